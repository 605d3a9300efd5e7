"""Session 42's scratch script (kept as run): user and system CPU and context switches per
request of the proxy at C = 1 and 16 against benchmarks/cpu_ab.py's fake Triton, HTTP and gRPC.

    TREE=/path/to/checkout SPINS=0,300,2000 CS=1 .venv/bin/python c1_split.py

SPINS sets TP_SPIN_US for the busy-poll experiment (busy-poll-experiment.patch applied to
TREE); c1-user-sys.txt came from its first form, which also measured cpu_ab's bare HTTP pipe.
"""

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, "/work/main")
sys.path.insert(0, "/work/main/benchmarks")
import signal
import tempfile

import yaml
from cpu_ab import FAKE, proxy_target, script_process, spawn_proxy

from proxy.bench.closed import SimpleRequest, run_closed, sender

TREE = os.environ.get("TREE", "/work/main")
SPINS = os.environ.get("SPINS", "0").split(",")
CS = [int(x) for x in os.environ.get("CS", "1,16").split(",")]


def stats(pid):
    tick = os.sysconf("SC_CLK_TCK")
    u = s = v = nv = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        rest = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        u += int(rest[11]) / tick
        s += int(rest[12]) / tick
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                v += int(line.split()[1])
            if line.startswith("nonvoluntary_ctxt_switches"):
                nv += int(line.split()[1])
    return u, s, v, nv


async def measure(target, pid, c, seconds):
    async with sender(target, SimpleRequest(api_key=None), c) as send:
        await run_closed(send, c, 1.0, warmup_s=0.0)
        a = stats(pid)
        lat, _errors, secs, _, _err = await run_closed(send, c, seconds, warmup_s=0.0)
        b = stats(pid)
    n = len(lat)
    return (
        n / secs,
        [(y - x) / n * (1e3 if i < 2 else 1) for i, (x, y) in enumerate(zip(a, b, strict=False))],
        statistics.median(lat) * 1e3,
    )


async def main():
    with script_process(FAKE) as (_, ports):
        hp, gp = ports.split()
        http, grpc_address = f"http://127.0.0.1:{hp}", f"127.0.0.1:{gp}"
        for rnd in range(3):
            for spin in SPINS:
                os.environ["TP_SPIN_US"] = spin
                for c in CS:
                    with tempfile.TemporaryDirectory() as tmp:
                        policy = Path(tmp) / "p.yaml"
                        policy.write_text(
                            yaml.safe_dump(
                                {
                                    "instances": [
                                        {
                                            "name": "t0",
                                            "http": http,
                                            "grpc": grpc_address,
                                            "metrics": http + "/metrics",
                                        }
                                    ],
                                    "listen": {
                                        "host": "127.0.0.1",
                                        "http_port": 0,
                                        "grpc_port": 0,
                                        "metrics_port": 0,
                                    },
                                }
                            )
                        )
                        log = Path(tmp) / "log"
                        proc = spawn_proxy(Path(TREE), policy, log)
                        try:
                            for proto in ("http", "grpc"):
                                target = await proxy_target(proc, log, proto)
                                rps, v, p50 = await measure(target, proc.pid, c, 3)
                                print(
                                    f"r{rnd} spin {spin:>5s} C={c:2d} proxy {proto:4s} "
                                    f"{rps:6.0f} req/s user {v[0]:.3f} sys {v[1]:.3f} ms/req "
                                    f"vcsw {v[2]:.2f} nvcsw {v[3]:.2f} /req p50 {p50:.3f}"
                                )
                        finally:
                            proc.send_signal(signal.SIGTERM)
                            proc.wait(30)


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
