"""P/D through the gateway against the project's simulated engine (real HTTP, real sockets).

The simulator stands in where real engines cannot run here: SGLang (its PyPI build needs CUDA) and
failure shapes that are impractical to produce on demand with real vLLM (a prefill engine that is
slow, a decode engine that fails its first answer, a bootstrap room that never arrives). The
real-vLLM NIXL flow is covered by tests/integration/test_pd_vllm.py.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread

MODEL = "m"
PROMPT = "Explain the plan: " + " ".join(f"step{i} then" for i in range(150))


def sim(dialect: str = "vllm", **kw) -> SimEngineThread:
    return SimEngineThread(model=MODEL, profile="cpu-tiny", dialect=dialect, kv_events=False, **kw).start()


def sources(eng: SimEngineThread) -> dict[str, int]:
    return dict(eng.call(lambda: eng.model.stats.prompt_tokens_by_source))


def load(eng: SimEngineThread) -> int:
    return httpx.get(f"{eng.url}/load", timeout=5).json()["server_load"]


def pd_mode(gw: GatewayThread, mode: str) -> float:
    return gw.runtime.metrics.registry.get_sample_value("dyad_pd_requests_total", {"mode": mode}) or 0.0


def gateway(workers: list[dict], **disagg) -> GatewayThread:
    config = load_config({
        "models": [{"name": MODEL, "block_size": 32}],
        "workers": [{**w, "models": [MODEL]} for w in workers],
        "router": {"policy": "least_load", "debug_headers": True},
        "health": {"interval_s": 30},  # the tests decide when a worker is seen down
        "disagg": {"min_prefill_tokens": 32, "prefill_timeout_s": 5, **disagg},
    })
    return GatewayThread(config).start()


@contextlib.contextmanager
def running(*things):
    try:
        yield things
    finally:
        for t in things:
            t.stop()


def body(stream: bool = False, max_tokens: int = 12, prompt: str = PROMPT) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def stream_text(r: httpx.Response) -> str:
    text = ""
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += "".join(c.get("text", "") for c in chunk.get("choices", []))
    return text


# --- vLLM dialect --------------------------------------------------------------------------------------

def test_vllm_dialect_split_transfers_the_prompt_and_matches_aggregated():
    with running(sim(), sim(), sim()) as (p, d, agg):
        with running(gateway([{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
                              {"id": "d", "url": d.url, "engine": "sim", "role": "decode"}])) as (gw,):
            before = sources(d)["external_kv_transfer"]
            r = httpx.post(f"{gw.url}/v1/completions", json=body(), timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-dyad-prefill-worker"] == "p"
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            assert sources(d)["external_kv_transfer"] - before == prompt_tokens
            assert sources(p)["local_compute"] == prompt_tokens
            ref = httpx.post(f"{agg.url}/v1/completions", json=body(), timeout=30).json()
            assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
            with httpx.stream("POST", f"{gw.url}/v1/completions", json=body(stream=True), timeout=30) as s:
                assert s.status_code == 200 and s.headers["x-dyad-prefill-worker"] == "p"
                assert stream_text(s) == ref["choices"][0]["text"]
            assert pd_mode(gw, "disaggregated") == 2


def test_a_both_role_worker_in_a_pd_fleet_serves_its_share_end_to_end():
    """A mixed fleet (prefill + decode + an aggregated worker): concurrent requests use the
    aggregated worker too, each served there whole (no hand-off), the rest split as usual."""
    with running(sim(), sim(), sim()) as (p, d, b):
        with running(gateway([{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
                              {"id": "d", "url": d.url, "engine": "sim", "role": "decode"},
                              {"id": "b", "url": b.url, "engine": "sim", "role": "both"}])) as (gw,):
            def one(i: int) -> tuple[str, str | None]:
                r = httpx.post(f"{gw.url}/v1/completions", json=body(max_tokens=24, prompt=f"{i} {PROMPT}"),
                               timeout=30)
                assert r.status_code == 200, r.text
                return r.headers["x-dyad-worker"], r.headers.get("x-dyad-prefill-worker")
            with ThreadPoolExecutor(6) as pool:
                served = list(pool.map(one, range(12)))
            on_b = [x for x in served if x[0] == "b"]
            assert on_b and all(pw in (None, "b") for _, pw in on_b), served  # whole requests on b
            assert any(x == ("d", "p") for x in served), served  # the split path still serves
            assert sources(b)["external_kv_transfer"] == 0 and sources(b)["local_compute"] > 0


def test_slow_prefill_is_bounded_and_decode_prefills_locally():
    with running(sim(prefill_delay_s=30), sim()) as (p, d):
        with running(gateway([{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
                              {"id": "d", "url": d.url, "engine": "sim", "role": "decode"}],
                             prefill_timeout_s=0.5)) as (gw,):
            started = time.monotonic()
            r = httpx.post(f"{gw.url}/v1/completions", json=body(), timeout=30)
            assert r.status_code == 200, r.text
            assert time.monotonic() - started < 5
            assert pd_mode(gw, "fallback") == 1
            assert sources(d)["external_kv_transfer"] == 0 and sources(d)["local_compute"] > 0
            # Giving up on the prefill step closed its connection: the prefill engine dropped it.
            deadline = time.monotonic() + 3
            while load(p) > 0:
                assert time.monotonic() < deadline, "the abandoned prefill step is still running"
                time.sleep(0.05)


def test_dead_prefill_engine_means_local_prefill_and_the_worker_leaves_rotation():
    with running(sim(), sim()) as (p, d):
        with running(gateway([{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
                              {"id": "d", "url": d.url, "engine": "sim", "role": "decode"}])) as (gw,):
            p.stop()
            r = httpx.post(f"{gw.url}/v1/completions", json=body(), timeout=30)
            assert r.status_code == 200, r.text
            assert pd_mode(gw, "fallback") == 1
            assert gw.runtime.fleet.get("p").state.value == "unhealthy"
            r = httpx.post(f"{gw.url}/v1/completions", json=body(), timeout=30)
            assert r.status_code == 200 and "x-dyad-prefill-worker" not in r.headers
            assert pd_mode(gw, "local") == 1


def test_decode_failing_before_its_first_token_moves_to_another_decode_worker():
    # (d0 answers 500 twice: to the hand-off, then to the same request without it — a decode engine that fails only
    # a hand-off is asked again at once to prefill locally: test_pd_unseen.py)
    with running(sim(), sim(fail_next=2), sim()) as (p, d0, d1):
        with running(gateway([{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
                              {"id": "d0", "url": d0.url, "engine": "sim", "role": "decode"},
                              {"id": "d1", "url": d1.url, "engine": "sim", "role": "decode"}])) as (gw,):
            with httpx.stream("POST", f"{gw.url}/v1/completions", json=body(stream=True), timeout=30) as s:
                assert s.status_code == 200
                assert s.headers["x-dyad-worker"] == "d1"  # d0 (chosen first: tie → id) answered 500
                assert len(stream_text(s)) > 0
            assert gw.runtime.metrics.registry.get_sample_value("dyad_retries_total", {"model": MODEL}) == 1


def test_client_cancellation_reaches_the_prefill_engine_and_the_decode_engine():
    with running(sim(prefill_delay_s=10), sim()) as (p, d):
        with running(gateway([{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
                              {"id": "d", "url": d.url, "engine": "sim", "role": "decode"}],
                             prefill_timeout_s=20)) as (gw,):
            # Leave during the prefill step (which would take 10 s).
            client = ThreadPoolExecutor(1).submit(
                httpx.post, f"{gw.url}/v1/completions", json=body(), timeout=httpx.Timeout(5, read=1.0))
            deadline = time.monotonic() + 3
            while load(p) == 0:
                assert time.monotonic() < deadline, "the prefill step never reached the prefill engine"
                time.sleep(0.02)
            with pytest.raises(httpx.ReadTimeout):
                client.result(10)
            deadline = time.monotonic() + 3
            while load(p) > 0:
                assert time.monotonic() < deadline, "the prefill engine kept the cancelled request"
                time.sleep(0.05)
            assert sources(d)["external_kv_transfer"] == 0 and load(d) == 0
    with running(sim(), sim()) as (p, d):
        with running(gateway([{"id": "p", "url": p.url, "engine": "sim", "role": "prefill"},
                              {"id": "d", "url": d.url, "engine": "sim", "role": "decode"}])) as (gw,):
            # Leave during decode.
            with httpx.stream("POST", f"{gw.url}/v1/completions", json=body(stream=True, max_tokens=2000),
                              timeout=30) as s:
                chunks = s.iter_raw()  # keep a reference: a collected iterator closes the connection at once
                next(chunks)
                assert load(d) == 1
            deadline = time.monotonic() + 3
            while load(d) > 0:
                assert time.monotonic() < deadline, "the decode engine kept generating for nobody"
                time.sleep(0.05)
            assert gw.runtime.fleet.get("d").inflight == 0


# --- SGLang dialect (simulated: SGLang cannot run on this machine) ------------------------------------

def sglang_pair(**decode_kw):
    return sim("sglang", disaggregation_mode="prefill"), sim("sglang", disaggregation_mode="decode", **decode_kw)


def sglang_worker(id_: str, eng: SimEngineThread, role: str, bootstrap_port: int | None = None) -> dict:
    w = {"id": id_, "url": eng.url, "engine": "sglang", "role": role}
    if role == "prefill":
        w["bootstrap_port"] = bootstrap_port or eng.port  # the sim serves its bootstrap on its main port
    return w


def test_sglang_dual_dispatch_client_gets_the_decode_stream():
    p, d = sglang_pair()
    with running(p, d):
        with running(gateway([sglang_worker("p", p, "prefill"), sglang_worker("d", d, "decode")])) as (gw,):
            with httpx.stream("POST", f"{gw.url}/v1/completions", json=body(stream=True), timeout=30) as s:
                assert s.status_code == 200
                assert s.headers["x-dyad-prefill-worker"] == "p" and s.headers["x-dyad-worker"] == "d"
                text = stream_text(s)
            assert len(text) > 0
            assert sources(d)["external_kv_transfer"] > 0 and sources(d)["local_compute"] == 0
            assert sources(p)["local_compute"] > 0
            chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            assert load(p) == 0 and load(d) == 0


def test_sglang_short_prompts_are_still_split_because_decode_servers_cannot_prefill():
    p, d = sglang_pair()
    with running(p, d):
        with running(gateway([sglang_worker("p", p, "prefill"), sglang_worker("d", d, "decode")],
                             min_prefill_tokens=100_000)) as (gw,):
            r = httpx.post(f"{gw.url}/v1/completions", json=body(prompt="hi"), timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-dyad-prefill-worker"] == "p"


def test_sglang_dead_prefill_server_is_replaced_by_another():
    p_dead, d = sglang_pair()
    p_ok = sim("sglang", disaggregation_mode="prefill")
    with running(p_dead, p_ok, d):
        with running(gateway([sglang_worker("p0", p_dead, "prefill"), sglang_worker("p1", p_ok, "prefill"),
                              sglang_worker("d", d, "decode")])) as (gw,):
            p_dead.stop()  # still healthy in the gateway's eyes: the next pair picks it (tie → id)
            started = time.monotonic()
            r = httpx.post(f"{gw.url}/v1/completions", json=body(), timeout=30)
            assert r.status_code == 200, r.text
            assert time.monotonic() - started < 5  # the decode side was not left waiting for its timeout
            assert gw.runtime.fleet.get("p0").state.value == "unhealthy"
            assert sources(p_ok)["local_compute"] > 0


def test_sglang_lost_bootstrap_fails_fast_with_a_clear_error():
    # The prefill server is told to the decode server at a port where nobody answers: the room
    # never arrives, the decode server gives up after its bootstrap timeout (1 s here).
    p, d = sglang_pair(bootstrap_timeout_s=1.0)
    with socket_port() as dead_port, running(p, d):
        with running(gateway([sglang_worker("p", p, "prefill", bootstrap_port=dead_port),
                              sglang_worker("d", d, "decode")])) as (gw,):
            started = time.monotonic()
            r = httpx.post(f"{gw.url}/v1/completions", json=body(stream=True), timeout=30)
            assert time.monotonic() - started < 10
            assert r.status_code >= 500
            err = r.json()["error"]
            assert "bootstrap" in err["message"].lower()
            assert load(d) == 0


@contextlib.contextmanager
def socket_port():
    """A loopback port that refuses connections (bound, never listening)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


