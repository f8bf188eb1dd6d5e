#!/usr/bin/env python3
"""Spike (not shipped, not imported by Dyad): a native HTTP data plane that asks Python only to decide.

The Rust module (``src/lib.rs``: tokio + hyper, built by ``build.sh`` from Debian's packaged crates, no
crates.io) accepts client connections, reads the body, calls ``decide(path, body)`` under the GIL, forwards to
the engine on a pooled keep-alive connection, and for a non-streamed answer calls ``check(status, body)``
before writing it. This script supplies those two callbacks from Dyad's own modules:

* ``native``: no Python at all (round robin in Rust): the floor of the design.
* ``py-rr``: a trivial Python ``decide`` (parse, pick): the cost of crossing into Python once.
* ``py-dyad``: Dyad's decision work on the request side: parse, ``request.validate`` (internal fields
  refused, every checked field), the token estimate, a ``RouteRequest``, ``Router.decide`` (round_robin,
  its metrics and recent-decision record), ``Router.begin``, the request metrics (arrivals, prompt tokens,
  in flight); on the answer side: parse, ``classify.error_in_answer``, usage, ``Router.finish``, the e2e and
  token histograms and an ``AccessRecord`` (the access log off, as by default).

A streamed answer (``py-dyad``) is screened in Rust as ``stream_protocol.py`` screens it for the OpenAI
chunk protocol: whole events only, each ``data:`` a JSON object or ``[DONE]``, the usage chunk the gateway
asked for withheld, and an end without ``[DONE]`` closed with an SSE error event and ``[DONE]``; then
``check_stream(context, usage, events, ended)`` does the accounting in Python after the last byte.

What ``py-dyad`` leaves out of the real request path (so its numbers are a lower bound for this design):
intake (auth, rate and concurrency limits, the admission queue), the request and stall timers, tracing
checks, failover and second opinions, the first-token accounting of a stream (TTFT, ITL), and the
Responses API's event protocol. See
docs/benchmarks.md, "Session 12: a native data plane, measured (spike)".

    experiments/native_plane/build.sh
    .venv/bin/python scripts/bench_gateway_overhead.py --floor protocol --native-spike native --native-spike py-dyad
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))

import dyad_native  # noqa: E402  (built by build.sh)
import orjson  # noqa: E402

from orchestrator.clock import MonotonicClock  # noqa: E402
from orchestrator.fleet.registry import FleetRegistry  # noqa: E402
from orchestrator.fleet.worker import Worker  # noqa: E402
from orchestrator.gateway import classify  # noqa: E402
from orchestrator.gateway import request as rq  # noqa: E402
from orchestrator.gateway.fastpath import new_request_id  # noqa: E402
from orchestrator.router.estimate import estimate_text_tokens  # noqa: E402
from orchestrator.router.policies.round_robin import RoundRobinPolicy  # noqa: E402
from orchestrator.router.router import Router  # noqa: E402
from orchestrator.router.types import RouteRequest  # noqa: E402
from orchestrator.telemetry.access_log import AccessLog, AccessRecord  # noqa: E402
from orchestrator.telemetry.children import request_children  # noqa: E402
from orchestrator.telemetry.metrics import DyadMetrics  # noqa: E402


def drive(coro):  # Router.decide is a coroutine that awaits nothing without a prefix tracker
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("Router.decide awaited: this spike has no event loop")


def dyad_callbacks(engine: str, model: str):
    worker = Worker("e0", engine, models=[model])
    fleet = FleetRegistry([worker], configured_models=[model])
    fleet.record_health(worker, True, 0.0)
    metrics = DyadMetrics()
    router = Router(RoundRobinPolicy(), fleet, MonotonicClock(), metrics, None, retry_after_s=1)
    access_log = AccessLog()

    def decide(path: str, body: bytes):
        started = time.perf_counter()
        obj = orjson.loads(body)
        if not isinstance(obj, dict):
            raise ValueError("the body must be a JSON object")
        endpoint = rq.CHAT if path.endswith("/chat/completions") else rq.COMPLETIONS
        name = rq.validate(endpoint, obj)
        stream = obj.get("stream") is True
        if stream:
            obj["stream_options"] = {"include_usage": True}
        prompt = obj.get("prompt")
        req = RouteRequest(request_id=new_request_id(), model=name,
                           prompt_tokens=estimate_text_tokens(prompt) if isinstance(prompt, str) else 1)
        counted = request_children(metrics, name, "completions" if endpoint == rq.COMPLETIONS else "chat")
        counted.arrivals.inc()
        counted.arrival_prompt_tokens.inc(req.prompt_tokens)
        decision = drive(router.decide(req))
        router.begin(decision, req)
        counted.inflight.inc()
        return decision.worker.url + path, orjson.dumps(obj), stream, (req, decision, counted, started)

    def check(status: int, body: bytes, context: tuple) -> bool:
        req, decision, counted, started = context
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = None
        ok = isinstance(obj, dict) and classify.error_in_answer(obj) is None
        usage = obj.get("usage") if ok else None
        router.finish(decision, req, ok)
        counted.inflight.dec()
        counted.requests("200" if ok else "502").inc()
        elapsed = time.perf_counter() - started
        counted.e2e.observe(elapsed)
        record = AccessRecord(request_id=req.request_id, endpoint="/v1/completions", model=req.model)
        if isinstance(usage, dict):
            counted.prompt_tokens.observe(usage.get("prompt_tokens") or 0)
            counted.generation_tokens.observe(usage.get("completion_tokens") or 0)
        record.status, record.total_s = (200 if ok else 502), elapsed
        access_log.emit(record)
        return ok

    def check_stream(context: tuple, usage: str | None, events: int, ended: bool) -> None:
        """After a streamed answer's last byte (screened in Rust): the accounting."""
        req, decision, counted, started = context
        router.finish(decision, req, ended)
        counted.inflight.dec()
        counted.requests("200").inc()
        elapsed = time.perf_counter() - started
        counted.e2e.observe(elapsed)
        used = orjson.loads(usage) if usage else {}
        counted.prompt_tokens.observe(used.get("prompt_tokens") or req.prompt_tokens)
        counted.generation_tokens.observe(used.get("completion_tokens") or events)
        record = AccessRecord(request_id=req.request_id, endpoint="/v1/completions", model=req.model, stream=True)
        record.status, record.total_s = 200, elapsed
        access_log.emit(record)

    return decide, check, check_stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--mode", choices=("native", "py-rr", "py-dyad"), default="py-dyad")
    ap.add_argument("--threads", type=int, default=1, help="tokio worker threads (1: the GIL is never handed between threads)")
    a = ap.parse_args()
    decide = check = check_stream = None
    if a.mode == "py-rr":
        def decide(path: str, body: bytes):
            return a.engine + path, None, orjson.loads(body).get("stream") is True, None
    elif a.mode == "py-dyad":
        decide, check, check_stream = dyad_callbacks(a.engine, a.model)
    dyad_native.serve(a.port, [a.engine], decide, check, check_stream, a.threads)


if __name__ == "__main__":
    main()
