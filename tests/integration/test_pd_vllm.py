"""Prefill/decode disaggregation through the gateway with REAL vLLM engines (NixlConnector on CPU).

One prefill engine (kv_producer) and one decode engine (kv_consumer) behind a Dyad gateway:
- the decode engine's ``prompt_tokens_by_source_total{source="external_kv_transfer"}`` grows by
  the prompt length, and the output equals an aggregated run at temperature 0 (same eager mode);
- short prompts are prefilled locally (conditional disaggregation);
- a client that goes away stops the decode engine's work;
- with the prefill engine killed, requests still succeed (local prefill on the decode engine).
The last test kills the prefill engine, so it runs last in this module.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from adapters.prometheus_text import parse_samples
from tests.fixtures.vllm import MODEL_NAME
from tests.fixtures.vllm_gateway import engines_or_fail, vllm_gateway
from tests.fixtures.vllm_pd import PdEngines

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_config("pd"), pytest.mark.slow, pytest.mark.timeout(900)]

ADMIN = "pd-admin-token"
LONG_PROMPT = "Summarize the inventory: " + " ".join(f"item{i} costs {i * 7 % 97}" for i in range(120))
SHORT_PROMPT = "Hello there"
# The hand-off tests' client waits longer than the gateway's own bounds on the two legs (prefill step
# 120 s + stall watchdog 120 s, the fixture below): under load the gateway's verdict (a hand-off, or
# a fallback the test names) must arrive, not the client's timeout. A fresh-clone CI run (load
# average ~20) once had the client give up at 120 s on the completion hand-off.
CLIENT_TIMEOUT = 300


def engine_counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def external(url: str) -> float:
    return engine_counter(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


# What can make a hand-off not happen, each a counter: the gateway fell back to a local prefill
# (prefill step failed or timed out) or prefilled locally; NIXL failed (handshake, transfer,
# notification) or the producer's KV lease expired before the consumer read it (the consumer then
# recomputes: ``kv_load_failure_policy: recompute``, and reads fewer external tokens than the prompt —
# which is what ``assert_handed_off`` checks; the lease counter alone is reported, see there).
NIXL_FAILURES = ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total")
LEASE_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


def handoff_counters(gw_url: str, prefill_url: str, decode_url: str) -> dict[str, float]:
    out = {f"gateway {mode}": pd_mode_count(gw_url, mode) for mode in ("disaggregated", "fallback", "local")}
    for side, url in (("prefill", prefill_url), ("decode", decode_url)):
        for name in (*NIXL_FAILURES, LEASE_EXPIRED):
            out[f"{side} {name}"] = engine_counter(url, name)
    out["decode external_kv_transfer tokens"] = external(decode_url)
    out["decode local_compute tokens"] = engine_counter(decode_url, "vllm:prompt_tokens_by_source_total",
                                                        source="local_compute")
    gw_metrics = httpx.get(f"{gw_url}/metrics", timeout=10).text
    out["gateway prefill step seconds"] = sum(float(line.rsplit(" ", 1)[1]) for line in gw_metrics.splitlines()
                                              if line.startswith("dyad_pd_prefill_seconds_sum"))
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def assert_handed_off(gw, prefill, decode, before: dict[str, float], prompt_tokens: int) -> None:
    """One request went prefill → decode over NIXL and the decode engine read the whole prompt's KV
    from the prefill engine; on failure, say which link broke."""
    changed = delta(handoff_counters(gw.url, prefill.url, decode.url), before)
    print(f"hand-off: {changed}")  # shown with -rA: how long the prefill step took under this run's load
    assert changed.get("gateway disaggregated") == 1 and "gateway fallback" not in changed, (
        f"the gateway did not hand the request off (prefill step failed or timed out?): {changed}")
    assert not any(k.endswith(NIXL_FAILURES) for k in changed), f"NIXL failed: {changed}"
    assert changed.get("decode external_kv_transfer tokens") == prompt_tokens, (
        f"the decode engine did not read all {prompt_tokens} prompt tokens over NIXL: {changed}")
    # The prefill engine's lease on the blocks may run out on a starved CPU although the decode engine
    # read every one of them (checked just above): the first hand-off's NIXL handshake was seen to wait
    # ~2 minutes, until the lease ran out, on a fresh-clone run. That is the engines' timing, not the
    # hand-off Dyad drives; it is printed, not failed on.
    if any(k.endswith(LEASE_EXPIRED) for k in changed):
        print(f"note: the prefill engine's KV lease ran out during a hand-off that completed: {changed}")


def pd_mode_count(gateway_url: str, mode: str) -> float:
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    m = re.search(rf'^dyad_pd_requests_total{{mode="{mode}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def gateway_disconnects(gateway_url: str) -> float:
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dyad_client_disconnects_total{"))


@pytest.fixture(scope="module")
def pd(vllm_pd_engines: PdEngines):
    prefill, decode = engines_or_fail(vllm_pd_engines.get, "pd")
    # The prefill step (one token of a ~1k-token prompt) takes ~0.3 s on a quiet core but 5.5 s
    # was measured with the machine's load average at 14, and a step slower than this bound is
    # abandoned for a local prefill on the decode engine (mode "fallback"): that is how the
    # hand-off test failed under load with 20 s here. The hand-off tests assert the gateway
    # did not fall back; the bound is a liveness limit, as long as the client's timeout.
    # The same holds for the stall watchdog: with scraping off it cannot see the decode engine
    # working (no generated-token counter), so a non-streamed answer has to arrive within the
    # 15-s default after the prefill leg. A fresh clone's CI run (load average ~20) once took
    # 29 s there and the request was pulled as stalled (a 503 instead of the hand-off).
    with vllm_gateway([prefill, decode], policy="least_load", worker_ids=["prefill", "decode"],
                      roles=["prefill", "decode"], model={"block_size": 32},
                      # A NIXL engine on CPU can leave /health unanswered for minutes while it does its first
                      # handshake with the other engine (a fresh-clone run: ~150 of ~640 probes answered in 5
                      # minutes, and the decode worker was taken out of rotation mid-test, a 503). These tests
                      # are about the hand-off: health does not pull a slow engine here (a killed one still
                      # fails over at once on the refused connection, as the last test checks).
                      gateway={"admin_token": ADMIN}, health={"interval_s": 0.5, "timeout_s": 5.0,
                                                              "failure_threshold": 1000}, scrape=None,
                      resilience={"stall_timeout_s": 120},
                      disagg={"min_prefill_tokens": 64, "prefill_timeout_s": 120}) as gw:
        yield gw, prefill, decode


def completion_body(prompt: str, max_tokens: int = 24, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def test_the_engines_expose_what_the_lease_alert_reads(pd):
    """deploy/prometheus/rules.yml's DyadKvHandoffLeaseExpired reads two NIXL counters from the engines; both
    are there, on both sides, under the names the rule uses (promtool's unit test feeds them by name only)."""
    _, prefill, decode = pd
    for engine in (prefill, decode):
        names = {x.name for x in parse_samples(httpx.get(f"{engine.url}/metrics", timeout=10).text, ("vllm:nixl_",))}
        assert {LEASE_EXPIRED, "vllm:nixl_num_notifications_after_expiry_total"} <= names, (
            engine.name, sorted(names))


def test_nixl_completion_transfers_the_prompt_and_matches_aggregated(pd):
    gw, prefill, decode = pd
    # Aggregated reference on the prefill engine (cold cache), then forget it again.
    ref = httpx.post(f"{prefill.url}/v1/completions", json=completion_body(LONG_PROMPT), timeout=60).json()
    assert httpx.post(f"{prefill.url}/reset_prefix_cache", timeout=10).status_code == 200

    before = handoff_counters(gw.url, prefill.url, decode.url)
    r = httpx.post(f"{gw.url}/v1/completions", json=completion_body(LONG_PROMPT), timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.headers["x-dyad-prefill-worker"] == "prefill"
    assert r.headers["x-dyad-worker"] == "decode"
    out = r.json()
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert prompt_tokens > 300
    assert_handed_off(gw, prefill, decode, before, prompt_tokens)
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 24
    assert "kv_transfer_params" not in out or out["kv_transfer_params"] is None


def test_nixl_chat_stream_matches_aggregated(pd):
    gw, prefill, decode = pd
    messages = [{"role": "user", "content": "List the prices. " + LONG_PROMPT}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 16, "temperature": 0}
    ref = httpx.post(f"{prefill.url}/v1/chat/completions", json=body, timeout=60).json()
    assert httpx.post(f"{prefill.url}/reset_prefix_cache", timeout=10).status_code == 200

    before = handoff_counters(gw.url, prefill.url, decode.url)
    text, usage = "", None
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=CLIENT_TIMEOUT,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-dyad-prefill-worker"] == "prefill"
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
    assert usage is not None
    assert_handed_off(gw, prefill, decode, before, usage["prompt_tokens"])
    assert text == ref["choices"][0]["message"]["content"]


def test_short_prompt_is_prefilled_on_the_decode_engine(pd):
    gw, prefill, decode = pd
    before_ext = external(decode.url)
    before_local = pd_mode_count(gw.url, "local")
    r = httpx.post(f"{gw.url}/v1/completions", json=completion_body(SHORT_PROMPT, 8), timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-dyad-worker"] == "decode"
    assert "x-dyad-prefill-worker" not in r.headers
    assert external(decode.url) == before_ext
    assert pd_mode_count(gw.url, "local") == before_local + 1


def test_a_long_prompt_asking_for_its_logprobs_is_prefilled_on_the_decode_engine(pd):
    """vLLM reads no transferred KV for a request with prompt logprobs (it computes the prompt again), so
    the gateway does not split a prompt it would otherwise split: no prefill leg, and every prompt position
    has its logprob."""
    gw, prefill, decode = pd
    # (its own prompt, long enough to be split without logprobs, shorter than LONG_PROMPT: every prompt
    # position's logprobs cost; its blocks are dropped from both engines after, as the other tests do)
    prompt = "Score the inventory: " + " ".join(f"item{i} costs {i * 7 % 97}" for i in range(30))
    body = completion_body(prompt, 2, echo=True, logprobs=1)
    before_local = pd_mode_count(gw.url, "local")
    r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.headers["x-dyad-worker"] == "decode" and "x-dyad-prefill-worker" not in r.headers
    assert pd_mode_count(gw.url, "local") == before_local + 1
    got = r.json()["choices"][0]
    assert got["text"].startswith(prompt)  # echoed
    logprobs = got["logprobs"]["token_logprobs"]
    assert r.json()["usage"]["prompt_tokens"] > 64  # (above the fixture's min_prefill_tokens: split without logprobs)
    assert logprobs[0] is None and len(logprobs) == r.json()["usage"]["prompt_tokens"] + 2
    assert all(isinstance(x, float) and x <= 0 for x in logprobs[1:])  # every prompt position's, computed
    for engine in (prefill, decode):
        assert httpx.post(f"{engine.url}/reset_prefix_cache", timeout=10).status_code == 200


def test_client_disconnect_stops_the_decode_engine(pd):
    """What is guarded: after the client leaves, the decode engine aborts the request instead of
    generating all 3000 tokens. Timing bounds below are only liveness limits (generous: a loaded
    2-core machine decodes several times slower); the verdict is the engine's own counters — the
    request did not finish by length and far fewer than 3000 tokens were generated."""
    gw, prefill, decode = pd
    # A prompt no engine holds any block of (it starts differently): a hand-off whose decode engine already
    # holds most of the prompt was seen to stall for 27 s to ~2 minutes (docs/engines.md §2).
    body = completion_body("Until the client leaves: " + LONG_PROMPT, 3000, stream=True, ignore_eos=True)
    finished_by_length = engine_counter(decode.url, "vllm:request_success_total", finished_reason="length")
    generated_before = engine_counter(decode.url, "vllm:generation_tokens_total")
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # keep a reference: a collected iterator closes the connection at once
        deadline = time.monotonic() + 60
        for _ in chunks:
            if engine_counter(decode.url, "vllm:num_requests_running") == 1:
                break
            assert time.monotonic() < deadline, "the decode engine never reported the request running"
    deadline = time.monotonic() + 60
    while engine_counter(decode.url, "vllm:num_requests_running") > 0:
        # (the gateway's own view, to tell whether it saw the client leave and let go of the engine)
        assert time.monotonic() < deadline, (
            "the decode engine kept generating after the client left; gateway: "
            f"{pd_mode_count(gw.url, 'disaggregated')=}, {gateway_disconnects(gw.url)=}, "
            f"{gw.runtime.fleet.get('decode').inflight=}")
        time.sleep(0.25)
    generated = engine_counter(decode.url, "vllm:generation_tokens_total") - generated_before
    assert engine_counter(decode.url, "vllm:request_success_total", finished_reason="length") == finished_by_length
    assert generated < 3000, f"{generated=}: the request ran to completion"
    assert gw.runtime.fleet.get("decode").inflight == 0


def test_prefill_engine_killed_requests_still_succeed(pd):
    gw, prefill, decode = pd
    prefill.kill()
    before = pd_mode_count(gw.url, "fallback") + pd_mode_count(gw.url, "local")
    for i in range(3):
        r = httpx.post(f"{gw.url}/v1/completions", json=completion_body(f"{i} {LONG_PROMPT}", 8), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    # Each was prefilled on the decode engine: either the split was planned and the prefill step
    # found the engine gone (fallback), or the prefill worker was already out of rotation (local).
    assert pd_mode_count(gw.url, "fallback") + pd_mode_count(gw.url, "local") == before + 3
    assert gw.runtime.fleet.get("prefill").state.value == "unhealthy"
    workers = httpx.get(f"{gw.url}/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}).json()["workers"]
    assert {w["id"]: w["role"] for w in workers} == {"prefill": "prefill", "decode": "decode"}
