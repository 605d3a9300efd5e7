"""A small fixed-seed transformer encoder: INPUT_IDS [batch, len] INT64 -> EMBEDDING [batch, 64].

BATCH_SIZE and PADDED_LENGTH [batch, 1] report the batch each request actually ran in.

Requests of different lengths share one batch padded to the longest; padding is masked out of
attention and of the mean pooling, so a sequence's embedding does not depend on its batch mates.
"""

import os
import sys

# Triton's python stub ignores PYTHONPATH; the launcher passes the venv's site-packages there.
sys.path[:0] = [
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path
]

import json  # noqa: E402
import math  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from torch.utils.dlpack import from_dlpack  # noqa: E402

VOCAB = 1000
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 2


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


def sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """The fixed positional encoding of "Attention Is All You Need": any length works."""
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        layer = torch.nn.TransformerEncoderLayer(
            D_MODEL, N_HEADS, dim_feedforward=4 * D_MODEL, dropout=0.0, batch_first=True
        )
        # No nested-tensor fast path: it would skip padded positions differently per batch.
        self.encoder = torch.nn.TransformerEncoder(layer, N_LAYERS, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """ids [B, L], pad [B, L] True where padding -> [B, D_MODEL] mean of real tokens."""
        x = self.embed(ids) * math.sqrt(D_MODEL)
        x = x + sinusoidal_positions(ids.shape[1], D_MODEL).to(x.device)
        h = self.encoder(x, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return (h * keep).sum(dim=1) / keep.sum(dim=1)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_num_threads", "1")))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"text_encoder running on {self.device}", flush=True)  # read by device checks
        torch.manual_seed(int(params.get("seed", "1234")))
        self.model = Encoder().to(self.device).eval()

    def execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        blocks: list[tuple[int, torch.Tensor]] = []  # (request index, its [rows, len] ids)
        for i, request in enumerate(requests):
            ids = input_tensor(request, "INPUT_IDS")
            error = validate(ids)
            if error is not None:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(error))
                continue
            blocks.append((i, ids))
        if blocks:
            n_rows = sum(ids.shape[0] for _, ids in blocks)
            longest = max(ids.shape[1] for _, ids in blocks)
            batch = torch.zeros((n_rows, longest), dtype=torch.int64)
            pad = torch.ones((n_rows, longest), dtype=torch.bool)
            spans: list[tuple[int, int, int]] = []  # (request index, first row, end row)
            start = 0
            for i, ids in blocks:
                stop = start + ids.shape[0]
                batch[start:stop, : ids.shape[1]] = ids
                pad[start:stop, : ids.shape[1]] = False
                spans.append((i, start, stop))
                start = stop
            with torch.inference_mode():
                emb = self.model(batch.to(self.device), pad.to(self.device)).float()
            for i, start, stop in spans:
                rows_i = stop - start
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[
                        output_tensor("EMBEDDING", emb[start:stop]),
                        output_tensor("BATCH_SIZE", column(rows_i, n_rows)),
                        output_tensor("PADDED_LENGTH", column(rows_i, longest)),
                    ]
                )
        return responses


def validate(ids: torch.Tensor) -> str | None:
    if ids.ndim != 2 or ids.shape[1] == 0:
        return f"INPUT_IDS must hold at least one token per row, got shape {list(ids.shape)}"
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= VOCAB:
        return f"INPUT_IDS must lie in [0, {VOCAB}), got [{lo}, {hi}]"
    return None
