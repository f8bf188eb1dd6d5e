"""Benchmark: disaggregated vs aggregated vs conditional fleets, in virtual time (simulator only).

    .venv/bin/python -m orchestrator.bench.disagg_virtual [--trace azure2023_code.csv] [--limit N] [--json out.json]

Eight simulated GPU-like engines (``orchestrator/sim/profiles.py``: an 8B-class model on one
H100-class GPU) serve the same trace three ways:

- ``8 aggregated``: every engine prefills (chunked, 8,192-token steps) and decodes; least-load routing.
- ``2P+6D``: every request is prefilled on one of two prefill engines, its KV moved to one of six
  decode engines (``profile.transfer_seconds``), decoded there. Pairs from Dyad's pair selection
  (``orchestrator.router.pd_selection.select_pair``).
- ``4P+4D`` and ``6P+2D``: the same split with prefill-heavier ratios (the Azure code trace is
  prefill-heavy), to show that the ratio decides.
- ``2P+6D conditional``: the same fleet, but a request whose uncached prompt is shorter than the
  profile-derived threshold, or that arrives while the prefill pool is backed up, is prefilled on
  its decode engine (Dyad's conditional disaggregation).

The event loop is the planner's ``VirtualFleet`` (``orchestrator/sim/virtual_time.py``), which routes
every request with the live gateway's ``Router`` and ``PdRoutingPolicy`` (pair selection on arrival,
as ``disagg.install`` sets the gateway up); this module only chooses the fleets and the settings.
Real engines cannot run at GPU scale here, so every number from this module is a simulation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator.bench.trace_paths import trace_path
from orchestrator.bench.traces import load_azure, rescale_time
from orchestrator.router.pd_selection import PdSelectionSettings, threshold_from_profile
from orchestrator.sim.profiles import GPU_LIKE, EngineProfile
from orchestrator.sim.virtual_time import FleetSpec, SimRequest, VirtualFleet, requests_from_trace
from orchestrator.stats import percentile

ISL_FACTOR = 1.0  # prompt-length scale of the long-output mix
AZURE = "azure2023_code.csv"  # found by orchestrator/bench/trace_paths.py unless --trace names a file


# --- workloads ---------------------------------------------------------------------------------------

def azure_code(limit: int | None, time_scale: float, path: Path | None = None) -> list[SimRequest]:
    """The Azure 2023 code trace (prefill-heavy: input mean 2,048, output mean 28), time compressed."""
    trace = rescale_time(load_azure(path or trace_path(AZURE), limit=limit), time_scale)
    return requests_from_trace(trace, block_tokens=16)


def long_output_mix(limit: int | None, time_scale: float, path: Path = AZURE, seed: int = 4) -> list[SimRequest]:
    """Azure code arrivals and prompt lengths (mean 2,048), outputs drawn uniformly from 200..800
    tokens (seeded) instead of the trace's ~28: long prompts *and* long decodes, where an aggregated
    engine's prefill chunks stall its running decodes."""
    rng = random.Random(seed)
    reqs = azure_code(limit, time_scale, path)
    return [replace(r, isl=max(1, int(r.isl * ISL_FACTOR)), osl=rng.randint(200, 800)) for r in reqs]


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 1.0
    itl_s: float = 0.025


def run_fleet(kind: str, profile: EngineProfile, requests: Sequence[SimRequest]) -> dict[str, Any]:
    reqs = [replace(r) for r in requests]  # fresh progress fields per run
    always_split = PdSelectionSettings(min_prefill_tokens=0)
    if kind == "aggregated":
        fleet = VirtualFleet(profile, FleetSpec(aggregated=8), policy="least_load")
    elif kind == "disaggregated":
        fleet = VirtualFleet(profile, FleetSpec(prefill=2, decode=6), pd_settings=always_split, prefix_index=True)
    elif kind in ("disaggregated-4p4d", "disaggregated-6p2d"):
        p = int(kind[-4])
        fleet = VirtualFleet(profile, FleetSpec(prefill=p, decode=8 - p), pd_settings=always_split,
                             prefix_index=True)
    elif kind == "conditional":
        settings = PdSelectionSettings(min_prefill_tokens=threshold_from_profile(profile),
                                       max_prefill_queue_tokens=2 * profile.max_num_batched_tokens)
        fleet = VirtualFleet(profile, FleetSpec(prefill=2, decode=6), pd_settings=settings, prefix_index=True)
    else:
        raise ValueError(kind)
    result = fleet.run(reqs)
    out: dict[str, Any] = {"fleet": kind, "result": result}
    if fleet.pd:
        out["local_prefills"] = sum(1 for _, _, pw, _ in fleet.route_log if pw is None)
        out["split"] = sum(1 for _, _, pw, _ in fleet.route_log if pw is not None)
    return out


