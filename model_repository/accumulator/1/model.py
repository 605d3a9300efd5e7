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

import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from torch.utils.dlpack import from_dlpack  # noqa: E402


# Tensors cross the Triton boundary through DLPack, never through numpy: Triton's python backend
# stub is built against the numpy 1.x ABI and misreads numpy 2 arrays (model_repository/README.md).
def input_tensor(request: Any, name: str) -> torch.Tensor:
    """The input ``name`` as a torch tensor over the request's own memory."""
    return from_dlpack(pb_utils.get_input_tensor_by_name(request, name).to_dlpack())


def output_tensor(name: str, tensor: torch.Tensor) -> Any:
    """An output over ``tensor``'s memory, left on its device (Triton copies a GPU tensor once,
    to wherever the response goes). The tensor itself, not a capsule, is handed over so that the
    stub makes its CUDA stream wait for torch's before reading the data."""
    return pb_utils.Tensor.from_dlpack(name, tensor.contiguous())


def flag(request: Any, name: str) -> bool:
    """A sequence control input (START, END, READY): absent or 0 is false."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(from_dlpack(tensor.to_dlpack()).reshape(-1)[0].item())


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
            value = input_tensor(request, "INPUT")
            if not flag(request, "READY"):
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[output_tensor("OUTPUT", torch.zeros_like(value))]
                    )
                )
                continue
            key = request.correlation_id()
            # A copy on the device: the input's memory belongs to the request.
            x = value.to(self.device, torch.int32, copy=True)
            fresh = flag(request, "START") or key not in self.sums
            # Never modified in place (the next request makes a new tensor), so the output can
            # share its memory.
            total = x if fresh else self.sums[key] + x
            if flag(request, "END"):
                self.sums.pop(key, None)
                self.last_seen.pop(key, None)
            else:
                self.sums[key] = total
                self.last_seen[key] = now
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[output_tensor("OUTPUT", total)])
            )
        self._expire(now)
        return responses

    def _expire(self, now: float) -> None:
        for key in [k for k, t in self.last_seen.items() if now - t > self.state_ttl_s]:
            self.sums.pop(key, None)
            self.last_seen.pop(key, None)
