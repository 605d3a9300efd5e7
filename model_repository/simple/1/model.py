"""Triton's quick-start `simple` model in torch: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = difference."""

import os
import sys

# Triton's python stub ignores PYTHONPATH; the launcher passes the venv's site-packages there.
sys.path[:0] = [
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path
]

import json  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_num_threads", "1")))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"simple running on {self.device}", flush=True)  # read by device checks

    def execute(self, requests: list[Any]) -> list[Any]:
        # One torch call for the whole dynamic batch; each request keeps its own rows.
        in0 = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        in1 = [pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy() for r in requests]
        a = torch.from_numpy(np.concatenate(in0)).to(self.device)
        b = torch.from_numpy(np.concatenate(in1)).to(self.device)
        total = (a + b).cpu().numpy()
        diff = (a - b).cpu().numpy()
        responses = []
        start = 0
        for x in in0:
            stop = start + x.shape[0]
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("OUTPUT0", total[start:stop]),
                        pb_utils.Tensor("OUTPUT1", diff[start:stop]),
                    ]
                )
            )
            start = stop
        return responses
