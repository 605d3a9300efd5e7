"""Where the wheel's Triton lives, and the environment a local server needs to run.

Everything here is pure or touches only the private backend cache; nothing edits site-packages.
The layout we rely on is that of ``nvidia-pytriton==0.7.0`` (Triton 2.51.0):

- ``<site-packages>/pytriton/tritonserver/bin/tritonserver``
- ``<site-packages>/pytriton/tritonserver/backends/python/`` (``libtriton_python.so`` ...)
- ``<site-packages>/pytriton/tritonserver/python_backend_stubs/3.X/triton_python_backend_stub``
- ``<site-packages>/nvidia_pytriton.libs/`` (bundled ``libtritonserver``, ``libcudart``...)

The stub embeds ``libpython3.X.so.1.0``, which the wheel does not ship.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PYTRITON_DIST = "nvidia-pytriton"
PYTRITON_PIN = "nvidia-pytriton==0.7.0"
INSTALL_HINT = "pip install 'triton-proxy[local]'"
BACKEND_DIR_ENV = "TRITON_PROXY_BACKEND_DIR"
STUB_NAME = "triton_python_backend_stub"
# Written last into a laid-out backend directory: its presence means the copy is complete.
_COMPLETE_MARKER = ".complete"


class LocalTritonError(RuntimeError):
    """A local Triton server cannot be set up or started; the message says what to do."""


class TritonNotInstalledError(LocalTritonError):
    pass


class LibpythonMissingError(LocalTritonError):
    pass


def py_tag(version: tuple[int, int] | None = None) -> str:
    """``3.11`` for the running interpreter (or the given version)."""
    major, minor = version or (sys.version_info.major, sys.version_info.minor)
    return f"{major}.{minor}"


def libpython_soname(version: tuple[int, int] | None = None) -> str:
    return f"libpython{py_tag(version)}.so.1.0"


def os_package_hint(version: tuple[int, int] | None = None) -> str:
    tag = py_tag(version)
    return (
        f"install the shared Python library for Python {tag}: on Debian/Ubuntu "
        f"`apt-get install libpython{tag}`, on Fedora/RHEL `dnf install python{tag}-libs`"
    )


@dataclass(frozen=True)
class TritonInstall:
    """The files of one installed ``nvidia-pytriton`` wheel."""

    site_packages: Path
    version: str

    @property
    def root(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def libs(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    def stub(self, version: tuple[int, int] | None = None) -> Path:
        return self.root / "python_backend_stubs" / py_tag(version) / STUB_NAME

    def check(self, version: tuple[int, int] | None = None) -> None:
        """Raise with an install hint unless every file a server needs is there."""
        binary = self.binary
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise TritonNotInstalledError(
                f"the Triton server binary is missing ({binary}); run {INSTALL_HINT} "
                f"(it brings {PYTRITON_PIN}, which ships tritonserver 2.51)"
            )
        if not (self.python_backend / "libtriton_python.so").is_file():
            raise TritonNotInstalledError(
                f"Triton's python backend is missing under {self.python_backend}; "
                f"reinstall with {INSTALL_HINT}"
            )
        stub = self.stub(version)
        if not stub.is_file():
            shipped = sorted(
                p.name for p in (self.root / "python_backend_stubs").glob("3.*") if p.is_dir()
            )
            raise TritonNotInstalledError(
                f"{PYTRITON_PIN} ships no python backend stub for Python {py_tag(version)} "
                f"(expected {stub}; it has {', '.join(shipped) or 'none'}); "
                "run under one of those Python versions"
            )


def find_install(site_packages: Path | None = None) -> TritonInstall:
    """Locate the wheel's files, in ``site_packages`` or wherever ``pytriton`` imports from."""
    if site_packages is None:
        # find_spec on a top-level package does not execute it: pytriton's import is heavy.
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonNotInstalledError(
                f"{PYTRITON_DIST} is not installed in this environment ({sys.prefix}); "
                f"run {INSTALL_HINT} (it brings {PYTRITON_PIN}, which ships tritonserver 2.51)"
            )
        site_packages = Path(next(iter(spec.submodule_search_locations))).parent
    try:
        version = metadata.version(PYTRITON_DIST)
    except metadata.PackageNotFoundError:
        version = "unknown"
    install = TritonInstall(site_packages=site_packages, version=version)
    install.check()
    return install


