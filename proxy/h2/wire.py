"""HTTP/2 and gRPC on the wire: frames, header blocks, length-prefixed messages, statuses.

Pure functions and small stateful codecs, no I/O (:mod:`proxy.h2.connection` does that).
RFC 9113 (HTTP/2), RFC 7541 (HPACK) and gRPC's PROTOCOL-HTTP2.md are the references; each
piece is as small as a relay of ``inference.GRPCInferenceService`` needs.
"""

from __future__ import annotations

import base64
import logging
import struct
import zlib
from collections.abc import Iterable, Sequence
from typing import cast
from urllib.parse import quote, unquote

import hpack
from hpack.exceptions import HPACKError

# hpack logs every header it decodes at DEBUG, values included: credentials (``authorization``)
# must never reach a log, whatever level the proxy runs at.
logging.getLogger("hpack").setLevel(logging.WARNING)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
# Flags.
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# SETTINGS parameters.
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 1, 2, 3, 4
MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 5, 6
# Error codes (RFC 9113 §7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
ENHANCE_YOUR_CALM = 11

DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
MAX_WINDOW = (1 << 31) - 1

Header = tuple[bytes, bytes]
View = bytes | memoryview
"""A frame's payload: DATA arrives as views of what was read, copied once into a message."""


class H2Error(Exception):
    """A connection error (RFC 9113 §5.4.1): the connection ends with GOAWAY(``code``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame_header(kind: int, flags: int, stream: int, n: int) -> bytes:
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream.to_bytes(4, "big")


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return frame_header(kind, flags, stream, len(payload)) + payload


def settings_frame(values: Iterable[tuple[int, int]]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in values))


def parse_settings(payload: View) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise H2Error(FRAME_SIZE_ERROR, "SETTINGS payload not a multiple of 6 bytes")
    return [struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6)]


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


def rst_stream(stream: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, code.to_bytes(4, "big"))


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def unpad(flags: int, payload: View) -> View:
    """A DATA or HEADERS payload without its padding (flag PADDED)."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise H2Error(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]


# --- HPACK --------------------------------------------------------------------------------


def _hpack_int(n: int, prefix_bits: int) -> bytes:
    cap = (1 << prefix_bits) - 1
    if n < cap:
        return bytes((n,))
    out = bytearray((cap,))
    n -= cap
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_FIELD_CACHE: dict[Header, bytes] = {}
_FIELD_CACHE_MAX = 1024
_FIELD_CACHE_VALUE = 128
"""Longest value remembered: the cache may hold client metadata, so 1024 small entries."""


def encode_field(name: bytes, value: bytes) -> bytes:
    """One header field as a literal never added to the peer's table (RFC 7541 §6.2.2).

    Stateless, so a header block can be built without a per-connection encoder; the fields a
    relay repeats on every call (``:status``, ``content-type``, ``grpc-status: 0``...) are
    encoded once (bounded cache).
    """
    key = (name, value)
    got = _FIELD_CACHE.get(key)
    if got is None:
        got = b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value
        if len(_FIELD_CACHE) < _FIELD_CACHE_MAX and len(value) <= _FIELD_CACHE_VALUE:
            _FIELD_CACHE[key] = got
    return got


def encode_block(headers: Iterable[Header]) -> bytes:
    return b"".join(encode_field(name, value) for name, value in headers)


class BlockDecoder:
    """A connection's HPACK decoder that decodes a repeated block once.

    Clients index their headers, so after a connection's first calls every request's block
    is the same few bytes of table references. A block whose decoding left the dynamic table
    as it was is remembered until the table changes (a block that inserts or evicts clears
    the memory), so the result is the same as decoding it again.
    """

    CACHED_BLOCKS = 64
    CACHED_BLOCK_BYTES = 512
    """Largest block remembered (an indexed request's block is tens of bytes): per connection
    the memory holds at most 64 blocks of this size, each decoding to at most 4 KiB."""

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._table = self._decoder.header_table
        self._known: dict[bytes, list[Header]] = {}

    def decode(self, block: bytes) -> list[Header]:
        known = self._known.get(block)
        if known is not None:
            return known
        entries = self._table.dynamic_entries
        before = (len(entries), entries[0] if entries else None, self._table.maxsize)
        try:
            headers = cast(list[Header], self._decoder.decode(block, raw=True))
        except HPACKError as exc:
            raise H2Error(COMPRESSION_ERROR, f"bad header block: {exc}") from exc
        after = (len(entries), entries[0] if entries else None, self._table.maxsize)
        unchanged = after[0] == before[0] and after[1] is before[1] and after[2] == before[2]
        small = len(block) <= self.CACHED_BLOCK_BYTES
        if unchanged and small and sum(len(k) + len(v) for k, v in headers) <= 4096:
            if len(self._known) >= self.CACHED_BLOCKS:
                self._known.clear()
            self._known[block] = headers
        elif not unchanged:
            self._known.clear()
        return headers


# --- gRPC ---------------------------------------------------------------------------------

