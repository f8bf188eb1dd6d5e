"""What makes a healthy engine look dead to the gateway, or a dead one look alive: probes that are slow
under load, a worker marked down while its streams are still delivering tokens, a non-streamed answer
that breaks off, stale pooled connections.

A real gateway over real sockets in front of ``FakeEngine`` / ``RawEngine`` test doubles
(tests/integration/fake_engine.py, raw_engine.py), which misbehave on cue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import struct
import threading
import time

import httpx
import pytest

from tests.integration.test_gateway_transport import RawServer, VanishedPeer
from tests.integration.test_request_path_failures import (
    MODEL,
    complete,
    engines,
    events,
    gateway,
    healthy,
    sample,
)


def stream_in_thread(gw, tokens: int, prompt: str = "hello") -> tuple[threading.Thread, dict]:
    """A stream read in a thread; ``out["first"]`` is set once its first bytes arrived, ``out["r"]`` holds
    the response (its text read) at the end."""
    out: dict = {"first": threading.Event()}

    def run() -> None:
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True}) as r:
            raw = b""
            for chunk in r.iter_raw():
                raw += chunk
                out["first"].set()
        r._content = raw
        out["r"] = r

    t = threading.Thread(target=run)
    t.start()
    assert out["first"].wait(30)
    time.sleep(0.2)  # (a few tokens out)
    return t, out


def relayed_tokens(r: httpx.Response) -> list[str]:
    return [c["choices"][0]["text"] for c in events(r)[:-1] if isinstance(c, dict) and c.get("choices")]


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


class ServerThread:
    """A raw asyncio test server (test_gateway_transport.py) on a loop of its own, shaped as ``gateway()``
    takes an engine (``url``, ``stop``)."""

    def __init__(self, server) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(server.start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class PeerThread(ServerThread):
    """A ``VanishedPeer`` answering completions."""

    def __init__(self) -> None:
        super().__init__(VanishedPeer(json.dumps({"id": "x", "object": "text_completion", "created": 1, "choices": [
            {"index": 0, "text": "a", "finish_reason": "length"}]}).encode()))

    def vanish(self) -> None:
        self.loop.call_soon_threadsafe(self.server.vanish)


def test_a_slow_health_probe_does_not_cut_streams_that_are_delivering_tokens():
    """/health answers later than ``health.timeout_s`` (an engine busy serving) while a stream on it
    delivers a token every 0.1 s: the worker stays in rotation and the stream ends whole on it (was: marked
    down after two missed probes, and the stream pulled: an error ending, nowhere to continue it). Once
    nothing flows, the missed probes count again: the worker is marked down."""
    (slow,) = engines("ok", tokens=30)
    slow.token_delay_s = 0.1
    with gateway([slow], health={"interval_s": 0.2, "timeout_s": 0.3, "failure_threshold": 2}) as gw:
        healthy(gw)
        t, out = stream_in_thread(gw, 30)
        slow.health_delay_s = 1.0
        t.join(60)
        r = out["r"]
        assert events(r)[-1] == "[DONE]" and "error" not in r.text, r.text[-400:]
        assert relayed_tokens(r) == [f"w{i} " for i in range(30)]
        assert gw.runtime.metrics.registry.get_sample_value(
            "dyad_stream_failovers_total", {"outcome": "error_event"}) in (None, 0.0)
        worker = gw.runtime.fleet.get("w0")
        assert worker.last_error and "did not answer" in worker.last_error  # the probes did fail meanwhile
        wait_for(lambda: not worker.health_ok)  # nothing flows now: the missed probes take it out


def test_a_worker_marked_down_lets_its_streams_that_deliver_tokens_finish():
    """A request the engine drops without answering, with no other worker to ask, takes the worker out of
    rotation (a dead engine looks like that). A stream on the same worker delivering a token every 0.1 s is
    left to finish there: it would break by itself if the engine had died (was: pulled with it, and ended
    with an error: nowhere to continue it)."""
    (eng,) = engines("poison_reset", tokens=30)
    eng.token_delay_s = 0.1
    with gateway([eng]) as gw:
        healthy(gw)
        t, out = stream_in_thread(gw, 30)
        dropped = httpx.post(gw.url + "/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": "POISON", "max_tokens": 2})
        assert dropped.status_code == 502 and dropped.json()["error"]["code"] == "engine_closed_connection"
        assert not gw.runtime.fleet.get("w0").health_ok  # marked down at once
        t.join(60)
        r = out["r"]
        assert events(r)[-1] == "[DONE]" and "error" not in r.text, r.text[-400:]
        assert relayed_tokens(r) == [f"w{i} " for i in range(30)]


def test_a_stream_left_running_on_a_worker_marked_down_is_pulled_once_it_goes_quiet():
    """The stream spared when its worker was marked down stops delivering (the engine hung after all): it is
    pulled once it has been quiet for the health loop's window (``failure_threshold * (interval_s + timeout_s)``), and
    ends honestly with the error ending, not after the 60 s stream idle timeout."""
    (eng,) = engines("poison_reset", tokens=30)
    eng.token_delay_s = 0.1
    with gateway([eng], health={"interval_s": 0.25, "failure_threshold": 2},
                 resilience={"stream_idle_timeout_s": 60}) as gw:
        healthy(gw)
        t, out = stream_in_thread(gw, 30)
        eng.healthy = False  # (its probes fail too: the health loop keeps it out once nothing flows)
        dropped = httpx.post(gw.url + "/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": "POISON", "max_tokens": 2})
        assert dropped.status_code == 502 and not gw.runtime.fleet.get("w0").health_ok
        t0 = time.monotonic()
        eng.token_delay_s = 60  # the engine stops sending
        t.join(60)
        took = time.monotonic() - t0
        r = out["r"]
        assert events(r)[-1] == "[DONE]" and "marked down" in events(r)[-2]["error"]["message"], r.text[-400:]
        assert 0 < len(relayed_tokens(r)) < 30
        assert took < 20  # pulled once quiet, not at the 60 s idle timeout


def test_an_answer_every_worker_breaks_off_is_the_requests_fault():
    """A non-streamed answer that breaks off after its head (the connection closes before its Content-Length
    is met) for one input, on every worker: each break took its worker out of rotation at once (with every
    stream on it), so one such request took the whole fleet out until the next health round. Judged as a
    connection dropped before the answer is: the same break on a second worker that answers others is the
    request's doing (a 502, every worker stays); a break where another worker answers takes the worker out."""
    with gateway(engines("poison_short", "poison_short"), health={"interval_s": 30}) as gw:
        healthy(gw)
        for _ in range(4):  # (breakers open after 3 here)
            for _ in range(2):
                assert complete(gw).status_code == 200
            r = complete(gw, prompt="POISON pill")
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_broke_off", r.text
        assert gw.runtime.breakers.snapshot() == {}
        assert all(w.health_ok for w in gw.runtime.fleet.workers())
        assert complete(gw).status_code == 200
    breaking, good = engines("poison_short", "ok")
    with gateway([breaking, good], health={"interval_s": 30}) as gw:
        healthy(gw)
        while not breaking.bodies:
            assert complete(gw, prompt="POISON pill").status_code == 200  # answered by the good worker
        assert not gw.runtime.fleet.get("w0").health_ok and gw.runtime.fleet.get("w1").health_ok


