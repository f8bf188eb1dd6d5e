"""The simulated engine's injected stream fault (``POST /sim/faults {"stream_fault": MODE, "stream_fault_after":
N}``, which the stream-ending and native-plane tests rely on) comes after N tokens however the engine's steps were
grouped into chunks. It counted chunks: an engine whose loop ran late (a loaded machine) delivered several tokens
in one chunk, so an 8-token answer could be whole in 3 chunks and the fault "after 3" never came — a test that
injected a failure then saw a complete stream (test_native_plane's failing-callback test did, once in CI).

The ``zero`` profile generates every token in one step: the most coalesced stream there is, every time."""

from __future__ import annotations

import json

import httpx
import pytest

from orchestrator.sim.server import SimEngineThread
from tests.integration.test_stream_endings import CHAT, COMPLETIONS, body_for, set_faults, sse_events


def content_of(endpoint: str, data: str) -> str:
    choice = json.loads(data)["choices"][0]
    return choice["delta"].get("content", "") if endpoint == CHAT else choice["text"]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("profile", ["zero", "cpu-tiny"])
@pytest.mark.parametrize("after", [0, 3, 7])
def test_an_eof_fault_comes_after_its_token_count_however_the_tokens_were_grouped(endpoint, profile, after):
    with SimEngineThread(model="m", profile=profile, kv_events=False) as engine:
        set_faults(engine, stream_fault="eof", stream_fault_after=after)
        with httpx.stream("POST", engine.url + endpoint, json=body_for(endpoint, 8), timeout=30) as r:
            assert r.status_code == 200
            raw = r.read().decode()
    datas = [d for _, d in sse_events(raw)]
    assert "[DONE]" not in datas  # the fault came: the stream ended without its end
    text = "".join(content_of(endpoint, d) for d in datas)
    assert len(text.split()) == after, datas
    assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in datas)  # nothing claims an end


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_an_answer_no_longer_than_the_fault_point_is_whole(endpoint):
    with SimEngineThread(model="m", profile="zero", kv_events=False) as engine:
        set_faults(engine, stream_fault="eof", stream_fault_after=8)
        with httpx.stream("POST", engine.url + endpoint, json=body_for(endpoint, 8), timeout=30) as r:
            raw = r.read().decode()
    datas = [d for _, d in sse_events(raw)]
    assert datas[-1] == "[DONE]"
    assert len("".join(content_of(endpoint, d) for d in datas[:-1]).split()) == 8


def test_the_garbage_fault_in_one_coalesced_chunk_comes_after_its_token_count():
    with SimEngineThread(model="m", profile="zero", kv_events=False) as engine:
        set_faults(engine, stream_fault="garbage", stream_fault_after=3)
        with httpx.stream("POST", engine.url + CHAT, json=body_for(CHAT, 8), timeout=30) as r:
            raw = r.read().decode()
    head, _, tail = raw.partition("<html>")
    assert tail.startswith("simulated garbage")
    datas = [d for _, d in sse_events(head)]
    assert len("".join(content_of(CHAT, d) for d in datas).split()) == 3
