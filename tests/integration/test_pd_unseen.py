"""P/D (prefill/decode) with engine faults and inputs no other test tries: what a prefill engine answers to its
leg (vLLM two-step) and to its half of a pair (SGLang dual dispatch), decode engines failing after a good prefill,
P/D streams that end every way, and requests whose fields only the decode engine judges.

Engines: the project's simulator (``SimEngineThread``) where it plays the role, and hand-written HTTP engine
doubles (fakes, named so: ``PrefillDouble``, ``SglangPrefillDouble`` on tests/integration/socket_engine.py) where
an answer no simulator gives is needed. The invariants, whatever the fault:
- the client gets a complete answer or an honest error (OpenAI-shaped, or an SSE error event then ``[DONE]``);
- a prefill engine's failure that another engine shows is the worker's counts in that worker's breaker (and a
  success resets its count); a failure the request causes counts against nobody;
- a request the decode engine refuses leaves no prefill work behind: no KV leased on the prefill engine for a
  hand-off nobody reads (vLLM keeps such blocks for VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s by default);
- accounting (workers' in-flight counts, the router's in-flight ledger, the in-flight gauge) returns to zero.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.engine_model import _LEASED
from orchestrator.sim.server import SimEngineThread
from tests.integration.socket_engine import STREAM_HEAD, SocketEngine, chunk, event
from tests.integration.test_engine_fault_matrix import check_stream

MODEL = "m"
PROMPT = "Explain the plan: " + " ".join(f"step{i} then" for i in range(150))


def _whole(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (status, ctype, len(body), body)


class PrefillDouble(SocketEngine):
    """A vLLM prefill engine double (a fake): each prefill step is answered by the next of ``script`` (then by
    ``mode``). A mode is "ok" (a one-token answer with a hand-off pointing at this double, which serves the
    simulator decode engine's ``/sim/kv_pull``), "status_NNN", "not_json", "error_200_NNN" (a 200 carrying an
    error object with that code), or a callable ``params -> answer dict`` (the answer's JSON)."""

    def __init__(self, mode: Any = "ok", script: list[Any] | None = None) -> None:
        self.mode = mode
        self.script = list(script or [])
        self.steps: list[dict[str, Any]] = []  # the prefill bodies received
        self.pulls = 0  # hand-offs the decode engine read
        self.lost = False  # True: every read of a hand-off fails (the blocks are gone: "no KV lease")
        self.release = threading.Event()  # what a "hold" answer waits for
        self._lock = threading.Lock()
        super().__init__()

    def params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
                "remote_engine_id": "double", "remote_request_id": "r", "remote_host": "127.0.0.1",
                "remote_port": int(self.url.rsplit(":", 1)[1]), "tp_size": 1}

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if method == "GET":
            out = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode() \
                if path == "/v1/models" else b""
            conn.sendall(_whole(200, out))
            return True
        if path == "/sim/kv_pull":
            if self.lost:
                conn.sendall(_whole(404, b'{"error": {"message": "no KV lease for this request"}}'))
                return True
            self.pulls += 1
            conn.sendall(_whole(200, b'{"num_tokens": 1, "block_ids": [1]}'))
            return True
        with self._lock:
            self.steps.append(json.loads(body or b"{}"))
            mode = self.script.pop(0) if self.script else self.mode
        answer: dict[str, Any] = {"id": "p", "object": "text_completion", "created": 1, "model": MODEL,
                                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        if callable(mode):
            conn.sendall(_whole(200, json.dumps(mode(self.params())).encode()))
        elif mode == "ok":
            conn.sendall(_whole(200, json.dumps({**answer, "kv_transfer_params": self.params()}).encode()))
        elif mode.startswith("status_"):
            conn.sendall(_whole(int(mode[7:]), json.dumps(
                {"error": {"message": f"prefill double says {mode[7:]}", "type": "X", "code": int(mode[7:])}}).encode()))
        elif mode.startswith("error_200_"):
            conn.sendall(_whole(200, json.dumps(
                {"error": {"message": "prefill double failed inside", "type": "X", "code": int(mode[10:])}}).encode()))
        elif mode == "hold":  # (answers "ok" once ``release`` is set)
            self.release.wait(60)
            conn.sendall(_whole(200, json.dumps({**answer, "kv_transfer_params": self.params()}).encode()))
        elif mode == "not_json":
            conn.sendall(_whole(200, b"<html>a proxy's page</html>", b"text/html"))
        else:
            raise AssertionError(mode)
        return True


class SglangPrefillDouble(SocketEngine):
    """An SGLang prefill server double (a fake): answers each half by ``mode`` — "garbage" (a 200 that is no
    JSON), "error_200" (a 200 carrying an error), "status_NNN" — after holding it ``hold_s`` (a connection the
    gateway closes meanwhile is counted in ``closed``)."""

    def __init__(self, mode: str, hold_s: float = 0.0) -> None:
        self.mode = mode
        self.hold_s = hold_s
        self.halves = 0
        self.closed = 0
        super().__init__()

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if method == "GET":
            out = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode() \
                if path == "/v1/models" else b""
            conn.sendall(_whole(200, out))
            return True
        self.halves += 1
        if self.hold_s:
            conn.settimeout(self.hold_s)
            try:
                if conn.recv(1) == b"":
                    self.closed += 1
                    return False
            except TimeoutError:
                pass
            conn.settimeout(None)
        if self.mode == "garbage":
            conn.sendall(_whole(200, b"\x00\x01 not an answer", b"application/octet-stream"))
        elif self.mode == "error_200":
            conn.sendall(_whole(200, b'{"error": {"message": "scheduler failed", "code": 500}}'))
        elif self.mode.startswith("status_"):
            conn.sendall(_whole(int(self.mode[7:]), b'{"error": {"message": "sglang double says no"}}'))
        else:
            raise AssertionError(self.mode)
        return True


class HandoffFailingDecode(SocketEngine):
    """A vLLM decode engine double (a fake) that fails every request carrying a hand-off, as vLLM with
    kv_load_failure_policy "fail" does when it cannot read the blocks: a 500, or for a stream an error event before
    any token; a request without one it answers ("a b")."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        super().__init__()

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if method == "GET":
            out = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode() \
                if path == "/v1/models" else b""
            conn.sendall(_whole(200, out))
            return True
        req = json.loads(body)
        self.bodies.append(req)
        handoff = "kv_transfer_params" in req
        if req.get("stream"):
            events = (b'data: {"error": {"message": "KV load failed", "type": "InternalServerError", "code": 500}}\n\n'
                      if handoff else event(False, "a ") + event(False, "b", "stop"))
            conn.sendall(STREAM_HEAD + chunk(b": first\r\n\r\n") + chunk(events) + chunk(b"data: [DONE]\n\n") + chunk(b""))
        elif handoff:
            conn.sendall(_whole(500, b'{"error": {"message": "KV load failed", "type": "InternalServerError"}}'))
        else:
            conn.sendall(_whole(200, json.dumps({"id": "x", "object": "text_completion", "created": 1, "model": MODEL,
                                                 "choices": [{"index": 0, "text": "a b", "finish_reason": "stop"}]}).encode()))
        return True


def sim(dialect: str = "vllm", **kw: Any) -> SimEngineThread:
    return SimEngineThread(model=MODEL, profile="cpu-tiny", dialect=dialect, kv_events=False, **kw).start()


@contextlib.contextmanager
def gateway(workers: list[dict[str, Any]], *engines: Any, **sections: Any) -> Iterator[GatewayThread]:
    cfg: dict[str, Any] = {
        "models": [{"name": MODEL, "block_size": 32}],
        "workers": [{**w, "models": [MODEL]} for w in workers],
        "router": {"policy": "least_load", "debug_headers": True},
        "health": {"interval_s": 30},
        "resilience": {"backoff_base_s": 0, "breaker_failure_threshold": 3, "breaker_open_s": 600},
        "disagg": {"min_prefill_tokens": 32, "prefill_timeout_s": 20},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    gw = GatewayThread(load_config(cfg, environ={})).start()
    try:
        healthy(gw)
        yield gw
    finally:
        gw.stop()
        for e in engines:
            e.stop()


def healthy(gw: GatewayThread) -> None:
    """Every worker in rotation, its model card read (the context length P/D decisions use)."""
    deadline = time.monotonic() + 30
    while not all(w.health_ok and w.model_cards_read for w in gw.runtime.fleet.workers()):
        assert time.monotonic() < deadline, [(w.id, w.health_ok) for w in gw.runtime.fleet.workers()]
        time.sleep(0.02)


def pd_mode(gw: GatewayThread, mode: str) -> float:
    return gw.runtime.metrics.registry.get_sample_value("dyad_pd_requests_total", {"mode": mode}) or 0.0


def leased(eng: SimEngineThread) -> int:
    """Prefills the simulated engine keeps KV blocks for, waiting for a remote decode to read them."""
    return eng.call(lambda: sum(1 for r in eng.model._reqs.values() if r.state == _LEASED))


def computed(eng: SimEngineThread) -> int:
    """Prompt tokens the simulated engine computed itself."""
    return eng.call(lambda: eng.model.stats.prompt_tokens_by_source.get("local_compute", 0))


def completion(gw: GatewayThread, stream: bool = False, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream, **extra})


def settled(gw: GatewayThread) -> None:
    """Accounting back to zero once the answers are in: in-flight counts, the router's ledger, the gauge."""
    deadline = time.monotonic() + 10
    while True:
        counts = {w.id: (w.inflight, w.inflight_prefill_tokens) for w in gw.runtime.fleet.workers()}
        gauge = gw.runtime.metrics.registry.get_sample_value("dyad_requests_inflight", {"model": MODEL}) or 0.0
        if all(c == (0, 0) for c in counts.values()) and gauge == 0 and len(gw.runtime.attempts) == 0:
            return
        assert time.monotonic() < deadline, (counts, gauge, len(gw.runtime.attempts))
        time.sleep(0.05)


def vllm_pair(prefill: Any, decode: Any, **worker: Any) -> list[dict[str, Any]]:
    return [{"id": "p", "url": prefill.url, "engine": "vllm", "role": "prefill", **worker},
            {"id": "d", "url": decode.url, "engine": "sim", "role": "decode"}]


# --- 1. requests the decode engine refuses: no prefill work left behind --------------------------------

CHAT_PROMPT = [{"role": "user", "content": PROMPT}]
DECODE_REFUSES = {  # request → what only the decode step would have judged before
    "completions logprobs above the engine's maximum": ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}),
    "chat top_logprobs above the engine's maximum": (
        "/v1/chat/completions", {"messages": CHAT_PROMPT, "logprobs": True, "top_logprobs": 30}),
    "chat top_logprobs without logprobs": ("/v1/chat/completions", {"messages": CHAT_PROMPT, "top_logprobs": 3}),
    "stream_options on an unstreamed request": (
        "/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}),
    "a prompt plus max_tokens beyond the context": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4000}),
}


