"""A stateful accumulator for the sequence batcher: OUTPUT = running sum of INPUT per sequence.

State is keyed by the request's correlation id (integer or string, as the client sent it),
reset when START is set and dropped when END is set. Requests with READY = 0 are the batcher's
fillers for idle slots: they get a zero and touch no state. Sequences that go idle longer than
``max_sequence_idle_microseconds`` are released by Triton; their state is dropped when the
same id starts again, or after ``state_ttl_s`` of inactivity.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


def flag(request: Any, name: str) -> bool:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_num_threads", "1")))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"accumulator running on {self.device}", flush=True)  # read by device checks
        idle_us = int(config.get("sequence_batching", {}).get("max_sequence_idle_microseconds", 0))
        # Keep orphaned state a while longer than Triton keeps the sequence itself.
        self.state_ttl_s = max(2 * idle_us / 1e6, 10.0)
        self.sums: dict[int | str, torch.Tensor] = {}
        self.last_seen: dict[int | str, float] = {}

    def execute(self, requests: list[Any]) -> list[Any]:
        now = time.monotonic()
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            if not flag(request, "READY"):
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor("OUTPUT", np.zeros_like(value))]
                    )
                )
                continue
            key = request.correlation_id()
            x = torch.from_numpy(value.astype(np.int32)).to(self.device)
            if flag(request, "START") or key not in self.sums:
                total = x.clone()
            else:
                total = self.sums[key] + x
            out = total.cpu().numpy().astype(np.int32)
            if flag(request, "END"):
                self.sums.pop(key, None)
                self.last_seen.pop(key, None)
            else:
                self.sums[key] = total
                self.last_seen[key] = now
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)])
            )
        self._expire(now)
        return responses

    def _expire(self, now: float) -> None:
        for key in [k for k, t in self.last_seen.items() if now - t > self.state_ttl_s]:
            self.sums.pop(key, None)
            self.last_seen.pop(key, None)