# grpc.StatusCode's numbers, by name, without importing grpc here.
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 1, 2, 3, 4, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14

_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """Seconds of a ``grpc-timeout`` value (``100m``), or None if malformed."""
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in _TIMEOUT_UNITS:
        return None
    return int(digits) * _TIMEOUT_UNITS[unit]


def format_timeout(seconds: float) -> bytes:
    """A ``grpc-timeout`` value for ``seconds`` (at most 8 digits, rounded up)."""
    micros = max(0, int(seconds * 1e6 + 0.999))
    if micros < 100_000_000:
        return b"%du" % micros
    millis = (micros + 999) // 1000
    if millis < 100_000_000:
        return b"%dm" % millis
    return b"%dS" % min(99_999_999, (millis + 999) // 1000)


def encode_message_text(message: str) -> bytes:
    """``grpc-message``: percent-encoded UTF-8 (PROTOCOL-HTTP2.md)."""
    return quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode("ascii")


def decode_message_text(value: bytes) -> str:
    return unquote(value.decode("ascii", "replace"), errors="replace")


def metadata_value(name: bytes, value: bytes) -> str | bytes:
    """A metadata value as grpc's API hands it: ``-bin`` keys base64-decoded."""
    if name.endswith(b"-bin"):
        try:
            return base64.b64decode(value + b"=" * (-len(value) % 4))
        except ValueError:
            return b""
    return value.decode("latin-1")


def metadata_field(name: str, value: str | bytes) -> Header:
    # Names and values came off the wire as latin-1 (invocation_metadata): back as they were.
    if isinstance(value, bytes):
        return name.encode("latin-1"), base64.b64encode(value).rstrip(b"=")
    return name.encode("latin-1"), value.encode("latin-1")


def message_prefix(length: int, compressed: bool = False) -> bytes:
    return bytes((1 if compressed else 0,)) + length.to_bytes(4, "big")


class MessageTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"Received message larger than max ({size} vs. {limit})")


class MessageReader:
    """Cuts a stream's DATA into gRPC's length-prefixed messages (decompressed).

    A message's body is gathered as views of the frames it came in and copied once, into the
    message, when it is whole: a 1 MiB message in 64 frames was copied 32 times over when each
    frame was joined to what came before."""

    def __init__(self, max_bytes: int, encoding: bytes | None = None) -> None:
        self.max_bytes = max_bytes
        self.encoding = encoding
        self._prefix = b""
        self._size: int | None = None
        """The body size of the message being read, once its prefix is whole."""
        self._compressed = False
        self._pieces: list[memoryview] = []
        self._got = 0

    def feed(self, data: View) -> list[bytes]:
        """The messages that ``data`` completes; raises ``MessageTooLarge`` or ``ValueError``
        (a compressed message in an encoding the call did not announce, or corrupt)."""
        out: list[bytes] = []
        view = memoryview(data)
        if self._size is None and not self._prefix and len(view) >= 5:
            # The usual case: whole messages in this frame, copied straight out of it.
            pos, end = 0, len(view)
            while end - pos >= 5 and view[pos] == 0:
                size = int.from_bytes(view[pos + 1 : pos + 5], "big")
                if size > self.max_bytes:
                    raise MessageTooLarge(size, self.max_bytes)
                if end - pos - 5 < size:
                    break
                out.append(view[pos + 5 : pos + 5 + size].tobytes())
                pos += 5 + size
            view = view[pos:]
        while True:
            if self._size is None:
                if not view:
                    return out
                take = 5 - len(self._prefix)
                self._prefix += bytes(view[:take])
                view = view[take:]
                if len(self._prefix) < 5:
                    return out
                size = int.from_bytes(self._prefix[1:5], "big")
                if size > self.max_bytes:
                    raise MessageTooLarge(size, self.max_bytes)
                self._size, self._compressed, self._prefix = size, bool(self._prefix[0]), b""
            want = self._size - self._got
            if want:
                if not view:
                    return out
                piece = view[:want]
                view = view[want:]
                self._pieces.append(piece)
                self._got += len(piece)
                if self._got < self._size:
                    return out
            pieces, self._pieces, self._got, self._size = self._pieces, [], 0, None
            body = pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)
            out.append(self._decompress(body) if self._compressed else body)

    @property
    def partial(self) -> bool:
        return self._size is not None or bool(self._prefix)

    def _decompress(self, body: bytes) -> bytes:
        if self.encoding == b"gzip":
            wbits = 16 + zlib.MAX_WBITS
        elif self.encoding == b"deflate":
            wbits = zlib.MAX_WBITS
        else:
            raise ValueError(
                f"compressed message without a known grpc-encoding ({self.encoding!r})"
            )
        inflater = zlib.decompressobj(wbits)
        try:
            plain = inflater.decompress(body, self.max_bytes + 1)
        except zlib.error as exc:
            raise ValueError(f"corrupt {self.encoding.decode()} message: {exc}") from exc
        if len(plain) > self.max_bytes:
            raise MessageTooLarge(len(plain), self.max_bytes)
        return plain


def find(headers: Sequence[Header], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None
