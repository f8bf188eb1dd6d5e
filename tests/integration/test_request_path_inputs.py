"""Client input on the request path (issue 13): internal fields, bounded keys, re-serializable bodies.

Real gateway over real sockets in front of ``FakeEngine`` (tests/integration/fake_engine.py, a test
double: a small HTTP server that records every body it receives), so each test can check what reached
an engine on every path: aggregated (vLLM and SGLang dialects), P/D split, a short prompt prefilled
locally on its decode worker.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from adapters import internal_field_carriers, internal_fields, scheduling_fields
from orchestrator.config import load_config
from tests.fixtures.sim_gateway import gateway_over
from tests.integration.fake_engine import FakeEngine

MODEL = "m"
LONG = "Explain the plan: " + " ".join(f"step{i} then" for i in range(150))


@contextlib.contextmanager
def fleet(roles: list[tuple[str, str]], **disagg):
    engines = [FakeEngine().start() for _ in roles]
    config = load_config({
        "models": [{"name": MODEL, "block_size": 16}],
        "workers": [{"id": f"w{i}", "url": e.url, "engine": kind, "role": role, "models": [MODEL]}
                    for i, (e, (kind, role)) in enumerate(zip(engines, roles, strict=True))],
        "router": {"policy": "least_load"},
        "health": {"interval_s": 30},
        "disagg": {"enabled": bool(disagg), "min_prefill_tokens": 64, **disagg},
    })
    with gateway_over(config, engines) as running:
        yield running


PATHS = {
    "aggregated-vllm": ([("vllm", "both")], LONG),
    "aggregated-sglang": ([("sglang", "both")], LONG),
    "pd-split": ([("vllm", "prefill"), ("vllm", "decode")], LONG),
    "pd-local-prefill": ([("vllm", "prefill"), ("vllm", "decode")], "short prompt"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("stream", [False, True])
def test_every_internal_field_is_refused_on_every_path(path, stream):
    roles, prompt = PATHS[path]
    disagg = {"connector": "nixl"} if any(r == "prefill" for _, r in roles) else {}
    with fleet(roles, **disagg) as (gw, engines):
        base = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": stream}
        r = httpx.post(f"{gw.url}/v1/completions", json=base, timeout=10)
        assert r.status_code == 200, r.text  # the path itself works
        seen = sum(len(e.bodies) for e in engines)
        assert seen >= 1
        for name in sorted(internal_fields()):
            for endpoint, body in (("/v1/completions", dict(base)),
                                   ("/v1/chat/completions", {"model": MODEL, "stream": stream, "max_tokens": 3,
                                                             "messages": [{"role": "user", "content": prompt}]})):
                body[name] = {"remote_host": "10.0.0.1", "remote_port": 22} if name == "kv_transfer_params" else "x"
                r = httpx.post(gw.url + endpoint, json=body, timeout=10)
                assert r.status_code == 400, (name, r.text)
                err = r.json()["error"]
                assert err["param"] == name and err["code"] == "internal_field"
                assert name in err["message"]
                # the same field inside a field the engine merges into where it keeps it (vLLM copies
                # ``vllm_xargs`` into the sampling params' extra_args, where its KV connector reads
                # ``kv_transfer_params``: a string there crashes a P/D engine's scheduler)
                for carrier in sorted(internal_field_carriers()):
                    carried = {k: v for k, v in body.items() if k != name}
                    carried[carrier] = {"session_id": "s", name: "x"}
                    r = httpx.post(gw.url + endpoint, json=carried, timeout=10)
                    assert r.status_code == 400, (carrier, name, r.text)
                    err = r.json()["error"]
                    assert err["param"] == f"{carrier}.{name}" and err["code"] == "internal_field", err
        assert sum(len(e.bodies) for e in engines) == seen  # nothing more reached an engine
        # and what Dyad itself sent carries only Dyad's values (the prefill hand-off when split)
        for e in engines:
            for b in e.bodies:
                kvp = b.get("kv_transfer_params")
                assert kvp is None or kvp.get("remote_host") != "10.0.0.1"



@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_client_cannot_set_the_engines_scheduling_order(kind):
    """vLLM and SGLang order the requests they hold by ``priority`` (lower first, under priority scheduling):
    a client setting it would overtake other keys at the engine whatever its own key's class. Only the
    engine's default (absent, null, 0) is accepted, on every route; the rest is refused before any engine."""
    assert "priority" in scheduling_fields()
    with fleet([(kind, "both")]) as (gw, engines):
        routes = {"/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                  "/v1/chat/completions": {"model": MODEL, "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "hi"}]}}
        for path, base in routes.items():
            for default in (0, None):
                r = httpx.post(gw.url + path, json={**base, "priority": default}, timeout=10)
                assert r.status_code == 200, (path, default, r.text)
        seen = len(engines[0].bodies)
        assert seen == 4 and all(b.get("priority") in (0, None) for b in engines[0].bodies)
        for path, base in {**routes, "/v1/embeddings": {"model": MODEL, "input": "hi"}}.items():
            for value in (-100, 1, 2**40, "high", True, 0.5, [0]):
                for stream in (False, True):
                    body = {**base, "priority": value}
                    if path != "/v1/embeddings":
                        body["stream"] = stream
                    r = httpx.post(gw.url + path, json=body, timeout=10)
                    assert r.status_code == 400, (path, value, r.text)
                    err = r.json()["error"]
                    assert err["param"] == "priority" and err["code"] == "internal_field", err
                    assert "scheduling order" in err["message"]
        assert len(engines[0].bodies) == seen  # nothing more reached the engine

