"""Prefix tracking against a real vLLM 0.32 engine (tiny local Llama, block size 32, KV events on ZMQ).

Checked: router-side tokenization (local tokenizer files + chat template) equals the engine's own
/tokenize; a subscriber that joins after traffic learns the engine's blocks through the replay
endpoint; blocks mapped from the engine's ``token_ids`` match the hashes the router computes for the
same prompt (so the index predicts the real hit); ``/reset_prefix_cache`` (AllBlocksCleared) empties
the worker's entries; a worker that goes unhealthy is cleared; on an engine with a tiny KV cache
(64 blocks), real evictions arrive as ``BlockRemoved`` and the index then predicts exactly the hit
the engine reports for a partly evicted prompt.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import WorkerState
from orchestrator.kv.tracker import build_prefix_tracker
from orchestrator.router.types import RouteRequest
from orchestrator.telemetry.metrics import DyadMetrics
from tests.fixtures.vllm import VllmEngine, VllmPool

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = " ".join(f"worker {i} keeps the shared prefix number {i} warm." for i in range(40))
MESSAGES = [{"role": "system", "content": "You are a terse assistant. " * 20},
            {"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]}]


def config_for(engine: VllmEngine):
    return load_config({
        "models": [{"name": engine.model, "tokenizer": str(engine.paths.model_dir), "block_size": 32}],
        "workers": [{"id": "v0", "url": engine.url, "models": [engine.model],
                     "kv_events": {"endpoint": f"tcp://*:{engine.kv_events_port}",
                                   "replay_endpoint": engine.kv_replay_endpoint}}],
        "router": {"policy": "kv_aware"},
    }, environ={})


async def until(pred, timeout=20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        v = await pred()
        if v:
            return v
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def engine_tokens(engine: VllmEngine, prompt: str, messages: list) -> tuple[list[int], list[int]]:
    """The engine's own /tokenize of a completions prompt and of a chat (its template, no extra specials)."""
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(f"{engine.url}/tokenize", json={"model": engine.model, "prompt": prompt})
        as_prompt = r.json()["tokens"]
        r = await c.post(f"{engine.url}/tokenize", json={
            "model": engine.model, "messages": messages, "add_generation_prompt": True, "add_special_tokens": False})
        return as_prompt, r.json()["tokens"]


