"""``dyad plan``: what prefill/decode split does this trace need, and what does the planner save?

    dyad plan --trace /work/shared/traces/aibrix_8min_up_and_down.jsonl --ttft 1 --itl 0.05 --budget 16

Everything runs in virtual time on the simulated fleet (``orchestrator/sim/virtual_time.py``):
1. static splits: for every prefill count P, the fewest decode workers D that reach the SLO
   attainment goal (binary search), and the cheapest such split ("best static in hindsight");
2. the dynamic SLO planner (the same ``Planner`` the gateway runs) starting from that split;
3. the reactive queue-length autoscaler (KEDA/HPA-style baseline), same starting point.
Reports SLO attainment, worker-hours and goodput per worker as a table, optional JSON and PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from orchestrator.planner.baselines import QueueAutoscaler
from orchestrator.planner.core import Planner, PlannerSettings
from orchestrator.planner.perf_model import PerfModel, ProfileError
from orchestrator.planner.solver import Limits, Targets
from orchestrator.sim.profiles import EngineProfile
from orchestrator.sim.virtual_cli import add_common, fail, load_requests
from orchestrator.sim.virtual_time import FleetSpec, SimRequest, SimResult, VirtualFleet, sweep_profile


def configure(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--budget", type=int, required=True, help="most workers (prefill + decode) allowed")
    parser.add_argument("--goal", type=float, default=0.99, help="SLO attainment a split must reach (0..1)")
    parser.add_argument("--perf-profile", default=None,
                        help="planner performance profile JSON (from `dyad profile`); default: sweep --profile")
    parser.add_argument("--predictor", default="auto", choices=["constant", "ewma", "linear", "holt_winters", "auto"])
    parser.add_argument("--headroom", type=float, default=0.0,
                        help="planner plans for (1 + headroom) x the forecast rate (surges during engine start)")
    parser.add_argument("--burst-window", type=float, default=600.0,
                        help="burst floor: prefill sized for seconds-scale peaks and kept this many seconds (0 = off)")
    parser.add_argument("--keda-prefill-target", type=float, default=1.0,
                        help="queue-length baseline: requests per prefill worker")
    parser.add_argument("--keda-decode-target", type=float, default=32.0,
                        help="queue-length baseline: requests per decode worker")
    parser.add_argument("--keda-window", type=float, default=300.0, help="baseline scale-down stabilization, s")
    parser.add_argument("--no-static-search", action="store_true", help="skip the static search (faster)")
    parser.add_argument("--plot", default=None, help="write a PNG (workers over time per strategy) here")


def perf_model_for(args: argparse.Namespace, profile: EngineProfile) -> PerfModel:
    if getattr(args, "perf_profile", None):
        return PerfModel.load(args.perf_profile)
    return PerfModel.from_dict(sweep_profile(profile))


def make_planner(args: argparse.Namespace, profile: EngineProfile, budget: int) -> Planner:
    settings = PlannerSettings(
        targets=Targets(args.ttft, args.itl), limits=Limits(budget=budget), interval_s=args.interval,
        predictor=getattr(args, "predictor", "auto"), role_change_s=args.role_change_s, start_s=args.start_s,
        cooldown_s=2 * args.interval, headroom=getattr(args, "headroom", 0.0),
        burst_window_s=getattr(args, "burst_window", 600.0))
    return Planner(perf_model_for(args, profile), settings)


def simulate(args: argparse.Namespace, profile: EngineProfile, reqs: list[SimRequest], spec: FleetSpec,
             scaler: Any = None) -> SimResult:
    fresh = [SimRequest(r.id, r.arrival, r.isl, r.osl, r.blocks, r.block_tokens) for r in reqs]
    fleet = VirtualFleet(profile, spec, policy=args.policy, scaler=scaler, interval_s=args.interval,
                         start_s=args.start_s, role_change_s=args.role_change_s)
    return fleet.run(fresh)


def search_static(args: argparse.Namespace, profile: EngineProfile, reqs: list[SimRequest],
                  log: Any = None) -> tuple[tuple[int, int], dict[str, Any], list[dict[str, Any]]]:
    """For each P, the smallest D reaching the goal; returns the cheapest split, its summary, all tried."""
    cache: dict[tuple[int, int], dict[str, Any]] = {}

    def score(p: int, d: int) -> dict[str, Any]:
        if (p, d) not in cache:
            cache[(p, d)] = simulate(args, profile, reqs, FleetSpec(p, d)).summary(args.ttft, args.itl)
            if log:
                log(f"  static P={p} D={d}: {100 * cache[(p, d)]['slo_attainment']:.2f}%")
        return cache[(p, d)]

    best: tuple[int, int] | None = None
    fallback = (1, 1)
    for p in range(1, args.budget):
        if best is not None and p + 1 >= sum(best):
            break
        hi = args.budget - p if best is None else min(args.budget - p, sum(best) - p - 1)
        if hi < 1 or score(p, hi)["slo_attainment"] < args.goal:
            top = score(p, args.budget - p)
            if top["slo_attainment"] > score(*fallback)["slo_attainment"]:
                fallback = (p, args.budget - p)
            continue
        lo = 1
        while lo < hi:
            mid = (lo + hi) // 2
            if score(p, mid)["slo_attainment"] >= args.goal:
                hi = mid
            else:
                lo = mid + 1
        best = (p, hi)
    chosen = best or fallback
    tried = [{"prefill": p, "decode": d, **{k: s[k] for k in ("slo_attainment", "worker_hours")}}
             for (p, d), s in sorted(cache.items())]
    return chosen, score(*chosen), tried


def run(args: argparse.Namespace) -> int:
    from orchestrator.sim.profiles import load_profile

    if args.budget < 2:
        return fail("--budget must be at least 2 (one prefill and one decode worker)")
    if not 0 < args.goal <= 1:
        return fail("--goal must be in (0, 1]")
    try:
        profile = load_profile(args.profile)
        reqs = load_requests(args.trace, args.format, speed=args.speed, scale_len=args.scale_len,
                             duration_s=args.duration, limit=args.limit)
        perf_model_for(args, profile)
    except (OSError, ValueError, KeyError, ProfileError) as e:
        return fail(str(e))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    timelines: dict[str, list[tuple[float, int, int, int]]] = {}
    tried: list[dict[str, Any]] = []
    if args.no_static_search:
        start = (1, 1)
    else:
        log("searching static splits ...")
        start, best, tried = search_static(args, profile, reqs, log)
        rows.append({"strategy": f"static P={start[0]} D={start[1]} (best in hindsight)", **best})
    planner = make_planner(args, profile, args.budget)
    dyn = simulate(args, profile, reqs, FleetSpec(*start), planner)
    rows.append({"strategy": "dynamic SLO planner", **dyn.summary(args.ttft, args.itl)})
    timelines["dynamic SLO planner"] = dyn.timeline
    keda = QueueAutoscaler(Limits(budget=args.budget), args.keda_prefill_target, args.keda_decode_target,
                           args.keda_window)
    base = simulate(args, profile, reqs, FleetSpec(*start), keda)
    rows.append({"strategy": "queue-length autoscaler (KEDA-style)", **base.summary(args.ttft, args.itl)})
    timelines["queue-length autoscaler"] = base.timeline

    print(f"trace {args.trace}: {len(reqs)} requests; targets TTFT {args.ttft}s ITL {args.itl}s; "
          f"budget {args.budget}; engine profile {profile.name}")
    print(f"{'strategy':48} {'SLO %':>7} {'worker-h':>9} {'goodput/w':>10} {'TTFT p90':>9} {'ITL p90':>8}")
    for r in rows:
        print(f"{r['strategy']:48} {100 * r['slo_attainment']:7.2f} {r['worker_hours']:9.3f} "
              f"{r['goodput_per_worker']:10.3f} {_ms(r['ttft_p90_s']):>9} {_ms(r['itl_p90_s']):>8}")
    if rows and not args.no_static_search:
        print(f"dynamic / best static worker-hours: {rows[1]['worker_hours'] / rows[0]['worker_hours']:.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"results": rows, "static_tried": tried}, indent=2))
    if args.plot:
        plot(args.plot, timelines, reqs, start)
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


def plot(path: str, timelines: dict[str, list[tuple[float, int, int, int]]], reqs: list[SimRequest],
         static: tuple[int, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    end = max(r.arrival for r in reqs)
    bins = max(1, int(end // 30) + 1)
    counts = [0] * bins
    for r in reqs:
        counts[int(r.arrival // 30)] += 1
    ax0.step([i * 30 for i in range(bins)], [c / 30 for c in counts], where="post")
    ax0.set_ylabel("arrivals (req/s)")
    for name, tl in timelines.items():
        if tl:
            ts = [t for t, *_ in tl]
            ax1.step(ts, [p + d + b for _, p, d, b in tl], where="post", label=f"{name} (total)")
            ax1.step(ts, [p for _, p, _, _ in tl], where="post", linestyle=":", label=f"{name} (prefill)")
    ax1.axhline(sum(static), color="gray", linestyle="--", label=f"static P={static[0]} D={static[1]}")
    ax1.set_ylabel("workers")
    ax1.set_xlabel("virtual time (s)")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
