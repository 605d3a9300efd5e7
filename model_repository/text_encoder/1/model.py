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

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

VOCAB = 1000
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 2


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
        rows: list[np.ndarray] = []
        owners: list[int] = []  # request index of each row
        for i, request in enumerate(requests):
            ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
            error = validate(ids)
            if error is not None:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(error))
                continue
            rows.extend(ids)
            owners.extend([i] * ids.shape[0])
        if rows:
            longest = max(len(r) for r in rows)
            ids = np.zeros((len(rows), longest), dtype=np.int64)
            pad = np.ones((len(rows), longest), dtype=bool)
            for j, row in enumerate(rows):
                ids[j, : len(row)] = row
                pad[j, : len(row)] = False
            with torch.inference_mode():
                emb = self.model(
                    torch.from_numpy(ids).to(self.device), torch.from_numpy(pad).to(self.device)
                )
            emb_np = emb.float().cpu().numpy()
            owner_arr = np.asarray(owners)
            for i in sorted(set(owners)):
                out = np.ascontiguousarray(emb_np[owner_arr == i])
                rows_i = out.shape[0]
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("EMBEDDING", out),
                        pb_utils.Tensor("BATCH_SIZE", np.full((rows_i, 1), len(rows), np.int64)),
                        pb_utils.Tensor("PADDED_LENGTH", np.full((rows_i, 1), longest, np.int64)),
                    ]
                )
        return responses


def validate(ids: np.ndarray) -> str | None:
    if ids.ndim != 2 or ids.shape[1] == 0:
        return f"INPUT_IDS must hold at least one token per row, got shape {list(ids.shape)}"
    if ids.min() < 0 or ids.max() >= VOCAB:
        return f"INPUT_IDS must lie in [0, {VOCAB}), got [{ids.min()}, {ids.max()}]"
    return None
