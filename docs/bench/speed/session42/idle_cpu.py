"""CPU of an idle proxy (no traffic) in front of cpu_ab's fake Triton, per policy variant."""

import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, "/work/main/benchmarks")
sys.path.insert(0, "/work/main")
from cpu_ab import CLASSES, FAKE, proxy_target, script_process, spawn_proxy, thread_cpu_s

TREE = os.environ.get("TREE", "/work/main")


async def main():
    with script_process(FAKE) as (_, ports):
        hp, gp = ports.split()
        http, grpc_address = f"http://127.0.0.1:{hp}", f"127.0.0.1:{gp}"
        for rnd in range(2):
            for name in ("plain", "classes", "classes-nowake"):
                doc = {
                    "instances": [
                        {
                            "name": f"t{i}",
                            "http": http,
                            "grpc": grpc_address,
                            "metrics": http + "/metrics",
                        }
                        for i in range(3)
                    ],
                    "listen": {
                        "host": "127.0.0.1",
                        "http_port": 0,
                        "grpc_port": 0,
                        "metrics_port": 0,
                    },
                }
                if name != "plain":
                    doc["scheduling"] = CLASSES
                if name == "classes-nowake":
                    doc["routing"] = {
                        "policy": {"name": "expected_finish"},
                        "wake": {"enabled": False},
                    }
                with tempfile.TemporaryDirectory() as tmp:
                    policy = Path(tmp) / "p.yaml"
                    policy.write_text(yaml.safe_dump(doc))
                    log = Path(tmp) / "log"
                    proc = spawn_proxy(Path(TREE), policy, log)
                    try:
                        await proxy_target(proc, log, "http")
                        await asyncio.sleep(3)
                        a = thread_cpu_s(proc.pid)
                        t = time.monotonic()
                        await asyncio.sleep(10)
                        b = thread_cpu_s(proc.pid)
                        dt = time.monotonic() - t
                        print(
                            f"r{rnd} {name:15s} idle CPU {1000 * (b - a) / dt:6.1f} ms/s",
                            flush=True,
                        )
                    finally:
                        proc.send_signal(signal.SIGTERM)
                        proc.wait(30)


asyncio.run(main())