@pytest.mark.parametrize("case", sorted(DECODE_REFUSES))
def test_a_request_the_decode_engine_refuses_leaves_no_kv_leased_on_the_prefill_engine(case):
    """Fields the one-token prefill step used to leave out (``logprobs``, ``top_logprobs``, ``stream_options``) or
    override (``max_tokens``) were judged by the decode engine only, after the prefill engine had computed the
    prompt and leased its blocks for the hand-off: each refused request pinned prompt-sized KV on the prefill
    pool for the lease's life. Now the prefill engine judges those fields itself (or, for a limit beyond the
    decode engine's context, no leg is sent): the client gets the engine's own 400, and nothing stays leased."""
    path, extra = DECODE_REFUSES[case]
    p, d = sim(), sim()
    with gateway(vllm_pair(p, d), p, d) as gw:
        assert gw.runtime.fleet.get("d").max_model_len == {MODEL: 4096}  # (read from its model card)
        r = httpx.post(f"{gw.url}{path}", json={"model": MODEL, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"], r.text
        assert computed(p) == 0 and leased(p) == 0, case  # (the prefill engine did nothing for it)
        # the same fleet still splits a good request, and its hand-off is read (no lease left either)
        r = completion(gw)
        assert r.status_code == 200 and r.headers["x-dyad-prefill-worker"] == "p", r.text
        assert pd_mode(gw, "disaggregated") == 1
        assert leased(p) == 0
        settled(gw)


ODD_INPUTS = [  # (path, body, status): the split decision with inputs at its edges
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, 200),
    ("/v1/completions", {"prompt": PROMPT, "n": 2}, 200),  # (several sequences: prefilled by the decode worker)
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "stream": True}, 200),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 3}, 200),
    ("/v1/completions", {"prompt": PROMPT, "echo": True}, 200),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1}, 200),  # (prompt logprobs: not split)
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": list(range(1, 400))}, 200),
    ("/v1/completions", {"prompt": [list(range(1, 400))]}, 200),
    ("/v1/completions", {"prompt": [PROMPT, PROMPT]}, 400),  # (a batch: never split; the simulator refuses it)
    ("/v1/completions", {"prompt": PROMPT * 20}, 400),  # (longer than the context)
    ("/v1/chat/completions", {"messages": CHAT_PROMPT, "logprobs": True, "top_logprobs": 2, "stream": True}, 200),
    ("/v1/chat/completions", {"messages": CHAT_PROMPT, "max_completion_tokens": 3, "max_tokens": 5000}, 200),
    ("/v1/chat/completions", {"messages": CHAT_PROMPT, "n": 3}, 200),
]


