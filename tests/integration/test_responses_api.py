"""``/v1/responses`` through a real gateway (uvicorn, loopback) in front of simulated engines.

``dyad sim-engine`` stands in for vLLM here: it serves the Responses API in vLLM 0.32's event
grammar and misbehaves on cue (``POST /sim/faults {"responses_fault": ...}``: a stream that ends
without a terminal event, a reset, garbage, a hang, a 200 JSON error body, the engine's own error
event), which a real vLLM cannot do on demand. The real-vLLM check of the same route is
``test_vllm_gateway.py::test_responses_api_through_the_gateway_on_real_vllm`` (marker ``vllm``).

Checked: every way the stream can end (complete, engine error event, or the gateway's ``event:
error`` + ``response.failed`` after EOF, reset, garbage, stall; failover before the first byte on a
200 JSON error body), usage counted into the token histograms and the access log, internal fields
refused, response ids routed to the engine that created them (GET, cancel, previous_response_id),
and prefix-aware routing on ``instructions``/``input``.
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from tests.fixtures.redis import redis_server, unique_prefix  # noqa: F401

MODEL = "tiny"


@pytest.fixture(scope="module")
def engines():
    engs = [SimEngineThread(model=MODEL, profile="cpu-tiny", seed=i, kv_events=False).start() for i in range(2)]
    try:
        yield engs
    finally:
        for e in engs:
            e.stop()


@pytest.fixture(autouse=True)
def no_faults(engines):
    yield
    for e in engines:
        httpx.post(f"{e.url}/sim/faults", json={"responses_fault": None, "responses_fault_after": 0}, timeout=5)


def fault(engine, mode, after=2):
    r = httpx.post(f"{engine.url}/sim/faults", json={"responses_fault": mode, "responses_fault_after": after},
                   timeout=5)
    assert r.status_code == 200, r.text


@contextlib.contextmanager
def gateway(engines, tmp_path, **sections):
    cfg = {
        "models": [{"name": MODEL}],
        "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "models": [MODEL]} for i, e in enumerate(engines)],
        "router": {"policy": "round_robin", "debug_headers": True},
        "health": {"interval_s": 30},
        "resilience": {"backoff_base_s": 0, "stream_idle_timeout_s": 1.0},
        "access_log": {"enabled": True, "output": str(tmp_path / "access.log"), "format": "json"},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    gw = GatewayThread(load_config(cfg, environ={})).start()
    try:
        yield gw
    finally:
        gw.stop()


def access(tmp_path, rid, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = tmp_path / "access.log"
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["request_id"] == rid:
                    return rec
        time.sleep(0.05)
    raise AssertionError(f"no access-log record for {rid}")


def sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.split("\n\n"):
        name = data = None
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:].strip())
        if name is not None or data is not None:
            out.append((name, data))
    return out


def create(gw, stream=False, rid=None, **extra):
    body = {"model": MODEL, "input": "hello there", "instructions": "answer briefly", "max_output_tokens": 6,
            "stream": stream, **extra}
    headers = {"x-request-id": rid} if rid else {}
    return httpx.post(f"{gw.url}/v1/responses", json=body, headers=headers, timeout=30)


def sample(gw, name, labels):
    return gw.runtime.metrics.registry.get_sample_value(name, labels) or 0.0


def test_non_streamed_response_counts_usage_and_its_id_lives_on_its_engine(engines, tmp_path):
    with gateway(engines, tmp_path) as gw:
        gen_before = sample(gw, "dyad_request_generation_tokens_sum", {"model": MODEL})
        prompt_before = sample(gw, "dyad_request_prompt_tokens_sum", {"model": MODEL})
        r = create(gw, rid="resp-whole")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "response" and body["output"][0]["content"][0]["text"]
        usage = body["usage"]
        owner = r.headers["x-dyad-worker"]
        assert sample(gw, "dyad_request_generation_tokens_sum", {"model": MODEL}) - gen_before == usage["output_tokens"]
        assert sample(gw, "dyad_request_prompt_tokens_sum", {"model": MODEL}) - prompt_before == usage["input_tokens"]
        assert sample(gw, "dyad_requests_total", {"model": MODEL, "endpoint": "responses", "status": "200"}) >= 1
        rec = access(tmp_path, "resp-whole")
        assert (rec["endpoint"], rec["status"], rec["stream"], rec["error_class"]) == ("/v1/responses", 200, False, None)
        assert rec["prompt_tokens"] == usage["input_tokens"] and rec["generated_tokens"] == usage["output_tokens"]
        assert rec["workers"][0]["id"] == owner
        # The id is only on the engine that made it: every GET reaches it (round robin would miss half).
        for _ in range(4):
            got = httpx.get(f"{gw.url}/v1/responses/{body['id']}", headers={"x-request-id": "resp-get"}, timeout=10)
            assert got.status_code == 200 and got.json()["id"] == body["id"]
        rec = access(tmp_path, "resp-get")
        assert rec["workers"][0]["id"] == owner and rec["endpoint"] == "/v1/responses/{id}"
        cancel = httpx.post(f"{gw.url}/v1/responses/{body['id']}/cancel", timeout=10)
        assert cancel.status_code == 400 and "synchronous" in cancel.json()["error"]["message"]  # the engine's word
        unknown = httpx.get(f"{gw.url}/v1/responses/resp_nobody", timeout=10)
        assert unknown.status_code == 404
        err = unknown.json()["error"]
        assert "resp_nobody" in err["message"] and err["param"] == "response_id"
        assert httpx.post(f"{gw.url}/v1/responses/resp_nobody/cancel", timeout=10).status_code == 404
        # a continuation goes where the previous response is stored
        for _ in range(3):
            nxt = create(gw, previous_response_id=body["id"])
            assert nxt.status_code == 200 and nxt.headers["x-dyad-worker"] == owner
        missing = create(gw, previous_response_id="resp_gone")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"


def test_a_response_id_is_only_served_to_the_key_that_created_it(engines, tmp_path):
    import hashlib

    keys = {"team-a": "sk-a-" + "x" * 20, "team-b": "sk-b-" + "y" * 20}
    auth = {"keys": [{"name": n, "sha256": hashlib.sha256(k.encode()).hexdigest()} for n, k in keys.items()]}
    with gateway(engines, tmp_path, auth=auth) as gw:
        a = {"authorization": f"Bearer {keys['team-a']}"}
        b = {"authorization": f"Bearer {keys['team-b']}"}
        r = httpx.post(f"{gw.url}/v1/responses", headers=a, json={"model": MODEL, "input": "hi"}, timeout=30)
        assert r.status_code == 200
        rid = r.json()["id"]
        assert httpx.get(f"{gw.url}/v1/responses/{rid}", headers=a, timeout=10).status_code == 200
        assert httpx.get(f"{gw.url}/v1/responses/{rid}", headers=b, timeout=10).status_code == 404
        assert httpx.get(f"{gw.url}/v1/responses/{rid}", timeout=10).status_code == 401


def test_streamed_response_relayed_whole_with_usage_counted(engines, tmp_path):
    with gateway(engines, tmp_path) as gw:
        before = sample(gw, "dyad_request_generation_tokens_sum", {"model": MODEL})
        r = create(gw, stream=True, rid="resp-stream")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.text)
        names = [n for n, _ in events]
        assert names[0] == "response.created" and names[-1] == "response.completed" and "error" not in names
        usage = events[-1][1]["response"]["usage"]
        deltas = [d["delta"] for n, d in events if n == "response.output_text.delta"]
        assert len(deltas) == usage["output_tokens"] == 6
        assert sample(gw, "dyad_request_generation_tokens_sum", {"model": MODEL}) - before == 6
        rec = access(tmp_path, "resp-stream")
        assert rec["stream"] is True and rec["status"] == 200 and rec["error_class"] is None
        assert rec["generated_tokens"] == 6 and rec["prompt_tokens"] == usage["input_tokens"]
        assert 0 < rec["ttft_s"] <= rec["total_s"]
        got = httpx.get(f"{gw.url}/v1/responses/{events[0][1]['response']['id']}", timeout=10)
        assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == "".join(deltas)


@pytest.mark.parametrize("mode", ["eof", "reset", "garbage", "hang"])
def test_a_broken_responses_stream_ends_with_error_and_response_failed(engines, tmp_path, mode):
    for e in engines:
        fault(e, mode, after=2)
    with gateway(engines, tmp_path) as gw:
        r = create(gw, stream=True, rid=f"resp-{mode}")
        assert r.status_code == 200  # the first events had gone out: the status cannot change
        events = sse(r.text)
        names = [n for n, _ in events]
        assert names[-2:] == ["error", "response.failed"], names
        assert names.count("response.output_text.delta") == 2
        assert "response.completed" not in names
        assert not any(line.startswith("<html>") for line in r.text.split("\n"))  # garbage is never relayed
        error, failed = events[-2][1], events[-1][1]
        seqs = [d["sequence_number"] for _, d in events]
        assert seqs == list(range(len(seqs)))  # numbered on from the last event the client saw
        assert error["type"] == "error" and error["code"] == "upstream_stream_failed" and error["message"]
        created_id = events[0][1]["response"]["id"]
        assert failed["response"]["id"] == created_id and failed["response"]["status"] == "failed"
        assert failed["response"]["error"]["message"] == error["message"]
        rec = access(tmp_path, f"resp-{mode}")
        assert rec["error_class"] == "stream_failed" and rec["status"] == 502 and rec["attempts"] == 1


def test_the_engines_own_error_event_is_an_honest_end(engines, tmp_path):
    for e in engines:
        fault(e, "error_event", after=1)
    with gateway(engines, tmp_path) as gw:
        r = create(gw, stream=True, rid="resp-engine-error")
        names = [n for n, _ in sse(r.text)]
        assert names[-1] == "error" and names.count("error") == 1 and "response.failed" not in names
        rec = access(tmp_path, "resp-engine-error")
        assert rec["status"] == 200  # relayed as the engine ended it


def test_a_200_json_error_to_a_stream_request_fails_over_before_the_first_byte(engines, tmp_path):
    fault(engines[0], "json_error_200")
    with gateway(engines, tmp_path) as gw:
        for i in range(2):  # round robin: one of the two starts on the faulty engine
            r = create(gw, stream=True, rid=f"resp-json-{i}")
            names = [n for n, _ in sse(r.text)]
            assert r.status_code == 200 and names[-1] == "response.completed"
            assert r.headers["x-dyad-worker"] == "w1"
        recs = [access(tmp_path, f"resp-json-{i}") for i in range(2)]
        tried_w0 = [r for r in recs if r["workers"][0]["id"] == "w0"]
        assert tried_w0 and all(r["attempts"] == 2 and r["workers"][1]["id"] == "w1" for r in tried_w0)
        fault(engines[1], "json_error_200")
        r = create(gw, stream=True)
        assert r.status_code >= 500 and "simulated engine error" in r.json()["error"]["message"]


def test_garbage_for_a_non_streamed_response_is_a_502_after_trying_elsewhere(engines, tmp_path):
    for e in engines:
        fault(e, "garbage")
    with gateway(engines, tmp_path) as gw:
        r = create(gw, rid="resp-garbage")
        assert r.status_code == 502 and r.json()["error"]["code"] == "bad_engine_answer"
        assert access(tmp_path, "resp-garbage")["attempts"] == 2


@pytest.mark.parametrize("field,value", [("kv_transfer_params", {"do_remote_prefill": True}),
                                         ("bootstrap_host", "10.0.0.1"), ("request_id", "resp_someone_elses")])
def test_internal_fields_are_refused_naming_the_field(engines, tmp_path, field, value):
    with gateway(engines, tmp_path) as gw:
        r = create(gw, **{field: value})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "internal_field"
        assert not any(field in h for e in engines for h in list(e.app.received_headers)[-1:])


@pytest.mark.parametrize("body,param", [({"model": MODEL}, "input"), ({"model": MODEL, "input": 3}, "input"),
                                        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                                        ({"model": MODEL, "input": "x", "instructions": ["a"]}, "instructions"),
                                        ({"model": MODEL, "input": "x", "previous_response_id": 7},
                                         "previous_response_id"),
                                        ({"input": "x"}, "model")])
def test_bad_bodies_get_a_400_naming_the_field(engines, tmp_path, body, param):
    with gateway(engines, tmp_path) as gw:
        r = httpx.post(f"{gw.url}/v1/responses", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_prefix_aware_routing_reads_instructions_and_input(tmp_path):
    engs = [SimEngineThread(model=MODEL, profile="cpu-tiny", seed=i, kv_events=True).start() for i in range(3)]
    workers = [{"id": f"k{i}", "url": e.url, "engine": "sim", "models": [MODEL],
                "kv_events": {"endpoint": e.kv_events_endpoint, "replay_endpoint": e.replay_endpoint}}
               for i, e in enumerate(engs)]
    cfg = load_config({"models": [{"name": MODEL, "block_size": 32}], "workers": workers,
                       "router": {"policy": "kv_aware", "debug_headers": True}, "health": {"interval_s": 1.0}},
                      environ={})
    gw = GatewayThread(cfg).start()
    try:
        system = " ".join(f"rule{i}" for i in range(640))  # 20 blocks of the sim's one-token words
        first = httpx.post(f"{gw.url}/v1/responses", timeout=30, json={
            "model": MODEL, "instructions": system, "input": "question one", "max_output_tokens": 2})
        assert first.status_code == 200
        owner = first.headers["x-dyad-worker"]
        deadline = time.monotonic() + 10
        second = None
        while time.monotonic() < deadline:  # until the engine's KV events reach the index
            second = httpx.post(f"{gw.url}/v1/responses", timeout=30, json={
                "model": MODEL, "instructions": system,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "question two"}]}],
                "max_output_tokens": 2})
            if int(second.headers["x-dyad-predicted-cached-tokens"]) > 0:
                break
            time.sleep(0.1)
        assert second is not None and second.status_code == 200
        assert int(second.headers["x-dyad-predicted-cached-tokens"]) >= 600
        assert second.headers["x-dyad-worker"] == owner
        # the engine's own counter agrees: the shared instructions were a cache hit there
        usage = second.json()["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= 600
    finally:
        gw.stop()
        for e in engs:
            e.stop()


def test_a_replayed_stream_comes_from_its_engine_and_ends_by_the_same_rule(engines, tmp_path):
    with gateway(engines, tmp_path) as gw:
        r = create(gw, stream=True)
        original = sse(r.text)
        rid = original[0][1]["response"]["id"]
        owner = engines[int(r.headers["x-dyad-worker"].removeprefix("w"))]
        replay = httpx.get(f"{gw.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 5}, timeout=10)
        assert replay.status_code == 200 and replay.headers["content-type"].startswith("text/event-stream")
        assert sse(replay.text) == original[6:]  # every event after sequence number 5, ending with completed
        fault(owner, "eof", after=3)
        cut = httpx.get(f"{gw.url}/v1/responses/{rid}", params={"stream": "true"}, headers={"x-request-id": "replay"},
                        timeout=10)
        events = sse(cut.text)
        assert [n for n, _ in events[:3]] == [n for n, _ in original[:3]]
        assert [n for n, _ in events[3:]] == ["error", "response.failed"]
        assert events[-1][1]["response"]["id"] == rid and events[-1][1]["sequence_number"] == 4
        rec = access(tmp_path, "replay")
        assert rec["stream"] is True and rec["error_class"] == "stream_failed" and rec["status"] == 502
        assert rec["workers"] == [{"id": f"w{engines.index(owner)}", "role": "both"}]


def test_a_stream_that_breaks_before_its_first_token_starts_again_elsewhere(engines, tmp_path):
    """The opening events (created, in_progress, ...) are held back until the first token, so a worker that
    fails before it costs the client nothing: the stream starts over on another worker."""
    fault(engines[0], "reset", after=0)
    with gateway(engines, tmp_path) as gw:
        before = sample(gw, "dyad_stream_failovers_total", {"outcome": "restarted"})
        recs = []
        for i in range(2):
            r = create(gw, stream=True, rid=f"resp-restart-{i}")
            events = sse(r.text)
            names = [n for n, _ in events]
            assert names[0] == "response.created" and names[-1] == "response.completed" and "error" not in names
            assert names.count("response.created") == 1  # one stream, as if the first worker had never been tried
            assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
            recs.append(access(tmp_path, f"resp-restart-{i}"))
        restarted = [r for r in recs if r["attempts"] == 2]
        assert restarted and all([w["id"] for w in r["workers"]] == ["w0", "w1"] for r in restarted)
        assert all(r["status"] == 200 and r["error_class"] is None for r in recs)
        assert sample(gw, "dyad_stream_failovers_total", {"outcome": "restarted"}) - before == len(restarted)
        # the generated tokens of a restarted stream are the second worker's, counted once
        assert all(r["generated_tokens"] == 6 for r in recs)
        fault(engines[1], "eof", after=0)
        r = create(gw, stream=True, rid="resp-restart-none")
        names = [n for n, _ in sse(r.text)]
        assert names == ["error", "response.failed"]  # nothing of either broken stream reached the client
        events = sse(r.text)
        assert "before its first token" in events[0][1]["message"]  # (w0 is out of rotation after its reset)
        assert access(tmp_path, "resp-restart-none")["error_class"] == "stream_failed"


def test_itl_counts_only_token_events(engines, tmp_path):
    with gateway(engines, tmp_path) as gw:
        before = sample(gw, "dyad_request_itl_seconds_count", {"model": MODEL})
        r = create(gw, stream=True)
        assert r.status_code == 200
        deltas = [n for n, _ in sse(r.text)].count("response.output_text.delta")
        # one observation per token after the first: the opening and closing events are not tokens
        assert sample(gw, "dyad_request_itl_seconds_count", {"model": MODEL}) - before == deltas - 1


@contextlib.contextmanager
def two_replicas(engines, tmp_path, index):
    """Two gateway replicas with the same ``index`` section (its Redis holds the response-owner map)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with gateway(engines, tmp_path / "a", index=index) as a, gateway(engines, tmp_path / "b", index=index) as b:
        yield a, b


