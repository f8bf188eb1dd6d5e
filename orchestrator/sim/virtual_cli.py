"""``dyad sim``: replay a trace against a simulated P/D (or aggregated) fleet in virtual time.

    dyad sim --trace shared/traces/mooncake_synthetic_trace.jsonl --prefill 6 --decode 4 \
             --profile gpu-like --ttft 2 --itl 0.05

Prints SLO attainment, latency percentiles, worker-hours and how fast the simulation ran. Requests are
routed by the live gateway's ``Router`` (the ``--policy``; P/D pair selection with ``--prefill/--decode``,
the local-prefill threshold derived from the profile as the gateway derives it, or ``--min-prefill-tokens``).
``--planner`` lets the SLO planner resize the fleet (the given split is the starting point).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.router.pd_selection import PdSelectionSettings
from orchestrator.sim.virtual_time import FleetSpec, SimRequest, VirtualFleet, requests_from_trace


def detect_format(path: str) -> str:
    """The trace format from the file's name and first line (``--format auto``)."""
    from orchestrator.bench.traces import open_text

    name = Path(path).name.lower()
    if name.endswith((".csv", ".csv.gz")):
        return "azure"  # (any CSV of arrival time + lengths: traces.load_azure)
    with open_text(path) as f:
        first = f.readline(1 << 20)
    if '"hash_ids"' in first or ('"input_length"' in first and '"timestamp"' in first):
        return "mooncake"  # (Mooncake's traces, or any JSONL of timestamp + input/output lengths)
    if '"requests"' in first:
        return "aibrix"
    return "sharegpt"


MAX_WORKERS = 10_000  # the simulator builds every worker: a fleet larger than this is a typo, not a what-if
MAX_REQUESTS = 5_000_000  # a trace looped by --duration beyond this would only fill memory


