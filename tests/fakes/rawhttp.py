"""A raw-socket HTTP/1.1 client: sends exactly the bytes given.

HTTP libraries normalise request targets (``..``, ``//``, percent-encodings) and refuse bad
headers; a fuzz test needs the bytes to arrive as written. Each exchange uses its own
connection; the response is read until the server closes it (requests carry
``Connection: close``) or until Content-Length / the last chunk says it is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawResponse:
    status: int | None
    """None when no (parsable) response came back."""
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""

    def json(self) -> Any:
        return json.loads(self.body)

    def triton_error(self) -> str | None:
        """The message of a ``{"error": "..."}`` body, or None if the body is not one."""
        try:
            doc = self.json()
        except ValueError:
            return None
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            return str(doc["error"])
        return None


def build(
    method: str,
    target: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    *,
    content_length: int | bool | None = True,
) -> bytes:
    """Request bytes. ``content_length``: True = the body's length, an int = that (a lie),
    False/None = no Content-Length header."""
    lines = [f"{method} {target} HTTP/1.1"]
    names = {k.lower() for k, _ in headers or ()}
    if "host" not in names:
        lines.append("Host: 127.0.0.1")
    for k, v in headers or ():
        lines.append(f"{k}: {v}")
    if content_length is True:
        lines.append(f"Content-Length: {len(body)}")
    elif isinstance(content_length, int) and content_length is not False:
        lines.append(f"Content-Length: {content_length}")
    if "connection" not in names:
        lines.append("Connection: close")
    head = "\r\n".join(lines).encode("latin-1", errors="replace") + b"\r\n\r\n"
    return head + body


def _parse(data: bytes) -> RawResponse:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return RawResponse(None, error=f"incomplete response head ({len(data)} bytes)")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return RawResponse(None, error=f"bad status line {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    body = rest
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(rest)
    elif "content-length" in headers and headers["content-length"].isdigit():
        body = rest[: int(headers["content-length"])]
    return RawResponse(int(parts[1]), headers, body)


def _complete(data: bytes) -> bool:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    lower = head.lower()
    for line in lower.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            try:
                return len(rest) >= int(line.split(b":", 1)[1])
            except ValueError:
                return False
    if b"transfer-encoding: chunked" in lower:
        return rest.endswith(b"0\r\n\r\n")
    return False


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return bytes(out)
        size = int(data[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


async def exchange(
    host: str,
    port: int,
    data: bytes,
    *,
    timeout_s: float = 10.0,
    half_close: bool = False,
) -> RawResponse:
    """Send ``data`` on a new connection and read one response.

    ``half_close`` shuts our write side after sending (a truncated body then ends at EOF);
    otherwise the connection stays open until the response is complete or the server closes.
    """
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as exc:
        return RawResponse(None, error=f"connect failed: {exc!r}")
    received = bytearray()
    try:
        writer.write(data)
        await writer.drain()
        if half_close and writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(timeout_s):
            while not _complete(bytes(received)):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                received += chunk
    except TimeoutError:
        response = _parse(bytes(received))
        response.error = response.error or "timed out waiting for the response"
        if response.status is None:
            response.error = "timed out waiting for the response"
        return response
    except (ConnectionError, OSError) as exc:
        if not received:
            return RawResponse(None, error=f"connection error: {exc!r}")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    if not received:
        return RawResponse(None, error="connection closed without a response")
    return _parse(bytes(received))
