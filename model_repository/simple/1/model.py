"""Triton's quick-start `simple` model in torch: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = difference."""

import os
import sys

# Triton's python stub ignores PYTHONPATH; the launcher passes the venv's site-packages there.
sys.path[:0] = [
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path
]

import json  # noqa: E402
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


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_num_threads", "1")))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"simple running on {self.device}", flush=True)  # read by device checks

    def execute(self, requests: list[Any]) -> list[Any]:
        # One torch call for the whole dynamic batch; each request keeps its own rows.
        in0 = [input_tensor(r, "INPUT0") for r in requests]
        in1 = [input_tensor(r, "INPUT1") for r in requests]
        a = torch.cat(in0).to(self.device)
        b = torch.cat(in1).to(self.device)
        total = a + b
        diff = a - b
        responses = []
        start = 0
        for x in in0:
            stop = start + x.shape[0]
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        output_tensor("OUTPUT0", total[start:stop]),
                        output_tensor("OUTPUT1", diff[start:stop]),
                    ]
                )
            )
            start = stop
        return responses
