"""Speed check of the pure core: replay the Mooncake synthetic trace round-robin over N simulated
engines in virtual time and report the CPU time it took.

    .venv/bin/python -m orchestrator.sim.bench_core [--engines 32] [--profile gpu-like]

Prompts are synthesized deterministically from the trace's ``hash_ids`` (one 512-token block per id).
"""

from __future__ import annotations

import argparse
import json
import time

from orchestrator.bench.trace_paths import trace_path
from orchestrator.sim.engine_model import EngineModel, SimRequest, SimRequestError
from orchestrator.sim.profiles import load_profile

TRACE = "mooncake_synthetic_trace.jsonl"  # default --trace, found by orchestrator/bench/trace_paths.py


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=32)
    ap.add_argument("--profile", default="gpu-like")
    ap.add_argument("--trace", default=None, help=f"trace file (default: {TRACE} in the traces directory)")
    args = ap.parse_args()
    prof = load_profile(args.profile)
    engines = [EngineModel(prof, seed=i, engine_id=f"e{i}") for i in range(args.engines)]
    rows = [json.loads(line) for line in open(args.trace or trace_path(TRACE))]
    blocks: dict[int, list[int]] = {}
    arrival: dict[str, float] = {}
    ttft: list[float] = []
    cpu0 = time.process_time()
    synth = 0.0

    def take(outs):
        for o in outs:
            if o.start_index == 0:
                ttft.append(o.times[0] - arrival[o.request_id])

    skipped = 0
    for i, r in enumerate(rows):
        t = r["timestamp"] / 1000.0
        s0 = time.process_time()
        toks: list[int] = []
        for h in r["hash_ids"]:
            b = blocks.get(h)
            if b is None:
                b = blocks[h] = [(h * 7919 + k) % 32000 for k in range(512)]
            toks.extend(b)
        toks = toks[: r["input_length"]]
        synth += time.process_time() - s0
        e = engines[i % len(engines)]
        take(e.advance(t))
        arrival[str(i)] = t
        try:
            e.submit(SimRequest(str(i), toks, r["output_length"]), t)
        except SimRequestError:
            skipped += 1
        e.drain_kv_events()
    for e in engines:
        take(e.advance(1e12))
        e.drain_kv_events()
    cpu = time.process_time() - cpu0
    span = rows[-1]["timestamp"] / 1000.0
    ttft.sort()
    hits = sum(e.stats.prefix_cache_hits for e in engines)
    queries = sum(e.stats.prefix_cache_queries for e in engines)
    print(f"{len(rows) - skipped} requests ({skipped} over max_model_len skipped), {span:.0f} s of trace, "
          f"{args.engines} engines, profile {prof.name}")
    print(f"core CPU {cpu - synth:.1f} s (+ {synth:.1f} s prompt synthesis) → {3600 / span * (cpu - synth):.0f} s "
          f"per simulated hour")
    print(f"TTFT p50 {ttft[len(ttft) // 2]:.3f} s, p99 {ttft[int(len(ttft) * 0.99)]:.3f} s; "
          f"round-robin hit ratio {hits / max(1, queries):.3f}")


if __name__ == "__main__":
    main()
