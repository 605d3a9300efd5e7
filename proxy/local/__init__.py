"""Launching local Triton servers from the ``nvidia-pytriton`` wheel's binary."""

from proxy.local.fleet import (
    LocalFleet,
    ServerStartError,
    TritonServer,
    free_ports,
    group_members,
    sigterm_raises_exit,
)
from proxy.local.install import (
    LibpythonMissingError,
    LocalTritonError,
    TritonInstall,
    TritonNotInstalledError,
    find_install,
)

__all__ = [
    "LibpythonMissingError",
    "LocalFleet",
    "LocalTritonError",
    "ServerStartError",
    "TritonInstall",
    "TritonNotInstalledError",
    "TritonServer",
    "find_install",
    "free_ports",
    "group_members",
    "sigterm_raises_exit",
]