def created_here_found_there(a, b) -> tuple[str, str]:
    """A response created through replica ``a`` is read (three times) and continued through ``b``, each
    time on the engine that created it. Returns the response's id and the continuation's."""
    r = create(a)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    for _ in range(3):
        got = httpx.get(f"{b.url}/v1/responses/{rid}", timeout=10)
        assert got.status_code == 200 and got.json()["id"] == rid, got.text
    nxt = create(b, previous_response_id=rid)
    assert nxt.status_code == 200 and nxt.headers["x-dyad-worker"] == r.headers["x-dyad-worker"], nxt.text
    return rid, nxt.json()["id"]


@pytest.mark.redis
def test_gateway_replicas_share_response_ids_through_redis(engines, tmp_path, redis_server):  # noqa: F811
    """Two gateway replicas on one Redis (``index.backend: redis``, real redis-server): a response created
    through one is found through the other (GET and previous_response_id); Redis holds digests only."""
    prefix = unique_prefix("resp")
    with two_replicas(engines, tmp_path, {"backend": "redis", "redis_url": redis_server.url,
                                          "key_prefix": prefix}) as (a, b):
        rid, _ = created_here_found_there(a, b)
        import redis

        keys = redis.Redis.from_url(redis_server.url).keys(f"{prefix}:resp:*")
        assert len(keys) == 2 and all(rid.encode() not in k for k in keys)  # digests, not the ids
        assert httpx.get(f"{b.url}/v1/responses/resp_other", timeout=10).status_code == 404


