"""A host-memory KV tier end to end: a gateway (in-process, real runtime) over simulated engines whose
profile has a host tier, KV events over ZMQ in vLLM's wire format (offloads as ``medium: "CPU"``).

Simulated engines, because vLLM 0.32's CPU build refuses native KV offloading at start ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs"; docs/operations.md). Checks:
a conversation pushed out of GPU memory is tracked in the index as host-tier blocks; the gateway
sends its next turn back to that engine, which reloads instead of recomputing (engine counters);
the reload is credited at the derived (not the default) host credit.
"""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.kv.index import Tier
from orchestrator.kv.masks import tier_of
from orchestrator.sim.profiles import CPU_TINY
from orchestrator.sim.server import SimEngineThread

MODEL = "sim-model"
# 48 blocks of 32 on GPU (1,536 tokens), 4× that on host
PROFILE = replace(CPU_TINY, name="cpu-tiny-host", block_size=32, num_gpu_blocks=48, max_model_len=1024,
                  host_kv_tokens=4 * 48 * 32, kv_bytes_per_token=2048, host_reload_bandwidth_bytes_s=1e9)


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def wait_for(pred, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_offloaded_blocks_are_indexed_per_tier_and_routed_back():
    n_engines = 2
    engines = [SimEngineThread(model=MODEL, profile=PROFILE, seed=i, kv_events=True).start() for i in range(n_engines)]
    workers = [{"id": f"sim-{i}", "url": e.url, "engine": "sim", "models": [MODEL],
                "kv_events": {"endpoint": e.kv_events_endpoint, "replay_endpoint": e.replay_endpoint}}
               for i, e in enumerate(engines)]
    cfg = load_config({
        "models": [{"name": MODEL, "block_size": 32}],
        "workers": workers,
        "router": {"policy": "kv_aware", "debug_headers": True, "seed": 3,
                   "kv_aware": {"tier_cost": {"kv_bytes_per_token": 2048, "prefill_tokens_per_s": 1 / 0.000259,
                                              "host_reload_bytes_per_s": 1e9}}},
        "health": {"interval_s": 1.0},
        "scrape": {"interval_s": 0.25},
    }, environ={})
    gw = GatewayThread(cfg).start()
    try:
        tracker = gw.runtime.prefix_tracker
        assert tracker.tier_weights["host"] == pytest.approx(1 - 2048 / 0.000259 / 1e9)

        def ask(prompt: str) -> httpx.Response:
            r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                           timeout=30, trust_env=False)
            assert r.status_code == 200, r.text
            return r

        convo = words("conv", 640)  # 20 blocks
        first = ask(convo + " q1")
        home = first.headers["x-dyad-worker"]
        eng = engines[int(home.split("-")[1])]
        # Push the conversation out of that engine's GPU memory with other prompts sent straight to
        # it (not through the gateway, so routing cannot avoid it)
        for k in range(4):
            r = httpx.post(f"{eng.url}/v1/completions", json={"model": MODEL, "prompt": words(f"other{k}x", 640),
                                                              "max_tokens": 2}, timeout=30, trust_env=False)
            assert r.status_code == 200

        # the index learns (from CPU-medium events) that the engine holds it in host memory only
        index = tracker.index
        slot = index._slots[home]

        def host_blocks() -> int:
            return sum(1 for m in index._blocks.values() if tier_of(m, slot) == int(Tier.HOST))

        wait_for(lambda: host_blocks() >= 19)
        assert eng.call(lambda: eng.model.num_host_blocks) >= 19
        in_host = {h for h, m in index._blocks.items() if tier_of(m, slot) == int(Tier.HOST)}
        before = eng.call(lambda: eng.model.stats.host_cache_hits)
        second = ask(convo + " q2")
        assert second.headers["x-dyad-worker"] == home
        assert int(second.headers["x-dyad-predicted-cached-tokens"]) >= 19 * 32
        assert eng.call(lambda: eng.model.stats.host_cache_hits) - before >= 19 * 32  # reloaded, not recomputed
        # reloaded blocks are on GPU again in the index (and no longer in host: the sim's tiers are exclusive)
        wait_for(lambda: sum(1 for h in in_host if tier_of(index._blocks.get(h, 0), slot) == int(Tier.DEVICE)) >= 19)
    finally:
        gw.stop()
        for e in engines:
            e.stop()
