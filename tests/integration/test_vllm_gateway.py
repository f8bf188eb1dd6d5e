"""The gateway in front of two real vLLM engines: the OpenAI surface end to end.

Chat and completions, streamed and not, ``usage`` and ``stream_options.include_usage``, unknown
model, engine errors passed through, X-Request-Id reaching the engine, and a client disconnect
aborting the engine's request. An engine killed under traffic is tests/integration/test_chaos_vllm.py
(one kill for the whole tier: each restart costs an engine start).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from adapters.prometheus_text import MetricSet
from orchestrator.gateway.serve import GatewayThread
from tests.fixtures.vllm import MODEL_NAME as MODEL
from tests.fixtures.vllm import VllmEngine, VllmPool
from tests.fixtures.vllm_gateway import engines_or_fail, vllm_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHAT = [{"role": "user", "content": "hello world, tell me about the cache"}]


@pytest.fixture(scope="module")
def gateway(vllm_pool: VllmPool) -> Iterator[GatewayThread]:
    with vllm_gateway(engines_or_fail(vllm_pool.get, 2)) as gw:
        yield gw


@pytest.fixture
def client(gateway: GatewayThread, vllm_engines: list[VllmEngine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=120) as c:
        yield c


def engine_metrics(engine: VllmEngine) -> MetricSet:
    return MetricSet.parse(httpx.get(f"{engine.url}/metrics", timeout=10).text, ("vllm:",))


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_chat_and_completions_non_streaming_with_usage(client: httpx.Client):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 6,
                                                  "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert chat["object"] == "chat.completion" and chat["model"] == MODEL
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["choices"][0]["message"]["content"]
    assert chat["usage"]["completion_tokens"] == 6 and chat["usage"]["prompt_tokens"] > 0
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + 6
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "the model", "max_tokens": 5,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion" and r.json()["usage"]["completion_tokens"] == 5


def test_round_robin_reaches_both_engines(client: httpx.Client):
    served = set()
    for _ in range(4):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        served.add(r.headers["x-dyad-worker"])
    assert served == {"w0", "w1"}


def test_chat_stream_with_include_usage_through_openai_client(gateway: GatewayThread, vllm_engines):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_usage_ends_with_done(client: httpx.Client):
    body = {"model": MODEL, "prompt": "the model", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # One token per chunk, unless the engine merged deltas (vLLM's RequestOutputCollector does when
    # its reader lags, e.g. on a loaded machine): every token arrives either way.
    assert 1 <= sum(len(c["choices"]) for c in chunks) <= 4
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == whole.json()["choices"][0]["text"]
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "length"
    assert all(c.get("usage") is None for c in chunks)


def test_unknown_model_is_openai_404(client: httpx.Client):
    r = client.post("/v1/chat/completions", json={"model": "no-such-model", "messages": CHAT})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "no-such-model" in err["message"] and err["type"]


def test_engine_error_keeps_engine_status_and_message(client: httpx.Client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 100_000})
    assert r.status_code == 400, r.text
    assert "error" in r.json() and "4096" in r.json()["error"]["message"]  # vLLM's max-model-len complaint


def test_request_id_reaches_engine(client: httpx.Client):
    rid = f"dyad-it-{uuid.uuid4().hex[:12]}"
    r = client.post("/v1/chat/completions", headers={"X-Request-Id": rid},
                    json={"model": MODEL, "messages": CHAT, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    assert r.json()["id"] == f"chatcmpl-{rid}"  # vLLM names its request after the header it received


async def _tries_of(gw: GatewayThread, request_id: str) -> list[tuple[str, bool]]:
    """The gateway's tries of ``request_id`` in flight now: (worker id, has relayed a token). Read on its loop."""
    return [(a.worker_id, a.quiet_for() is not None) for w in gw.runtime.fleet.workers()
            for a in gw.runtime.attempts.on_worker(w.id) if a.req.request_id == request_id]