@pytest.mark.redis
def test_gateway_replicas_share_response_ids_through_redis_cluster(engines, tmp_path):
    """Two gateway replicas on a real 3-node Redis Cluster (``index.backend: redis_cluster``,
    tests/fixtures/redis_cluster.py): a response created through one is found through the other; each
    id is one hash-tagged key (``<prefix>:resp:{<digest>}``) with the 24 h TTL, digests only. With the
    node holding that key's slot killed, the creating replica still routes the id (best effort, bounded),
    the other answers 404 naming it, never a 5xx."""
    import redis
    from redis.cluster import key_slot

    from orchestrator.gateway.responses_api import OWNERS_TTL_S, _key
    from tests.fixtures.redis_cluster import RedisCluster

    with RedisCluster(primaries=3, replicas=0) as cl:
        prefix = unique_prefix("cresp")
        with two_replicas(engines, tmp_path, {"backend": "redis_cluster", "redis_url": cl.url,
                                              "key_prefix": prefix}) as (a, b):
            rid, nid = created_here_found_there(a, b)
            keys: dict[bytes, int] = {}  # key → the port of the primary that holds it
            for port in cl.ports:
                node = redis.Redis(port=port)
                keys.update({k: port for k in node.keys(f"{prefix}:resp:*")})
                node.close()
            assert len(keys) == 2 and all(rid.encode() not in k and nid.encode() not in k for k in keys)
            for k, port in keys.items():
                tag = k.decode().split(":resp:", 1)[1]
                assert tag.startswith("{") and tag.endswith("}") and len(tag) == 2 + 32  # {16-byte digest}
                node = redis.Redis(port=port)
                assert key_slot(k) == key_slot(tag[1:-1].encode())  # the digest alone picks the slot
                assert 0 < node.ttl(k) <= OWNERS_TTL_S
                node.close()
            assert httpx.get(f"{b.url}/v1/responses/resp_other", timeout=10).status_code == 404
            # The node holding the first id's key dies (no replica): best effort from here on.
            cl.kill(keys[b.runtime.response_owners.shared._name(_key(rid)).encode()])
            for _ in range(2):  # a created rid: it routes it from its own map
                assert httpx.get(f"{a.url}/v1/responses/{rid}", timeout=10).status_code == 200
            gone = httpx.get(f"{b.url}/v1/responses/{rid}", timeout=10)  # b never saw rid created
            assert gone.status_code == 404 and rid in gone.json()["error"]["message"], gone.text
            assert httpx.get(f"{b.url}/v1/responses/{nid}", timeout=10).status_code == 200  # b's own id