async def test_local_tokenization_equals_engine_tokenize(vllm_engine: VllmEngine):
    cfg = config_for(vllm_engine)
    tracker = build_prefix_tracker(cfg, FleetRegistry.from_config(cfg), DyadMetrics())
    tok = tracker.tokenizer
    engine_prompt, engine_chat = await engine_tokens(vllm_engine, PROMPT, MESSAGES)
    assert await tok.token_ids(vllm_engine.model, "/v1/completions", {"prompt": PROMPT}) == engine_prompt
    assert await tok.token_ids(vllm_engine.model, "/v1/chat/completions", {"messages": MESSAGES}) == engine_chat
    assert tok.engine_calls == 0  # all local
    # Head first (a long new prompt is routed on its head's tokens): the head's ids but its last block are
    # the leading ids of what the engine computes for the whole prompt, completions and chat.
    long_text = " ".join(f"{PROMPT} Part {i}:\n    def f{i}(x): return x * {i} # ünïcödé 模型" for i in range(8))
    long_chat = [{"role": "system", "content": long_text}, {"role": "user", "content": "go"}]
    engine_long, engine_long_chat = await engine_tokens(vllm_engine, long_text, long_chat)
    for endpoint, body, engine_ids in (("/v1/completions", {"prompt": long_text}, engine_long),
                                       ("/v1/chat/completions", {"messages": long_chat}, engine_long_chat)):
        probe = tok.head_probe(vllm_engine.model, endpoint, body, block_size=32)
        assert probe is not None, endpoint
        safe = (len(probe[0]) // 32 - 1) * 32
        assert safe >= 32 and list(probe[0][:safe]) == engine_ids[:safe], endpoint


async def test_engine_events_map_to_the_routers_hashes(vllm_engine: VllmEngine):
    cfg = config_for(vllm_engine)
    fleet = FleetRegistry.from_config(cfg)
    worker = fleet.get("v0")
    fleet.record_health(worker, True, 0.0)
    metrics = DyadMetrics()
    tracker = build_prefix_tracker(cfg, fleet, metrics)
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(f"{vllm_engine.url}/reset_prefix_cache")
        assert r.status_code == 200
        # Traffic before the tracker listens: it must learn these blocks by replay.
        r = await c.post(f"{vllm_engine.url}/v1/completions",
                         json={"model": vllm_engine.model, "prompt": PROMPT, "max_tokens": 1})
        r.raise_for_status()
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        await tracker.start()
        try:
            req = RouteRequest(request_id="r1", model=vllm_engine.model, prompt_tokens=0)

            annotated: list[RouteRequest] = []  # annotate returns a new (frozen) value each time

            async def overlap():
                got = await tracker.annotate(req, {"prompt": PROMPT}, "/v1/completions", [worker])
                annotated.append(got)
                ov = got.overlaps.get("v0")
                return ov.blocks if ov else 0

            full_blocks = prompt_tokens // 32
            assert full_blocks >= 5
            assert await until(lambda: overlap()) == full_blocks
            assert len(annotated[-1].block_hashes) == full_blocks
            sub = tracker.subscribers["v0"]
            assert sub.replayed >= 1  # learnt through the engine's replay endpoint
            assert metrics.registry.get_sample_value("dyad_kv_events_total",
                                                     {"worker": "v0", "type": "BlockStored"}) >= 1
            # A chat request: its blocks show up live, mapped from the event token ids.
            r = await c.post(f"{vllm_engine.url}/v1/chat/completions",
                             json={"model": vllm_engine.model, "messages": MESSAGES, "max_tokens": 1})
            r.raise_for_status()
            chat_req = RouteRequest(request_id="r2", model=vllm_engine.model, prompt_tokens=0)

            async def chat_overlap():
                got = await tracker.annotate(chat_req, {"messages": MESSAGES}, "/v1/chat/completions",
                                             [worker])
                ov = got.overlaps.get("v0")
                return ov is not None and ov.blocks == r.json()["usage"]["prompt_tokens"] // 32
            await until(chat_overlap)
            # The engine empties its cache: AllBlocksCleared empties the worker's entries.
            r = await c.post(f"{vllm_engine.url}/reset_prefix_cache")
            assert r.status_code == 200
            # The clear event is published at the next engine step: give it one.
            await c.post(f"{vllm_engine.url}/v1/completions",
                         json={"model": vllm_engine.model, "prompt": "x", "max_tokens": 1})
            assert await until(lambda: _blocks_zero(tracker, annotated[-1]))
            # And a worker that turns unhealthy is forgotten.
            await c.post(f"{vllm_engine.url}/v1/completions",
                         json={"model": vllm_engine.model, "prompt": PROMPT, "max_tokens": 1})
            await until(lambda: overlap())
            for _ in range(cfg.health.failure_threshold):
                fleet.record_health(worker, False, 1.0, "test")
            assert worker.state is WorkerState.UNHEALTHY
            assert await until(lambda: _blocks_zero(tracker, annotated[-1]))
        finally:
            await tracker.stop()


async def _blocks_zero(tracker, req) -> bool:
    ov = await tracker.index.overlaps(req.block_hashes)
    return "v0" not in ov


def _prefix_hits(metrics_text: str) -> float:
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.vllm_config("small-kv")  # one engine, 64-block KV cache (tests/fixtures/vllm.py SMALL_KV_BYTES)
async def test_real_evictions_remove_entries(vllm_pool: VllmPool):
    try:
        (engine,) = vllm_pool.use("small-kv")
    except (RuntimeError, TimeoutError) as e:
        pytest.fail(str(e), pytrace=False)
    cfg = config_for(engine)
    fleet = FleetRegistry.from_config(cfg)
    worker = fleet.get("v0")
    fleet.record_health(worker, True, 0.0)
    metrics = DyadMetrics()
    tracker = build_prefix_tracker(cfg, fleet, metrics)
    # The watched prompt: ~520 tokens (16 blocks). Fillers: ~130 tokens (4 blocks) each, so the
    # first evictions take only part of it (vLLM evicts a freed request's tail blocks first).
    watched = " ".join(f"document zero sentence {i} says something new." for i in range(20))
    fillers = [" ".join(f"filler {d} line {i} adds other words." for i in range(5)) for d in range(40)]
    await tracker.start()
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            async def send(prompt: str) -> dict:
                r = await c.post(f"{engine.url}/v1/completions",
                                 json={"model": engine.model, "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                return r.json()

            async def overlap_of(prompt: str) -> int:
                req = RouteRequest(request_id="probe", model=engine.model, prompt_tokens=0)
                req = await tracker.annotate(req, {"prompt": prompt}, "/v1/completions", [worker])
                ov = req.overlaps.get("v0")
                return ov.blocks if ov else 0

            first = await send(watched)
            full = first["usage"]["prompt_tokens"] // 32
            assert 12 <= full <= 20
            assert await until(lambda: _eq(overlap_of(watched), full)) is True
            for filler in fillers:  # fill the 64-block cache until the watched prompt starts to go
                await send(filler)
                await asyncio.sleep(0.3)
                if await overlap_of(watched) < full:
                    break

            async def removed() -> bool:
                n = metrics.registry.get_sample_value("dyad_kv_events_total", {"worker": "v0", "type": "BlockRemoved"})
                return bool(n) and await overlap_of(watched) < full
            await until(removed)
            await asyncio.sleep(0.5)  # let the last batch of events land
            predicted = await overlap_of(watched)
            assert 0 < predicted < full  # partly evicted: its head is still cached
            # The index's view equals the engine's: resend the first prompt and compare with the hit
            # the engine itself counts.
            before = _prefix_hits((await c.get(f"{engine.url}/metrics")).text)
            await send(watched)
            after = _prefix_hits((await c.get(f"{engine.url}/metrics")).text)
            assert after - before == predicted * 32, (predicted, after - before)
    finally:
        await tracker.stop()


async def _eq(value_coro, expected) -> bool:
    return (await value_coro) == expected
