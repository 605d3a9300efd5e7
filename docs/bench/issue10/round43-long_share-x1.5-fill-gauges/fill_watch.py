"""Poll each bench proxy's /metrics for accel_sim's fill, long load and occupancy gauges.

Usage: python fill_watch.py OUT SECONDS, started beside ``triton-proxy bench``: each new
``proxy.cli serve --policy`` process is found by its listening ports and read every 0.5 s
until it exits (session 43, long_share.yaml x1.5, fill-watch.txt).
"""

import re
import subprocess
import sys
import time
import urllib.request

GAUGE = re.compile(
    r'^triton_proxy_model_(fill|long_load|occupancy)\{model="accel_sim"\} (\S+)', re.MULTILINE
)


def proxies() -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", "proxy.cli serve --policy"], capture_output=True, text=True, check=False
    )
    return [int(pid) for pid in found.stdout.split()]


def ports(pid: int) -> list[int]:
    sockets = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False)
    return sorted(
        {
            int(m.group(1))
            for line in sockets.stdout.splitlines()
            if f"pid={pid}," in line
            for m in [re.search(r"127\.0\.0\.1:(\d+)", line)]
            if m
        }
    )


def read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=1) as answer:
        return answer.read().decode()


def metrics_url(pid: int) -> str | None:
    for _ in range(40):
        for port in ports(pid):
            url = f"http://127.0.0.1:{port}/metrics"
            try:
                if "triton_proxy_model_fill" in read(url):
                    return url
            except OSError:
                pass
        time.sleep(0.5)
    return None


def main() -> None:
    out_path, seconds = sys.argv[1], float(sys.argv[2])
    seen: set[int] = set()
    end = time.time() + seconds
    with open(out_path, "w") as out:
        while time.time() < end:
            for pid in proxies():
                if pid in seen:
                    continue
                seen.add(pid)
                url = metrics_url(pid)
                print(f"# pid {pid} {url}", file=out, flush=True)
                start = time.time()
                while url and pid in proxies():
                    try:
                        body = read(url)
                    except OSError:
                        break
                    values = " ".join(f"{k}={float(v):.2f}" for k, v in sorted(GAUGE.findall(body)))
                    print(f"{time.time() - start:6.1f} {values}", file=out, flush=True)
                    time.sleep(0.5)
            time.sleep(0.5)


if __name__ == "__main__":
    main()