def test_odd_inputs_on_a_pd_fleet_end_honestly_and_leave_nothing_behind():
    p, d = sim(), sim()
    with gateway(vllm_pair(p, d), p, d) as gw:
        for path, extra, status in ODD_INPUTS:
            r = httpx.post(f"{gw.url}{path}", json={"model": MODEL, "max_tokens": 3, **extra}, timeout=60)
            assert r.status_code == status, (extra, r.text[:300])
            if status != 200:
                assert r.json()["error"]["message"], r.text
            assert leased(p) == 0, extra
        settled(gw)


def test_min_tokens_above_the_limit_goes_to_the_decode_engine_whole():
    """``min_tokens`` cannot go to the one-token prefill step (any value above 1 is refused there); one above the
    client's own limit is refused by the decode engine. Such a request gets no prefill leg: the decode engine
    answers it (the simulator accepts it, vLLM refuses it with its own message naming the client's limit)."""
    p, d = PrefillDouble(), sim()
    with gateway(vllm_pair(p, d), p, d) as gw:
        r = completion(gw, max_tokens=3, min_tokens=9)
        assert r.status_code == 200, r.text
        assert p.steps == [] and pd_mode(gw, "local") == 1
        r = completion(gw, max_tokens=9, min_tokens=3)  # (a valid one is split, min_tokens left out of the step)
        assert r.status_code == 200 and len(p.steps) == 1 and "min_tokens" not in p.steps[0], r.text
        assert p.pulls == 1
        settled(gw)