# --- role changes through the admin API (simulated engines; the real-vLLM run is test_pd_roles.py) ----

def test_role_admin_api_answers_and_refuses_clearly():
    with running(sim(), sim(), sim()) as (e0, e1, e2):
        config = load_config({
            "models": [{"name": MODEL}],
            "workers": [{"id": "a", "url": e0.url, "engine": "sim", "role": "decode", "models": [MODEL]},
                        {"id": "b", "url": e1.url, "engine": "sim", "role": "decode", "models": [MODEL]},
                        {"id": "c", "url": e2.url, "engine": "sim", "role": "prefill", "models": [MODEL]}],
            "gateway": {"admin_token": "t"}, "health": {"interval_s": 30}, "router": {"debug_headers": True}})
        with running(GatewayThread(config).start()) as (gw,):
            auth = {"authorization": "Bearer t"}
            url = f"{gw.url}/admin/workers"
            assert httpx.post(f"{url}/b/role", json={"role": "prefill"}).status_code == 401
            r = httpx.post(f"{url}/b/role", json={"role": "sideways"}, headers=auth)
            assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_role"
            r = httpx.post(f"{url}/b/role", json={}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "role"
            r = httpx.post(f"{url}/zz/role", json={"role": "decode"}, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
            # b is busy: the change is accepted (202) and pending until b has drained.
            gw.runtime.fleet.get("b").inflight = 1
            r = httpx.post(f"{url}/b/role", json={"role": "prefill"}, headers=auth)
            assert r.status_code == 202, r.text
            assert r.json()["target_role"] == "prefill" and r.json()["pools"]["moving"] == ["b"]
            listed = {w["id"]: w for w in httpx.get(url, headers=auth).json()["workers"]}
            assert listed["b"]["role"] == "decode" and listed["b"]["target_role"] == "prefill"
            # Requests meanwhile go around it.
            for _ in range(3):
                r = httpx.post(f"{gw.url}/v1/completions", json=body(max_tokens=3), timeout=30)
                assert r.status_code == 200 and r.headers["x-dyad-worker"] == "a"
                assert r.headers["x-dyad-prefill-worker"] == "c"
            r = httpx.post(f"{url}/a/role", json={"role": "prefill"}, headers=auth)
            assert r.status_code == 409 and r.json()["error"]["code"] == "last_decoder"
            gw.runtime.fleet.get("b").inflight = 0
            deadline = time.monotonic() + 3
            while gw.runtime.fleet.get("b").role.value != "prefill":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            pools = httpx.get(f"{gw.url}/admin/pools", headers=auth).json()["pools"]
            assert pools == {"prefill": ["b", "c"], "decode": ["a"], "both": [], "moving": []}
            r = httpx.post(f"{url}/b/role", json={"role": "decode", "wait": True}, headers=auth)
            assert r.status_code == 200 and r.json()["role"] == "decode" and r.json()["drained"] is True
            metrics = httpx.get(f"{gw.url}/metrics").text
            assert 'dyad_role_changes_total{from_role="decode",to_role="prefill"} 1.0' in metrics
            assert 'dyad_role_changes_total{from_role="prefill",to_role="decode"} 1.0' in metrics
            assert 'dyad_worker_role{role="decode",worker="b"} 1.0' in metrics
