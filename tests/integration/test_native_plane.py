"""The native data plane as a whole (``gateway.data_plane: native``): what only this mode has.

The request-path suites run against this mode too (``make test``: ``pytest --data-plane native``, the same
tests and expectations as the Python plane). Here: the loopback gateway behind the plane answers only the
plane; a handler that waits (the admission queue) is finished behind the plane; a model on prefill/decode
pairs is handed over; a Python callback that fails mid-stream still ends the stream honestly.
The engines are ``dyad sim-engine`` (fault injection on cue); the plane and the gateway are real.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway import native
from orchestrator.gateway.native import lane as lane_module
from orchestrator.gateway.serve import GatewayThread
from tests.fixtures.redis import redis_server, unique_prefix  # noqa: F401
from tests.integration.test_stream_endings import (
    CHAT,
    PACED,
    body_for,
    error_ending,
    fault_for,
    pd_body,
    pd_config,
    read_stream,
    set_faults,
)


@pytest.fixture(autouse=True)
def _built() -> None:
    if native.load() is None:
        import os

        message = f"the native data plane is not built: run `{native.BUILD}`"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)


def native_config(urls: list[str], **sections: Any) -> Any:
    return load_config({
        "models": [{"name": "m"}],
        "workers": [{"id": f"w{i}", "url": u, "engine": "sim", "models": ["m"]} for i, u in enumerate(urls)],
        "router": {"policy": "round_robin", "debug_headers": True},
        "health": {"interval_s": 30},
        "gateway": {"data_plane": "native"},
        **sections,
    }, environ={})


def kv_events_config(engines: list[Any], **sections: Any) -> Any:
    """Native mode over simulated engines that publish KV events (round_robin unless ``router`` says otherwise)."""
    return load_config({
        "models": [{"name": "m", "block_size": 32}],
        "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "models": ["m"],
                     "kv_events": {"endpoint": e.kv_events_endpoint, "replay_endpoint": e.replay_endpoint}}
                    for i, e in enumerate(engines)],
        "router": {"policy": "round_robin", "debug_headers": True},
        "health": {"interval_s": 30},
        "gateway": {"data_plane": "native"},
        **sections,
    }, environ={})


def completion(url: str, **extra: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4, **extra},
                      headers=extra.pop("headers", None), timeout=30)


def test_the_gateway_behind_the_plane_answers_only_the_plane(engines):
    (engine,) = engines(1)
    with GatewayThread(native_config([engine.url])) as gw:
        lane = gw.plane.lane
        behind = f"http://127.0.0.1:{gw.plane.fallback_port}"
        assert gw.plane.fallback_port != gw.port
        # straight to the loopback port: refused, whatever is asked
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
            r = httpx.request(method, behind + path, json={"model": "m", "prompt": "x"}, timeout=10)
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["code"] == "forbidden"
        # through the plane: the same routes are served (the plane adds the secret)
        assert httpx.get(gw.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "m"
        # a client that forges the plane's headers (even the right secret, and a resume token) gets nothing of them:
        # they are stripped before anything else, so the request is served as any other
        forged = {"x-dyad-native-secret": lane.secret, "x-dyad-native-resume": "0" * 24,
                  "x-dyad-native-peer": "10.9.9.9:1"}
        r = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4},
                       headers=forged, timeout=10)
        assert r.status_code == 200, r.text
        r = httpx.get(gw.url + "/v1/models", headers=forged, timeout=10)
        assert r.status_code == 200
        assert lane.handled["native"] >= 1


def test_a_request_that_waits_in_the_admission_queue_is_finished_behind_the_plane(engines):
    """One dispatch slot per worker: a second request queues. Its handler waited, so the lane parks it as it
    stands and the Python gateway finishes it (nothing is done twice: one arrival, one answer each)."""
    (engine,) = engines(1, PACED)  # 20 tokens/s: each request holds its slot ~0.4 s
    cfg = native_config([engine.url], limits={"max_inflight_per_worker": 1, "queue_size": 4, "queue_timeout_s": 30})
    with GatewayThread(cfg) as gw:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: completion(gw.url, max_tokens=8, ignore_eos=True), range(3)))
        metrics = gw.runtime.metrics.registry
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
        assert all(len(a.json()["choices"][0]["text"].split()) == 8 for a in answers)
        assert gw.plane.lane.handled["parked"] >= 1  # at least one waited in the queue
        assert metrics.get_sample_value("dyad_native_plane_requests_total", {"way": "parked"}) >= 1
        assert metrics.get_sample_value("dyad_request_arrivals_total", {"model": "m"}) == 3
        assert metrics.get_sample_value("dyad_requests_total",
                                        {"model": "m", "endpoint": "completions", "status": "200"}) == 3


def test_a_model_on_prefill_decode_pairs_is_handed_to_the_python_gateway(engines):
    p, d = engines(2)
    cfg = pd_config(p.url, d.url)
    cfg.gateway.data_plane = "native"
    with GatewayThread(cfg) as gw:
        status, events = read_stream(gw.url, CHAT, pd_body(CHAT, 6))
        assert status == 200
        assert events[-1][1] == "[DONE]"
        assert gw.plane.lane.handled["fallback"] >= 1 and gw.plane.lane.handled["native"] == 0
        assert gw.runtime.metrics.registry.get_sample_value("dyad_native_plane_requests_total",
                                                            {"way": "handed_over"}) >= 1
        assert gw.runtime.metrics.registry.get_sample_value("dyad_pd_requests_total", {"mode": "disaggregated"}) == 1


def test_a_python_callback_that_fails_mid_stream_still_ends_the_stream_honestly(engines, monkeypatch):
    """The native counterpart of the Python plane's injected relay failure: the lane's judgment of a broken
    stream raises; the plane logs it (lane.internal_error) and ends the stream with an SSE error event."""
    calls: list[str] = []

    def broken(self: Any, *args: Any) -> Any:
        raise RuntimeError("injected lane failure")

    original = lane_module.NativeLane.internal_error

    def recorded(self: Any, where: str, exc: BaseException) -> None:
        calls.append(where)
        original(self, where, exc)

    monkeypatch.setattr(lane_module.Exchange, "stream_broken", broken)
    monkeypatch.setattr(lane_module.NativeLane, "internal_error", recorded)
    (engine,) = engines(1)
    set_faults(engine, **fault_for(CHAT, "eof", 3))
    with GatewayThread(native_config([engine.url])) as gw:
        status, events = read_stream(gw.url, CHAT, body_for(CHAT, 8))
    assert status == 200
    err = error_ending(CHAT, events, "internal gateway error")
    assert err["code"] == "internal_error"
    assert calls == ["stream_broken"]


def test_kv_aware_routing_on_kv_events_is_carried_by_the_plane_without_a_failure_or_a_leak():
    """kv_aware on engines that publish KV events: a repeated prompt's cache hit makes the prefix tracker start a
    background task (refreshing the prefix's recency) from inside ``Router.decide``, which runs on the plane's
    thread. That work is queued on the event loop (native/loop.py): every request is answered by the plane, and
    afterwards nothing is left counted in flight (the drain's count, the workers' in-flight counts)."""
    from orchestrator.sim.server import SimEngineThread

    engines = [SimEngineThread(model="m", profile="cpu-tiny", seed=i, kv_events=True).start() for i in range(2)]
    try:
        cfg = kv_events_config(engines, router={"policy": "kv_aware", "debug_headers": True})
        prompt = " ".join(f"w{i}" for i in range(300))  # 9 blocks of 32
        with GatewayThread(cfg) as gw:
            tracker = gw.runtime.prefix_tracker
            statuses, hits = [], []
            for _ in range(10):
                r = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2},
                               timeout=30)
                statuses.append(r.status_code)
                hits.append(int(r.headers.get("x-dyad-predicted-cached-tokens", "0")))
                deadline = time.monotonic() + 5  # the engine's events for this prompt, before the next request
                while not gw.call(tracker.index.worker_blocks(r.headers["x-dyad-worker"])) \
                        and time.monotonic() < deadline:
                    time.sleep(0.02)
            assert statuses == [200] * 10
            assert max(hits) > 0  # the cache hits that start the tracker's background work did happen
            assert gw.plane.lane.handled["native"] == 10  # all carried by the plane, none handed over
            rt = gw.runtime
            deadline = time.monotonic() + 5
            while (rt.shutdown.active or any(w.inflight for w in rt.fleet.workers())) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rt.shutdown.active == 0 and [w.inflight for w in rt.fleet.workers()] == [0, 0]
    finally:
        for e in engines:
            e.stop()


def nothing_left_counted(gw: GatewayThread) -> dict[str, Any]:
    """What a finished request must have given back: the drain's count, the per-client and dispatch counts, the
    workers' in-flight counts and the attempts registered in flight (polled briefly: some end on the loop)."""
    rt = gw.runtime

    def counts() -> dict[str, Any]:
        return {"active": rt.shutdown.active, "clients": sum(rt.intake.concurrent.values()),
                "inflight": sum(w.inflight for w in rt.fleet.workers()), "attempts": len(rt.attempts)}

    deadline = time.monotonic() + 5
    while any(counts().values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return counts()


@pytest.mark.parametrize("where", ["decide", "answered", "stream_done"])
def test_a_lane_failure_answers_500_and_leaves_nothing_counted(engines, monkeypatch, where):
    """Dyad's own code failing on the plane's thread (a decision, the judgment of an answer, a stream's end):
    the client gets the plane's 500 (or the stream's internal error event), the failure is reported, and the
    request's counts are given back — a leaked count would hold a drain for its whole grace period and a client
    against its concurrency limit. The next request is served normally."""
    from orchestrator.router.router import Router

    calls: list[str] = []
    original_report = lane_module.NativeLane.internal_error
    monkeypatch.setattr(lane_module.NativeLane, "internal_error",
                        lambda self, w, exc: (calls.append(w), original_report(self, w, exc)))
    armed = {"on": True}

    def failing(original: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            if armed["on"]:
                armed["on"] = False
                raise RuntimeError(f"injected failure in {where}")
            return original(*args, **kw)
        return wrapper

    if where == "decide":
        original_decide = Router.decide

        async def decide(self: Any, *args: Any, **kw: Any) -> Any:
            if armed["on"]:
                armed["on"] = False
                raise RuntimeError("injected failure in decide")
            return await original_decide(self, *args, **kw)
        monkeypatch.setattr(Router, "decide", decide)
    else:
        monkeypatch.setattr(lane_module.Exchange, where, failing(getattr(lane_module.Exchange, where)))
    (engine,) = engines(1)
    cfg = native_config([engine.url], limits={"max_concurrent_per_client": 1})
    with GatewayThread(cfg) as gw:
        if where == "stream_done":
            status, events = read_stream(gw.url, CHAT, body_for(CHAT, 4))
            assert status == 200 and events[-1][1] == "[DONE]"  # the stream itself was whole: its tokens all came
        else:
            r = completion(gw.url)
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        assert calls and not armed["on"]
        assert nothing_left_counted(gw) == {"active": 0, "clients": 0, "inflight": 0, "attempts": 0}
        again = completion(gw.url)
        assert again.status_code == 200, again.text


def test_log_lines_from_the_planes_thread_carry_their_own_requests_id(engines, caplog):
    """The plane's thread runs many requests' callbacks in turn: each runs with its own request's id (and model)
    on its log lines, as the Python gateway does. Two requests overlap (a paced engine: both are admitted before
    either is answered); the access log, written through the `dyad.access` logger when each answer is judged,
    must carry the same request id in its record as in its fields."""
    import logging

    from orchestrator.telemetry.logging import RequestContextFilter

    caplog.handler.addFilter(RequestContextFilter())  # (what `dyad serve`'s log handler has: the bound id, fields)
    (engine,) = engines(1, PACED)
    cfg = native_config([engine.url], access_log={"enabled": True, "output": "logger"})
    with caplog.at_level(logging.INFO, logger="dyad.access"), GatewayThread(cfg) as gw:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda i: completion(gw.url, max_tokens=6, ignore_eos=True,
                                                         headers={"x-request-id": f"req-{i}"}), range(3)))
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert gw.plane.lane.handled["native"] == 3
    records = [r for r in caplog.records if r.name == "dyad.access"]
    assert sorted(r.access["request_id"] for r in records) == ["req-0", "req-1", "req-2"]
    assert [r.request_id for r in records] == [r.access["request_id"] for r in records]
    assert [getattr(r, "model", None) for r in records] == ["m", "m", "m"]


def test_clients_behind_a_trusted_proxy_are_told_apart_by_the_plane(engines):
    """A gateway behind a local proxy (loopback is trusted by default, as uvicorn's proxy-headers middleware
    has it): the plane's requests name their client by X-Forwarded-For like the Python gateway's, so
    ``limits.max_concurrent_per_client`` counts each forwarded client on its own (two clients at once: both
    served; one client twice at once: the second refused), and a forwarded client on the fallback's routes is
    the forwarded one, not the plane."""
    (engine,) = engines(1, PACED)  # each request holds ~0.3 s
    cfg = native_config([engine.url], limits={"max_concurrent_per_client": 1})
    with GatewayThread(cfg) as gw:
        def ask(client: str) -> httpx.Response:
            return completion(gw.url, max_tokens=6, ignore_eos=True, headers={"x-forwarded-for": client})

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            two = sorted(r.status_code for r in pool.map(ask, ["198.51.100.1", "198.51.100.2"]))
            same = sorted(r.status_code for r in pool.map(ask, ["198.51.100.3", "198.51.100.3"]))
        assert two == [200, 200]
        assert same == [200, 429]
        assert gw.plane.lane.handled["native"] >= 3


@pytest.mark.redis
@pytest.mark.parametrize("uses", ["limits", "index"])
def test_requests_that_use_redis_are_finished_on_the_loop_and_redis_answers_them(redis_server, uses):  # noqa: F811
    """Rate limits or the prefix index on Redis: the client library bounds its calls with asyncio.timeout, which
    needs a task, and the plane's thread has none. Such a handler moves to the event loop before its first
    Redis call (loop_thread.on_loop_thread): the lane parks it and the Python gateway finishes it. Redis is
    used, not bypassed: the bucket's keys are in Redis and the limiter never falls back to local buckets; the
    repeated prompt's prefix is found in the Redis index and no lookup fails."""
    import redis as redis_lib

    from orchestrator.gateway.auth import hash_key
    from orchestrator.sim.server import SimEngineThread

    prefix = unique_prefix("native-redis")
    engines = [SimEngineThread(model="m", profile="cpu-tiny", seed=i, kv_events=True).start() for i in range(2)]
    try:
        sections: dict[str, Any] = {
            "limits": {"auth": {"keys": [{"name": "team", "sha256": hash_key("team-key"), "rpm": 100}]},
                       "limits": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": prefix}},
            "index": {"router": {"policy": "kv_aware", "debug_headers": True},
                      "index": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": prefix}},
        }[uses]
        cfg = kv_events_config(engines, **sections)
        prompt = " ".join(f"r{i}" for i in range(300))
        with GatewayThread(cfg) as gw:
            hits = []
            for _ in range(6):
                r = httpx.post(gw.url + "/v1/completions", headers={"authorization": "Bearer team-key"},
                               json={"model": "m", "prompt": prompt, "max_tokens": 2}, timeout=30)
                assert r.status_code == 200, r.text
                hits.append(int(r.headers["x-dyad-predicted-cached-tokens"]))
                time.sleep(0.3)  # (the engine's KV events reach the index)
            if uses == "limits":
                assert redis_lib.Redis.from_url(redis_server.url).keys(f"{prefix}:rl:*")  # the bucket is in Redis
                assert not gw.runtime.intake.limiter._redis_down
                assert gw.runtime.metrics.registry.get_sample_value("dyad_rate_limit_local_fallbacks_total") == 0
            else:
                assert max(hits) > 0  # the prefix was found in the Redis index
                assert gw.runtime.prefix_tracker.annotate_failures == 0
            assert gw.plane.lane.handled["parked"] == 6  # each moved to the loop before its first Redis call
            assert nothing_left_counted(gw) == {"active": 0, "clients": 0, "inflight": 0, "attempts": 0}
    finally:
        for e in engines:
            e.stop()


def test_a_role_change_hands_the_models_requests_over_and_back(engines):
    """The plane carries requests only while the fleet has no prefill/decode split (known per fleet change,
    not walked per request). A worker moved to the decode role through the admin API: the next requests are
    handed to the Python gateway (pairs); moved back: the plane carries them again."""
    a, b = engines(2)
    admin = {"authorization": "Bearer native-admin"}
    cfg = native_config([a.url, b.url], gateway={"data_plane": "native", "admin_token": "native-admin"})
    with GatewayThread(cfg) as gw:
        lane = gw.plane.lane

        def served(n: int) -> dict[str, int]:
            before = dict(lane.handled)
            for _ in range(n):
                r = completion(gw.url)
                assert r.status_code == 200, r.text
            return {k: lane.handled[k] - before[k] for k in ("native", "fallback")}

        assert served(4) == {"native": 4, "fallback": 0}
        r = httpx.post(f"{gw.url}/admin/workers/w1/role", json={"role": "decode", "wait": True}, headers=admin,
                       timeout=30)
        assert r.status_code == 200, r.text
        assert served(4) == {"native": 0, "fallback": 4}
        r = httpx.post(f"{gw.url}/admin/workers/w1/role", json={"role": "both", "wait": True}, headers=admin,
                       timeout=30)
        assert r.status_code == 200, r.text
        assert served(4) == {"native": 4, "fallback": 0}


def test_a_decision_that_waits_is_finished_on_the_loop_and_the_plane_carries_the_request(engines, monkeypatch):
    """A decision that waits (a tracker hook on a remote store would): the lane cannot park it half made, so the
    event loop finishes it and the plane's thread waits for the decision; the request is then carried natively
    and answered, with nothing left counted."""
    import asyncio

    from orchestrator.router.router import Router

    original = Router.decide
    waited = []

    async def decide(self: Any, *args: Any, **kw: Any) -> Any:
        await asyncio.sleep(0.01)  # (suspends: a timer on the loop)
        waited.append(True)
        return await original(self, *args, **kw)

    monkeypatch.setattr(Router, "decide", decide)
    (engine,) = engines(1)
    with GatewayThread(native_config([engine.url])) as gw:
        answers = [completion(gw.url) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
        assert len(waited) == 3 and gw.plane.lane.handled["native"] == 3
        assert nothing_left_counted(gw) == {"active": 0, "clients": 0, "inflight": 0, "attempts": 0}


@pytest.mark.redis
@pytest.mark.parametrize("parked", ["admitted", "handler"])
def test_parked_work_the_plane_never_hands_over_is_given_up_without_a_leak(engines, redis_server, parked):  # noqa: F811
    """The lane parks a request for the Python gateway (an admitted request on prefill/decode pairs; a handler
    that moved to the loop before its Redis call) and the plane forwards it with a resume token. If that never
    arrives (the client left before the hand-over, the loopback refused it), the parked work expires after
    ``RESUME_TTL_S`` and ends as a request whose client left: nothing stays counted (drain, client, slot)."""
    import orjson

    from orchestrator.gateway.auth import hash_key

    if parked == "admitted":
        p, d = engines(2)
        cfg = pd_config(p.url, d.url)
    else:
        (engine,) = engines(1)
        cfg = native_config([engine.url], limits={"backend": "redis", "redis_url": redis_server.url,
                                                   "key_prefix": unique_prefix("native-park")},
                            auth={"keys": [{"name": "team", "sha256": hash_key("team-key"), "rpm": 100}]})
    cfg.gateway.data_plane = "native"
    cfg.limits.max_concurrent_per_client = 4
    with GatewayThread(cfg) as gw:
        lane = gw.plane.lane
        body = orjson.dumps({"model": "m", "prompt": " ".join(["w"] * 80), "max_tokens": 4})
        headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer team-key")]
        with concurrent.futures.ThreadPoolExecutor(1) as plane_thread:  # (a thread of its own, as the plane's:
            # the lane binds each request's id on the thread it runs on)
            step = plane_thread.submit(lane.admit, "/v1/completions", "", headers, body, "127.0.0.1:5555",
                                       None).result()
        assert step[0] == "fallback" and step[1], step  # parked, with a resume token the plane never sends on
        rt = gw.runtime
        assert rt.shutdown.active == 1 and sum(rt.intake.concurrent.values()) == 1
        assert lane.expire(time.monotonic()) == 0  # not due yet
        assert lane.expire(time.monotonic() + lane_module.RESUME_TTL_S + 1) == 1
        assert nothing_left_counted(gw) == {"active": 0, "clients": 0, "inflight": 0, "attempts": 0}
        assert completion(gw.url, headers={"authorization": "Bearer team-key"}).status_code == 200
