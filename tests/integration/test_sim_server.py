"""The simulated engine over HTTP (real uvicorn servers on loopback, real ZMQ sockets), both dialects.

Uses the simulator on purpose: it is the subject under test."""

from __future__ import annotations

import threading
import time

import httpx
import msgpack
import pytest
import zmq

from orchestrator.sim.server import SimEngineThread


@pytest.fixture(scope="module")
def eng():
    with SimEngineThread(model="m", profile="cpu-tiny", seed=7) as e:
        yield e


@pytest.fixture(scope="module")
def client(eng):
    with httpx.Client(base_url=eng.url, timeout=30) as c:
        yield c


def sse(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:])
    return out


def test_completion_shape_usage_and_stream_equals_nonstream(client):
    body = {"model": "m", "prompt": "the quick brown fox", "max_tokens": 4}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    j = r.json()
    assert j["object"] == "text_completion" and j["model"] == "m"
    assert j["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8, "prompt_tokens_details": None}
    assert j["choices"][0]["finish_reason"] == "length" and j["kv_transfer_params"] is None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        data = sse(s.iter_lines())
    assert data[-1] == "[DONE]"
    import json

    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == j["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_stream_chunks_and_include_usage(client):
    import json

    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_completion_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        chunks = [json.loads(d) for d in sse(s.iter_lines()) if d != "[DONE]"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    # three tokens (one word each), in up to three chunks: a loaded machine was seen to get two of them
    # in one chunk (the engine sends what a step produced when it falls behind, as vLLM does)
    assert 1 <= len(content) <= 3 and len("".join(content).split()) == 3, content
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    prompt_len = client.post("/tokenize", json={"messages": body["messages"]}).json()["count"]
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_len
    r = client.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    assert r["choices"][0]["message"]["content"] == "".join(content)  # deterministic under the seed


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/v1/completions", {"model": "m", "prompt": "a", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": "m"}, 400, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, 400,
         "stream_options"),
        ("/v1/completions", {"model": "m", "prompt": "a", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": "m", "prompt": "a " * 4000, "max_tokens": 200}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         400, "messages[0].content"),  # a text-only model (orchestrator/kv/message_content.py)
    ],
)
def test_openai_shaped_errors(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]


def test_malformed_json_and_unknown_routes(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert client.get("/nope").status_code == 404
    assert client.get("/v1/completions").status_code == 405


def test_small_endpoints(client, eng):
    assert client.get("/health").status_code == 200
    assert client.get("/ping").status_code == 200
    assert client.get("/version").json() == {"version": "0.32.0"}
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "m" and models["data"][0]["max_model_len"] == 4096
    assert client.get("/load").json() == {"server_load": 0}
    tok = client.post("/tokenize", json={"model": "m", "prompt": "a b c d"}).json()
    assert tok["count"] == 4 and tok["max_model_len"] == 4096
    assert client.post("/detokenize", json={"tokens": [1, 2, 3]}).json()["prompt"].count(" ") == 2
    src = client.get("/kv_event_sources").json()
    assert src["0"]["endpoint"] == eng.kv_events_endpoint and src["0"]["publisher"] == "zmq"
    rc = client.post("/v1/completions/render", json={"model": "m", "prompt": "x y", "max_tokens": 3}).json()
    assert rc[0]["token_ids"] == tok["tokens"][:0] + client.post("/tokenize", json={"prompt": "x y"}).json()["tokens"]
    assert rc[0]["sampling_params"]["max_tokens"] == 3
    rch = client.post("/v1/chat/completions/render", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert rch["token_ids"] == client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()["tokens"]
    info = client.get("/server_info").json()
    assert info["vllm_config"]["cache_config"]["block_size"] == 32


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not found")


def test_metrics_names_types_and_prefix_counters(client):
    prompt = " ".join(f"w{i}" for i in range(300))
    before = client.get("/metrics").text
    for _ in range(2):
        assert client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2}).status_code == 200
    text = client.get("/metrics").text
    for name, typ in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                      ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries", "counter"),
                      ("vllm:prefix_cache_hits", "counter"), ("vllm:prompt_tokens", "counter"),
                      ("vllm:generation_tokens", "counter"), ("vllm:prompt_tokens_by_source", "counter"),
                      ("vllm:request_success", "counter"), ("vllm:time_to_first_token_seconds", "histogram"),
                      ("vllm:inter_token_latency_seconds", "histogram"), ("vllm:e2e_request_latency_seconds", "histogram"),
                      ("vllm:request_queue_time_seconds", "histogram"), ("vllm:request_prompt_tokens", "histogram"),
                      ("vllm:request_generation_tokens", "histogram"), ("vllm:cache_config_info", "gauge")]:
        assert f"# TYPE {name} {typ}" in text
    hits = _metric(text, "vllm:prefix_cache_hits_total", model_name="m") - _metric(before, "vllm:prefix_cache_hits_total")
    assert hits == 9 * 32  # the second request hit the 9 full blocks of the first
    assert _metric(text, "vllm:cache_config_info", block_size="32") == 1.0
    assert _metric(text, "vllm:request_success_total", finished_reason="length") >= 2


