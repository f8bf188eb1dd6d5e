"""The request path's failure classes against two real vLLM engines (issue 13), and usage (issue 14).

Run only by the real-vLLM tier (marker ``vllm``). What real vLLM can be made to do on cue here: refuse
one kind of request (a 400 for a prompt longer than its context — the request's fault, on every
engine), stream with and without ``include_usage``, and die (SIGKILL) mid-stream. Shapes vLLM does not
produce on demand (garbage bytes, a 200 JSON error to a stream, hanging while /health answers) are in
test_request_path_failures.py against a named fake engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from orchestrator.gateway.serve import GatewayThread
from tests.fixtures.vllm import MODEL_NAME, VllmPool
from tests.fixtures.vllm_gateway import engines_or_fail, vllm_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = MODEL_NAME


@pytest.fixture(scope="module")
def gateway(vllm_pool: VllmPool) -> Iterator[GatewayThread]:
    with vllm_gateway(engines_or_fail(vllm_pool.get, 2), resilience={"breaker_failure_threshold": 2}) as gw:
        yield gw


def test_requests_vllm_refuses_never_open_a_breaker(gateway):
    too_long = "word " * 5000  # longer than the tiny model's context: vLLM answers 400 on any engine
    for _ in range(6):
        r = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": too_long, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 400, r.text
    assert gateway.runtime.breakers.snapshot() == {}
    assert httpx.get(f"{gateway.url}/ready", timeout=10).json()["status"] == "ready"


def test_internal_fields_never_reach_vllm(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_usage_is_counted_and_not_relayed_unasked(gateway, chat):
    m = gateway.runtime.metrics.registry
    before = m.get_sample_value("dyad_request_generation_tokens_sum", {"model": MODEL}) or 0.0
    body = {"model": MODEL, "max_tokens": 6, "ignore_eos": True, "stream": True}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "count"}]
    else:
        path, body["prompt"] = "/v1/completions", "count"
    r = httpx.post(gateway.url + path, json=body, timeout=60)
    lines = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert not any("usage" in json.loads(x) and json.loads(x)["usage"] for x in lines[:-1])
    after = m.get_sample_value("dyad_request_generation_tokens_sum", {"model": MODEL})
    assert after - before == 6
