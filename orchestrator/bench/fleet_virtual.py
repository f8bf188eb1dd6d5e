"""The fleet-routing benchmark in virtual time: the same numbers the live benchmark reports
(engine-side prefix hit ratio, TTFT, prefill load per engine), from ``VirtualFleet``.

It replays a trace on N aggregated simulated engines with one of the gateway's own routing policies,
in virtual time (no sockets, no sleeps), so it can run the whole Mooncake trace in seconds and
cross-check a live run of a slice. Hit ratio and prefill load come from each engine model's own
counters (``EngineStats.prefix_cache_queries/hits``, what the live simulated engine exports as
``vllm:prefix_cache_*_total``), not from the router's belief.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from orchestrator.bench.runner import percentile
from orchestrator.bench.traces import TraceRequest
from orchestrator.config import KvAwareConfig
from orchestrator.sim.engine_model import chain_block_hashes
from orchestrator.sim.profiles import EngineProfile, tier_cost_of
from orchestrator.sim.virtual_time import FleetSpec, SimRequest, VirtualFleet, requests_from_trace


def run_virtual_routing(trace: Sequence[TraceRequest] | Sequence[SimRequest], profile: EngineProfile, *,
                        workers: int = 8, policy: str = "kv_aware", seed: int = 0,
                        kv_aware: KvAwareConfig | None = None) -> dict[str, Any]:
    """Replay ``trace`` (trace requests, or ``SimRequest``s already carrying block ids) on
    ``workers`` aggregated engines routed by ``policy``; a summary dict with ``hit_ratio``,
    ``ttft_s`` (mean/p50/p90/p99/max), ``itl_s`` (per-request mean ITL: mean/p99),
    ``prefill_load`` (per engine uncached prompt tokens, max/mean), ``finished`` and the
    simulation's wall time. With a host tier in ``profile``, ``hit_ratio`` counts GPU hits and
    host reloads (prompt tokens not recomputed), ``gpu_hit_ratio`` / ``host_hit_ratio`` split it, and
    unless ``kv_aware`` is given the router credits host hits by ``tier_cost_of(profile)``."""
    if kv_aware is None and tier_cost_of(profile) is not None:
        kv_aware = KvAwareConfig(tier_cost=tier_cost_of(profile))
    if trace and isinstance(trace[0], SimRequest):
        reqs = [replace(r) for r in trace]  # fresh progress fields per run
        block_tokens = reqs[0].block_tokens
    else:
        reqs = requests_from_trace(trace)
        block_tokens = 512
    fleet = VirtualFleet(profile, FleetSpec(aggregated=workers), policy=policy, seed=seed,
                         block_tokens=block_tokens, kv_aware=kv_aware)
    res = fleet.run(reqs)
    queries = hits = host_hits = 0
    loads = []
    for sw in fleet.workers.values():
        st = sw.engine.model.stats
        queries += st.prefix_cache_queries
        hits += st.prefix_cache_hits
        host_hits += st.host_cache_hits
        loads.append(st.prefix_cache_queries - st.prefix_cache_hits - st.host_cache_hits)
    ttfts = [r.ttft for r in res.requests if r.ttft is not None]
    itls = [r.itl for r in res.requests if r.itl is not None]
    mean_load = sum(loads) / len(loads) if loads else 0.0
    return {
        "policy": policy,
        "requests": len(res.requests),
        "finished": sum(1 for r in res.requests if r.finish is not None),
        "hit_ratio": (hits + host_hits) / queries if queries else None,
        "gpu_hit_ratio": hits / queries if queries else None,
        "host_hit_ratio": host_hits / queries if queries else None,
        "ttft_s": {"mean": sum(ttfts) / len(ttfts) if ttfts else None,
                   **{f"p{q}": percentile(ttfts, q) for q in (50, 90, 99)},
                   "max": max(ttfts, default=None)},
        "itl_s": {"mean": sum(itls) / len(itls) if itls else None, "p99": percentile(itls, 99)},
        "prefill_load": {"per_engine": loads, "max": max(loads, default=None), "mean": mean_load,
                         "max_over_mean": max(loads) / mean_load if loads and mean_load > 0 else None},
        "virtual_s": res.duration_s,
        "wall_s": res.wall_s,
    }


def chat_requests(trace: Sequence[TraceRequest], block_tokens: int = 16) -> list[SimRequest]:
    """Multi-turn chat trace requests (``messages``, e.g. ShareGPT) as ``SimRequest``s whose block
    ids are chained hashes of the conversation's words, so consecutive turns share their history
    as a cached prefix (one word = one simulator token, as the live simulator counts them)."""
    vocab: dict[str, int] = {}
    out = []
    for i, r in enumerate(trace):
        words = " ".join(str(m.get("content", "")) for m in (r.messages or ())).split()
        tokens = [vocab.setdefault(w, len(vocab)) for w in words]
        full = len(tokens) // block_tokens * block_tokens
        out.append(SimRequest(id=i, arrival=r.arrival_s, isl=max(1, len(tokens)), osl=max(1, r.output_len),
                              blocks=tuple(chain_block_hashes(tokens[:full], block_tokens)),
                              block_tokens=block_tokens))
    return out