def test_a_slow_health_probe_does_not_take_out_an_engine_whose_metrics_show_it_generating():
    """Long non-streamed requests leave no trace until they complete; while /health answers late the engine's
    own generated-token counter (its /metrics, scraped) still rises: the worker stays in rotation and the
    request is answered there (was: marked down after two missed probes, the request pulled and, with no other
    worker, answered 503)."""
    (busy,) = engines("ok", tokens=5)
    busy.report_generation = True
    with gateway([busy], health={"interval_s": 0.2, "timeout_s": 0.3, "failure_threshold": 2},
                 scrape={"interval_s": 0.2, "timeout_s": 2}) as gw:
        healthy(gw)
        busy.delay_s = 3.0
        busy.health_delay_s = 1.0
        r = complete(gw)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "w0 w1 w2 w3 w4", r.text
        worker = gw.runtime.fleet.get("w0")
        assert worker.last_error and "did not answer" in worker.last_error  # the probes did fail meanwhile
        assert len(busy.bodies) == 1  # never pulled and sent again


def test_with_every_worker_out_for_slow_probes_requests_still_go_to_them():
    """An engine too busy to answer /health in time (its probes time out; it still takes connections and
    answers requests) leaves rotation. With no healthy worker left, its requests were answered 503: an outage
    the gateway made itself. They now go to it (``health.last_resort``), counted, with /ready 200 and
    ``degraded`` naming it; never to a worker whose probes answer with an error. Once a probe answers it is
    back in rotation (no more last-resort decisions); once its probes answer with an error too, the answer is a
    503 at once, not a hang. (A worker a request finds unreachable leaves the last resort too: unit-tested in
    tests/unit/test_fleet_registry.py, since a stopped ``FakeEngine`` still answers on open connections.)"""
    slow, sick = engines("ok", "ok")
    with gateway([slow, sick], health={"interval_s": 0.2, "timeout_s": 0.3, "failure_threshold": 2}) as gw:
        healthy(gw)
        fleet = gw.runtime.fleet
        w0, w1 = fleet.get("w0"), fleet.get("w1")
        sick.healthy = False  # its probes answer 503
        slow.health_delay_s = 1.0  # busy: answers /health after the probe gave up
        wait_for(lambda: w0.health_ok is False and w1.health_ok is False)
        assert w0.out_by_timeouts and not w1.out_by_timeouts
        served = len(slow.bodies)
        for _ in range(3):
            r = complete(gw)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "w0 w1 w2 w3 w4", r.text
            assert r.headers["x-dyad-worker"] == "w0"
        assert len(slow.bodies) == served + 3
        labels = {"policy": "round_robin", "outcome": "last_resort"}
        assert sample(gw, "dyad_routing_decisions_total", labels) == 3
        ready = httpx.get(gw.url + "/ready", timeout=10)
        assert ready.status_code == 200, ready.text
        body = ready.json()
        assert body["status"] == "degraded" and body["models"][MODEL]["last_resort"] == ["w0"], body
        assert body["models"][MODEL]["healthy_workers"] == 0 and "health.last_resort" in body["reason"]
        slow.health_delay_s = 0.0
        wait_for(lambda: w0.health_ok is True)
        assert complete(gw).status_code == 200
        assert sample(gw, "dyad_routing_decisions_total", labels) == 3  # in rotation: no last resort
        slow.healthy = False  # its probes answer 503 at once
        wait_for(lambda: w0.health_ok is False)
        assert not w0.out_by_timeouts
        started = time.monotonic()
        r = complete(gw)
        assert r.status_code == 503, r.text
        assert time.monotonic() - started < 10
        assert sample(gw, "dyad_routing_decisions_total", labels) == 3