def test_session_keys_are_stored_bounded():
    with fleet([("vllm", "both"), ("vllm", "both")]) as (gw, engines):
        router = gw.runtime.router
        huge = "s" * 30_000  # (headers are capped at 64 KiB in total)
        for i in range(20):
            r = httpx.post(f"{gw.url}/v1/completions", timeout=10, headers={"x-session-id": huge + str(i)},
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": huge + str(i)})
            assert r.status_code == 200, r.text
        keys = [d.get("session_key") for d in router.recent_decisions]
        assert keys and all(k is not None and len(k) <= 32 for k in keys)


def test_deep_nesting_is_refused_naming_the_limit_and_shallow_nesting_forwarded():
    with fleet([("vllm", "both")]) as (gw, engines):
        deep = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "extra": {}}
        x = deep["extra"]
        for _ in range(600):
            x["a"] = {}
            x = x["a"]
        r = httpx.post(f"{gw.url}/v1/completions", json=deep, timeout=10)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "nesting_too_deep" and "254" in r.json()["error"]["message"]
        ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "extra": [[[[["fine"]]]]]}
        r = httpx.post(f"{gw.url}/v1/completions", json=ok, timeout=10)
        assert r.status_code == 200 and engines[0].bodies[-1]["extra"] == [[[[["fine"]]]]]


def test_the_id_an_engine_keys_a_request_by_is_the_gateways_not_the_clients():
    """SGLang keys a request by the body's ``rid`` (it de-duplicates and aborts by it): an internal field a
    client body may not carry. The gateway sets it from the request id, which a client chooses with
    X-Request-Id — or guesses: the gateway's own ids are a process prefix and a counter, echoed in every
    answer. Two requests with one X-Request-Id, or one naming another request's id, still reach the
    engine under distinct rids; the request id stays the rid's prefix (logs), and the client's answer
    keeps the id it sent."""
    with fleet([("sglang", "both")]) as (gw, engines):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        same = [httpx.post(f"{gw.url}/v1/completions", json=body, headers={"x-request-id": "same"}, timeout=10)
                for _ in range(2)]
        own = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=10)
        spoof = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=10,
                           headers={"x-request-id": own.headers["x-request-id"]})
        answers = [*same, own, spoof]
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert [r.headers["x-request-id"] for r in same] == ["same", "same"]
        rids = [b["rid"] for b in engines[0].bodies]
        assert len(rids) == 4 and len(set(rids)) == 4, rids
        for r, rid in zip(answers, rids, strict=True):
            assert rid.startswith(r.headers["x-request-id"]) and rid != r.headers["x-request-id"], (rid, r.headers)


def test_a_request_id_that_is_not_plain_ascii_is_replaced_not_mangled():
    """Header values arrive as bytes (latin-1 to the app); a non-ASCII X-Request-Id went on to the engine and
    back to the client re-encoded as UTF-8 — other bytes than the client sent, under the client's name.
    Like an unprintable or overlong one, it is replaced by a fresh id, the same one echoed and forwarded."""
    with fleet([("vllm", "both")]) as (gw, engines):
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers={"x-request-id": b"caf\xe9-1"}, timeout=10)
        assert r.status_code == 200, r.text
        echoed = r.headers.get_list("x-request-id", split_commas=False)
        assert len(echoed) == 1 and echoed[0].isascii() and "caf" not in echoed[0], echoed
        assert engines[0].headers[-1]["x-request-id"] == echoed[0]


def test_prompt_scoring_with_echo_and_max_tokens_0_is_forwarded():
    """vLLM's completions score a prompt without generating anything: ``echo: true`` with ``max_tokens: 0``
    (the prompt's own logprobs, as evaluation harnesses ask for them). The gateway refused that as
    "max_tokens must be at least 1"; without ``echo`` a 0 is still refused, naming the field."""
    with fleet([("vllm", "both")]) as (gw, engines):
        body = {"model": MODEL, "prompt": "score me", "max_tokens": 0, "echo": True, "logprobs": 1}
        r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert engines[0].bodies[-1]["max_tokens"] == 0 and engines[0].bodies[-1]["echo"] is True
        for bad in ({**body, "echo": False}, {k: v for k, v in body.items() if k != "echo"}):
            r = httpx.post(f"{gw.url}/v1/completions", json=bad, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "echo": True}
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text  # (completions only)


