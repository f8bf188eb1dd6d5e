"""Mid-stream failover: the pure pieces (event framing, what was sent, continuation requests, id
rewriting), then whole streams through a gateway whose engine dies mid-stream.

The end-to-end tests use Dyad's simulated engines because an engine must die after an exact number
of tokens (``POST /sim/faults {"die_after_tokens": N}``: the engine drops every connection); the
same with a real vLLM engine killed by SIGKILL is in tests/integration/test_chaos_vllm.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import orjson
import pytest

from adapters.base import EngineKind
from orchestrator.config import load_config
from orchestrator.gateway.failover import (
    ContinuationRewriter,
    SseRecorder,
    continuation_body,
    error_event,
    parse_sent,
    why_not_continuable,
)
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.profiles import load_profile
from orchestrator.sim.server import SimEngineThread

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_chunk(content: str | None = None, role: str | None = None, finish: str | None = None) -> bytes:
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    obj = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 100, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_recorder_forwards_whole_events_only():
    rec = SseRecorder()
    event = chat_chunk("hello")
    assert rec.split(event[:10]) == b""
    assert rec.split(event[10:] + event[:5]) == event
    out = rec.split(event[5:] + b"data: [DONE]\n\n")
    assert out == event + b"data: [DONE]\n\n"
    rec.record(out)
    assert rec.done


def test_parse_sent_and_continuation_bodies():
    sent = parse_sent([chat_chunk("", role="assistant"), chat_chunk("Hel"), chat_chunk("lo")], chat=True)
    assert (sent.id, sent.created, sent.content, sent.tokens, sent.role_sent) == ("chatcmpl-x", 100, "Hello", 2, True)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "min_tokens": 3,
            "stream": True}
    cont = continuation_body(CHAT, body, sent)
    assert cont["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
    assert cont["max_tokens"] == 8 and cont["min_tokens"] == 1
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # the client's body is untouched
    comp = continuation_body(COMPLETIONS, {"model": "m", "prompt": "The", "stream": True}, sent)
    assert comp["prompt"] == "TheHello" and comp["max_tokens"] == 16 - 2  # OpenAI/vLLM default budget
    assert continuation_body(CHAT, {**body, "max_tokens": 2}, sent) is None  # nothing left to generate


@pytest.mark.parametrize(("endpoint", "extra", "engine", "reason"), [
    (CHAT, {"n": 2}, EngineKind.VLLM, "n > 1"),
    (CHAT, {"logprobs": True}, EngineKind.VLLM, "logprobs"),
    (CHAT, {"tools": [{"type": "function"}]}, EngineKind.VLLM, "tools"),
    (CHAT, {"response_format": {"type": "json_object"}}, EngineKind.VLLM, "structured output"),
    (CHAT, {}, EngineKind.SGLANG, "chat continuation is not supported on sglang engines"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, EngineKind.VLLM, "the prompt is not a single string"),
    (COMPLETIONS, {"echo": True}, EngineKind.VLLM, "echo"),
    (COMPLETIONS, {}, EngineKind.SGLANG, None),
    (CHAT, {"n": 1, "logprobs": False}, EngineKind.SIM, None),
])
def test_what_can_be_continued(endpoint, extra, engine, reason):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "p"} | extra
    assert why_not_continuable(endpoint, body, engine) == reason


def test_rewriter_keeps_the_original_id_drops_the_role_chunk_and_moves_usage():
    sent = parse_sent([chat_chunk("", role="assistant"), chat_chunk("a"), chat_chunk("b"), chat_chunk("c")], chat=True)
    rw = ContinuationRewriter(sent, chat=True)
    new = [json.loads(line[6:]) for line in [
        b'data: {"id":"chatcmpl-other","created":999,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
        b'data: {"id":"chatcmpl-other","created":999,"choices":[{"index":0,"delta":{"content":"d"},"finish_reason":"stop"}]}',
        b'data: {"id":"chatcmpl-other","created":999,"choices":[],"usage":{"prompt_tokens":13,"completion_tokens":1,"total_tokens":14}}',
    ]]
    raw = b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in new) + b"data: [DONE]\n\n"
    out = rw.feed(raw[:37]) + rw.feed(raw[37:])
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert len(objs) == 2  # the role chunk is gone
    assert {o["id"] for o in objs} == {"chatcmpl-x"} and {o["created"] for o in objs} == {100}
    assert objs[0]["choices"][0]["delta"] == {"content": "d"}
    assert objs[1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}


def test_error_event_ends_with_done():
    ev = error_event("it broke")
    first, second, rest = ev.split(b"\n\n")
    assert json.loads(first[6:])["error"]["message"] == "it broke"
    assert second == b"data: [DONE]" and rest == b""


# --- end to end over simulated engines ---------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[SimEngineThread, SimEngineThread, GatewayThread]]:
    a = SimEngineThread(model="m", profile="cpu-tiny", kv_events=False).start()
    b = SimEngineThread(model="m", profile="cpu-tiny", kv_events=False).start()
    config = load_config({
        "models": [{"name": "m"}],
        "workers": [{"id": "a", "url": a.url, "engine": "sim", "models": ["m"]},
                    {"id": "b", "url": b.url, "engine": "sim", "models": ["m"]}],
        "router": {"policy": "round_robin", "debug_headers": True},
        "health": {"interval_s": 30},
    }, environ={})
    with GatewayThread(config) as gw:
        yield a, b, gw
    a.stop()
    b.stop()


def stream(gw: GatewayThread, endpoint: str, body: dict) -> tuple[httpx.Response, list[str]]:
    with httpx.stream("POST", gw.url + endpoint, json={"model": "m", "stream": True, **body}, timeout=30) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return r, events


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_engine_dies_mid_stream_and_the_stream_completes_on_the_other(pair, endpoint):
    a, b, gw = pair
    httpx.post(f"{a.url}/sim/faults", json={"die_after_tokens": 5}, timeout=5)
    prompt = {"messages": [{"role": "user", "content": "tell me"}]} if endpoint == CHAT else {"prompt": "tell me"}
    r, events = stream(gw, endpoint, {**prompt, "max_tokens": 12, "ignore_eos": True,
                                      "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["x-dyad-worker"] == "a"  # it started on the engine that died
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    content = [c["choices"][0] for c in chunks if c["choices"]]
    pieces = [(ch.get("delta") or {}).get("content") if endpoint == CHAT else ch.get("text") for ch in content]
    # The simulator's tokenizer is one token per word. An engine sends one token per event unless it falls
    # behind (a loaded machine: then several per event); the continuation's budget counts events, so it is
    # exact with one token per event (5 from a, 7 from b) and generous, never short, by the extra tokens
    # of multi-token events (module docstring of failover.py).
    words = [len(p.split()) for p in pieces if p]
    assert 12 <= sum(words) <= 12 + sum(n - 1 for n in words)
    if all(n == 1 for n in words):
        assert len(words) == 12
    assert content[-1]["finish_reason"] == "length"
    if endpoint == CHAT:
        assert sum(1 for ch in content if "role" in ch.get("delta", {})) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    # One failover: a continuation after the tokens the client has, or (when the engine's reset came before the
    # gateway read any token: under load the kernel drops unread bytes on a reset) a start-over from the
    # beginning, which the client cannot tell apart (the preamble is held until the first token).
    reg = gw.runtime.metrics.registry
    outcomes = {o: reg.get_sample_value("dyad_stream_failovers_total", {"outcome": o}) or 0.0
                for o in ("continued", "restarted", "completed", "error_event")}
    assert outcomes["continued"] + outcomes["restarted"] == 1.0 and outcomes["error_event"] == 0.0, outcomes


def test_a_stream_that_cannot_be_continued_ends_with_an_error_event(pair):
    a, b, gw = pair
    httpx.post(f"{a.url}/sim/faults", json={"die_after_tokens": 3}, timeout=5)
    r, events = stream(gw, CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10,
                                  "ignore_eos": True, "logprobs": True})
    assert r.status_code == 200
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "(logprobs)" in err["message"] and err["code"] == "upstream_stream_failed"
    assert 'dyad_stream_failovers_total{outcome="error_event"} 1.0' in gw.runtime.metrics.render().decode()


def test_no_other_worker_left_ends_with_an_error_event(pair):
    a, b, gw = pair
    b.stop()
    httpx.post(f"{a.url}/sim/faults", json={"die_after_tokens": 4}, timeout=5)
    r, events = stream(gw, COMPLETIONS, {"prompt": "x", "max_tokens": 10, "ignore_eos": True})
    assert r.status_code == 200
    assert events[-1] == "[DONE]"
    assert "could not be continued" in json.loads(events[-2])["error"]["message"]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    # what was generated before the crash reached the client: 4 tokens (one word each in the
    # simulator), in 4 events, or fewer when the engine fell behind and sent several per event
    assert sum(len(t.split()) for t in texts) == 4 and 1 <= len(texts) <= 4, texts


# --- how long a stream may take: idle timeout, not the whole-request timeout ------------------------

# 20 tokens/s on one sequence; prefill costs 3 ms per token, so a long prompt sent to the same engine
# stalls its running streams for a known time (one step holds every sequence's next token). The
# simulated engine runs on its event loop's clock: these durations are lower bounds (a loaded machine
# only makes them longer), and every assertion below holds for any slower run: the stream is at
# least 2.5 s long against a 1 s request timeout; the engine's silence is at least 9 s against a 2 s
# idle timeout, itself 40 times the gap between tokens.
PACED = {"base": "zero", "name": "paced", "step_fixed_s": 0.05, "per_prefill_token_s": 0.003}
SILENCE_PROMPT_WORDS = 3000  # one ~9 s prefill step


@contextmanager
def paced_gateway(idle_timeout_s: float) -> Iterator[tuple[SimEngineThread, GatewayThread]]:
    engine = SimEngineThread(model="m", profile=load_profile(PACED), kv_events=False).start()
    config = load_config({
        "models": [{"name": "m"}],
        "workers": [{"id": "a", "url": engine.url, "engine": "sim", "models": ["m"]}],
        "gateway": {"request_timeout_s": 1.0},
        "resilience": {"stream_idle_timeout_s": idle_timeout_s},
        "health": {"interval_s": 30},
    }, environ={})
    try:
        with GatewayThread(config) as gw:
            yield engine, gw
    finally:
        engine.stop()


def test_a_stream_outlives_the_request_timeout_while_chunks_flow():
    # The idle timeout is a liveness bound here (tokens come every 50 ms): this test is about the
    # request timeout not applying to a stream whose chunks flow.
    with paced_gateway(idle_timeout_s=30.0) as (engine, gw):
        body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream_options": {"include_usage": True}}
        r, events = stream(gw, COMPLETIONS, body)  # >= 2.5 s of tokens, 2.5x gateway.request_timeout_s
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert not any("error" in json.loads(e) for e in events[:-1])
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 50
        # the same generation not streamed is bounded by gateway.request_timeout_s
        r = httpx.post(gw.url + COMPLETIONS, json={"model": "m", "prompt": "x", "max_tokens": 50, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 504 and "gateway.request_timeout_s" in r.json()["error"]["message"]


def test_a_stream_whose_engine_goes_silent_ends_on_the_idle_timeout():
    silence: dict = {}
    with paced_gateway(idle_timeout_s=2.0) as (engine, gw):
        def stall_engine() -> None:  # one prefill step of >= 9 s: no token out for any sequence
            silence["r"] = httpx.post(engine.url + COMPLETIONS, timeout=60,
                                      json={"model": "m", "prompt": "word " * SILENCE_PROMPT_WORDS, "max_tokens": 1})

        staller = threading.Thread(target=stall_engine)
        with httpx.stream("POST", gw.url + COMPLETIONS, timeout=60,
                          json={"model": "m", "prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                "stream": True}) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        staller.start()
        assert staller.ident is not None, events  # the stream got its first tokens before any silence
        staller.join(60)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "no data event from the engine for 2 s" in err["message"], err
    tokens = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert 3 <= len(tokens) < 200  # what came before the silence reached the client; the rest never came