FLEETS = ("aggregated", "disaggregated", "conditional", "disaggregated-4p4d", "disaggregated-6p2d")

# ITL targets (seconds) at which SLO attainment is also reported, TTFT target unchanged: where an
# aggregated fleet's decode stalls start to cost it goodput, i.e. where a split fleet could win.
ITL_SWEEP_S = (0.008, 0.010, 0.0125, 0.015, 0.020, 0.025, 0.035, 0.050, 0.100)


def attainment(requests: Sequence[SimRequest], slo: Slo) -> float:
    """Share of all requests (unfinished ones count as misses) with TTFT and mean ITL within the SLO."""
    good = sum(1 for r in requests if r.finish is not None and r.ttft is not None and r.ttft <= slo.ttft_s
               and (r.itl is None or r.itl <= slo.itl_s))
    return good / len(requests) if requests else 0.0


def summarize(run: dict[str, Any], slo: Slo) -> dict[str, Any]:
    res = run["result"]
    done = [r for r in res.requests if r.finish is not None]
    ttft = [r.ttft for r in done if r.ttft is not None]
    itl = [r.itl for r in done if r.itl is not None]
    att = attainment(res.requests, slo)
    return {
        "fleet": run["fleet"], "requests": len(res.requests), "finished": len(done),
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "slo_attainment": round(att, 4) if res.requests else None,
        "goodput_rps": round(att * len(res.requests) / res.duration_s, 3) if res.duration_s else None,
        "attainment_by_itl_ms": {f"{t * 1000:g}": round(attainment(res.requests, Slo(slo.ttft_s, t)), 4)
                                 for t in ITL_SWEEP_S},
        "local_prefills": run.get("local_prefills"), "split": run.get("split"),
        "wall_s": round(res.wall_s, 2),
    }


def crossover(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Per workload: the swept ITL targets at which some split fleet meets the SLO for more requests
    than the aggregated fleet (goodput is attainment x requests / duration, and the durations are
    nearly equal), with the best split fleet at each; or a note that there is none."""
    out: dict[str, str] = {}
    for wl in dict.fromkeys(r["workload"] for r in rows):
        agg = next(r for r in rows if r["workload"] == wl and r["fleet"] == "aggregated")
        wins = []
        for key, agg_att in agg["attainment_by_itl_ms"].items():
            best = max((r for r in rows if r["workload"] == wl and r["fleet"] != "aggregated"),
                       key=lambda r: r["attainment_by_itl_ms"][key])
            if best["attainment_by_itl_ms"][key] > agg_att:
                wins.append(f"{key} ms: {best['fleet']} {100 * best['attainment_by_itl_ms'][key]:.1f}% "
                            f"vs {100 * agg_att:.1f}%")
        out[wl] = ("a split fleet beats aggregated at ITL " + "; ".join(wins)) if wins \
            else "no split fleet beats aggregated at any swept ITL target"
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["workload", "fleet", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "slo_attainment",
            "goodput_rps", "local_prefills"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=AZURE, help="Azure 2023 code trace CSV (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace (default: all 8,819)")
    ap.add_argument("--time-scales", default="1.0,0.5", help="arrival-time compression factors (comma list)")
    ap.add_argument("--ttft", type=float, default=Slo.ttft_s)
    ap.add_argument("--itl", type=float, default=Slo.itl_s)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    slo = Slo(args.ttft, args.itl)
    profile = GPU_LIKE
    rows = []
    for scale in (float(s) for s in args.time_scales.split(",")):
        for name, make in (("azure-code", azure_code), ("long-output", long_output_mix)):
            reqs = make(args.limit, scale, args.trace)
            span = max(r.arrival for r in reqs) or 1.0
            label = f"{name} {len(reqs) / span:.1f} rps"
            for kind in FLEETS:
                row = summarize(run_fleet(kind, profile, reqs), slo)
                row["workload"] = label
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"profile {profile.name}; SLO: TTFT <= {slo.ttft_s:g} s and per-request mean ITL <= {slo.itl_s * 1000:g} ms; "
          f"conditional threshold {threshold_from_profile(profile)} uncached tokens, prefill queue cap "
          f"{2 * profile.max_num_batched_tokens} tokens")
    print(table(rows))
    keys = [f"{t * 1000:g}" for t in ITL_SWEEP_S]
    print(f"\nSLO attainment by ITL target (TTFT <= {slo.ttft_s:g} s):")
    print("| workload | fleet | " + " | ".join(f"ITL {k} ms" for k in keys) + " |")
    print("|" + "---|" * (len(keys) + 2))
    for r in rows:
        print(f"| {r['workload']} | {r['fleet']} | "
              + " | ".join(f"{100 * r['attainment_by_itl_ms'][k]:.1f}%" for k in keys) + " |")
    for wl, note in crossover(rows).items():
        print(f"{wl}: {note}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
