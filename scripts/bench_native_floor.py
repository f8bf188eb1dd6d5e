#!/usr/bin/env python3
"""The native data plane's floor for ``bench_gateway_overhead.py --floor native``: the compiled plane
(``native/dataplane``) with a lane that does no Dyad work (one fixed engine, relay every answer). Not a
gateway: what the plane itself costs per request, with its two Python calls.

    .venv/bin/python scripts/bench_native_floor.py --engine http://127.0.0.1:PORT --port 8100
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.config import load_config  # noqa: E402
from orchestrator.gateway.native import require  # noqa: E402
from orchestrator.gateway.native.plane import limits_of  # noqa: E402


class Try:
    def __init__(self, url: str, body: bytes, stream: bool) -> None:
        self.url, self.body, self.stream = url, body, stream
        self.headers = [(b"content-type", b"application/json")]
        self.delay_s, self.first_byte_timeout, self.idle_timeout, self.deadline_s = 0.0, 60.0, 60.0, None
        self.max_answer_bytes, self.error_body_bytes = 1 << 26, 1 << 20
        self.reply_headers: list[tuple[bytes, bytes]] = []
        self.strip_usage = False

    def answered(self, status: int, headers: Any, body: Any) -> tuple[str]:
        return ("relay",)

    def failed(self, kind: str, detail: str) -> tuple[Any, ...]:
        return ("reply", 502, [(b"content-type", b"text/plain")], detail.encode())

    def streaming(self) -> None: ...
    def first_event(self, *a: Any) -> None: ...
    def stream_done(self, *a: Any) -> None: ...
    def stream_broken(self, *a: Any) -> tuple[Any, ...]:
        return ("end", b"")
    def client_gone(self) -> None: ...


class Lane:
    def __init__(self, engine: str) -> None:
        self.engine = engine

    def admit(self, path: str, query: str, headers: Any, body: bytes, peer: str, cancel: Any) -> tuple[Any, ...]:
        return ("send", Try(self.engine + path, body, b'"stream": true' in body or b'"stream":true' in body))

    def internal_error(self, where: str, exc: BaseException) -> None:
        print(where, exc, file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    plane = require().Plane("127.0.0.1", args.port, Lane(args.engine), "127.0.0.1:9", "x",
                            limits_of(load_config(None, environ={})))
    plane.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    stop.wait()
    plane.stop(1.0)


if __name__ == "__main__":
    main()
