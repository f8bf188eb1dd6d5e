"""The simulated engine's ``n > 1`` and ``logprobs`` (chat and completions, streamed and not), in vLLM's
shapes. The simulator is the subject under test (it stands in for engines in the fleet tests)."""

from __future__ import annotations

import json

import httpx
import pytest

from orchestrator.sim.server import SimEngineThread


@pytest.fixture(scope="module")
def client():
    with SimEngineThread(model="m", profile="cpu-tiny", seed=3) as eng, \
            httpx.Client(base_url=eng.url, timeout=30) as c:
        c.engine = eng
        yield c


def _sse(r):
    out = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 6}
COMPL = {"model": "m", "prompt": "once upon a time", "max_tokens": 6}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPL)])
def test_n_choices_have_their_own_text_and_usage_counts_the_prompt_once(client, path, body):
    one = client.post(path, json=body).json()
    r = client.post(path, json={**body, "n": 3})
    assert r.status_code == 200, r.text
    j = r.json()
    assert [c["index"] for c in j["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in j["choices"]]
    assert len(set(texts)) == 3  # different samples
    first = one["choices"][0]
    assert texts[0] == (first["message"]["content"] if "message" in first else first["text"])
    assert all(c["finish_reason"] == "length" for c in j["choices"])
    assert j["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert j["usage"]["completion_tokens"] == 3 * 6


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPL)])
def test_streamed_n_choices_equal_the_whole_answer(client, path, body):
    whole = client.post(path, json={**body, "n": 2}).json()
    with client.stream("POST", path, json={**body, "n": 2, "stream": True,
                                           "stream_options": {"include_usage": True}}) as r:
        chunks = _sse(r)
    by_index: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        [ch] = c["choices"]
        piece = ch["delta"].get("content", "") if "delta" in ch else ch["text"]
        by_index[ch["index"]] += piece
        if ch["finish_reason"]:
            finish[ch["index"]] = ch["finish_reason"]
    want = [c["message"]["content"] if "message" in c else c["text"] for c in whole["choices"]]
    assert [by_index[0], by_index[1]] == want
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    if "chat" in path:  # one role chunk per choice, as vLLM sends
        roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
        assert roles == [0, 1]


def test_chat_logprobs_shape_and_that_tokens_spell_the_text(client):
    j = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3}).json()
    [c] = j["choices"]
    content = c["logprobs"]["content"]
    assert len(content) == 6
    assert "".join(t["token"] for t in content) == c["message"]["content"]
    for t in content:
        assert t["logprob"] < 0 and t["bytes"] == list(t["token"].encode())
        assert len(t["top_logprobs"]) == 3 and t["top_logprobs"][0]["token"] == t["token"]
        lps = [a["logprob"] for a in t["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)
    plain = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).json()["choices"][0]
    assert all(t["top_logprobs"] == [] for t in plain["logprobs"]["content"])
    assert client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_streamed_match_the_whole_answer(client):
    body = {**CHAT, "logprobs": True, "top_logprobs": 2}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = _sse(r)
    streamed = [t for c in chunks for t in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert streamed == whole


def test_completion_logprobs_offsets_tokens_and_top_entries(client):
    j = client.post("/v1/completions", json={**COMPL, "logprobs": 2}).json()
    [c] = j["choices"]
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["text_offset"] == [c["text"].index(t.strip(), o) - (1 if t.startswith(" ") else 0)
                                 for t, o in zip(lp["tokens"], lp["text_offset"], strict=True)]
    assert all(lp["top_logprobs"][i][t] == lp["token_logprobs"][i] for i, t in enumerate(lp["tokens"]))
    assert all(1 <= len(d) <= 2 for d in lp["top_logprobs"])
    zero = client.post("/v1/completions", json={**COMPL, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert all(len(d) == 1 for d in zero["top_logprobs"])  # the sampled token only
    with client.stream("POST", "/v1/completions", json={**COMPL, "logprobs": 2, "stream": True}) as r:
        chunks = _sse(r)
    merged = {k: [x for ch in chunks for x in ch["choices"][0]["logprobs"][k]] for k in lp}
    assert merged == lp


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {**COMPL, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPL, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {**COMPL, "logprobs": "many"}, "logprobs"),
    ("/v1/completions", {**COMPL, "n": 0}, "n"),
    ("/v1/completions", {**COMPL, "n": 10_000}, "n"),
])
def test_bad_n_and_logprobs_are_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_engine_records_forwarded_headers(client):
    client.post("/v1/completions", json=COMPL, headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    assert client.engine.app.received_headers[-1]["traceparent"].startswith("00-" + "a" * 32)