def number(kind: type = float, *, gt: float | None = None, ge: float | None = None,
           le: float | None = None, lt: float | None = None) -> Any:
    """An argparse ``type`` for a finite number in range: argparse names the flag in its error
    (``argument --interval: must be > 0 (got -5)``) instead of a traceback from deep in the run."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'} (got {text!r})") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number (got {text!r})")
        if gt is not None and not value > gt:
            raise argparse.ArgumentTypeError(f"must be > {gt:g} (got {text})")
        if ge is not None and not value >= ge:
            raise argparse.ArgumentTypeError(f"must be >= {ge:g} (got {text})")
        if le is not None and not value <= le:
            raise argparse.ArgumentTypeError(f"must be <= {le:g} (got {text})")
        if lt is not None and not value < lt:
            raise argparse.ArgumentTypeError(f"must be < {lt:g} (got {text})")
        return value
    return parse


def load_requests(path: str, fmt: str = "auto", *, speed: float = 1.0, scale_len: float = 1.0,
                  duration_s: float | None = None, limit: int | None = None) -> list[SimRequest]:
    """A trace as simulator requests. ``speed`` compresses time (2 = twice the rate); ``duration_s``
    loops the trace (prefix block ids shifted per loop, so loops do not share a cache) or cuts it."""
    from orchestrator.bench.traces import load_trace

    if speed <= 0:
        raise ValueError("--speed must be > 0")
    fmt = detect_format(path) if fmt == "auto" else fmt
    trace = load_trace(path, fmt, scale_len=scale_len, time_scale=1.0 / speed, limit=limit)
    reqs = requests_from_trace(trace)
    if not reqs:
        raise ValueError(f"{path}: no requests")
    if duration_s is None:
        return reqs
    span = max(reqs[-1].arrival + 1e-3, 1.0)
    if duration_s > span and math.ceil(duration_s / span) * len(reqs) > MAX_REQUESTS:
        raise ValueError(f"--duration {duration_s:g}: loops the trace ({len(reqs)} requests in {span:g} s) to more "
                         f"than {MAX_REQUESTS:,} requests; give a shorter duration (or --speed < 1)")
    max_block = max((b for r in reqs for b in r.blocks), default=0) + 1
    out: list[SimRequest] = []
    loop = 0
    while True:
        for r in reqs:
            t = r.arrival + loop * span
            if t >= duration_s:
                return out
            out.append(replace(r, id=len(out), arrival=t, blocks=tuple(b + loop * max_block for b in r.blocks)))
        loop += 1


TRACE_HELP = ("trace file: Mooncake JSONL (or any JSONL of timestamp ms, input_length, output_length), AIBrix JSONL, "
              "a CSV of arrival time + prompt and output lengths (Azure, BurstGPT), ShareGPT (JSONL or the JSON array)")


def add_common(parser: argparse.ArgumentParser, trace_help: str = TRACE_HELP) -> None:
    parser.add_argument("--trace", required=True, help=trace_help)
    parser.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure", "aibrix", "sharegpt"])
    parser.add_argument("--profile", default="gpu-like", help="engine profile: gpu-like, cpu-tiny or a JSON file")
    parser.add_argument("--speed", type=number(gt=0), default=1.0, help="arrival-rate multiplier (2 = twice as fast)")
    parser.add_argument("--scale-len", type=number(gt=0), default=1.0, help="multiply prompt/output lengths")
    parser.add_argument("--duration", type=number(gt=0), default=None, help="loop or cut the trace to this many seconds")
    parser.add_argument("--limit", type=number(int, ge=1), default=None, help="only the first N requests of the trace")
    parser.add_argument("--policy", default="least_load",
                        choices=["round_robin", "least_load", "power_of_two", "random", "kv_aware"])
    parser.add_argument("--ttft", type=number(gt=0), default=2.0, help="TTFT target, seconds")
    parser.add_argument("--itl", type=number(gt=0), default=0.05, help="ITL target, seconds")
    parser.add_argument("--start-s", type=number(ge=0), default=60.0, help="seconds a new engine takes to serve")
    parser.add_argument("--role-change-s", type=number(ge=0), default=5.0, help="seconds a role change takes")
    parser.add_argument("--interval", type=number(gt=0), default=30.0, help="planner interval, seconds")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")


def configure(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--prefill", type=number(int, ge=0, le=MAX_WORKERS), default=0, help="prefill workers")
    parser.add_argument("--decode", type=number(int, ge=0, le=MAX_WORKERS), default=0, help="decode workers")
    parser.add_argument("--aggregated", type=number(int, ge=0, le=MAX_WORKERS), default=0, help="aggregated (prefill+decode) workers")
    parser.add_argument("--min-prefill-tokens", type=number(int, ge=0), default=None,
                        help="P/D: uncached prompts shorter than this prefill on their decode worker "
                             "(disagg.min_prefill_tokens; default: derived from the profile)")
    parser.add_argument("--planner", action="store_true", help="let the SLO planner resize the P/D fleet")
    parser.add_argument("--budget", type=number(int, ge=2, le=MAX_WORKERS), default=None, help="planner worker budget (default: 4x the start)")


def fail(msg: str) -> int:
    print(f"dyad: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from orchestrator.config import KvAwareConfig
    from orchestrator.sim.profiles import load_profile, tier_cost_of

    if args.prefill < 0 or args.decode < 0 or args.aggregated < 0:
        return fail("--prefill, --decode and --aggregated must be >= 0")
    if args.aggregated and (args.prefill or args.decode):
        return fail("use either --aggregated or --prefill/--decode, not both")
    if not (args.aggregated or (args.prefill and args.decode)):
        return fail("give --prefill P --decode D (both >= 1) or --aggregated N")
    if args.planner and args.aggregated:
        return fail("--planner sizes prefill/decode pools; it does not apply to --aggregated")
    if args.trace.startswith("synthetic:"):
        return fail(f"--trace {args.trace}: synthetic workloads are read by dyad plan; dyad sim replays a trace file")
    try:
        profile = load_profile(args.profile)
        reqs = load_requests(args.trace, args.format, speed=args.speed, scale_len=args.scale_len,
                             duration_s=args.duration, limit=args.limit)
    except (OSError, ValueError, KeyError) as e:
        return fail(str(e))
    scaler = None
    if args.planner:
        from orchestrator.planner.plan_cli import make_planner
        budget = args.budget or 4 * (args.prefill + args.decode)
        scaler = make_planner(args, profile, budget)
    cost = tier_cost_of(profile)  # a host tier in the profile: credit its hits at the reload cost
    pd = None if args.min_prefill_tokens is None else PdSelectionSettings(min_prefill_tokens=args.min_prefill_tokens)
    fleet = VirtualFleet(profile, FleetSpec(args.prefill, args.decode, args.aggregated), policy=args.policy,
                         scaler=scaler, interval_s=args.interval, start_s=args.start_s,
                         role_change_s=args.role_change_s, pd_settings=pd,
                         kv_aware=KvAwareConfig(tier_cost=cost) if cost is not None else None)
    result = fleet.run(reqs)
    s = result.summary(args.ttft, args.itl)
    s.update({"prefill": args.prefill, "decode": args.decode, "aggregated": args.aggregated,
              "workers_at_end": dict(zip(("prefill", "decode", "aggregated"), fleet.counts(), strict=True)),
              "profile": profile.name, "policy": args.policy, "trace": args.trace})
    print_summary(s)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(s, indent=2))
    return 0


def _f(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v * 1000:.0f} ms" if unit == "ms" else f"{v:.3f}"
    return str(v)


def print_summary(s: dict[str, Any]) -> None:
    print(f"requests {s['requests']} (finished {s['finished']}), {s['virtual_s']:.0f} s simulated "
          f"in {s['wall_s']:.2f} s wall ({s['speedup']:.0f}x real time)")
    print(f"SLO attainment {100 * s['slo_attainment']:.2f}%  worker-hours {s['worker_hours']:.2f}  "
          f"goodput/worker {s['goodput_per_worker']:.3f} req/s")
    print(f"TTFT p50 {_f(s['ttft_p50_s'], 'ms')} p90 {_f(s['ttft_p90_s'], 'ms')} p99 {_f(s['ttft_p99_s'], 'ms')}  "
          f"ITL p50 {_f(s['itl_p50_s'], 'ms')} p90 {_f(s['itl_p90_s'], 'ms')}")
