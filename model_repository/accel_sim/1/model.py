"""An accelerator's cost curve on a CPU: each batch sleeps
``base_ms + per_token_us * batch_size * longest_length`` (both from config.pbtxt parameters),
the fixed cost plus the per-token cost of the batch padded to its longest sequence.

The result is real but cheap: OUTPUT [batch, 8] = mean over the tokens of a fixed-seed embedding.
BATCH_SIZE, PADDED_LENGTH and BATCH_COST_US [batch, 1] report the batch each request ran in and
its emulated cost in microseconds; BATCH_START_US (when the stub was handed the batch, on the
host's monotonic clock) and BATCH_SERVER (the tritonserver's process id) say when and where it
ran, so a client on the same host can tell how long each request waited in Triton.
"""

import os
import sys

# Triton's python stub ignores PYTHONPATH; the launcher passes the venv's site-packages there.
sys.path[:0] = [
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path
]

import fcntl  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from torch.utils.dlpack import from_dlpack  # noqa: E402

VOCAB = 1000
OUT_DIM = 8


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


def column(rows: int, value: int) -> torch.Tensor:
    """An INT64 [rows, 1] tensor filled with ``value``."""
    return torch.full((rows, 1), value, dtype=torch.int64)


def batch_cost_s(base_ms: float, per_token_us: float, batch_size: int, longest: int) -> float:
    return base_ms / 1e3 + per_token_us / 1e6 * batch_size * longest


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_num_threads", "1")))
        self.base_ms = float(params.get("base_ms", "3"))
        self.per_token_us = float(params.get("per_token_us", "2"))
        self.device_lock = None
        if params.get("shared_device", "0") == "1":
            # One lock file per server: every model instance's stub is a child of it.
            path = os.path.join(tempfile.gettempdir(), f"accel_sim-device-{os.getppid()}.lock")
            self.device_lock = open(path, "a")  # noqa: SIM115 - held for the model's life
        self.server = os.getppid()  # the tritonserver whose stub this is (BATCH_SERVER)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"accel_sim running on {self.device}", flush=True)  # read by device checks
        gen = torch.Generator().manual_seed(int(params.get("seed", "1234")))
        self.table = torch.randn(VOCAB, OUT_DIM, generator=gen).to(self.device)

    def execute(self, requests: list[Any]) -> list[Any]:
        started = time.monotonic()
        inputs: list[torch.Tensor | None] = []
        for request in requests:
            ids = input_tensor(request, "INPUT_IDS")
            valid = (
                ids.ndim == 2
                and ids.shape[1] > 0
                and int(ids.min()) >= 0
                and int(ids.max()) < VOCAB
            )
            inputs.append(ids if valid else None)
        ok = [ids for ids in inputs if ids is not None]
        batch_size = sum(ids.shape[0] for ids in ok)
        longest = max((ids.shape[1] for ids in ok), default=0)
        cost_s = batch_cost_s(self.base_ms, self.per_token_us, batch_size, longest) if ok else 0.0
        responses = []
        for ids in inputs:
            if ids is None:
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(
                            f"INPUT_IDS must be [batch, len>0] ids in [0, {VOCAB})"
                        )
                    )
                )
                continue
            with torch.inference_mode():
                out = self.table[ids.to(self.device)].mean(dim=1).float()
            rows = ids.shape[0]
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        output_tensor("OUTPUT", out),
                        output_tensor("BATCH_SIZE", column(rows, batch_size)),
                        output_tensor("PADDED_LENGTH", column(rows, longest)),
                        output_tensor("BATCH_COST_US", column(rows, round(cost_s * 1e6))),
                        output_tensor("BATCH_START_US", column(rows, round(started * 1e6))),
                        output_tensor("BATCH_SERVER", column(rows, self.server)),
                    ]
                )
            )
        if self.device_lock is not None:
            # The device is busy with another instance's batch: wait for it, then run ours.
            fcntl.flock(self.device_lock, fcntl.LOCK_EX)
            started = time.monotonic()
        try:
            # The emulated device time covers the whole batch, the real work included.
            remaining = cost_s - (time.monotonic() - started)
            if remaining > 0:
                time.sleep(remaining)
        finally:
            if self.device_lock is not None:
                fcntl.flock(self.device_lock, fcntl.LOCK_UN)
        return responses

    def finalize(self) -> None:
        if self.device_lock is not None:
            self.device_lock.close()
