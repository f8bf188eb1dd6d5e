#!/usr/bin/env python3
"""How kv_aware's two weights trade cache hits against load, in virtual time (the simulator: 8
GPU-like engines cannot run here), on three workloads:

- **mooncake-slice**: the Mooncake synthetic trace's last 83 s (the fleet benchmark's slice; long
  prompts, mean 23k tokens, short outputs), over several policy seeds (ties are broken at random);
- **mooncake-full**: the whole trace, where the fleet's KV memory cannot hold every prefix;
- **chat**: ShareGPT multi-turn conversations (short prompts that grow turn by turn, outputs
  ~200 tokens: decode-heavy), where spreading running decodes matters more.

Each row replays the workload on ``VirtualFleet`` with the gateway's own policy code, the
simulated engine's own core, and the same load fields a live scrape fills. Prints hit ratio
(from the engines' counters), TTFT, ITL (chat) and max/mean prefill load per engine.

    .venv/bin/python scripts/sweep_kv_weights.py [--seeds 8] [--chat-rates 20,60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.bench.fleet_virtual import chat_requests, run_virtual_routing  # noqa: E402
from orchestrator.bench.trace_paths import trace_path  # noqa: E402
from orchestrator.bench.traces import (  # noqa: E402
    ideal_prefix_hit_ratio,
    load_mooncake,
    load_sharegpt,
    time_window,
)
from orchestrator.config import KvAwareConfig  # noqa: E402
from orchestrator.sim.profiles import GPU_LIKE  # noqa: E402

GRID = [(1.0, 1.0), (0.1, 1.0), (1.0, 2.0), (0.1, 2.0), (0.1, 3.0), (0.0, 2.0)]  # (decode_load_weight, recompute_weight)


def summarize(runs: list[dict], ideal: float | None) -> str:
    hit = statistics.mean(r["hit_ratio"] for r in runs)
    worst = min(r["hit_ratio"] for r in runs)
    p99 = statistics.mean(r["ttft_s"]["p99"] for r in runs)
    mean = statistics.mean(r["ttft_s"]["mean"] for r in runs)
    mm = [r["prefill_load"]["max_over_mean"] for r in runs]
    out = f"hit {100 * hit:5.1f}%"
    if ideal:
        out += f" ({100 * hit / ideal:3.0f}% of ideal, worst seed {100 * worst / ideal:3.0f}%)"
    out += f"  TTFT mean {mean:6.3f} p99 {p99:6.3f} s  prefill max/mean {statistics.mean(mm):.2f} (max {max(mm):.2f})"
    itl = [r["itl_s"]["mean"] for r in runs if r["itl_s"]["mean"] is not None]
    if itl:
        out += f"  ITL mean {1e3 * statistics.mean(itl):.1f} ms p99 {1e3 * statistics.mean(r['itl_s']['p99'] for r in runs):.1f} ms"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=None, help="Mooncake trace (default: found by trace_paths)")
    ap.add_argument("--chat-trace", type=Path, default=None, help="ShareGPT trace (default: found by trace_paths)")
    ap.add_argument("--seeds", type=int, default=8, help="policy seeds per row on the Mooncake slice")
    ap.add_argument("--full-seeds", type=int, default=2, help="policy seeds per row on the whole trace")
    ap.add_argument("--chat-rates", default="20,60", help="ShareGPT conversations started per second")
    ap.add_argument("--chat-requests", type=int, default=1500)
    args = ap.parse_args()

    full = load_mooncake(args.trace or trace_path("mooncake_synthetic_trace.jsonl"))
    window = time_window(full, 940, 1023)
    cap = ideal_prefix_hit_ratio(full, 8 * (GPU_LIKE.cache_tokens // 512))
    workloads = [("mooncake-slice 940:1023", window, ideal_prefix_hit_ratio(window), range(args.seeds)),
                 ("mooncake-full (ideal = the pooled-LRU bound)", full, cap, range(args.full_seeds))]
    for rate in (float(x) for x in args.chat_rates.split(",") if x):
        chats = chat_requests(load_sharegpt(args.chat_trace or trace_path("sharegpt_v3_partial.jsonl.gz"), session_rate=rate,
                                            limit=args.chat_requests))
        workloads.append((f"chat (ShareGPT, {rate:g} conversations/s)", chats, None, range(1)))
    for name, reqs, ideal, seeds in workloads:
        print(f"\n{name}: {len(reqs)} requests" + (f", ideal hit {100 * ideal:.1f}%" if ideal else ""), flush=True)
        if ideal is None:  # the chat rows also show what load-only policies do there
            for pol in ("round_robin", "least_load"):
                runs = [run_virtual_routing(reqs, GPU_LIKE, policy=pol, seed=s) for s in seeds]
                print(f"  {pol:<34}{summarize(runs, ideal)}", flush=True)
        for dw, rw in GRID:
            cfg = KvAwareConfig(decode_load_weight=dw, recompute_weight=rw)
            runs = [run_virtual_routing(reqs, GPU_LIKE, policy="kv_aware", seed=s, kv_aware=cfg) for s in seeds]
            default = " (default)" if (dw, rw) == (KvAwareConfig().decode_load_weight, KvAwareConfig().recompute_weight) else ""
            print(f"  kv_aware decode {dw:g} recompute {rw:g}{default:<11}{summarize(runs, ideal)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
