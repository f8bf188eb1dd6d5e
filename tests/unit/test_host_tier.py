"""Host-memory KV tier (issue 16): the simulator's GPU → host demotion and reload, the events it emits
(in the shape vLLM's OffloadingConnector sends them) followed through the real mapper into the index,
the reload credit derived from bandwidth, and the virtual fleet using it. Pure: no sockets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.bench.fleet_virtual import run_virtual_routing
from orchestrator.config import KvAwareConfig, TierCostConfig
from orchestrator.kv.events import KvEventMapper
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.index import Tier
from orchestrator.kv.masks import tier_of
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.kv.tier_cost import effective_tier_weights, reload_credit
from orchestrator.sim.engine_model import EngineModel, SimRequest
from orchestrator.sim.profiles import CPU_TINY, GPU_LIKE, tier_cost_of
from orchestrator.sim.virtual_time import SimRequest as FleetRequest

BS = 16
# 8 GPU blocks, 16 host blocks: a 64-token prompt (4 blocks) fits twice on GPU
PROFILE = replace(CPU_TINY, block_size=BS, num_gpu_blocks=8, max_model_len=128, host_kv_tokens=16 * BS,
                  kv_bytes_per_token=2048, host_reload_bandwidth_bytes_s=1e6)


def run(m: EngineModel, req: SimRequest, at: float) -> float:
    """Submit at ``at``, run to completion; the request's first-token time."""
    m.advance(at)
    m.submit(req, at)
    first = None
    while (t := m.next_event_time()) is not None:
        for o in m.advance(t):
            if o.request_id == req.request_id and first is None:
                first = o.times[0]
    assert first is not None
    return first


def prompt(k: int) -> list[int]:
    return [1000 * k + i for i in range(4 * BS + 1)]  # 4 full blocks + 1 token


def test_evicted_blocks_are_demoted_to_host_and_reloaded_instead_of_recomputed():
    m = EngineModel(PROFILE)
    run(m, SimRequest("a", prompt(1), 1), 0.0)
    for k in (2, 3, 4):  # push a's blocks out of GPU memory
        run(m, SimRequest(f"x{k}", prompt(k), 1), 10.0 * k)
    dev, host = m.cached_prefix_tiers(m_hashes(m, prompt(1)))
    assert dev == 0 and host == 4
    before = m.stats.prefix_cache_hits
    t0 = 100.0
    first = run(m, SimRequest("a2", prompt(1), 1), t0)
    assert m.stats.prefix_cache_hits == before  # not a GPU hit ...
    assert m.stats.host_cache_hits == 4 * BS  # ... a host reload
    assert m.stats.prompt_tokens_by_source["external_kv_transfer"] == 4 * BS
    assert m.cached_prefix_tiers(m_hashes(m, prompt(1))) == (4, 0)  # back on GPU, out of host (exclusive)
    # the reload is paid at the modelled bandwidth: 64 tokens × 2 KiB / 1 MB/s ≈ 0.131 s, and it
    # replaces 64 tokens of prefill (64 × 0.259 ms ≈ 0.017 s): slower here, by construction
    cold = EngineModel(PROFILE)
    cold_first = run(cold, SimRequest("c", prompt(1), 1), t0) - t0
    reload_s = PROFILE.host_reload_seconds(4 * BS)
    assert reload_s == pytest.approx(64 * 2048 / 1e6)
    assert first - t0 == pytest.approx(cold_first - 4 * BS * PROFILE.per_prefill_token_s + reload_s, rel=1e-6)


def m_hashes(m: EngineModel, tokens: list[int]) -> list[int]:
    from orchestrator.sim.engine_model import chain_block_hashes
    return chain_block_hashes(tokens, m.profile.block_size)


def test_host_capacity_is_bounded_lru():
    m = EngineModel(PROFILE)
    for k in range(1, 10):
        run(m, SimRequest(f"r{k}", prompt(k), 1), 10.0 * k)
    assert m.num_host_blocks == 16
    assert m.cached_prefix_tiers(m_hashes(m, prompt(1))) == (0, 0)  # oldest fell out of both tiers
    assert m.cached_prefix_tiers(m_hashes(m, prompt(6)))[1] == 4


