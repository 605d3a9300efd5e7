"""Sleeps each request's DELAY_MS, polling ``is_cancelled()``, and counts what happened.

A request found cancelled stops at once and gets a CANCELLED error. Every response carries the
instance's counters as they were before it (completed, cancelled, milliseconds the cancelled
ones had run) and the ``timeout`` Triton attached to the request, so a test can ask Triton what
it did. Tensors cross the boundary through DLPack, not numpy (model_repository/README.md).
"""

import os
import sys

# Triton's python stub ignores PYTHONPATH; the launcher passes the venv's site-packages there.
sys.path[:0] = [
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path
]

import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from torch.utils.dlpack import from_dlpack  # noqa: E402


def delay_ms(request: Any) -> int:
    tensor = pb_utils.get_input_tensor_by_name(request, "DELAY_MS")
    return int(from_dlpack(tensor.to_dlpack()).reshape(-1)[0].item())


def scalar(name: str, value: int) -> Any:
    return pb_utils.Tensor.from_dlpack(name, torch.tensor([[value]], dtype=torch.int64))


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_num_threads", "1")))
        self.poll_s = float(params.get("poll_ms", "5")) / 1e3
        self.completed = 0
        self.cancelled = 0
        self.cancelled_ms = 0

    def execute(self, requests: list[Any]) -> list[Any]:
        counters = (self.completed, self.cancelled, self.cancelled_ms)
        began = time.monotonic()
        ends = [began + delay_ms(r) / 1e3 for r in requests]
        outcome: list[str | None] = [None] * len(requests)
        while any(o is None for o in outcome):
            now = time.monotonic()
            for i, request in enumerate(requests):
                if outcome[i] is not None:
                    continue
                if request.is_cancelled():
                    outcome[i] = "cancelled"
                    self.cancelled += 1
                    self.cancelled_ms += round((now - began) * 1e3)
                elif now >= ends[i]:
                    outcome[i] = "done"
                    self.completed += 1
            if any(o is None for o in outcome):
                time.sleep(self.poll_s)
        responses = []
        for request, what in zip(requests, outcome, strict=True):
            if what == "cancelled":
                error = pb_utils.TritonError(
                    "sleeper: request cancelled", pb_utils.TritonError.CANCELLED
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            timeout = getattr(request, "timeout", lambda: 0)()
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        scalar("TIMEOUT_US", int(timeout or 0)),
                        scalar("COMPLETED", counters[0]),
                        scalar("CANCELLED", counters[1]),
                        scalar("CANCELLED_MS", counters[2]),
                    ]
                )
            )
        return responses