def test_a_worker_whose_pooled_connections_lead_nowhere_stays_in_rotation():
    """The engine restarted behind the same address and its old connections lead nowhere (no FIN, no reset: a
    host that went away): every health probe took the next dead pooled connection and timed out, so the worker
    stayed out of rotation for one probe timeout per pooled connection (here 30 s) although fresh
    connections were answered at once. A failed probe now closes the worker's idle connections: the next one
    connects afresh, and the worker never leaves rotation."""
    peer = PeerThread()
    with gateway([peer], health={"interval_s": 0.2, "timeout_s": 1.0, "failure_threshold": 2},
                 scrape={"interval_s": 60}) as gw:
        healthy(gw)
        with concurrent.futures.ThreadPoolExecutor(30) as pool:  # 30 connections in the gateway's pool
            assert set(pool.map(lambda _: complete(gw).status_code, range(30))) == {200}
        downs: list[str] = []
        gw.runtime.fleet.subscribe(lambda ev, w: downs.append(w.state.value) if ev == "state" else None)
        peer.vanish()
        worker = gw.runtime.fleet.get("w0")
        wait_for(lambda: worker.last_error is not None)  # a probe found a dead connection
        time.sleep(2.0)  # (more probe rounds)
        assert worker.health_ok and "unhealthy" not in downs, downs
        assert complete(gw).status_code == 200


