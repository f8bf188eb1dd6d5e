"""``dyad bench``: replay a public trace against any OpenAI-compatible endpoint.

Example (the Mooncake trace, 200 requests, lengths / 16, twice the trace's speed, against Dyad with
two engines' counters read for the real prefix-cache hit ratio)::

    dyad bench --url http://127.0.0.1:8000 --model tiny --trace mooncake_synthetic_trace.jsonl \\
        --format mooncake --limit 200 --scale-len 0.0625 --speed 2 \\
        --engines http://127.0.0.1:8101,http://127.0.0.1:8102 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from orchestrator.bench import traces
from orchestrator.bench.runner import BenchOptions, format_table, plot_results, run_bench


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of the OpenAI endpoint (http://host:port)")
    p.add_argument("--model", required=True, help="model name to put in every request")
    p.add_argument("--trace", required=True, help="trace file")
    p.add_argument("--format", required=True, choices=traces.FORMATS, help="trace format")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, help="fixed arrival rate (requests/s) instead of the trace's times")
    pace.add_argument("--concurrency", type=int, help="closed loop: keep this many requests in flight")
    p.add_argument("--speed", type=float, default=1.0, help="open loop: replay arrivals this many times faster")
    p.add_argument("--limit", type=int, help="only the first N requests")
    p.add_argument("--window", help="only requests arriving in START:END seconds of the trace")
    p.add_argument("--scale-len", type=float, default=1.0,
                   help="scale prompt lengths (Mooncake: blocks of 512*F words) and output lengths")
    p.add_argument("--scale-output", type=float, help="scale output lengths separately (default: --scale-len)")
    p.add_argument("--max-output", type=int, help="cap output tokens per request")
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds (for goodput)")
    p.add_argument("--slo-itl", type=float, help="per-request mean inter-token latency SLO in seconds")
    p.add_argument("--engines", default="", help="comma-separated engine URLs whose /metrics give the real hit ratio")
    p.add_argument("--api", choices=("chat", "completions", "auto"), default="auto",
                   help="endpoint: auto = chat for traces with messages (ShareGPT), else completions")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = end-to-end)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for endpoints that reject it)")
    p.add_argument("--api-key", help="bearer key for the endpoint")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of synthesized prompt content")
    p.add_argument("--json", dest="json_out", help="write options, summary and per-request results here")
    p.add_argument("--plot", help="write a PNG with latency plots here")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--progress-interval", type=float, default=10.0,
                   help="seconds between progress lines when stderr is not a terminal (a bar otherwise)")


def _load(args: argparse.Namespace) -> list[traces.TraceRequest]:
    kw: dict = {}
    if args.format in ("mooncake", "azure"):
        kw["scale_len"] = args.scale_len
        if args.scale_output is not None:
            kw["scale_output"] = args.scale_output
    elif args.scale_output is not None or args.scale_len != 1.0:
        kw["scale_output"] = args.scale_output if args.scale_output is not None else args.scale_len
    if args.format == "mooncake":
        kw["seed"] = args.seed
    limit = None if args.window else args.limit
    reqs = traces.load_trace(args.trace, args.format, limit=limit, **kw)
    if args.window:
        try:
            start, end = (float(x) for x in args.window.split(":", 1))
        except ValueError:
            raise SystemExit("dyad bench: --window must be START:END in seconds") from None
        reqs = traces.time_window(reqs, start, end)
        if args.limit is not None:
            reqs = reqs[: args.limit]
    if args.max_output is not None:
        from dataclasses import replace

        reqs = [replace(r, output_len=min(r.output_len, args.max_output)) for r in reqs]
    return reqs


def run(args: argparse.Namespace) -> int:
    if args.plot:  # before the run, not after it
        from orchestrator.bench.plots import PlotUnavailable, require_pyplot

        try:
            require_pyplot("dyad bench --plot")
        except PlotUnavailable as e:
            print(f"dyad bench: {e}", file=sys.stderr)
            return 2
    if not Path(args.trace).exists():
        print(f"dyad bench: trace file not found: {args.trace}", file=sys.stderr)
        return 2
    try:
        reqs = _load(args)
    except (ValueError, KeyError) as e:
        print(f"dyad bench: cannot read {args.trace} as {args.format}: {e}", file=sys.stderr)
        return 2
    if not reqs:
        print("dyad bench: no requests selected", file=sys.stderr)
        return 2
    opts = BenchOptions(
        url=args.url, model=args.model, speed=args.speed, rate=args.rate, concurrency=args.concurrency,
        api=args.api, stream=not args.no_stream, ignore_eos=not args.no_ignore_eos, slo_ttft_s=args.slo_ttft,
        slo_itl_s=args.slo_itl, engines=[u.strip() for u in args.engines.split(",") if u.strip()],
        timeout_s=args.timeout, api_key=args.api_key, progress=False if args.quiet else None,
        progress_interval_s=args.progress_interval)
    try:
        result = asyncio.run(run_bench(reqs, opts))
    except ValueError as e:
        print(f"dyad bench: {e}", file=sys.stderr)
        return 2
    info = traces.summarize(reqs)
    title = (f"dyad bench: {len(reqs)} requests from {Path(args.trace).name} ({args.format}), "
             f"input mean {info['input_mean']:.0f} tok, output mean {info['output_mean']:.0f} tok")
    print(format_table(result.summary, title))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result.to_json(), indent=1))
        print(f"wrote {args.json_out}")
    if args.plot:
        plot_results(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result.summary["ok"] > 0 else 1
