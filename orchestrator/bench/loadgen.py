"""A minimal keep-alive HTTP/1.1 client for overhead benchmarks.

Measuring a gateway that adds well under a millisecond needs a client whose own cost is small and
steady: httpx spends a few hundred microseconds of Python per request, which on a 2-core machine
competes with the server being measured and caps closed-loop throughput. This client writes one
pre-encoded request on a persistent connection and reads the response (Content-Length or chunked)
straight from the socket, nothing more. It is for benchmarks only: no TLS, no redirects, no proxies.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(slots=True)
class Timing:
    status: int
    first_byte_s: float  # request written → first body bytes (streaming: first SSE chunk)
    total_s: float  # request written → whole body read
    body: bytes


class RawHttpError(Exception):
    pass


def encode_request(url: str, body: dict, extra_headers: dict[str, str] | None = None) -> tuple[str, int, bytes]:
    """(host, port, request bytes) for a JSON POST to ``url``."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// is supported: {url}")
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    payload = json.dumps(body).encode()
    head = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Connection: keep-alive"]
    for k, v in (extra_headers or {}).items():
        head.append(f"{k}: {v}")
    return host, port, ("\r\n".join(head) + "\r\n\r\n").encode() + payload


class RawConnection:
    """One persistent connection; ``send`` reopens it if the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        self.reader = self.writer = None

    async def send(self, request: bytes, timeout: float = 60.0) -> Timing:
        for attempt in (0, 1):
            if self.writer is None:
                await self._open()
            try:
                return await asyncio.wait_for(self._roundtrip(request), timeout)
            except (ConnectionError, asyncio.IncompleteReadError, RawHttpError):
                await self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _roundtrip(self, request: bytes) -> Timing:
        assert self.reader is not None and self.writer is not None
        reader = self.reader
        t0 = time.perf_counter()
        self.writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError) as e:
            raise RawHttpError(f"bad status line {lines[0]!r}") from e
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        first: float | None = None
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size_line = await reader.readline()
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readline()  # the blank line after the last chunk (no trailers)
                    break
                data = await reader.readexactly(size + 2)
                if first is None:
                    first = time.perf_counter() - t0
                parts.append(data[:-2])
            body = b"".join(parts)
        else:
            n = int(headers.get("content-length", "0"))
            body = await reader.readexactly(n) if n else b""
            first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return Timing(status, first if first is not None else total, total, body)
