"""A tiny char-level text generator (fixed-seed random GRU, greedy decoding), decoupled.

Each request is generated on its own worker thread so execute() returns at once and several
streams interleave, as a continuous-batching LLM server's would. A stream sends one response per
token (``text_output`` = that token's text), ``token_delay_ms`` apart, then a response with only
the FINAL flag. ``stream=false`` sends one response with the whole text, flagged FINAL.
"""

import os
import sys

# Triton's python stub ignores PYTHONPATH; the launcher passes the venv's site-packages there.
sys.path[:0] = [
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path
]

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from torch.utils.dlpack import from_dlpack  # noqa: E402

# Printable ASCII; anything else reads as "?".
CHARS = [chr(c) for c in range(32, 127)]
INDEX = {c: i for i, c in enumerate(CHARS)}
UNKNOWN = INDEX["?"]
EMBED = 32
HIDDEN = 128


class CharGRU(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(len(CHARS), EMBED)
        self.cell = torch.nn.GRUCell(EMBED, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, len(CHARS))

    def step(self, token: int, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = self.embed(torch.tensor([token], device=h.device))
        h = self.cell(x, h)
        return h, int(self.head(h).argmax(dim=-1).item())


def encode(text: str) -> list[int]:
    return [INDEX.get(c, UNKNOWN) for c in text] or [INDEX[" "]]


def text_tensor(text: str) -> Any:
    # BYTES tensors have no DLPack form: numpy is their only way (model_repository/README.md).
    return pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))


def scalar_input(request: Any, name: str) -> torch.Tensor | None:
    """The first element of an optional numeric input, read through DLPack (not numpy)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else from_dlpack(tensor.to_dlpack()).reshape(-1)[0]


def stub_reads_numpy() -> bool:
    """Whether Triton's python backend stub reads numpy arrays correctly in this interpreter.

    The stub is compiled against the numpy 1.x ABI (pybind11 2.10); under numpy 2 it takes every
    element size for 0, so each array it makes holds its first element repeated and each array it
    is given counts as 0 bytes long. Numeric tensors avoid numpy through DLPack; BYTES tensors
    cannot (DLPack has no string type).
    """
    probe = pb_utils.Tensor.from_dlpack("probe", torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    return bool(probe.as_numpy().tolist() == [1, 2, 3, 4])


class _UnreadableBytes:
    """What the stub gets for a BYTES tensor when it cannot read numpy arrays: the stub reshapes
    the decoded tensor to the input's shape, so this hands back that shape filled with None."""

    def __init__(self, encoded: Any) -> None:
        del encoded  # the stub already lost the data: every byte is a copy of the first

    def reshape(self, dims: Any) -> Any:
        return np.full(tuple(dims), None, dtype=np.object_)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_num_threads", "1")))
        self.token_delay_s = float(params.get("token_delay_ms", "30")) / 1e3
        self.default_max_tokens = int(params.get("default_max_tokens", "16"))
        self.max_tokens_limit = int(params.get("max_tokens_limit", "512"))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"text_generator running on {self.device}", flush=True)  # read by device checks
        torch.manual_seed(int(params.get("seed", "1234")))
        self.model = CharGRU().to(self.device).eval()
        self.bytes_error: str | None = None
        if not stub_reads_numpy():
            # The stub decodes BYTES inputs through this module function before execute() runs,
            # from a buffer whose bytes are all copies of the first: the original decodes garbage
            # or raises, and a raise there kills the stub (std::terminate). This stand-in keeps
            # the stub alive, and each request gets the error below.
            pb_utils.deserialize_bytes_tensor = _UnreadableBytes
            self.bytes_error = (
                f"BYTES tensors (text_input, text_output) cannot cross Triton's python backend "
                f"stub under numpy {np.__version__}: the stub is built for the numpy 1.x ABI; "
                "serve this model with numpy<2 on the server's Python path"
            )
            print(f"text_generator: {self.bytes_error}", flush=True)
        # A GRU step is tiny; one lock keeps torch calls from different streams serial.
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(
            int(params.get("max_concurrent", "32")), thread_name_prefix="generate"
        )

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self.pool.submit(self.generate, request)
        return None

    def finalize(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=False)

    def generate(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            self._generate(request, sender)
        except Exception as exc:  # the stream must always end, with the reason
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"text_generator: {exc}")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def _generate(self, request: Any, sender: Any) -> None:
        prompt_t = pb_utils.get_input_tensor_by_name(request, "text_input")
        # Triton does not enforce required inputs on the generate endpoints.
        if prompt_t is None:
            raise ValueError("the text_input input is required")
        max_t = scalar_input(request, "max_tokens")
        max_tokens = self.default_max_tokens if max_t is None else int(max_t.item())
        if not 0 < max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"max_tokens must be in [1, {self.max_tokens_limit}], got {max_tokens}"
            )
        stream_t = scalar_input(request, "stream")
        stream = True if stream_t is None else bool(stream_t.item())
        if self.bytes_error is not None:
            raise RuntimeError(self.bytes_error)
        prompt = prompt_t.as_numpy().reshape(-1)[0]
        prompt = prompt.decode("utf-8", "replace") if isinstance(prompt, bytes) else str(prompt)

        with self.lock, torch.inference_mode():
            h = torch.zeros(1, HIDDEN, device=self.device)
            for token in encode(prompt):
                h, nxt = self.model.step(token, h)
        pieces: list[str] = []
        for _ in range(max_tokens):
            if sender.is_cancelled():
                break
            time.sleep(self.token_delay_s)
            piece = CHARS[nxt]
            pieces.append(piece)
            if stream:
                sender.send(pb_utils.InferenceResponse(output_tensors=[text_tensor(piece)]))
            with self.lock, torch.inference_mode():
                h, nxt = self.model.step(nxt, h)
        if stream:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            sender.send(
                pb_utils.InferenceResponse(output_tensors=[text_tensor("".join(pieces))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
