#!/usr/bin/env python3
"""Python bytecodes the native lane runs per request: a deterministic measure of Dyad's per-request Python.

Timing Python on a shared machine moves by tens of percent between runs; the number of bytecodes a request
executes does not. This starts one zero-cost simulated engine (``dyad sim-engine --profile zero``) and a
gateway in this process, then calls the native lane's callbacks directly on this thread (``lane.admit``, then
``answered`` - or ``streaming``, ``first_event``, ``stream_done`` for a stream - with a canned engine answer:
no plane, no sockets on the request's way), counting the interpreter's opcode events (``sys.settrace`` with
``f_trace_opcodes``) over ``--requests`` requests after a warm-up. The lane runs the same route handler,
decision and accounting as the Python gateway, so the count is also most of the Python plane's per-request
work (without its HTTP server and relay).

    .venv/bin/python scripts/count_request_bytecodes.py [--stream] [--chat] [--policy kv_aware] [--top 40]

Prints bytecodes and Python calls per request, and with ``--top N`` the N functions that run the most.
C code (orjson, dict operations, prometheus_client's C parts) executes no bytecodes: it is not counted.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from orchestrator.config import load_config  # noqa: E402
from orchestrator.gateway.native.lane import NativeLane  # noqa: E402
from orchestrator.gateway.serve import GatewayThread  # noqa: E402
from orchestrator.ports import free_port, wait_ready  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog"
ANSWER = orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "bench",
                       "choices": [{"index": 0, "text": " a b c d e f g h", "finish_reason": "length",
                                    "logprobs": None}],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17}})
USAGE = '{"prompt_tokens":9,"completion_tokens":8,"total_tokens":17}'


class _Cancel:
    """The plane's cancel handle, as the lane sees it (nothing to cancel here)."""

    def cancel(self, why: str) -> None:
        return None

    def quiet_for(self) -> float | None:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--chat", action="store_true", help="/v1/chat/completions (default: /v1/completions)")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--top", type=int, default=0, help="also list the N functions that run the most bytecodes")
    args = ap.parse_args()

    eport = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sim-engine", "--port", str(eport),
                               "--model", "bench", "--profile", "zero"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_ready(f"http://127.0.0.1:{eport}/health", engine), "the simulated engine did not start"
        config = load_config({
            "models": [{"name": "bench"}],
            "workers": [{"id": "e0", "url": f"http://127.0.0.1:{eport}", "engine": "sim", "models": ["bench"]}],
            "router": {"policy": args.policy}, "gateway": {"host": "127.0.0.1"}}, environ={})
        req: dict[str, Any] = {"model": "bench", "max_tokens": 8, "temperature": 0.0, "stream": args.stream}
        if args.chat:
            req["messages"] = [{"role": "user", "content": PROMPT}]
        else:
            req["prompt"] = PROMPT
        body = orjson.dumps(req)
        path = "/v1/chat/completions" if args.chat else "/v1/completions"
        headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        answer_head = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
        with GatewayThread(config) as gw:  # (its own loop serves nothing here: the lane is called directly)
            lane = NativeLane(gw.app, gw.loop)

            def one() -> None:
                step = lane.admit(path, "", headers, body, "127.0.0.1:5555", _Cancel())
                assert step[0] == "send", step
                t = step[1]
                if args.stream:
                    t.streaming()
                    t.first_event(0.0001)
                    t.stream_done(USAGE, 9, 0.0001, 0.0002, [0.00001] * 7)
                else:
                    assert t.answered(200, answer_head, ANSWER)[0] == "relay"

            for _ in range(args.warmup):
                one()
            ops: collections.Counter[tuple[str, int, str]] = collections.Counter()
            calls: collections.Counter[tuple[str, int, str]] = collections.Counter()

            def trace(frame: Any, event: str, arg: Any) -> Any:
                key = (frame.f_code.co_filename, frame.f_code.co_firstlineno, frame.f_code.co_qualname)
                if event == "call":
                    frame.f_trace_opcodes = True
                    calls[key] += 1
                elif event == "opcode":
                    ops[key] += 1
                return trace

            sys.settrace(trace)
            try:
                for _ in range(args.requests):
                    one()
            finally:
                sys.settrace(None)
        n = args.requests
        what = f"{'streamed' if args.stream else 'non-streamed'} {path}, {args.policy}"
        print(f"{what}: {sum(ops.values()) / n:.0f} bytecodes per request, {sum(calls.values()) / n:.0f} Python calls")
        for key, count in ops.most_common(args.top):
            name = key[0]
            name = str(Path(name).relative_to(ROOT)) if name.startswith(str(ROOT)) else name.split("site-packages/")[-1]
            print(f"{count / n:8.1f}  {calls[key] / n:5.1f} calls  {name}:{key[1]}:{key[2]}")
    finally:
        engine.terminate()
        engine.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
