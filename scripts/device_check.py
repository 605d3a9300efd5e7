"""Check the model repository on a CUDA machine: every model runs on the GPU and answers
what it answers on the CPU.

Run on a machine with a GPU and the nvidia-pytriton wheel installed:
    python3 scripts/device_check.py [LOG_DIR]
It starts one Triton server with CUDA visible and one with CUDA hidden, sends the same
requests to both over plain HTTP (no client library needed), compares the outputs and prints
which device each model reported in its server log. Exit status 0 only if all agree.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.local import LocalFleet  # noqa: E402

MODELS = ("simple", "text_encoder", "accel_sim", "accumulator", "text_generator")
IDS = list(range(1, 65))
REQUESTS = {
    "simple": {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [3] * 16},
        ]
    },
    "text_encoder": {
        "inputs": [{"name": "INPUT_IDS", "shape": [1, 64], "datatype": "INT64", "data": IDS}],
        "outputs": [{"name": "EMBEDDING"}],
    },
    "accel_sim": {
        "inputs": [{"name": "INPUT_IDS", "shape": [1, 64], "datatype": "INT64", "data": IDS}],
        "outputs": [{"name": "OUTPUT"}],
    },
    "accumulator": {
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [5]}],
        "parameters": {"sequence_id": 7, "sequence_start": True, "sequence_end": True},
    },
}


def post(url: str, path: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        return {"error": f"HTTP {exc.code}: {exc.read().decode(errors='replace')}"}


def outputs(url: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for model, body in REQUESTS.items():
        answer = post(url, f"/v2/models/{model}/infer", body)
        if "error" in answer:
            out[model] = answer
            continue
        out[model] = {o["name"]: o["data"] for o in answer["outputs"]}  # type: ignore[index,union-attr]
    gen = post(
        url,
        "/v2/models/text_generator/generate",
        {"text_input": "hello", "max_tokens": 8, "stream": False},
    )
    out["text_generator"] = gen.get("text_output", gen)
    return out


def close(a: object, b: object) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-3 + 1e-3 * abs(float(b))  # type: ignore[arg-type]
    return a == b


def run(log_dir: Path, cuda: bool) -> tuple[dict[str, object], str]:
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        logs = log_dir / ("gpu" if cuda else "cpu")
        with LocalFleet(1, ROOT / "model_repository", MODELS, logs) as f:
            server = f.start(timeout_s=300)[0]
            result = outputs(server.http_url)
            log = server.log_path.read_text(errors="replace")
    finally:
        if env_before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_before
    return result, log


def main() -> int:
    log_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/device-check")
    gpu, gpu_log = run(log_dir, cuda=True)
    cpu, _ = run(log_dir, cuda=False)
    ok = True
    for model in gpu:
        same = close(gpu[model], cpu[model]) and "error" not in str(gpu[model])[:20]
        ok &= same
        print(f"{model:15s} GPU vs CPU outputs {'match' if same else 'DIFFER'}")
        if not same:
            print("  gpu:", json.dumps(gpu[model])[:300], "\n  cpu:", json.dumps(cpu[model])[:300])
    devices = [line for line in gpu_log.splitlines() if "running on" in line]
    print("\n".join(devices) or "no model reported its device in the log")
    ok &= bool(devices) and all("cuda" in line for line in devices)
    print("DEVICE CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