def test_a_try_pulled_as_stalled_takes_the_workers_dead_pooled_connections_with_it():
    """The request path's side of it: a try sent on a pooled connection that leads nowhere is pulled by the
    stall watchdog (no byte, no work); the worker's other idle connections went idle as that one did, so the
    next request connects afresh and is answered (was: it took the next dead pooled connection, and stalled
    too, once per pooled connection)."""
    peer = PeerThread()
    with gateway([peer], health={"interval_s": 60}, scrape={"interval_s": 60},
                 resilience={"stall_timeout_s": 0.5, "stall_prefill_tokens_per_s": 1e6}) as gw:
        healthy(gw)
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            assert set(pool.map(lambda _: complete(gw).status_code, range(10))) == {200}
        peer.vanish()
        stalled = complete(gw)
        assert stalled.status_code >= 500 and "stalled" in stalled.text, stalled.text
        assert complete(gw).status_code == 200


class EndsWithoutBodyEnd(RawServer):
    """A streamed answer that is whole by its protocol (tokens, ``data: [DONE]``) but whose HTTP body never ends
    properly: the engine then closes the connection without the last chunk (``close``), resets it (``reset``),
    or keeps it open (``hang``)."""

    def __init__(self, after: str) -> None:
        super().__init__(lambda req: [], close_after=after != "hang")
        self.after = after
        self.handlers: set[asyncio.Task] = set()

    def answer(self, request: bytes, served: int) -> list[tuple[float, bytes]] | None:
        if request.startswith(b"GET"):
            return [(0, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")]
        events = b"".join(b"data: " + json.dumps({"id": "r", "object": "text_completion", "created": 1, "choices": [
            {"index": 0, "text": t, "finish_reason": f}]}).encode() + b"\n\n" for t, f in (("a ", None), ("b", "length")))
        body = events + b"data: [DONE]\n\n"
        parts = [(0, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                  + b"%x\r\n%s\r\n" % (len(body), body))]
        return parts + [(3600, b"")] if self.after == "hang" else parts

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.after == "reset":  # (the close below then resets the connection)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.handlers.add(asyncio.current_task())
        await super().handle(reader, writer)

    async def stop(self) -> None:
        for task in self.handlers:
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        await super().stop()


@pytest.mark.parametrize("after", ["close", "reset", "hang"])
def test_a_stream_whole_by_its_protocol_is_no_broken_stream_whatever_its_body_does_after(after):
    """An engine that ends each stream with its tokens and ``data: [DONE]`` and then closes or resets the
    connection without the body's last chunk, or keeps it open: each stream was counted as broken against
    the worker (its breaker opened after three, a healthy engine taken out; with ``hang`` each client also
    waited out the 60 s idle timeout for the end of its answer). The answer is whole: the stream is
    complete, and the worker served it."""
    with gateway([ServerThread(EndsWithoutBodyEnd(after))], resilience={"stream_idle_timeout_s": 60}) as gw:
        healthy(gw)
        for _ in range(4):  # (breakers open after 3 here)
            started = time.monotonic()
            r = complete(gw, stream=True)
            assert r.status_code == 200 and events(r)[-1] == "[DONE]" and "error" not in r.text, r.text
            assert relayed_tokens(r) == ["a ", "b"]
            assert time.monotonic() - started < 20  # (not the 60 s idle timeout)
        assert gw.runtime.breakers.snapshot() == {}
        assert gw.runtime.metrics.registry.get_sample_value(
            "dyad_upstream_errors_total", {"worker": "w0", "kind": "stream"}) in (None, 0.0)
        assert gw.runtime.fleet.get("w0").last_served_at is not None