def test_a_prompt_only_the_decode_engines_context_holds_is_served_by_it():
    """Engines started with different context lengths: a prompt beyond the prefill engine's (4,096 here) but within
    the decode engine's (131,072) was sent to the prefill engine, whose 400 went to the client. It now goes to the
    decode worker whole."""
    p, d = sim(), SimEngineThread(model=MODEL, profile="gpu-like", kv_events=False).start()
    with gateway(vllm_pair(p, d), p, d) as gw:
        assert gw.runtime.fleet.get("p").max_model_len == {MODEL: 4096}
        assert gw.runtime.fleet.get("d").max_model_len == {MODEL: 131072}
        r = completion(gw, prompt=PROMPT * 25)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 4096
        assert computed(p) == 0 and pd_mode(gw, "local") == 1
        settled(gw)


def test_prefill_step_fields_the_engine_judges_are_sent_to_it():
    """What reaches the prefill engine: the fields it judges as the decode engine would; only what a one-token,
    unstreamed step cannot carry is left out, and only when its value is one the engine accepts."""
    p, d = PrefillDouble(), sim()
    with gateway(vllm_pair(p, d), p, d) as gw:
        r = completion(gw, logprobs=2, echo=False, n=1, best_of=1, min_tokens=2)
        assert r.status_code == 200, r.text
        step = p.steps[-1]
        assert step["logprobs"] == 2 and step["max_tokens"] == 1 and step["stream"] is False
        assert not {"echo", "n", "best_of", "min_tokens", "stream_options"} & set(step), step
        r = completion(gw, stream=True)
        assert r.status_code == 200 and "stream_options" not in p.steps[-1]
        settled(gw)