def test_kv_events_over_zmq_and_replay(client, eng):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(eng.kv_events_endpoint)
    time.sleep(0.3)  # slow joiner
    prompt = " ".join(f"z{i}" for i in range(70))  # 2 full blocks of 32
    client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
    assert sub.poll(5000)
    topic, seq_b, payload = sub.recv_multipart()
    assert topic == b"kv-events" and len(seq_b) == 8
    ts, events, dp_rank = msgpack.unpackb(payload)
    assert dp_rank == 0 and isinstance(ts, float)
    ev = events[0]
    assert ev["type"] == "BlockStored" and ev["block_size"] == 32 and len(ev["block_hashes"]) == 2
    assert ev["token_ids"] == client.post("/tokenize", json={"prompt": prompt}).json()["tokens"][:64]
    seq = int.from_bytes(seq_b, "big")
    sub.close()
    # replay from the start: everything buffered, in order, then the end marker
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(eng.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while True:
        assert dealer.poll(5000)
        frames = dealer.recv_multipart()
        assert frames[0] == b""
        s = int.from_bytes(frames[2], "big", signed=True)
        if s == -1:
            break
        seqs.append(s)
    dealer.close()
    assert seqs == list(range(len(seqs))) and seq in seqs


def test_client_disconnect_aborts_in_core(client, eng):
    before = eng.call(lambda: eng.model.stats.request_success["abort"])
    with client.stream("POST", "/v1/completions",
                       json={"model": "m", "prompt": "long one", "max_tokens": 2000, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.time() + 5
    while time.time() < deadline:
        if eng.call(lambda: eng.model.stats.request_success["abort"]) > before:
            break
        time.sleep(0.05)
    assert eng.call(lambda: eng.model.stats.request_success["abort"]) == before + 1
    assert eng.call(lambda: eng.model.num_running) == 0


def test_fail_next_fault(client):
    client.post("/sim/faults", json={"fail_next": 1})
    r = client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    assert client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 1}).status_code == 200


# ----------------------------------------------------------------------------- P/D, vLLM dialect
def test_vllm_pd_two_step_exchange():
    with SimEngineThread(model="m", profile="cpu-tiny", kv_events=False) as p, \
            SimEngineThread(model="m", profile="cpu-tiny", kv_events=False) as d, httpx.Client(timeout=30) as c:
        prompt = " ".join(f"p{i}" for i in range(400))
        body = {"model": "m", "prompt": prompt, "max_tokens": 6}
        step1 = c.post(p.url + "/v1/completions", headers={"X-Request-Id": "abc"}, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                            "remote_engine_id": None, "remote_block_ids": None,
                                                            "remote_host": None, "remote_port": None}}).json()
        kvp = step1["kv_transfer_params"]
        assert kvp["do_remote_prefill"] is True and kvp["remote_block_ids"] and kvp["remote_port"] == p.port
        assert p.call(lambda: p.model.kv_usage) > 0  # pinned under a lease
        t0 = time.time()
        r = c.post(d.url + "/v1/completions", headers={"X-Request-Id": "abc"},
                   json={**body, "kv_transfer_params": kvp})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        assert time.time() - t0 < 0.4  # no local prefill of 400 tokens × 0.26 ms + steps
        m = c.get(d.url + "/metrics").text
        assert _metric(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 400
        assert _metric(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
        assert p.call(lambda: p.model.kv_usage) == 0  # the pull released the lease
        # the same lease cannot be pulled twice → fail after the pull timeout
        d.config.kv_pull_timeout_s = 0.3
        r = c.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": kvp})
        assert r.status_code == 500 and "KV transfer" in r.json()["error"]["message"]


def test_vllm_pd_prefill_gone_fails_or_recomputes():
    with SimEngineThread(model="m", profile="zero", kv_events=False, kv_pull_timeout_s=0.3) as d, \
            httpx.Client(timeout=30) as c:
        kvp = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "x",
               "remote_request_id": "gone", "remote_host": "127.0.0.1", "remote_port": 9}
        t0 = time.time()
        r = c.post(d.url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2,
                                                    "kv_transfer_params": kvp})
        assert r.status_code == 500 and time.time() - t0 >= 0.3
        assert c.get(d.url + "/health").status_code == 200  # stays healthy
        d.config.kv_load_failure_policy = "recompute"
        r = c.post(d.url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2,
                                                    "kv_transfer_params": kvp})
        assert r.status_code == 200
        assert _metric(c.get(d.url + "/metrics").text, "vllm:prompt_tokens_by_source_total",
                       source="local_compute") == 2