def test_client_disconnect_aborts_engine_request(gateway: GatewayThread, client: httpx.Client,
                                                 vllm_engines: list[VllmEngine]):
    """A client that leaves mid-stream: the engine stops generating for it (an abort, not a finished request).

    Which engine decodes the stream is the gateway's own record, read while the stream runs: its try in flight
    (``runtime.attempts``), not the response's ``x-dyad-worker`` (the first try's worker: a try moved after the
    headers, by the stall watchdog or a worker marked down, continues elsewhere), and the moment to leave is
    judged from the gateway's side and the engine's gauge, with a generous deadline, not from the client's reads
    (on a loaded machine the client lags the engine by seconds). Once, in CI, the test read
    ``num_requests_running`` 0 on the header's engine 5 lines into the stream, and took 21.6 s where it takes a
    few: the stream was not decoding on that engine by then (moved by the stall watchdog, 15 s, or already
    finished while the client lagged). The counts after the disconnect are summed over both engines, so they
    hold wherever the stream ran."""
    by_worker = {w.id: e for w in gateway.runtime.config.workers for e in vllm_engines if e.url == w.url}
    assert len(by_worker) == 2
    max_tokens = 4000  # about 50 s of decoding on these CPU engines: far more than the test waits for

    def counts() -> tuple[float, float]:
        """Generated tokens, and requests finished by reaching max_tokens, over both engines."""
        ms = [engine_metrics(e) for e in by_worker.values()]
        return (sum(m.sum("vllm:generation_tokens_total") for m in ms),
                sum(m.sum_by("finished_reason", "vllm:request_success_total").get("length", 0.0) for m in ms))

    def running() -> dict[str, float]:
        return {wid: engine_metrics(e).sum("vllm:num_requests_running") for wid, e in by_worker.items()}

    generated_before, length_before = counts()
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()  # (kept: a dropped iterator closes the response, i.e. the client leaves)
        next(lines)  # the stream has begun
        deadline = time.monotonic() + 120
        while True:  # decoding: one try in flight, it has relayed a token, and its engine runs one request
            tries = gateway.call(_tries_of(gateway, rid))
            now = running()
            if len(tries) == 1 and tries[0][1] and now[tries[0][0]] == 1:
                break
            if time.monotonic() > deadline:
                generated = counts()[0] - generated_before
                pytest.fail(f"the stream was never seen decoding on one engine: tries {tries}, running {now}, "
                            f"{generated:.0f} tokens generated of {max_tokens}")
            time.sleep(0.1)
        wid = tries[0][0]
        engine = by_worker[wid]
    # The client is gone; the engine must stop generating (not finish max_tokens).
    closed_at = time.monotonic()
    while engine_metrics(engine).sum("vllm:num_requests_running") != 0:
        if time.monotonic() > closed_at + 30:
            pytest.fail(f"engine {engine.name} ({wid}) still running the request 30 s after the client left")
        time.sleep(0.1)
    generated, length = counts()
    assert generated - generated_before < max_tokens  # stopped early: an abort, not a finished request
    assert length == length_before  # and nothing finished by running to max_tokens
    print(f"{wid} stopped {time.monotonic() - closed_at:.2f} s after the disconnect, "
          f"{generated - generated_before:.0f} tokens")


def test_responses_api_through_the_gateway_on_real_vllm(gateway: GatewayThread, vllm_engines):
    """POST /v1/responses, non-streamed and streamed, with the official client; usage counted by the gateway;
    the response id routed back to the engine that created it (vLLM without a response store answers 404
    there, in its own words, rather than the gateway guessing another engine)."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    metrics = gateway.runtime.metrics.registry

    def generated() -> float:
        return metrics.get_sample_value("dyad_request_generation_tokens_sum", {"model": MODEL}) or 0.0

    before = generated()
    whole = client.responses.create(model=MODEL, input="hello world, tell me about the cache",
                                    instructions="Answer briefly.", max_output_tokens=6,
                                    extra_body={"ignore_eos": True})
    assert whole.object == "response" and whole.output_text
    assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0
    assert generated() - before == 6
    events = list(client.responses.create(model=MODEL, input="tell me about routing", max_output_tokens=5,
                                          stream=True, extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and "error" not in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text and final.usage.output_tokens == 5
    assert generated() - before == 11
    got = httpx.get(f"{gateway.url}/v1/responses/{whole.id}", timeout=30)
    assert got.status_code == 404 and whole.id in got.json()["error"]["message"]
    assert "this gateway routes" not in got.json()["error"]["message"]  # the owning engine's answer, not ours
    unknown = httpx.get(f"{gateway.url}/v1/responses/resp_unknown", timeout=30)
    assert unknown.status_code == 404 and "this gateway routes" in unknown.json()["error"]["message"]