def test_with_redis_unreachable_a_replica_still_routes_the_ids_it_saw(engines, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = {"index": {"backend": "redis", "redis_url": f"redis://127.0.0.1:{port}/0", "key_prefix": "x"}}
    with gateway(engines, tmp_path, **down) as gw:
        r = create(gw)
        assert r.status_code == 200
        for _ in range(2):
            assert httpx.get(f"{gw.url}/v1/responses/{r.json()['id']}", timeout=10).status_code == 200
        assert httpx.get(f"{gw.url}/v1/responses/resp_unknown", timeout=10).status_code == 404


def _keyed_auth(name: str, secret: str, **limits) -> tuple[dict, dict]:
    """An ``auth`` section with one key (and its limits) and the headers that present it."""
    import hashlib

    return ({"keys": [{"name": name, "sha256": hashlib.sha256(secret.encode()).hexdigest(), **limits}]},
            {"authorization": f"Bearer {secret}"})


def test_reading_and_cancelling_stored_responses_draw_on_the_keys_request_budget(engines, tmp_path):
    """GET /v1/responses/{id} and POST .../cancel take a request from the key's rpm bucket like a create:
    past it, an OpenAI-style 429 with Retry-After, logged, before the owner map or an engine is asked."""
    auth, key = _keyed_auth("reader", "sk-reader-" + "r" * 20, rpm=4)
    with gateway(engines, tmp_path, auth=auth) as gw:
        r = httpx.post(f"{gw.url}/v1/responses", headers=key, json={"model": MODEL, "input": "hi"}, timeout=30)
        assert r.status_code == 200, r.text  # 1 of 4
        rid = r.json()["id"]
        got = httpx.get(f"{gw.url}/v1/responses/{rid}", headers=key, timeout=10)  # 2
        assert got.status_code == 200 and got.headers["x-ratelimit-limit-requests"] == "4"
        assert got.headers["x-ratelimit-remaining-requests"] == "2"
        assert httpx.post(f"{gw.url}/v1/responses/{rid}/cancel", headers=key, timeout=10).status_code == 400  # 3
        assert httpx.get(f"{gw.url}/v1/responses/{rid}", headers=key, timeout=10).status_code == 200  # 4
        for i, (method, suffix) in enumerate((("GET", ""), ("POST", "/cancel"))):
            refused = httpx.request(method, f"{gw.url}/v1/responses/{rid}{suffix}", timeout=10,
                                    headers={**key, "x-request-id": f"refused-{i}"})
            assert refused.status_code == 429, refused.text
            err = refused.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "rpm_exceeded" and "reader" in err["message"]
            assert int(refused.headers["retry-after"]) >= 1
            rec = access(tmp_path, f"refused-{i}")
            assert (rec["status"], rec["error_class"], rec["client_key_id"]) == (429, "rpm_exceeded", "reader")
            assert rec["workers"] == [] and rec["attempts"] == 0  # no engine was asked
        # the budget is the key's: a create is refused too
        assert httpx.post(f"{gw.url}/v1/responses", headers=key, json={"model": MODEL, "input": "hi"},
                          timeout=30).status_code == 429


def test_reading_a_stored_response_counts_as_one_of_the_clients_concurrent_requests(engines, tmp_path):
    """``limits.max_concurrent_per_client``: a GET by id while the same key has a stream open is refused
    (429 naming the limit); once that stream is over, and after each GET, the count is back down."""
    auth, key = _keyed_auth("one-at-a-time", "sk-single-" + "s" * 20)
    with gateway(engines, tmp_path, auth=auth, limits={"max_concurrent_per_client": 1},
                 resilience={"stream_idle_timeout_s": 30.0}) as gw:
        r = httpx.post(f"{gw.url}/v1/responses", headers=key, json={"model": MODEL, "input": "hi"}, timeout=30)
        rid = r.json()["id"]
        for _ in range(3):  # each GET gave its place back when its answer was over
            assert httpx.get(f"{gw.url}/v1/responses/{rid}", headers=key, timeout=10).status_code == 200
        for e in engines:
            fault(e, "hang", after=2)
        body = {"model": MODEL, "input": "hold on", "stream": True, "max_output_tokens": 6}
        with httpx.stream("POST", f"{gw.url}/v1/responses", headers=key, json=body, timeout=30) as held:
            assert held.status_code == 200
            chunks = held.iter_raw()  # (kept: a dropped iterator closes the stream)
            assert b"response.output_text.delta" in next(chunks)  # under way; its engine now sends nothing more
            for _ in range(2):  # (a refusal gives back no place it did not take: the stream still holds one)
                busy = httpx.get(f"{gw.url}/v1/responses/{rid}", headers=key, timeout=10)
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "too_many_concurrent_requests"
                assert busy.headers["retry-after"]
            assert gw.runtime.intake.concurrent == {"key:one-at-a-time": 1}
        deadline = time.monotonic() + 15
        while (code := httpx.get(f"{gw.url}/v1/responses/{rid}", headers=key, timeout=10).status_code) == 429:
            assert time.monotonic() < deadline, "the client's place was never given back after it left"
            time.sleep(0.1)
        assert code == 200


def test_stored_response_routes_are_refused_while_the_gateway_drains(engines, tmp_path):
    """Like every /v1 request: once taken in, a GET or cancel is one the drain waits for (and gives its
    place back however it ends: an answer, a 404, a replayed stream); while draining, 503 + Retry-After."""
    with gateway(engines, tmp_path, gateway={"retry_after_s": 4}) as gw:
        r = create(gw, stream=True)
        rid = sse(r.text)[0][1]["response"]["id"]
        assert httpx.get(f"{gw.url}/v1/responses/{rid}", timeout=10).status_code == 200
        assert httpx.get(f"{gw.url}/v1/responses/resp_nobody", timeout=10).status_code == 404
        assert httpx.get(f"{gw.url}/v1/responses/{rid}", params={"stream": "true"}, timeout=10).status_code == 200
        assert httpx.post(f"{gw.url}/v1/responses/{rid}/cancel", timeout=10).status_code == 400
        deadline = time.monotonic() + 5
        while gw.runtime.shutdown.active:  # every one of them (and the create) counted out
            assert time.monotonic() < deadline, gw.runtime.shutdown.active
            time.sleep(0.02)
        gw.runtime.shutdown.begin()  # what the first SIGTERM does (orchestrator/gateway/shutdown.py)
        for method, suffix in (("GET", ""), ("POST", "/cancel")):
            refused = httpx.request(method, f"{gw.url}/v1/responses/{rid}{suffix}", timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down" and refused.headers["retry-after"] == "4"
        assert gw.runtime.shutdown.active == 0
