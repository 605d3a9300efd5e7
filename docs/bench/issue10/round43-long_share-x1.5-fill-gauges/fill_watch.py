"""Poll a bench proxy's /metrics for the fill, long load and occupancy while it runs."""
import re, subprocess, sys, time, urllib.request
out = open(sys.argv[1], "w")
def pids():
    r = subprocess.run(["pgrep", "-f", "proxy.cli serve --policy"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]
def ports(pid):
    r = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True)
    return sorted({int(m.group(1)) for line in r.stdout.splitlines() if f"pid={pid}," in line
                   for m in [re.search(r"127\.0\.0\.1:(\d+)|\*:(\d+)|0\.0\.0\.0:(\d+)", line)] if m and m.group(1)})
seen = set(); t_end = time.time() + float(sys.argv[2])
while time.time() < t_end:
    for pid in pids():
        if pid in seen: continue
        seen.add(pid); url = None
        for _ in range(40):
            for port in ports(pid):
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
                    if "triton_proxy_model_fill" in body: url = f"http://127.0.0.1:{port}/metrics"; break
                except Exception: pass
            if url: break
            time.sleep(0.5)
        print(f"# pid {pid} {url}", file=out, flush=True)
        t0 = time.time()
        while url and pid in pids():
            try:
                body = urllib.request.urlopen(url, timeout=1).read().decode()
            except Exception: break
            vals = {k: v for k, v in re.findall(r'^(triton_proxy_model_(?:fill|long_load|occupancy))\{model="accel_sim"\} (\S+)', body, re.M)}
            print(f"{time.time()-t0:6.1f} " + " ".join(f"{k.split('_model_')[1]}={float(v):.2f}" for k, v in sorted(vals.items())), file=out, flush=True)
            time.sleep(0.5)
    time.sleep(0.5)