# ----------------------------------------------------------------------------- SGLang dialect
def test_sglang_dialect_surface():
    with SimEngineThread(model="s", profile="cpu-tiny", dialect="sglang", kv_events=False) as e, \
            httpx.Client(base_url=e.url, timeout=30) as c:
        r = c.post("/generate", json={"text": "hello world", "sampling_params": {"max_new_tokens": 3}}).json()
        assert len(r["output_ids"]) == 3 and r["meta_info"]["finish_reason"]["type"] == "length"
        assert r["meta_info"]["prompt_tokens"] == 2
        with c.stream("POST", "/generate", json={"text": "hello world", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 3}}) as s:
            data = sse(s.iter_lines())
        import json

        # One chunk per emitted batch: 3 tokens arrive in up to 3 chunks (fewer when the machine is so loaded
        # that the engine loop emits several tokens in one wake-up), then [DONE].
        assert data[-1] == "[DONE]" and 2 <= len(data) <= 4
        assert json.loads(data[-2])["text"] == r["text"]  # cumulative text, like SGLang
        assert len(json.loads(data[-2])["output_ids"]) >= 1
        assert c.post("/generate", json={"sampling_params": {}}).status_code == 400
        m = c.get("/metrics").text
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                     "sglang:gen_throughput", "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                     "sglang:e2e_request_latency_seconds", "sglang:num_prefill_prealloc_queue_reqs",
                     "sglang:num_decode_prealloc_queue_reqs", "sglang:cache_config_info"):
            assert f"# TYPE {name} " in m
        assert "vllm:" not in m
        info = c.get("/get_server_info").json()
        assert info["page_size"] == 32 and c.get("/server_info").json() == info | {"internal_states": info["internal_states"]}
        assert c.get("/get_model_info").json()["model_path"] == "s" and c.get("/model_info").status_code == 200
        assert c.get("/get_load").json()[0]["num_reqs"] == 0
        ok = c.post("/v1/chat/completions", json={"model": "s", "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 2})
        assert ok.status_code == 200


def test_sglang_pd_dual_dispatch_and_lost_bootstrap():
    with SimEngineThread(model="s", profile="cpu-tiny", dialect="sglang", kv_events=False,
                         disaggregation_mode="prefill") as p, \
            SimEngineThread(model="s", profile="cpu-tiny", dialect="sglang", kv_events=False,
                            disaggregation_mode="decode", bootstrap_timeout_s=0.5) as d, httpx.Client(timeout=30) as c:
        boot_port = c.get(p.url + "/server_info").json()["disaggregation_bootstrap_port"]
        body = {"model": "s", "prompt": " ".join(f"q{i}" for i in range(300)), "max_tokens": 5,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": boot_port, "bootstrap_room": 12345}
        results = {}

        def call(name, url):
            results[name] = c.post(url + "/v1/completions", json=body)

        th = [threading.Thread(target=call, args=("d", d.url)), threading.Thread(target=call, args=("p", p.url))]
        for t in th:
            t.start()
        for t in th:
            t.join()
        assert results["p"].status_code == 200 and results["d"].status_code == 200
        assert results["d"].json()["usage"]["completion_tokens"] == 5
        dm = c.get(d.url + "/metrics").text
        assert _metric(dm, "sglang:prompt_tokens_total") == 300
        assert p.call(lambda: p.model.kv_usage) == 0  # the decode side took the KV
        # lost bootstrap: nobody prefills room 999 → the decode side fails after its timeout
        t0 = time.time()
        r = c.post(d.url + "/v1/completions", json={**body, "bootstrap_room": 999})
        assert r.status_code == 500 and "bootstrap_room=999" in r.json()["error"]["message"]
        assert 0.5 <= time.time() - t0 < 5
        assert c.post(d.url + "/v1/completions", json={"model": "s", "prompt": "a"}).status_code == 400
