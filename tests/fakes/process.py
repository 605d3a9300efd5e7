"""The real proxy as a separate process (``python -m proxy.cli serve``).

A process of its own gives the fuzz and shutdown tests what an in-process proxy cannot: its
RSS alone, proof that it did not crash (it still runs and answers), its log, and real signals
(SIGTERM drains and exits).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
_PORT = re.compile(r"(HTTP|gRPC) localhost:(\d+)|metrics http://localhost:(\d+)/metrics")


class ProxyProcess:
    """Starts ``triton-proxy serve`` on free ports with ``policy`` (a policy document)."""

    def __init__(self, policy: dict[str, Any], workdir: Path) -> None:
        doc = dict(policy)
        listen = dict(doc.get("listen") or {})
        listen.update(host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=0)
        doc["listen"] = listen
        self.policy_path = workdir / "proxy-policy.yaml"
        self.policy_path.write_text(yaml.safe_dump(doc))
        self.log_path = workdir / "proxy.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http_port = 0
        self.grpc_port = 0
        self.metrics_port = 0

    def start(self, timeout_s: float = 30) -> ProxyProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxy.cli", "serve", "--policy", str(self.policy_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=env,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log()
            if "metrics http://localhost:" in text:
                for m in _PORT.finditer(text):
                    if m.group(1) == "HTTP":
                        self.http_port = int(m.group(2))
                    elif m.group(1) == "gRPC":
                        self.grpc_port = int(m.group(2))
                    elif m.group(3):
                        self.metrics_port = int(m.group(3))
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"proxy did not start in {timeout_s} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        """Resident set size of the proxy process, from /proc."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def cpu_seconds(self) -> float:
        """User + system CPU time the proxy process has used (a load-independent figure)."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 20) -> int | None:
        """SIGTERM, wait, SIGKILL if it did not exit; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
