"""proxy.h2.connection's bound on control answers to a peer that does not read: pure logic,
over a transport that only records what is written."""

from __future__ import annotations

from proxy.h2 import wire
from proxy.h2.connection import MAX_CONTROL_BACKLOG, Connection


class _Transport:
    """What the connection calls on its transport; ``buffered`` is its write buffer."""

    def __init__(self) -> None:
        self.buffered = 0
        self.closed = False

    def write(self, data: bytes) -> None:
        self.buffered += len(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def close(self) -> None:
        self.closed = True


def _connection() -> tuple[Connection, _Transport]:
    conn = Connection(stream_window=1 << 20, max_streams=10)
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(wire.PREFACE + wire.settings_frame(()))
    return conn, transport


def _pings(n: int) -> bytes:
    return b"".join(wire.frame(wire.PING, 0, 0, i.to_bytes(8, "big")) for i in range(n))


def test_a_slow_reader_of_a_large_answer_is_not_cut_off_for_a_ping() -> None:
    conn, transport = _connection()
    transport.buffered += 9 << 20  # a 9 MiB answer sent within the peer's window, unread
    conn.pause_writing()
    conn.data_received(_pings(3))
    assert not transport.closed and not conn.closed


def test_control_answers_piling_up_unread_cost_the_connection() -> None:
    conn, transport = _connection()
    conn.pause_writing()
    per_ping = len(wire.frame(wire.PING, wire.ACK, 0, bytes(8)))
    below = MAX_CONTROL_BACKLOG // per_ping
    conn.data_received(_pings(below))
    assert not transport.closed
    conn.data_received(_pings(2))
    assert transport.closed and conn.closed
    # a peer that reads (the transport resumed) starts from nothing again
    conn, transport = _connection()
    conn.pause_writing()
    conn.data_received(_pings(below))
    conn.resume_writing()
    conn.pause_writing()
    conn.data_received(_pings(below))
    assert not transport.closed
