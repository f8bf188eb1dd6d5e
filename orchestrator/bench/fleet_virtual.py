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
from typing import Any

from orchestrator.bench.runner import percentile
from orchestrator.bench.traces import TraceRequest
from orchestrator.sim.profiles import EngineProfile
from orchestrator.sim.virtual_time import FleetSpec, VirtualFleet, requests_from_trace


def run_virtual_routing(trace: Sequence[TraceRequest], profile: EngineProfile, *, workers: int = 8,
                        policy: str = "kv_aware", seed: int = 0) -> dict[str, Any]:
    """Replay ``trace`` on ``workers`` aggregated engines routed by ``policy``; a summary dict with
    ``hit_ratio``, ``ttft_s`` (mean/p50/p90/p99/max), ``prefill_load`` (per engine uncached prompt
    tokens, max/mean), ``finished`` and the simulation's wall time."""
    reqs = requests_from_trace(trace)
    fleet = VirtualFleet(profile, FleetSpec(aggregated=workers), policy=policy, seed=seed)
    res = fleet.run(reqs)
    queries = hits = 0
    loads = []
    for sw in fleet.workers.values():
        st = sw.engine.model.stats
        queries += st.prefix_cache_queries
        hits += st.prefix_cache_hits
        loads.append(st.prefix_cache_queries - st.prefix_cache_hits)
    ttfts = [r.ttft for r in res.requests if r.ttft is not None]
    mean_load = sum(loads) / len(loads) if loads else 0.0
    return {
        "policy": policy,
        "requests": len(res.requests),
        "finished": sum(1 for r in res.requests if r.finish is not None),
        "hit_ratio": hits / queries if queries else None,
        "ttft_s": {"mean": sum(ttfts) / len(ttfts) if ttfts else None,
                   **{f"p{q}": percentile(ttfts, q) for q in (50, 90, 99)},
                   "max": max(ttfts, default=None)},
        "prefill_load": {"per_engine": loads, "max": max(loads, default=None), "mean": mean_load,
                         "max_over_mean": max(loads) / mean_load if loads and mean_load > 0 else None},
        "virtual_s": res.duration_s,
        "wall_s": res.wall_s,
    }
