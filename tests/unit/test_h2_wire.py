"""proxy.h2.wire: gRPC framing, timeouts, status text and the HPACK block memory."""

from __future__ import annotations

import gzip
import random
import zlib

import hpack
import pytest

from proxy.h2 import wire


def test_timeouts_round_trip_rounding_up() -> None:
    for seconds in (0.0, 1e-6, 0.0123, 1.5, 99.0, 3600.0, 10**7):
        text = wire.format_timeout(seconds)
        assert len(text) <= 9
        back = wire.parse_timeout(text)
        assert back is not None and back >= seconds - 1e-9
        assert back - seconds <= max(1.0, seconds * 1e-6)


@pytest.mark.parametrize("bad", [b"", b"m", b"12", b"12x", b"-1S", b"123456789S", b"1.5S"])
def test_malformed_timeouts_read_as_none(bad: bytes) -> None:
    assert wire.parse_timeout(bad) is None


def test_status_text_survives_percent_encoding() -> None:
    for text in ("plain words", "100% done\r\nnext", "naïve é ✓", "a/b?c=d"):
        encoded = wire.encode_message_text(text)
        assert all(0x20 <= b < 0x7F for b in encoded)
        assert wire.decode_message_text(encoded) == text


def test_binary_metadata_is_base64_on_the_wire() -> None:
    name, value = wire.metadata_field("x-trace-bin", b"\x00\xff\x10")
    assert wire.metadata_value(name, value) == b"\x00\xff\x10"
    assert wire.metadata_value(b"x-plain", b"abc") == "abc"


def _framed(message: bytes, compressed: bool = False) -> bytes:
    return wire.message_prefix(len(message), compressed) + message


def test_messages_cut_at_any_byte() -> None:
    messages = [b"", b"a", bytes(range(256)) * 40, b"z" * 5]
    data = b"".join(_framed(m) for m in messages)
    rng = random.Random(7)
    for _ in range(50):
        reader = wire.MessageReader(1 << 20)
        got: list[bytes] = []
        pos = 0
        while pos < len(data):
            step = rng.randint(1, 700)
            got += reader.feed(data[pos : pos + step])
            pos += step
        assert got == messages and not reader.partial


def test_compressed_messages_are_inflated() -> None:
    plain = b"tensor" * 1000
    gz = wire.MessageReader(1 << 20, b"gzip")
    assert gz.feed(_framed(gzip.compress(plain), True)) == [plain]
    deflate = wire.MessageReader(1 << 20, b"deflate")
    assert deflate.feed(_framed(zlib.compress(plain), True)) == [plain]
    with pytest.raises(ValueError, match="grpc-encoding"):
        wire.MessageReader(1 << 20).feed(_framed(b"x", True))
    with pytest.raises(ValueError, match="corrupt"):
        wire.MessageReader(1 << 20, b"gzip").feed(_framed(b"not gzip", True))


def test_sizes_are_bounded_before_and_after_inflating() -> None:
    with pytest.raises(wire.MessageTooLarge, match=r"\(1001 vs. 1000\)"):
        wire.MessageReader(1000).feed(wire.message_prefix(1001))
    bomb = gzip.compress(b"\0" * 10_000_000)
    assert len(bomb) < 20_000
    with pytest.raises(wire.MessageTooLarge):
        wire.MessageReader(1 << 20, b"gzip").feed(_framed(bomb, True))


def test_block_memory_decodes_exactly_as_a_fresh_decoder() -> None:
    """Blocks from a real (indexing) encoder, repeated and interleaved with blocks that
    change the table: the remembering decoder agrees with hpack's own throughout."""
    encoder = hpack.Encoder()
    rng = random.Random(3)
    fixed = [(":method", "POST"), (":path", "/inference.GRPCInferenceService/ModelInfer")]
    ours = wire.BlockDecoder(1 << 16)
    reference = hpack.Decoder()
    for i in range(400):
        headers = list(fixed)
        if rng.random() < 0.3:
            headers.append(("x-request", f"r{rng.randint(0, 40)}"))
        if rng.random() < 0.1:
            headers.append(("x-big", "v" * rng.randint(100, 900)))  # evicts older entries
        block = encoder.encode(headers)
        expected = [(k.encode(), v.encode()) for k, v in reference.decode(block)]
        assert ours.decode(block) == expected, i


def test_encoded_fields_decode_with_any_decoder() -> None:
    fields = [(b":status", b"200"), (b"grpc-message", b"x" * 300), (b"k", b"")]
    assert hpack.Decoder().decode(wire.encode_block(fields), raw=True) == fields


def test_a_bad_block_is_a_compression_error() -> None:
    with pytest.raises(wire.H2Error) as info:
        wire.BlockDecoder(1 << 16).decode(b"\xff\xff\xff\xff")
    assert info.value.code == wire.COMPRESSION_ERROR