# --- 2. what a vLLM prefill engine answers to its leg -----------------------------------------------------

def _no_params(params):
    return {"choices": [{"index": 0, "text": "x"}]}


def _null_params(params):
    return {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": None}


def _extra_keys(params):
    return {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": {**params, "future_field": [1, {"a": 2}]}}


def _missing_keys(params):
    return {"choices": [{"index": 0, "text": "x"}],
            "kv_transfer_params": {k: v for k, v in params.items() if k != "remote_engine_id"}}


def _string_params(params):
    return {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": "do_remote_prefill"}


def _list_params(params):
    return {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": [params]}


def _huge_answer(params):
    return {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params, "pad": "x" * (5 << 20)}


def _other_host(params):
    return {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": {**params, "remote_host": "192.0.2.7"}}


# mode → (what the client gets, how the request is served, whether the prefill worker's breaker counts it)
PREFILL_ANSWERS: dict[str, tuple[Any, int, str, bool]] = {
    "no kv_transfer_params": (_no_params, 200, "fallback", False),  # (its one token ended it: nobody's fault)
    "null kv_transfer_params": (_null_params, 200, "fallback", False),
    "extra keys": (_extra_keys, 200, "disaggregated", False),  # (passed on: connector-version specific)
    "a missing key": (_missing_keys, 200, "fallback", True),
    "a string": (_string_params, 200, "fallback", True),
    "a list": (_list_params, 200, "fallback", True),
    "an answer past the bound": (_huge_answer, 200, "fallback", True),
    "HTTP 500": ("status_500", 200, "fallback", True),
    "HTTP 503": ("status_503", 200, "fallback", True),
    "HTTP 401": ("status_401", 200, "fallback", True),  # (the gateway's access to that worker)
    "HTTP 429": ("status_429", 200, "fallback", False),  # (busy: never held against it)
    "a 200 that is not JSON": ("not_json", 200, "fallback", True),
    "a 200 carrying a 500": ("error_200_500", 200, "fallback", True),
    "a 200 carrying a 400": ("error_200_400", 400, "none", False),  # (the request's refusal: passed on)
    "HTTP 400": ("status_400", 400, "none", False),
}


@pytest.mark.parametrize("case", sorted(PREFILL_ANSWERS))
def test_every_prefill_answer_is_judged(case):
    """Each shape, answered to every leg: the client always gets a complete answer (the decode engine prefills
    by itself) or the request's own refusal; a shape that is the worker's fault counts in its breaker, which opens
    after ``breaker_failure_threshold`` (3) and then the prefill worker gets no more legs; a shape that is nobody's
    fault (or the request's) never opens it."""
    mode, status, served, counted = PREFILL_ANSWERS[case]
    p, d = PrefillDouble(mode), sim()
    with gateway(vllm_pair(p, d), p, d) as gw:
        for _ in range(4):
            r = completion(gw)
            assert r.status_code == status, (case, r.text)
            if status != 200:
                assert isinstance(r.json()["error"]["message"], str), r.text
        breakers = gw.runtime.breakers.snapshot()
        if counted:  # (a 503 counts against its health too: out of rotation after health.failure_threshold)
            assert breakers == {"p": "open"} or gw.runtime.fleet.get("p").state.value == "unhealthy", (case, breakers)
            assert len(p.steps) < 4, case  # no leg once it is out
        else:
            assert breakers == {} and gw.runtime.fleet.get("p").state.value == "healthy", (case, breakers)
            assert len(p.steps) == 4, case
        if served != "none":
            assert pd_mode(gw, served) == len(p.steps), (case, served)
        settled(gw)


def test_a_handoff_naming_another_host_is_passed_on_as_the_engine_said():
    """The side channel is the engine's own listener, often on another interface or name than its HTTP API:
    a well-formed hand-off naming another host is passed to the decode engine (which, here, cannot reach it and
    recomputes: kv_load_failure_policy recompute)."""
    p, d = PrefillDouble(_other_host), sim(kv_load_failure_policy="recompute", kv_pull_timeout_s=0.5)
    with gateway(vllm_pair(p, d), p, d) as gw:
        r = completion(gw)
        assert r.status_code == 200, r.text
        assert pd_mode(gw, "disaggregated") == 1 and p.pulls == 0
        assert gw.runtime.breakers.snapshot() == {}
        settled(gw)


def test_a_prefill_workers_breaker_counts_consecutive_failures_only():
    """A prefill worker that fails one leg in three never opens its breaker (each hand-off it gives is a success
    for it, resetting the count); three failures in a row open it."""
    script = ["status_500", "ok", "ok"] * 3 + ["status_500"] * 3
    p, d = PrefillDouble(script=script), sim()
    with gateway(vllm_pair(p, d), p, d) as gw:
        for i in range(9):
            assert completion(gw).status_code == 200
            assert gw.runtime.breakers.snapshot() == {}, i
        for _ in range(3):
            assert completion(gw).status_code == 200
        assert gw.runtime.breakers.snapshot() == {"p": "open"}
        assert pd_mode(gw, "disaggregated") == 6 and pd_mode(gw, "fallback") == 6
        assert completion(gw).status_code == 200 and len(p.steps) == 12  # (no leg while it is open)
        settled(gw)


def test_a_half_open_prefill_workers_breaker_takes_one_leg_at_a_time_and_closes_after_good_ones():
    """Once its breaker's open time is over, a prefill worker gets legs again as a half-open breaker allows: one
    at a time (``half_open_probes``), others prefilled locally meanwhile; ``breaker_success_threshold`` (2) good legs
    close it. (A prefill worker's breaker never counted a success: it stayed half-open for ever, taking every leg.)"""
    p, d = PrefillDouble(script=["status_500"] * 3 + ["hold"]), sim()
    with gateway(vllm_pair(p, d), p, d, resilience={"breaker_open_s": 0.5}) as gw:
        for _ in range(3):
            assert completion(gw).status_code == 200
        assert gw.runtime.breakers.snapshot() == {"p": "open"}
        deadline = time.monotonic() + 30
        while gw.runtime.breakers.blocked(gw.runtime.clock.now()):  # (its open time passes: half-open)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with ThreadPoolExecutor(1) as pool:
            probe = pool.submit(completion, gw)  # the probe leg, held by the prefill engine
            while len(p.steps) < 4:
                assert time.monotonic() < deadline and not probe.done()
                time.sleep(0.02)
            r = completion(gw)  # meanwhile: no second leg on the half-open worker
            assert r.status_code == 200 and len(p.steps) == 4, r.text
            p.release.set()
            assert probe.result(60).status_code == 200
        assert gw.runtime.breakers.snapshot() == {"p": "half_open"}
        assert completion(gw).status_code == 200 and len(p.steps) == 5
        assert gw.runtime.breakers.snapshot() == {}  # (two good legs: closed)
        settled(gw)


# --- 3. the decode engine after a good prefill -------------------------------------------------------------

def test_decode_failing_after_a_good_prefill_is_tried_on_another_decode_worker_and_the_prefill_worker_is_not_blamed():
    """d0 answers 500 to the hand-off and again to the same request without it: d0's fault, not the prefill
    worker's; the request is tried on d1, split again with the same prefill worker."""
    p, d0, d1 = sim(), sim(fail_next=2), sim()
    workers = [{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
               {"id": "d0", "url": d0.url, "engine": "sim", "role": "decode"},
               {"id": "d1", "url": d1.url, "engine": "sim", "role": "decode"}]
    with gateway(workers, p, d0, d1) as gw:
        r = completion(gw)
        assert r.status_code == 200 and r.headers["x-dyad-worker"] == "d1", r.text
        assert r.headers["x-dyad-prefill-worker"] == "p" and pd_mode(gw, "disaggregated") == 1
        assert "p" not in gw.runtime.breakers.snapshot()
        assert gw.runtime.fleet.get("p").state.value == "healthy"
        settled(gw)


@pytest.mark.parametrize("decoders", [1, 2])
def test_a_handoff_no_decode_engine_can_read_is_the_prefill_workers_fault(decoders):
    """A prefill engine whose hand-offs cannot be read (its blocks gone; the decode engine, with
    kv_load_failure_policy "fail", answers 500). Every split request failed: with two decode workers the same 500
    on both was judged the request's (a 500 to the client, nobody counted, for ever); with one, the decode worker's
    breaker opened (every request then a 503). Now the decode worker is asked again at once without the hand-off:
    the client gets its answer, and the prefill worker's breaker counts the failure (open after 3, then no legs)."""
    p = PrefillDouble()
    p.lost = True
    ds = [sim(kv_pull_timeout_s=0.3) for _ in range(decoders)]
    workers = [{"id": "p", "url": p.url, "engine": "vllm", "role": "prefill"}]
    workers += [{"id": f"d{i}", "url": d.url, "engine": "sim", "role": "decode"} for i, d in enumerate(ds)]
    with gateway(workers, p, *ds) as gw:
        for _ in range(4):
            r = completion(gw)
            assert r.status_code == 200, r.text
        assert gw.runtime.breakers.snapshot() == {"p": "open"}
        assert len(p.steps) == 3 and pd_mode(gw, "fallback") == 3 and pd_mode(gw, "disaggregated") == 0
        settled(gw)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_engine_failing_every_handoff_still_answers_and_the_prefill_worker_is_counted(stream):
    """As above, with a decode engine that reports the failed read the way vLLM does: a 500, or for a stream an error
    event before any token — a stream whose error event went to the client every time (never retried: the relay
    passes an engine's error event on), nobody counted. The executor now reads a split stream up to its first event
    and treats an error there as the decode engine's 5xx."""
    p = PrefillDouble()
    ds = [HandoffFailingDecode(), HandoffFailingDecode()]
    workers = [{"id": "p", "url": p.url, "engine": "vllm", "role": "prefill"}]
    workers += [{"id": f"d{i}", "url": d.url, "engine": "vllm", "role": "decode"} for i, d in enumerate(ds)]
    with gateway(workers, p, *ds) as gw:
        for _ in range(4):
            r = completion(gw, stream=stream)
            if stream:
                assert check_stream(r, chat=False) == ("ok", "a b"), r.text
            else:
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a b", r.text
        assert gw.runtime.breakers.snapshot() == {"p": "open"}
        assert len(p.steps) == 3 and sum(len(d.bodies) for d in ds) == 3 * 2 + 1
        settled(gw)


def test_a_decode_engine_that_fails_with_or_without_a_handoff_is_not_the_prefill_workers_fault():
    p, d = PrefillDouble(), sim(fail_next=100)
    with gateway(vllm_pair(p, d), p, d) as gw:
        for _ in range(3):
            r = completion(gw)
            assert r.status_code == 500 and r.json()["error"]["message"], r.text
        assert gw.runtime.breakers.snapshot() == {"d": "open"}
        assert gw.runtime.fleet.get("p").state.value == "healthy"
        settled(gw)


def test_a_split_chat_stream_is_relayed_whole_after_its_first_event_is_read():
    p, d = sim(), sim()
    with gateway(vllm_pair(p, d), p, d) as gw:
        body = {"model": MODEL, "messages": CHAT_PROMPT, "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}}
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60)
        outcome, text = check_stream(r, chat=True)
        assert outcome == "ok" and text and r.headers["x-dyad-prefill-worker"] == "p", r.text
        assert '"usage"' in r.text and pd_mode(gw, "disaggregated") == 1
        settled(gw)


@pytest.mark.parametrize("fault", ["eof", "reset", "garbage", "hang"])
def test_a_pd_stream_that_breaks_ends_honestly_and_accounting_returns_to_zero(fault):
    """A split stream whose decode engine breaks it after a few tokens: with another decode worker the stream is
    continued there and ends complete; alone, it ends with an SSE error event then [DONE]. Either way the
    workers' in-flight counts, the router's ledger and the in-flight gauge return to zero, and the prefill worker
    (whose leg succeeded) is never blamed."""
    for alone in (True, False):
        p, d0 = sim(), sim()
        httpx.post(f"{d0.url}/sim/faults", json={"stream_fault": fault, "stream_fault_after": 2}, timeout=10)
        workers = [{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
                   {"id": "d0", "url": d0.url, "engine": "sim", "role": "decode"}]
        engines: list[Any] = [p, d0]
        if not alone:
            d1 = sim()
            engines.append(d1)
            workers.append({"id": "d1", "url": d1.url, "engine": "sim", "role": "decode"})
        with gateway(workers, *engines, resilience={"stream_idle_timeout_s": 2}) as gw:
            r = completion(gw, stream=True, max_tokens=8)
            outcome, text = check_stream(r, chat=False)
            assert outcome == ("error_event" if alone else "ok"), (fault, alone, r.text)
            assert text, r.text
            settled(gw)
            assert "p" not in gw.runtime.breakers.snapshot()
            assert gw.runtime.fleet.get("p").state.value == "healthy"


# --- 4. SGLang dual dispatch: one half failing -------------------------------------------------------------

@pytest.mark.parametrize("mode", ["garbage", "error_200", "status_500"])
def test_an_sglang_prefill_half_answering_no_answer_is_replaced_at_once(mode):
    """A prefill half that answers 200 with something that is no answer (bytes that are not JSON, or an error
    object): the pair is given up at once and retried with another prefill worker, not left to the decode half,
    which would wait for its bootstrap timeout (here 120 s, beyond the client's patience)."""
    bad = SglangPrefillDouble(mode)
    good = sim("sglang", disaggregation_mode="prefill")
    d = sim("sglang", disaggregation_mode="decode", bootstrap_timeout_s=120)
    workers = [{"id": "p0", "url": bad.url, "engine": "sglang", "role": "prefill", "bootstrap_port": 1},
               {"id": "p1", "url": good.url, "engine": "sglang", "role": "prefill", "bootstrap_port": good.port},
               {"id": "d", "url": d.url, "engine": "sglang", "role": "decode"}]
    with gateway(workers, bad, good, d) as gw:
        for _ in range(4):
            r = completion(gw, stream=True)
            assert r.status_code == 200 and r.headers["x-dyad-prefill-worker"] in ("p0", "p1"), r.text
            assert check_stream(r, chat=False)[0] == "ok", r.text
        # (each failure counted once p1 served the request: open after 3, then no more halves on p0)
        assert gw.runtime.breakers.snapshot() == {"p0": "open"} and bad.halves == 3
        settled(gw)


def test_an_sglang_decode_half_failing_ends_the_prefill_half():
    """The decode half refuses at once while the prefill half is still working: the prefill half's connection is
    closed (SGLang aborts it) rather than left to run for nobody; the client gets the decode engine's answer."""
    p = SglangPrefillDouble("status_500", hold_s=60)
    d = sim("sglang", disaggregation_mode="decode", fail_next=5)
    workers = [{"id": "p", "url": p.url, "engine": "sglang", "role": "prefill", "bootstrap_port": 1},
               {"id": "d", "url": d.url, "engine": "sglang", "role": "decode"}]
    with gateway(workers, p, d) as gw:
        r = completion(gw)
        assert r.status_code == 500, r.text
        assert isinstance(r.json()["error"]["message"], str)
        deadline = time.monotonic() + 30
        while p.closed < p.halves:
            assert time.monotonic() < deadline, (p.halves, p.closed)
            time.sleep(0.05)
        assert "p" not in gw.runtime.breakers.snapshot()
        settled(gw)