def test_events_with_medium_keep_the_index_per_tier_in_step_with_the_engine():
    """Every event the engine emits goes through the real mapper into the real index; after each
    request the index's (device, host) view of each prompt equals the engine's."""
    m = EngineModel(PROFILE)
    mapper = KvEventMapper("w", lambda: "m")
    index = MemoryPrefixIndex()
    kinds = set()

    def sync():
        for _t, batch in m.drain_kv_events():
            for ev in batch:
                kinds.add((ev["type"], ev.get("medium")))
                op = mapper.apply(ev)
                if op is None:
                    continue
                if op.kind == "store":
                    index.store_now("w", op.hashes, op.tier)
                elif op.kind == "remove":
                    index.remove_now("w", op.hashes, op.tier)

    ours = {k: BlockHasher("m", BS).hash_blocks(prompt(k)[: 4 * BS]) for k in range(1, 8)}
    order = [1, 2, 3, 4, 1, 5, 2, 6, 7, 1]
    for i, k in enumerate(order):
        run(m, SimRequest(f"r{i}", prompt(k), 1), 10.0 * i)
        sync()
        for j, hashes in ours.items():
            dev, host = m.cached_prefix_tiers(m_hashes(m, prompt(j)))
            masks = [tier_of(index._blocks.get(h, 0), index._slots["w"]) if "w" in index._slots else 0
                     for h in hashes]
            assert sum(1 for x in masks[:dev] if x & Tier.DEVICE) == dev, (i, j)
            assert sum(1 for x in masks[dev:dev + host] if x & Tier.HOST) == host, (i, j)
            assert not any(x & Tier.HOST for x in masks[:dev])  # exclusive tiers, as the engine
    assert {("BlockStored", "CPU"), ("BlockRemoved", "CPU"), ("BlockRemoved", "GPU")} <= kinds


def test_tokenless_offload_event_of_an_unknown_block_is_skipped():
    mapper = KvEventMapper("w", lambda: "m")
    op = mapper.apply({"type": "BlockStored", "block_hashes": [42], "parent_block_hash": None, "token_ids": [],
                       "block_size": 0, "medium": "CPU"})
    assert op is None and mapper.unmapped == 1


def test_reload_credit_from_bandwidth():
    # 8B-class model, 12k tokens/s prefill, 25 GB/s: reload is 6% of the compute time
    assert reload_credit(131072, 25e9, 12000) == pytest.approx(1 - 12000 * 131072 / 25e9)
    assert reload_credit(131072, 1e9, 12000) == 0.0  # slower than recomputing: no credit
    assert reload_credit(131072, 1e15, 12000) == pytest.approx(1.0, abs=1e-5)
    cfg = KvAwareConfig(tier_cost=TierCostConfig(kv_bytes_per_token=131072, prefill_tokens_per_s=12000,
                                                 host_reload_bytes_per_s=25e9, disk_read_bytes_per_s=2e9))
    w = effective_tier_weights(cfg)
    assert w["device"] == 1.0 and w["host"] == pytest.approx(0.937, abs=1e-3)
    assert w["disk"] == pytest.approx(1 - 12000 * 131072 / 2e9)
    assert effective_tier_weights(KvAwareConfig())["host"] == 0.75  # unset: the configured weights


def test_virtual_fleet_with_host_tier_hits_more_than_gpu_only():
    """Two workers whose GPU holds 2 conversations each; 12 conversations come back after the others
    pushed them out: only the host tier keeps them, and kv_aware routes each back to its holder."""
    prof = replace(GPU_LIKE, num_gpu_blocks=2 * 8 * 512 // 16)  # 8 blocks of 512 tokens
    reqs = []
    for rnd in range(2):
        for c in range(12):
            blocks = tuple(10_000 * c + b for b in range(4))
            reqs.append(FleetRequest(id=len(reqs), arrival=rnd * 60.0 + c * 2.0, isl=4 * 512, osl=4, blocks=blocks))
    gpu = run_virtual_routing(reqs, prof, workers=2)
    host_prof = replace(prof, host_kv_tokens=4 * prof.cache_tokens)
    assert tier_cost_of(host_prof) is not None
    host = run_virtual_routing(reqs, host_prof, workers=2)
    assert gpu["host_hit_ratio"] == 0
    assert host["host_hit_ratio"] > 0.3 and host["hit_ratio"] > gpu["hit_ratio"] + 0.3
    assert host["ttft_s"]["mean"] < gpu["ttft_s"]["mean"]


def test_engine_metrics_export_host_reloads_as_vllm_external_hits_and_bench_counts_them():
    from orchestrator.bench.runner import EngineCounters, parse_engine_counters
    from orchestrator.sim.metrics_text import render_vllm

    m = EngineModel(PROFILE)
    run(m, SimRequest("a", prompt(1), 1), 0.0)
    for k in (2, 3, 4):
        run(m, SimRequest(f"x{k}", prompt(k), 1), 10.0 * k)
    run(m, SimRequest("a2", prompt(1), 1), 100.0)
    text = render_vllm(m, "m")
    c = parse_engine_counters("http://e", text)
    assert c.external_hits == 4 * BS and c.prefix_hits == m.stats.prefix_cache_hits
    assert "vllm:external_prefix_cache_queries_total" in text
    d = c.minus(EngineCounters(url="http://e", prefix_queries=0, prefix_hits=0, external_hits=0))
    assert d["external_hits"] == 4 * BS
    # an engine without a host tier exports no external counters (as vLLM without a connector)
    assert "external_prefix_cache" not in render_vllm(EngineModel(CPU_TINY), "m")
