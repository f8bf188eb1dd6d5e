#!/usr/bin/env python3
"""A host-memory KV tier on a simulated fleet, in virtual time (issue 16).

Replays a trace on N aggregated simulated engines (``VirtualFleet``: the gateway's own ``kv_aware``
policy over the simulator's engine core; 8 GPU engines cannot run here) twice: GPU KV only, and
with a host tier of ``--host-x`` times the GPU KV (LRU demotion GPU → host, reload over
``--reload-gbps``). Reports the prefix hit ratio (GPU hits + host reloads, from the engines' own
counters), its share of the pooled-LRU bound over the fleet's memory (one LRU as large as all
workers' GPU KV, or GPU + host KV: what perfect placement could keep), and TTFT.

``--credit-sweep`` also routes with fixed host credits (0, 0.5, 0.75, 1) next to the one derived
from bandwidth (``router.kv_aware.tier_cost``), to check the derived credit is not beaten by a
hand-picked weight; run it on a second workload (``--workload chat``) and a slower link too.

    .venv/bin/python scripts/bench_host_tier.py --trace mooncake_synthetic_trace.jsonl
    .venv/bin/python scripts/bench_host_tier.py --workload chat --trace sharegpt_v3_partial.jsonl.gz \
        --gpu-scale 0.0625 --credit-sweep
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.bench.fleet_virtual import chat_requests, run_virtual_routing  # noqa: E402
from orchestrator.bench.traces import ideal_prefix_hit_ratio, load_mooncake, load_sharegpt  # noqa: E402
from orchestrator.config import KvAwareConfig  # noqa: E402
from orchestrator.kv.tier_cost import derived_tier_weights  # noqa: E402
from orchestrator.sim.profiles import load_profile, tier_cost_of  # noqa: E402
from orchestrator.sim.virtual_time import SimRequest, requests_from_trace  # noqa: E402


def pooled_lru_hit_ratio(reqs: Sequence[SimRequest], capacity_blocks: int) -> float:
    """One LRU of ``capacity_blocks`` blocks over the whole fleet, replayed in arrival order: the
    share of prompt tokens whose leading blocks it still holds (full blocks of ``block_tokens``)."""
    seen: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in sorted(reqs, key=lambda r: r.arrival):
        total += r.isl
        n = 0
        for h in r.blocks:
            if h not in seen:
                break
            n += 1
        hit += min(n * r.block_tokens, r.isl)
        for h in r.blocks:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > capacity_blocks:
            seen.popitem(last=False)
    return hit / total if total else 0.0


def row(name: str, res: dict, bound: float) -> str:
    t = res["ttft_s"]
    return (f"| {name} | {res['finished']}/{res['requests']} | {100 * res['hit_ratio']:.1f}% "
            f"({100 * res['gpu_hit_ratio']:.1f} + {100 * res['host_hit_ratio']:.1f}) | "
            f"{100 * res['hit_ratio'] / bound:.0f}% | {t['mean']:.2f} / {t['p50']:.2f} / {t['p99']:.2f} | "
            f"{res['wall_s']:.0f} s |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="Mooncake JSONL (or ShareGPT JSON/JSONL[.gz] with --workload chat)")
    ap.add_argument("--workload", choices=["mooncake", "chat"], default="mooncake")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--profile", default="gpu-like")
    ap.add_argument("--gpu-scale", type=float, default=1.0, help="multiply the profile's GPU KV blocks")
    ap.add_argument("--host-x", type=float, default=4.0, help="host tier size as a multiple of the GPU KV")
    ap.add_argument("--reload-gbps", type=float, default=25.0, help="host → GPU bandwidth, GB/s")
    ap.add_argument("--policy", default="kv_aware")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-rate", type=float, default=20.0, help="ShareGPT conversations started per second")
    ap.add_argument("--chat-requests", type=int, default=3000)
    ap.add_argument("--credit-sweep", action="store_true", help="also route with fixed host credits")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()

    base = load_profile(args.profile)
    base = replace(base, num_gpu_blocks=max(1, int(base.num_gpu_blocks * args.gpu_scale)))
    host = replace(base, host_kv_tokens=int(base.cache_tokens * args.host_x),
                   host_reload_bandwidth_bytes_s=args.reload_gbps * 1e9)
    if args.workload == "mooncake":
        trace = load_mooncake(args.trace)
        reqs = requests_from_trace(trace)
        block_tokens = 512
    else:
        trace = load_sharegpt(args.trace, session_rate=args.chat_rate, limit=args.chat_requests)
        reqs = chat_requests(trace)
        block_tokens = reqs[0].block_tokens
    gpu_blocks = base.cache_tokens // block_tokens
    host_blocks = host.host_kv_tokens // block_tokens
    if args.workload == "mooncake":  # the trace's own block lengths (its last block is partial)
        bound_gpu = ideal_prefix_hit_ratio(trace, args.workers * gpu_blocks)
        bound_all = ideal_prefix_hit_ratio(trace, args.workers * (gpu_blocks + host_blocks))
        bound_inf = ideal_prefix_hit_ratio(trace)
    else:
        bound_gpu = pooled_lru_hit_ratio(reqs, args.workers * gpu_blocks)
        bound_all = pooled_lru_hit_ratio(reqs, args.workers * (gpu_blocks + host_blocks))
        bound_inf = pooled_lru_hit_ratio(reqs, 1 << 62)
    cost = tier_cost_of(host)
    credit = derived_tier_weights(cost)["host"] if cost else 0.0
    print(f"{args.workload}: {len(reqs)} requests, {args.workers} workers × {gpu_blocks} GPU blocks"
          f" (+ {host_blocks} host blocks, {args.reload_gbps:g} GB/s → derived host credit {credit:.3f}) "
          f"of {block_tokens} tokens; pooled LRU bound: GPU only {100 * bound_gpu:.1f}%, GPU + host "
          f"{100 * bound_all:.1f}%, infinite {100 * bound_inf:.1f}%", flush=True)
    print("| fleet | finished | hit ratio (GPU + host) | % of pooled LRU (same memory) | TTFT mean / p50 / p99 (s) | wall |")
    print("|---|---|---|---|---|---|")
    out: dict = {"bounds": {"gpu": bound_gpu, "gpu_host": bound_all, "infinite": bound_inf},
                 "derived_host_credit": credit, "runs": {}}
    runs = [("GPU only", base, None, bound_gpu),
            (f"GPU + host {args.host_x:g}× (credit {credit:.2f}, derived)", host, None, bound_all)]
    if args.credit_sweep:
        for c in (0.0, 0.5, 0.75, 1.0):
            runs.append((f"GPU + host {args.host_x:g}×, fixed host credit {c:g}", host,
                         KvAwareConfig(tier_weights={"device": 1.0, "host": c, "disk": 0.0}), bound_all))
    for name, prof, cfg, bound in runs:
        started = time.time()
        res = run_virtual_routing(reqs, prof, workers=args.workers, policy=args.policy, seed=args.seed,
                                  kv_aware=cfg)
        res["wall_s"] = time.time() - started
        print(row(name, res, bound), flush=True)
        out["runs"][name] = res
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
