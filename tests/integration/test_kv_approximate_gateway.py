"""A `kv_aware` gateway end to end in approximate mode: engines that publish no KV events.

The gateway records what it routed (``ApproximateRecorder``); its index writes are applied after the
request has been sent (``MemoryPrefixIndex.store_later``) or before the next read. Checks, on a live
gateway: what a request recorded is in the index once it is answered; a follow-up sharing a long
prefix goes where that prefix was sent and hits the engine's cache there (engine counters, not the
router's prediction); for a chat conversation too; a prompt never seen before carries no false
overlap. Two simulated engines (``SimEngineThread``, kv_events off) stand in for engines without
events (SGLang, vLLM without ``--kv-events-config``); the gateway, tokenizer (the simulator's), index
and HTTP are real.
"""

from __future__ import annotations

import httpx
import pytest

from orchestrator.kv.tracker import PrefixTracker
from orchestrator.sim.server import SimEngineThread
from tests.fixtures.sim_gateway import kv_aware_pair

MODEL = "sim-model"


@pytest.fixture(scope="module")
def fleet():
    with kv_aware_pair({"name": MODEL, "block_size": 32}, seed=5) as running:
        yield running


def hits(engine: SimEngineThread) -> int:
    return engine.call(lambda: engine.model.stats.prefix_cache_hits)


def test_a_routed_prompt_is_recorded_and_its_follow_up_goes_there(fleet):
    gw, engines = fleet
    tracker: PrefixTracker = gw.runtime.prefix_tracker  # type: ignore[assignment]
    assert tracker.subscribers == {}  # no events: approximate mode
    doc = " ".join(f"appx{i}" for i in range(1280))  # 40 blocks of 32
    with httpx.Client(base_url=gw.url, timeout=60, trust_env=False) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": doc + " first", "max_tokens": 2})
        assert r.status_code == 200, r.text
        first = r.headers["x-dyad-worker"]
        assert gw.call(tracker.index.worker_blocks(first)) == 40  # recorded by the time the answer is out
        assert len(tracker.approx) >= 40
        by_id = {f"sim-{i}": e for i, e in enumerate(engines)}
        before = hits(by_id[first])
        for q in range(3):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": doc + f" follow-up {q}", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["x-dyad-worker"] == first
        assert hits(by_id[first]) - before >= 3 * 40 * 32  # the engine found the prefix cached each time
        # a prompt nobody sent before: no overlap anywhere
        req = gw.call(gw.runtime.router.annotate(
            _route_request("new"), {"model": MODEL, "prompt": "never seen " + doc}, "/v1/completions"))
        assert req.block_hashes and not any(o.blocks for o in req.overlaps.values())


def test_a_long_chat_conversation_stays_where_its_history_is(fleet):
    gw, _ = fleet
    tracker: PrefixTracker = gw.runtime.prefix_tracker  # type: ignore[assignment]
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": " ".join(f"c{k}w{i}" for i in range(400))}
             for k in range(6)]
    with httpx.Client(base_url=gw.url, timeout=60, trust_env=False) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": turns, "max_tokens": 2})
        assert r.status_code == 200, r.text
        first = r.headers["x-dyad-worker"]
        assert gw.call(tracker.index.worker_blocks(first)) >= 2400 // 32
        more = turns + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": more, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.headers["x-dyad-worker"] == first


def _route_request(rid: str):
    from orchestrator.router.types import RouteRequest
    return RouteRequest(request_id=rid, model=MODEL, prompt_tokens=0, block_size=32)
