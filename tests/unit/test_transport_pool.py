"""The engine client's connection pool (``orchestrator/gateway/transport.py``): a connection goes back to the pool
reading. The socket is a recording stand-in (a fake asyncio transport): the unit tier opens no sockets."""

from __future__ import annotations

import asyncio

from orchestrator.gateway.transport import _READ_HIGH_WATER, FastTransport, _Conn


class RecordingTransport(asyncio.Transport):
    """Records pause/resume and close; writes go nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True
        self.closed = False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_connection_pooled_after_an_answer_left_unread_reads_the_next_answer():
    # An answer that arrived whole while its reader lagged (buffered past the high-water mark: reading paused),
    # then was left unread by a caller that stopped at its size bound. Pooled so, the socket stayed paused and
    # the next request's answer on it was never read: the try stalled until the watchdog gave up (16 s).
    async def run() -> None:
        pool = FastTransport()
        conn = _Conn(pool, ("127.0.0.1", 1))
        transport = RecordingTransport()
        conn.connection_made(transport)
        conn.busy = True
        body = b"x" * (_READ_HIGH_WATER + (512 << 10))
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 256 << 10):
            conn.data_received(body[i:i + (256 << 10)])
        assert conn.complete and conn.keep_alive and not transport.reading  # whole, unread, paused
        await conn.next_chunk(5.0)  # the caller reads a little, then stops (its bound)
        pool._put_idle(conn)
        assert pool._take_idle(("127.0.0.1", 1)) is conn
        assert transport.reading, "a pooled connection must read the next answer"

    asyncio.run(run())