def default_backend_cache(install: TritonInstall, version: tuple[int, int] | None = None) -> Path:
    """``~/.cache/triton-proxy/backends/<pytriton-version>-py3.X``; ``$TRITON_PROXY_BACKEND_DIR``
    overrides it."""
    override = os.environ.get(BACKEND_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_home / "triton-proxy" / "backends" / f"{install.version}-py{py_tag(version)}"


def prepare_backend_dir(
    install: TritonInstall, target: Path, version: tuple[int, int] | None = None
) -> Path:
    """Lay out ``target/python/`` with the python backend and the stub for this interpreter.

    Returns ``target``, to pass as ``--backend-directory``. The directory is built on the side
    and renamed into place, so concurrent launchers never see a half-copied backend.
    """
    python_dir = target / "python"
    if (python_dir / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        staged_python = staging / "python"
        staged_python.mkdir()
        for src in sorted(install.python_backend.iterdir()):
            if src.is_file():
                shutil.copy2(src, staged_python / src.name)
        shutil.copy2(install.stub(version), staged_python / STUB_NAME)
        (staged_python / _COMPLETE_MARKER).write_text(f"{install.site_packages}\n")
        if target.exists() and not (python_dir / _COMPLETE_MARKER).is_file():
            # An incomplete leftover from an interrupted run: replace it.
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            # Another launcher won the race; its copy is as good as ours.
            if not (python_dir / _COMPLETE_MARKER).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _interpreter_libdir(version: tuple[int, int] | None) -> Path | None:
    """The running interpreter's own shared libpython directory, if it was built shared."""
    if version is not None and version != sys.version_info[:2]:
        return None
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and (Path(libdir) / libpython_soname()).is_file():
        return Path(libdir)
    return None


def missing_libraries(executable: Path, env: Mapping[str, str]) -> list[str]:
    """Sonames ``ldd`` reports as not found for ``executable`` under ``env``."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    proc = subprocess.run(
        [ldd, str(executable)],
        env=dict(env),
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    return [
        line.split("=>", 1)[0].strip() for line in proc.stdout.splitlines() if "not found" in line
    ]


def site_packages_dirs() -> list[str]:
    """The running interpreter's site-packages, in ``sys.path`` order (venv first)."""
    dirs = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if Path(d).is_dir()]


def server_env(
    install: TritonInstall,
    *,
    base: Mapping[str, str] | None = None,
    python_path: Sequence[str] | None = None,
    extra_lib_dirs: Sequence[str] = (),
) -> dict[str, str]:
    """The environment for ``tritonserver``: bundled libs on ``LD_LIBRARY_PATH``, venv on
    ``PYTHONPATH`` (models re-add it to ``sys.path``: the stub's interpreter ignores it)."""
    env = dict(os.environ if base is None else base)
    lib_dirs = [str(install.libs), *extra_lib_dirs]
    lib_dirs += [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(lib_dirs))
    paths = list(site_packages_dirs() if python_path is None else python_path)
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def libpython_error(stub: Path, version: tuple[int, int] | None = None) -> LibpythonMissingError:
    return LibpythonMissingError(
        f"{libpython_soname(version)} is missing: Triton's python backend stub ({stub}) "
        "embeds it. " + os_package_hint(version)
    )


def resolve_server_env(
    install: TritonInstall,
    stub: Path,
    *,
    base: Mapping[str, str] | None = None,
    version: tuple[int, int] | None = None,
) -> dict[str, str]:
    """``server_env``, checked: the stub must find every library it needs.

    The system's ``libpython3.X`` is preferred (as the wheel expects); when it is absent but the
    running interpreter was built shared (pyenv, conda), that interpreter's library serves.
    """
    env = server_env(install, base=base)
    missing = missing_libraries(stub, env)
    soname = libpython_soname(version)
    if soname in missing:
        libdir = _interpreter_libdir(version)
        if libdir is None:
            raise libpython_error(stub, version)
        env = server_env(install, base=base, extra_lib_dirs=[str(libdir)])
        missing = missing_libraries(stub, env)
        if soname in missing:
            raise libpython_error(stub, version)
    if missing:
        raise LocalTritonError(
            f"Triton's python backend stub ({stub}) cannot load {', '.join(missing)} "
            f"with LD_LIBRARY_PATH={env.get('LD_LIBRARY_PATH', '')}"
        )
    return env
