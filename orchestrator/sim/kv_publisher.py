"""KV cache events on the wire, exactly as vLLM's ``ZmqEventPublisher`` sends them (docs/engines.md §3).

PUB socket: multipart ``[topic, seq (8-byte big-endian, from 0), msgpack([ts, [event, ...], dp_rank])]``.
Replay ROUTER socket: a DEALER sends ``[b"", start_seq (8 bytes)]`` and receives
``[b"", topic, seq, payload]`` for every buffered batch with seq >= start, then an end marker whose
seq is -1 (signed). The buffer is bounded (``buffer_steps`` batches), as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _bind_free(sock: zmq.Socket, host: str, port: int | None) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


class KvEventPublisher:
    """Owns the PUB and replay sockets of one simulated engine; used from its asyncio loop."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, replay_port: int | None = None,
                 topic: str = "kv-events", buffer_steps: int = 10_000, dp_rank: int = 0) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self.port = _bind_free(self._pub, host, port)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self.replay_port = _bind_free(self._replay, host, replay_port)
        self.host = host
        self.topic = topic
        self._topic = topic.encode()
        self.buffer_steps = buffer_steps
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._dp_rank = dp_rank
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    def config(self) -> dict[str, Any]:
        """What vLLM's /kv_event_sources reports for this publisher (its KVEventsConfig)."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": self.topic,
        }

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[dict[str, Any]], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        seq = self._seq
        self._seq += 1
        payload = msgpack.packb([time.time() if ts is None else ts, events, self._dp_rank])
        seq_b = seq.to_bytes(8, "big")
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq_b, payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) != 3:
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._pub.close(0)
        self._replay.close(0)
        self._ctx.term()
