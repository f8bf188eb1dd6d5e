"""``dyad plan``: what prefill/decode split does this trace need, and what does the planner save?

    dyad plan --trace traces/aibrix_8min_up_and_down.jsonl --ttft 1 --itl 0.05 --budget 16
    dyad plan --trace synthetic:daily,peak=4,trough=0.5,osl_ratio=4,seed=1 --budget 24 --plot day.png

Everything runs in virtual time on the simulated fleet (``orchestrator/sim/virtual_time.py``):
1. static splits: for every prefill count P, the fewest decode workers D that reach the SLO
   attainment goal (binary search), and the cheapest such split ("best static in hindsight");
2. the dynamic SLO planner (the same ``Planner`` the gateway runs) and
3. the reactive queue-length autoscaler (KEDA/HPA-style baseline), both starting from the same
   neutral split (``--start``; by default what the profile sizes for the first interval's load, the
   fleet an operator would have deployed for the load at hand — never the hindsight answer).
4. optionally (``--oracle``) upper bounds, not planners: the same start split, then a split known in
   hindsight from a given moment on (``HindsightOracle``: what no planner without foresight before that
   moment can beat).
Reports SLO attainment, worker-hours, cost and goodput per worker as a table; ``--json`` adds a
per-interval timeline per strategy (load, ISL/OSL, TTFT/ITL, P and D counts) and the planner's
decisions with the reason for each change; ``--plot`` draws it (needs the ``plots`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from adapters.base import Role
from orchestrator.planner.baselines import HindsightOracle, QueueAutoscaler, first_overload
from orchestrator.planner.core import Planner, PlannerSettings
from orchestrator.planner.metrics_source import PEAK_WINDOW_S
from orchestrator.planner.perf_model import PerfModel, ProfileError
from orchestrator.planner.predictors import LoadForecast
from orchestrator.planner.solver import Limits, Targets, fit_budget, solve
from orchestrator.sim.profiles import EngineProfile
from orchestrator.sim.virtual_cli import MAX_WORKERS, TRACE_HELP, add_common, fail, load_requests, number
from orchestrator.sim.virtual_time import (
    FleetSpec,
    SimRequest,
    SimResult,
    VirtualFleet,
    requests_from_trace,
    sweep_profile,
)
from orchestrator.stats import percentile

PLOT_EXTRA = "dyad-serve[plots]"


def configure(parser: argparse.ArgumentParser) -> None:
    from orchestrator.bench.workloads import SHAPES
    add_common(parser, TRACE_HELP + "; or a seeded synthetic day, synthetic:<shape>[,key=value ...] (shapes: "
               + ", ".join(SHAPES) + "; keys: duration, peak, trough, isl, osl, osl_ratio, sigma, noise, max_len, seed; "
               "e.g. synthetic:daily,peak=4,trough=0.5,seed=1)")
    parser.add_argument("--budget", type=number(int, le=MAX_WORKERS), required=True, help="most workers (prefill + decode) allowed")
    parser.add_argument("--goal", type=number(), default=0.99, help="SLO attainment a split must reach (0..1)")
    parser.add_argument("--start", default="auto",
                        help="split the planner and the autoscaler start from: P:D, or auto (the profile's "
                             "sizing for the first interval's load)")
    parser.add_argument("--perf-profile", default=None,
                        help="planner performance profile JSON (from `dyad profile`); default: sweep --profile")
    parser.add_argument("--decode-profile", default=None,
                        help="engine profile of the decode workers when they run on other hardware (default: "
                             "--profile)")
    parser.add_argument("--decode-perf-profile", default=None,
                        help="planner performance profile JSON of the decode workers (default: sweep --decode-profile)")
    parser.add_argument("--prefill-cost", type=number(ge=0), default=1.0, help="price of a prefill worker-hour")
    parser.add_argument("--decode-cost", type=number(ge=0), default=1.0, help="price of a decode worker-hour")
    parser.add_argument("--cost-budget", type=number(gt=0), default=None, help="most spent per hour on the fleet")
    parser.add_argument("--predictor", default="auto", choices=["constant", "ewma", "linear", "holt_winters", "auto"])
    parser.add_argument("--headroom", type=number(ge=0), default=0.0,
                        help="planner plans for (1 + headroom) x the forecast rate (surges during engine start)")
    parser.add_argument("--decode-headroom", type=number(ge=0), default=0.25,
                        help="decode sized for (1 + this) x the peak streams in flight within an interval")
    parser.add_argument("--burst-window", type=_auto_float, default=600.0,
                        help="burst floor: prefill sized for seconds-scale peaks and kept this many seconds (0 = off; "
                             "auto = --start-s + --interval, the time a worker given back takes to return)")
    parser.add_argument("--decode-floor", action="store_true",
                        help="the burst floor keeps decode's peak sizing too (default: prefill's only)")
    parser.add_argument("--rise-quantile", type=number(ge=0, lt=1), default=0.0,
                        help="size for the lead forecast times this quantile of how far the load outran it "
                             "recently (a conformal upper bound; 0 = off)")
    parser.add_argument("--jump-quantile", type=_quantile_arg, default=None,
                        help="the quantile of the load's measured rises (and bursts) that insurance covers "
                             "(default: PlannerSettings')")
    parser.add_argument("--scale-in-step", type=number(int, ge=0), default=1,
                        help="most workers of a role given back per interval (0 = all above the need plus margin, "
                             "after the hysteresis intervals and the churn rule)")
    parser.add_argument("--fast-interval", type=number(ge=0), default=2.0,
                        help="load-reactive mode: look at queues every this many seconds between intervals (0 = off)")
    parser.add_argument("--standby-prefill", type=number(int, ge=0), default=1,
                        help="warm standby prefill workers kept at least (0 = none)")
    parser.add_argument("--standby-decode", type=number(int, ge=0), default=1, help="warm standby decode workers kept at least")
    parser.add_argument("--standby-auto", action="store_true",
                        help="keep more than --standby-prefill/--standby-decode warm workers when the recent bursts "
                             "need them (sized from observed burst factors)")
    parser.add_argument("--standby-net-of-spare", action=argparse.BooleanOptionalAction, default=None,
                        help="count serving workers kept beyond the model's sizing (burst floor, scale-in "
                             "hysteresis) against the warm standby pool (default: PlannerSettings')")
    parser.add_argument("--standby-shared", action=argparse.BooleanOptionalAction, default=None,
                        help="one warm standby pool for both roles, sized for their joint shortfall measured over the "
                             "load's history (not the sum of per-role pools), woken into the role that needs it by a "
                             "role change (--role-change-s); only when both roles run on the same profile at the "
                             "same price (default: PlannerSettings')")
    parser.add_argument("--fast-lookahead", action=argparse.BooleanOptionalAction, default=None,
                        help="load-reactive mode: wake warm decode standby for the streams extrapolated to when a "
                             "worker woken at the next look would serve (fast interval + standby wake, from the "
                             "growth over that span), not the streams now (default: PlannerSettings')")
    parser.add_argument("--scale-in-insured", action=argparse.BooleanOptionalAction, default=None,
                        help="a confirmed decline keeps giving back: after a step down, while every interval stays "
                             "below capacity, one more worker goes back the next interval when the pool without it "
                             "still holds the capacity proportional insurance measured and the hysteresis keep "
                             "(default: PlannerSettings')")
    parser.add_argument("--standby-confirm", action=argparse.BooleanOptionalAction, default=None,
                        help="a warm standby want that comes without growth (no role grew this interval or in "
                             "the load mode since the last one, and the load rose no further than its measured "
                             "rise) cold-starts a worker only once it held over the last scale-in intervals (a want "
                             "born of one interval's rounding wobble is gone before the worker is ready); parking "
                             "is not held back (default: PlannerSettings')")
    parser.add_argument("--standby-wake-s", type=number(ge=0), default=5.0,
                        help="seconds a standby worker takes to serve once activated (vLLM sleep mode: ~seconds)")
    parser.add_argument("--insurance", choices=["fixed", "proportional"], default="proportional",
                        help="capacity beyond the model's sizing: fixed (the --burst-window floor and the "
                             "--standby-* warm workers) or proportional (once the load's rise within --start-s + "
                             "--interval is measured, the floor and the warm standby keep only what the horizon's "
                             "largest need times that rise asks for; --burst-window and --standby-* are the bounds)")
    parser.add_argument("--cold-backlog", choices=["off", "observed", "forecast"], default="observed",
                        help="load mode: start cold prefill workers only for a backlog that outlasts the start-up, "
                             "judged on the arrivals seen now (observed) or the forecast (forecast); off = every "
                             "confirmed shortfall starts cold workers")
    parser.add_argument("--keda-prefill-target", type=number(gt=0), default=1.0,
                        help="queue-length baseline: requests per prefill worker")
    parser.add_argument("--keda-decode-target", type=number(gt=0), default=32.0,
                        help="queue-length baseline: requests per decode worker")
    parser.add_argument("--keda-window", type=number(ge=0), default=300.0, help="baseline scale-down stabilization, s")
    parser.add_argument("--no-static-search", action="store_true", help="skip the static search (faster)")
    parser.add_argument("--static", default=None, metavar="P:D",
                        help="replay this static split as the comparison row instead of searching (e.g. a split "
                             "an earlier search found)")
    parser.add_argument("--oracle", action="append", default=None, metavar="SPLIT@WHEN[,SPLIT@WHEN...]",
                        help="add an upper-bound row (repeatable): the start split until the first WHEN, then at "
                             "least SPLIT from each WHEN on (cold starts, never scaled in). SPLIT: P:D, static (the "
                             "static row's split) or budget (its decode count, the rest of --budget prefill); WHEN: "
                             "seconds, or overload (the first arrival at which the last 5 s held more arrivals than "
                             "any 5 s of the first interval: the first sign, without foresight, that the start "
                             "split is outgrown). E.g. static@30 = a planner that knows the future from its first "
                             "decision; budget@overload = one that grows only on load it has seen")
    parser.add_argument("--oracle-only", action="store_true",
                        help="skip the planner and autoscaler runs: the static row (if any) and the --oracle rows only")
    parser.add_argument("--plot", default=None,
                        help=f"write a PNG here: load, workers, TTFT/ITL vs the SLO per strategy (needs {PLOT_EXTRA})")


def _quantile_arg(v: str) -> float:
    try:
        q = float(v)
    except ValueError:
        q = math.nan
    if not 0 < q <= 1:
        raise argparse.ArgumentTypeError(f"expected a quantile in (0, 1] (got {v!r})")
    return q


def _auto_float(v: str) -> float | None:
    if v == "auto":
        return None
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds or auto (got {v!r})") from None


# ------------------------------------------------------------------------------ inputs

def requests_for(args: argparse.Namespace) -> list[SimRequest]:
    """``--trace`` as simulator requests: a trace file, or a seeded ``synthetic:`` workload."""
    from orchestrator.bench.workloads import is_synthetic, load_synthetic

    if not is_synthetic(args.trace):
        return load_requests(args.trace, args.format, speed=args.speed, scale_len=args.scale_len,
                             duration_s=args.duration, limit=args.limit)
    if args.speed <= 0:
        raise ValueError("--speed must be > 0")
    reqs = requests_from_trace(load_synthetic(args.trace, time_scale=1.0 / args.speed, scale_len=args.scale_len))
    if args.duration is not None:
        reqs = [r for r in reqs if r.arrival < args.duration]
    if args.limit is not None:
        reqs = reqs[: args.limit]
    if not reqs:
        raise ValueError(f"{args.trace}: no requests")
    return reqs


def perf_model_for(args: argparse.Namespace, profile: EngineProfile) -> PerfModel:
    if getattr(args, "perf_profile", None):
        return PerfModel.load(args.perf_profile)
    return PerfModel.from_dict(sweep_profile(profile))


def decode_perf_for(args: argparse.Namespace, profile: EngineProfile) -> PerfModel | None:
    if getattr(args, "decode_perf_profile", None):
        return PerfModel.load(args.decode_perf_profile)
    if getattr(args, "decode_profile", None):
        return PerfModel.from_dict(sweep_profile(profile))
    return None


def limits_for(args: argparse.Namespace, budget: int) -> Limits:
    return Limits(budget=budget, prefill_cost=getattr(args, "prefill_cost", 1.0),
                  decode_cost=getattr(args, "decode_cost", 1.0), cost_budget=getattr(args, "cost_budget", None))


# PlannerSettings fields with a --x / --no-x flag whose default (None) leaves the setting's own default
ON_OFF_SETTINGS = ("standby_net_of_spare", "fast_lookahead", "standby_shared", "standby_confirm", "scale_in_insured")


def make_planner(args: argparse.Namespace, profile: EngineProfile, budget: int,
                 decode_profile: EngineProfile | None = None) -> Planner:
    g = getattr
    settings = PlannerSettings(
        targets=Targets(args.ttft, args.itl), limits=limits_for(args, budget), interval_s=args.interval,
        predictor=g(args, "predictor", "auto"), role_change_s=args.role_change_s, start_s=args.start_s,
        cooldown_s=2 * args.interval, headroom=g(args, "headroom", 0.0),
        decode_headroom=g(args, "decode_headroom", 0.25), burst_window_s=g(args, "burst_window", 600.0),
        scale_in_step=g(args, "scale_in_step", 1), rise_quantile=g(args, "rise_quantile", 0.0),
        decode_floor=g(args, "decode_floor", False), fast_interval_s=g(args, "fast_interval", 2.0),
        standby_auto=g(args, "standby_auto", False), standby_prefill=g(args, "standby_prefill", 1),
        standby_decode=g(args, "standby_decode", 1),
        standby_wake_s=g(args, "standby_wake_s", 5.0), cold_backlog=g(args, "cold_backlog", "observed"),
        insurance=g(args, "insurance", "proportional"))
    if g(args, "jump_quantile", None) is not None:
        settings.jump_quantile = args.jump_quantile
    for name in ON_OFF_SETTINGS:  # --x / --no-x: PlannerSettings' default unless given
        if g(args, name, None) is not None:
            setattr(settings, name, g(args, name))
    decode_perf = decode_perf_for(args, decode_profile) if decode_profile is not None else None
    return Planner(perf_model_for(args, profile), settings, decode_perf=decode_perf)


def neutral_split(args: argparse.Namespace, perf: PerfModel, decode_perf: PerfModel | None,
                  reqs: list[SimRequest], budget: int) -> tuple[tuple[int, int], str]:
    """The split every dynamic strategy starts from. ``P:D`` as given, or ``auto``: the profile's
    sizing for the first interval's load (what an operator deploys for the load at hand): decode for
    its mean rate, prefill for its peak rate over ``PEAK_WINDOW_S`` (as the planner's burst floor does)."""
    spec = str(getattr(args, "start", "auto"))
    if spec != "auto":
        try:
            p, d = (int(x) for x in spec.split(":"))
        except ValueError:
            raise ValueError(f"--start must be P:D or auto (got {spec!r})") from None
        if p < 1 or d < 1 or p + d > budget:
            raise ValueError(f"--start {spec}: need P >= 1, D >= 1 and P + D <= --budget {budget}")
        return (p, d), f"given ({spec})"
    first = [r for r in reqs if r.arrival < reqs[0].arrival + args.interval] or reqs[:1]
    f = LoadForecast(len(first) / args.interval, sum(r.isl for r in first) / len(first),
                     sum(r.osl for r in first) / len(first))
    bins: dict[int, int] = {}
    for r in first:
        k = int(r.arrival // PEAK_WINDOW_S)
        bins[k] = bins.get(k, 0) + 1
    peak = max(f.request_rate, max(bins.values()) / PEAK_WINDOW_S)
    lim = limits_for(args, budget)
    mean = solve(f, perf, Targets(args.ttft, args.itl), lim, decode_perf=decode_perf)
    burst = solve(LoadForecast(peak, f.isl, f.osl), perf, Targets(args.ttft, args.itl), lim, decode_perf=decode_perf)
    p, d = burst.prefill, mean.decode
    if not lim.fits(p, d):
        p, d = fit_budget(burst.prefill_exact, mean.decode_exact, lim)
    return (p, d), (f"auto: the profile's sizing for the first {args.interval:g}s: {f.request_rate:.2f} req/s "
                    f"(peak {peak:.2f} over {PEAK_WINDOW_S:g}s), ISL {f.isl:.0f}, OSL {f.osl:.0f}")


# ------------------------------------------------------------------------------ runs

def simulate(args: argparse.Namespace, profile: EngineProfile, reqs: list[SimRequest], spec: FleetSpec,
             scaler: Any = None, decode_profile: EngineProfile | None = None,
             give_up_below: float | None = None) -> SimResult:
    """One replay. ``give_up_below``: stop as soon as so many requests missed the SLO that the
    attainment cannot reach this goal any more (the static search only needs pass/fail there)."""
    fresh = [SimRequest(r.id, r.arrival, r.isl, r.osl, r.blocks, r.block_tokens) for r in reqs]
    fleet = VirtualFleet(profile, spec, policy=args.policy, scaler=scaler, interval_s=args.interval,
                         start_s=args.start_s, role_change_s=args.role_change_s,
                         role_profiles={Role.DECODE: decode_profile} if decode_profile else None)
    stop = None
    if give_up_below is not None:
        allowed = math.floor((1.0 - give_up_below) * len(fresh) + 1e-9)
        missed = 0

        def stop(r: SimRequest) -> bool:
            nonlocal missed
            if r.ttft is None or r.ttft > args.ttft or (r.itl is not None and r.itl > args.itl):
                missed += 1
            return missed > allowed
    return fleet.run(fresh, stop=stop)


def search_static(args: argparse.Namespace, profile: EngineProfile, reqs: list[SimRequest],
                  log: Any = None, decode_profile: EngineProfile | None = None,
                  ) -> tuple[tuple[int, int], dict[str, Any], list[dict[str, Any]], SimResult]:
    """For each P, the smallest D reaching the goal; the cheapest split (by cost per hour, then by
    workers), its summary, all splits tried, and its run."""
    cache: dict[tuple[int, int], tuple[dict[str, Any], SimResult]] = {}
    lim = limits_for(args, args.budget)

    def score(p: int, d: int) -> dict[str, Any]:
        if (p, d) not in cache:
            res = simulate(args, profile, reqs, FleetSpec(p, d), decode_profile=decode_profile,
                           give_up_below=args.goal)
            summary = res.summary(args.ttft, args.itl)
            summary["stopped_early"] = summary["finished"] < summary["requests"]
            res.requests = []  # keep the summary, not every request of every split tried
            cache[(p, d)] = (summary, res)
            if log:
                log(f"  static P={p} D={d}: " + (f"< {100 * args.goal:g}% (stopped early)" if summary["stopped_early"]
                                                  else f"{100 * summary['slo_attainment']:.2f}%"))
        return cache[(p, d)][0]

    def price(split: tuple[int, int]) -> tuple[float, int]:
        return lim.cost(*split), sum(split)

    best: tuple[int, int] | None = None
    fallback = (1, 1)
    for p in range(1, args.budget):
        if best is not None and lim.cost(p + 1, 0) >= price(best)[0] and p + 1 >= sum(best):
            break
        hi = args.budget - p
        if best is not None:  # only cheaper splits are of interest
            while hi >= 1 and price((p, hi)) >= price(best):
                hi -= 1
        if lim.cost_budget is not None:
            while hi >= 1 and not lim.fits(p, hi):
                hi -= 1
        if hi < 1 or score(p, hi)["slo_attainment"] < args.goal:
            top = args.budget - p
            # the best-effort fallback matters only while no split reaches the goal (each is a full replay)
            if best is None and lim.fits(p, top) and score(p, top)["slo_attainment"] > score(*fallback)["slo_attainment"]:
                fallback = (p, top)
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
    run_ = simulate(args, profile, reqs, FleetSpec(*chosen), decode_profile=decode_profile)
    summary = run_.summary(args.ttft, args.itl)  # in full, also when the search gave up on it early
    tried = [{"prefill": p, "decode": d, **{k: s[k] for k in ("slo_attainment", "worker_hours", "stopped_early")}}
             for (p, d), (s, _) in sorted(cache.items())]
    return chosen, summary, tried, run_


def interval_rows(res: SimResult, interval: float, ttft: float, itl: float,
                  start: tuple[int, int]) -> list[dict[str, Any]]:
    """Per interval (by arrival): load, lengths, TTFT/ITL p90, SLO attainment and P/D counts (serving or
    starting; a warm standby pool is shown apart)."""
    if not res.requests:
        return []
    end = max(r.arrival for r in res.requests)
    n = int(end // interval) + 1
    bins: list[list[SimRequest]] = [[] for _ in range(n)]
    for r in res.requests:
        bins[int(r.arrival // interval)].append(r)
    tl = [(d.at, d.current.get("prefill", 0), d.current.get("decode", 0), sum(d.standby.values()))
          for d in res.decisions if d.mode == "interval"]
    rows, j = [], -1
    counts = (start[0], start[1], 0)
    for k, b in enumerate(bins):
        t0 = k * interval
        while j + 1 < len(tl) and tl[j + 1][0] <= t0 + 1e-9:
            j += 1
            counts = (tl[j][1], tl[j][2], tl[j][3])
        ttfts = sorted(r.ttft for r in b if r.ttft is not None)
        itls = sorted(r.itl for r in b if r.itl is not None)
        ok = sum(1 for r in b if r.finish is not None and r.ttft is not None and r.ttft <= ttft
                 and (r.itl is None or r.itl <= itl))
        rows.append({
            "t": t0, "rate": round(len(b) / interval, 4),
            "isl": round(sum(r.isl for r in b) / len(b), 1) if b else None,
            "osl": round(sum(r.osl for r in b) / len(b), 1) if b else None,
            "ttft_p90_s": round(percentile(ttfts, 90), 4) if ttfts else None,
            "itl_p90_s": round(percentile(itls, 90), 5) if itls else None,
            "slo_attainment": round(ok / len(b), 4) if b else None,
            "prefill": counts[0], "decode": counts[1], "standby": counts[2]})
    return rows


def with_cost(summary: dict[str, Any], res: SimResult, lim: Limits) -> dict[str, Any]:
    rs = res.role_seconds
    summary["cost"] = round((rs.get("prefill", 0.0) * lim.prefill_cost + rs.get("decode", 0.0) * lim.decode_cost)
                            / 3600.0, 4)
    summary["prefill_worker_hours"] = round(rs.get("prefill", 0.0) / 3600.0, 4)
    summary["decode_worker_hours"] = round(rs.get("decode", 0.0) / 3600.0, 4)
    return summary


BREAKDOWN_PARTS = ("standby", "starting", "waking", "floor", "hold", "sized")


def breakdown(res: SimResult, static_wh: float | None = None) -> dict[str, Any]:
    """Where a run's worker-hours went (pure accounting over the replay): warm ``standby`` (incl. starting
    into it), cold ``starting`` and ``waking`` standby (paid, not serving), and serving workers split into
    those the burst ``floor`` kept beyond the model's sizing, those ``hold`` kept beyond both (scale-in
    hysteresis, the churn rule, the pace of giving back, decode's batch-cap floor) and the rest (``sized``: what the model
    asked for, the latency guard and the 1 + 1 minimum included). With ``static_wh``: ``sized`` minus
    the static split's worker-hours is the serving capacity above it (negative: below it, in troughs)."""
    ss = res.state_seconds
    per_role: dict[str, dict[str, float]] = {}
    for key, sec in ss.items():
        bucket, role = key.split(":", 1)
        per_role.setdefault(role, {})
        per_role[role][bucket] = per_role[role].get(bucket, 0.0) + sec / 3600.0
    out: dict[str, Any] = {}
    for part in BREAKDOWN_PARTS:
        if part == "sized":
            v = sum(r.get("serving", 0.0) - r.get("floor", 0.0) - r.get("hold", 0.0) for r in per_role.values())
        else:
            v = sum(r.get(part, 0.0) for r in per_role.values())
        out[part] = round(v, 4)
    out["by_role"] = {role: {k: round(v, 4) for k, v in sorted(r.items())} for role, r in sorted(per_role.items())}
    if static_wh is not None:
        out["static"] = round(static_wh, 4)
        out["sized_above_static"] = round(out["sized"] - static_wh, 4)
        out["excess_over_static"] = round(res.worker_seconds / 3600.0 - static_wh, 4)
    return out


def _breakdown_line(name: str, b: dict[str, Any]) -> str:
    parts = [f"standby {b['standby']:.3f}", f"starting {b['starting'] + b['waking']:.3f}",
             f"floor {b['floor']:.3f}", f"hold {b['hold']:.3f}", f"sized {b['sized']:.3f}"]
    if "static" in b:
        parts.append(f"(sized - static {b['sized_above_static']:+.3f}; total - static {b['excess_over_static']:+.3f})")
    return f"  {name}: worker-hours " + ", ".join(parts)


def oracle_split(spec: str, static: tuple[int, int] | None, budget: int) -> tuple[int, int]:
    """An oracle stage's split: ``P:D``, ``static`` (the static row's split) or ``budget`` (the static split's
    decode count, every other worker of the budget prefill)."""
    if spec in ("static", "budget"):
        if static is None:
            raise ValueError(f"--oracle {spec}: needs the static row (a search or --static P:D)")
        return static if spec == "static" else (budget - static[1], static[1])
    try:
        p, d = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--oracle: a split is static, budget or P:D (got {spec!r})") from None
    if p < 1 or d < 1:
        raise ValueError(f"--oracle {spec}: need P >= 1 and D >= 1")
    return p, d


def oracle_stages(spec: str, static: tuple[int, int] | None, budget: int, interval: float,
                  arrivals: list[float]) -> list[tuple[float, tuple[int, int]]]:
    """``--oracle SPLIT@WHEN[,...]`` as (seconds, split) stages; WHEN ``overload`` = ``first_overload`` of
    the arrivals (never: the stage never comes)."""
    stages = []
    for part in spec.split(","):
        split, _, when = part.strip().partition("@")
        if not when:
            raise ValueError(f"--oracle {spec}: each stage is SPLIT@WHEN (got {part!r})")
        if when == "overload":
            t = first_overload(arrivals, interval, PEAK_WINDOW_S)
            at = math.inf if t is None else t
        else:
            try:
                at = float(when)
            except ValueError:
                raise ValueError(f"--oracle {spec}: WHEN is seconds or overload (got {when!r})") from None
        stages.append((at, oracle_split(split, static, budget)))
    return stages


def make_oracle(args: argparse.Namespace, stages: list[tuple[float, tuple[int, int]]]) -> HindsightOracle:
    # looks between interval ticks only when a stage falls between them
    off_tick = any(math.isfinite(at) and at % args.interval > 1e-9 for at, _ in stages)
    fast = (getattr(args, "fast_interval", 2.0) or 2.0) if off_tick else 0.0
    return HindsightOracle([(at, {Role.PREFILL: p, Role.DECODE: d}) for at, (p, d) in stages], fast_interval_s=fast)


def run(args: argparse.Namespace) -> int:
    from orchestrator.sim.profiles import load_profile

    if args.budget < 2:
        return fail("--budget must be at least 2 (one prefill and one decode worker)")
    if not 0 < args.goal <= 1:
        return fail("--goal must be in (0, 1]")
    if getattr(args, "oracle_only", False) and not getattr(args, "oracle", None):
        return fail("--oracle-only needs at least one --oracle")
    if args.plot and not plot_available():
        return fail(f"--plot needs matplotlib: pip install '{PLOT_EXTRA}'")
    try:
        profile = load_profile(args.profile)
        decode_profile = load_profile(args.decode_profile) if args.decode_profile else None
        reqs = requests_for(args)
        perf = perf_model_for(args, profile)
        dperf = decode_perf_for(args, decode_profile or profile)
        lim = limits_for(args, args.budget)
        start, start_why = neutral_split(args, perf, dperf, reqs, args.budget)
    except (OSError, ValueError, KeyError, ProfileError) as e:
        return fail(str(e))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    timelines: dict[str, list[dict[str, Any]]] = {}
    decisions: dict[str, list[dict[str, Any]]] = {}
    tried: list[dict[str, Any]] = []
    static: tuple[int, int] | None = None
    given = getattr(args, "static", None)
    if given:
        try:
            static = tuple(int(x) for x in given.split(":"))  # type: ignore[assignment]
            assert static is not None and len(static) == 2 and min(static) >= 1
        except (ValueError, AssertionError):
            return fail(f"--static must be P:D with P, D >= 1 (got {given!r})")
        sres = simulate(args, profile, reqs, FleetSpec(*static), decode_profile=decode_profile)
        name = f"static P={static[0]} D={static[1]} (given)"
        rows.append({"strategy": name, **with_cost(sres.summary(args.ttft, args.itl), sres, lim)})
        timelines[name] = interval_rows(sres, args.interval, args.ttft, args.itl, static)
    elif not args.no_static_search:
        log("searching static splits ...")
        static, best, tried, sres = search_static(args, profile, reqs, log, decode_profile)
        name = f"static P={static[0]} D={static[1]} (best in hindsight)"
        rows.append({"strategy": name, **with_cost(best, sres, lim)})
        timelines[name] = interval_rows(sres, args.interval, args.ttft, args.itl, static)
    dyn = base = None
    if not getattr(args, "oracle_only", False):
        planner = make_planner(args, profile, args.budget, decode_profile)
        dyn = simulate(args, profile, reqs, FleetSpec(*start), planner, decode_profile)
        rows.append({"strategy": "dynamic SLO planner", **with_cost(dyn.summary(args.ttft, args.itl), dyn, lim)})
        timelines["dynamic SLO planner"] = interval_rows(dyn, args.interval, args.ttft, args.itl, start)
        decisions["dynamic SLO planner"] = [d.timeline_row() for d in dyn.decisions]
        keda = QueueAutoscaler(Limits(budget=args.budget), args.keda_prefill_target, args.keda_decode_target,
                               args.keda_window)
        base = simulate(args, profile, reqs, FleetSpec(*start), keda, decode_profile)
        name = "queue-length autoscaler (KEDA-style)"
        rows.append({"strategy": name, **with_cost(base.summary(args.ttft, args.itl), base, lim)})
        timelines[name] = interval_rows(base, args.interval, args.ttft, args.itl, start)
    oracle_rows: list[dict[str, Any]] = []
    arrivals = sorted(r.arrival for r in reqs)
    for spec in getattr(args, "oracle", None) or []:
        try:
            stages = oracle_stages(spec, static, args.budget, args.interval, arrivals)
        except ValueError as e:
            return fail(str(e))
        ores = simulate(args, profile, reqs, FleetSpec(*start), make_oracle(args, stages), decode_profile)
        name = "oracle: start split, then " + ", ".join(
            f">= P={p} D={d} from t={at:.3f}s" for at, (p, d) in stages)
        oracle_rows.append({"strategy": name, "oracle": spec, **with_cost(ores.summary(args.ttft, args.itl), ores, lim)})
        timelines[name] = interval_rows(ores, args.interval, args.ttft, args.itl, start)
        decisions[name] = [d.timeline_row() for d in ores.decisions]

    print(f"trace {args.trace}: {len(reqs)} requests; SLO TTFT <= {args.ttft}s and ITL <= {args.itl}s, goal "
          f"{100 * args.goal:g}%; budget {args.budget} workers"
          + (f" / {args.cost_budget:g} per hour" if args.cost_budget is not None else "")
          + f"; engine profile {profile.name}" + (f" (decode: {decode_profile.name})" if decode_profile else ""))
    print(f"dynamic strategies start from P={start[0]} D={start[1]} ({start_why})")
    print(f"{'strategy':44} {'SLO %':>7} {'worker-h':>9} {'cost':>8} {'goodput/w':>10} {'TTFT p99':>9} {'ITL p90':>8}")
    for r in rows:
        print(f"{r['strategy']:44} {100 * r['slo_attainment']:7.2f} {r['worker_hours']:9.3f} {r['cost']:8.3f} "
              f"{r['goodput_per_worker']:10.3f} {_ms(r['ttft_p99_s']):>9} {_ms(r['itl_p90_s']):>8}")
    static_wh = rows[0]["worker_hours"] if static is not None else None
    if dyn is not None and base is not None:
        rows[-2]["worker_hours_breakdown"] = breakdown(dyn, static_wh)
        rows[-1]["worker_hours_breakdown"] = breakdown(base, static_wh)
    for r in oracle_rows:
        print(f"{'oracle ' + r['oracle']:44} {100 * r['slo_attainment']:7.2f} {r['worker_hours']:9.3f} "
              f"{r['cost']:8.3f} {r['goodput_per_worker']:10.3f} {_ms(r['ttft_p99_s']):>9} {_ms(r['itl_p90_s']):>8}")
        print(f"  ({r['strategy']})")
    if static is not None:
        if dyn is not None:
            print(f"dynamic / {'given' if given else 'best'} static worker-hours: "
                  f"{rows[1]['worker_hours'] / rows[0]['worker_hours']:.3f}")
        for r in oracle_rows:
            print(f"oracle {r['oracle']} / {'given' if given else 'best'} static worker-hours: "
                  f"{r['worker_hours'] / rows[0]['worker_hours']:.3f}")
    if dyn is not None:
        print("where the worker-hours went (standby | starting+waking | burst floor | scale-in hold | "
              "sized by the model):")
        print(_breakdown_line("planner", rows[-2]["worker_hours_breakdown"]))
        print(_breakdown_line("autoscaler", rows[-1]["worker_hours_breakdown"]))
    rows += oracle_rows
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "trace": args.trace, "requests": len(reqs), "profile": profile.name,
            "decode_profile": decode_profile.name if decode_profile else None,
            "slo": {"ttft_s": args.ttft, "itl_s": args.itl, "goal": args.goal},
            "budget": {"workers": args.budget, "cost_per_hour": args.cost_budget,
                       "prefill_cost": args.prefill_cost, "decode_cost": args.decode_cost},
            "interval_s": args.interval, "start": {"prefill": start[0], "decode": start[1], "why": start_why},
            "results": rows, "static_tried": tried, "timelines": timelines, "decisions": decisions}, indent=1))
    if args.plot:
        plot(args.plot, timelines, args)
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


# ------------------------------------------------------------------------------ the plot

def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: str, timelines: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax_load, ax_w, ax_ttft, ax_itl = axes
    name = Path(args.trace).name if not args.trace.startswith("synthetic:") else args.trace
    fig.suptitle(f"dyad plan: {name}\nSLO TTFT <= {args.ttft:g} s, ITL <= {1000 * args.itl:g} ms; "
                 f"budget {args.budget} workers", fontsize=11)
    any_rows = next(iter(timelines.values()), [])
    ts = [r["t"] / 60.0 for r in any_rows]
    ax_load.step(ts, [r["rate"] for r in any_rows], where="post", color="black")
    ax_load.set_ylabel("arrivals (req/s)")
    def color_of(label: str) -> str:  # the same colour for a strategy in every plot
        return "tab:gray" if label.startswith("static") else "tab:blue" if label.startswith("dynamic") \
            else "tab:green" if label.startswith("oracle") else "tab:orange"

    for label, rows in timelines.items():
        color = color_of(label)
        t = [r["t"] / 60.0 for r in rows]
        short = label.split(" (")[0]
        ax_w.step(t, [r["prefill"] for r in rows], where="post", color=color, linestyle="--",
                  label=f"{short}: prefill")
        ax_w.step(t, [r["decode"] for r in rows], where="post", color=color, label=f"{short}: decode")
        if any(r.get("standby") for r in rows):
            ax_w.step(t, [r.get("standby", 0) for r in rows], where="post", color=color, linestyle=":",
                      label=f"{short}: warm standby")
        ax_ttft.plot(t, [r["ttft_p90_s"] if r["ttft_p90_s"] is not None else math.nan for r in rows],
                     color=color, label=short)
        ax_itl.plot(t, [1000 * r["itl_p90_s"] if r["itl_p90_s"] is not None else math.nan for r in rows],
                    color=color, label=short)
    ax_w.set_ylabel("workers")
    ax_w.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_w.legend(fontsize=7, ncol=3)
    ax_ttft.axhline(args.ttft, color="red", linestyle=":", label="TTFT SLO")
    ax_ttft.set_ylabel("TTFT p90 (s)")
    ax_ttft.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax_ttft.yaxis.set_major_formatter(plain)
    ax_ttft.yaxis.set_minor_formatter(plain)
    ax_ttft.legend(fontsize=7)
    ax_itl.axhline(1000 * args.itl, color="red", linestyle=":", label="ITL SLO")
    ax_itl.set_ylabel("ITL p90 (ms)")
    ax_itl.legend(fontsize=7)
    ax_itl.set_xlabel(f"time (virtual minutes; one point per {args.interval:g} s interval, by arrival)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
