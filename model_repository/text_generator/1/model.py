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
    return pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))


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
        prompt = prompt_t.as_numpy().reshape(-1)[0]
        prompt = prompt.decode("utf-8", "replace") if isinstance(prompt, bytes) else str(prompt)
        max_tokens = self.default_max_tokens
        max_t = pb_utils.get_input_tensor_by_name(request, "max_tokens")
        if max_t is not None:
            max_tokens = int(max_t.as_numpy().reshape(-1)[0])
        if not 0 < max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"max_tokens must be in [1, {self.max_tokens_limit}], got {max_tokens}"
            )
        stream = True
        stream_t = pb_utils.get_input_tensor_by_name(request, "stream")
        if stream_t is not None:
            stream = bool(stream_t.as_numpy().reshape(-1)[0])

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