def test_a_batch_of_prompts_is_never_split_and_several_sequences_are_prefilled_locally():
    """The P/D hand-off carries one prompt's KV: vLLM's prefill answer to a batch of prompts has only the first
    prompt's ``kv_transfer_params``, which the decode step then applied to every prompt of the batch (the
    others' KV read from the first one's blocks, theirs left leased on the prefill engine). ``n`` or ``best_of``
    above 1 makes vLLM fork children that share one transfer: a vLLM decode worker prefills those itself. One
    long prompt for one sequence is still split."""
    with fleet([("vllm", "prefill"), ("vllm", "decode")], connector="nixl") as (gw, engines):
        prefill, decode = engines
        for prompt in ([LONG, LONG + " and more"], [list(range(1, 200)), list(range(2, 300))]):
            r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                           timeout=10)
            assert r.status_code == 200, r.text
            assert not prefill.bodies and "kv_transfer_params" not in decode.bodies[-1], decode.bodies[-1]
        # several sequences from one prompt: vLLM's children would share one transfer (a shallow copy)
        for extra, endpoint in (({"n": 2}, "completions"), ({"best_of": 3}, "completions"), ({"n": 2}, "chat/completions")):
            body = {"model": MODEL, "max_tokens": 2, **extra}
            body.update({"messages": [{"role": "user", "content": LONG}]} if endpoint.startswith("chat") else {"prompt": LONG})
            r = httpx.post(f"{gw.url}/v1/{endpoint}", json=body, timeout=10)
            assert r.status_code == 200, r.text
            assert not prefill.bodies and "kv_transfer_params" not in decode.bodies[-1], (extra, decode.bodies[-1])
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": LONG, "max_tokens": 2, "n": 1},
                       timeout=10)
        assert r.status_code == 200 and len(prefill.bodies) == 1 and decode.bodies[-1]["kv_transfer_params"]


def test_a_request_for_its_prompts_logprobs_is_prefilled_where_it_is_decoded():
    """vLLM computes the whole prompt again on the decode engine for a request that asks for its prompt's
    logprobs (``SamplingParams.skip_reading_prefix_cache``: no cached or transferred KV is read), so a
    prefill leg on another worker was work for nothing, its blocks held by the prefill engine until they
    timed out. Such a request (``prompt_logprobs``, or ``echo`` with logprobs) is prefilled on its vLLM
    decode worker; the same prompt without them is still split."""
    with fleet([("vllm", "prefill"), ("vllm", "decode")], connector="nixl") as (gw, engines):
        prefill, decode = engines
        chat = {"messages": [{"role": "user", "content": LONG}]}
        for extra, endpoint in (({"echo": True, "logprobs": 0}, "completions"), ({"prompt_logprobs": 1}, "completions"),
                                ({"echo": True}, "chat/completions"), ({"prompt_logprobs": 0}, "chat/completions")):
            body = {"model": MODEL, "max_tokens": 2, **extra, **(chat if endpoint.startswith("chat") else {"prompt": LONG})}
            r = httpx.post(f"{gw.url}/v1/{endpoint}", json=body, timeout=10)
            assert r.status_code == 200, r.text
            assert not prefill.bodies and "kv_transfer_params" not in decode.bodies[-1], (extra, decode.bodies[-1])
        for extra, endpoint in (({"echo": True}, "completions"), ({"logprobs": 2}, "completions"),
                                ({"echo": True, "top_logprobs": None}, "chat/completions")):
            body = {"model": MODEL, "max_tokens": 2, **extra, **(chat if endpoint.startswith("chat") else {"prompt": LONG})}
            n = len(prefill.bodies)
            r = httpx.post(f"{gw.url}/v1/{endpoint}", json=body, timeout=10)
            assert r.status_code == 200 and len(prefill.bodies) == n + 1, (extra, r.text)  # no prompt logprobs: split


def test_a_compressed_body_is_refused_naming_the_header_not_taken_for_broken_json():
    """A client that gzips its JSON body got a 400 "not valid JSON" (the gateway decodes no Content-Encoding):
    true, but it sent the client looking for a JSON mistake. Now a body that does not parse and came with a
    Content-Encoding is a 415 naming the header; a JSON body labelled ``identity`` (or gzip, yet plain) is
    served as before."""
    import gzip
    import json
    with fleet([("vllm", "both")]) as (gw, engines):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        for path in ("/v1/completions", "/v1/embeddings"):
            r = httpx.post(f"{gw.url}{path}", content=gzip.compress(json.dumps(body).encode()),
                           headers={"content-type": "application/json", "content-encoding": "gzip"}, timeout=10)
            assert r.status_code == 415, r.text
            err = r.json()["error"]
            assert err["param"] == "content-encoding" and "gzip" in err["message"] and "uncompressed" in err["message"]
        for encoding in ("identity", "gzip"):
            r = httpx.post(f"{gw.url}/v1/completions", content=json.dumps(body).encode(),
                           headers={"content-type": "application/json", "content-encoding": encoding}, timeout=10)
            assert r.status_code == 200, (encoding, r.text)
        r = httpx.post(f"{gw.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"},
                       timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert engines[0].bodies and all(b.get("prompt") == "hello" for b in engines[0].bodies)
