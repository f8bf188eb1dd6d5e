#!/usr/bin/env python3
"""Prefix-aware routing on a simulated 8-worker fleet, replaying a slice of the Mooncake synthetic
trace: Dyad's round_robin, least_load and kv_aware, and the anchors vllm-router (kv_aware fed by the
simulator's KV events; cache_aware) and sglang-router (cache_aware), in front of the same fleet, in
one run; then the same Dyad policies in virtual time on the same slice and on the whole trace.

The fleet is the project's simulator, because this machine cannot run 8 GPU engines (2 cores, no
GPU): 8 ``dyad sim-engine`` processes (one process each, not threads under one GIL), restarted
before every router (empty caches, zeroed counters). How the run stays valid on 2 shared cores:

- **Time dilation K** (``--dilation``): every cost of the ``gpu-like`` profile is multiplied by K and
  the trace's arrivals are stretched by K, so engine timing relative to arrivals is GPU-like while
  the Python overheads (client, router, simulator HTTP; a few ms per request) shrink to ~1/K of an
  engine's time. Reported TTFTs are client-side TTFT divided by K.
- **Lengths x ``--scale-len``** (default 1/8: a 512-token Mooncake block becomes 64 words, which the
  simulator's tokenizer counts as 64 tokens; block sharing is exact). The per-token prefill and
  attention costs are multiplied by 1/scale-len, the chunked-prefill budget and the KV capacity by
  scale-len, so a scaled prompt costs what the real one would and the cache holds the same number of
  trace blocks (840 of 512 tokens per worker, gpu-like's 430k tokens). Outputs are not scaled.
- **A slice** (``--window``, default 940:1023 s, the trace's last 83 s, 349 requests): the
  trace's prefix reuse is long-range and concentrated at its end — the first minutes reuse almost
  nothing (ideal hit ratio 6% in the first 60 s), the last 83 s reuse 68% of their own prompt
  tokens, the whole trace 65%. The slice's ideal (infinite cache, from an empty cache) is the
  reference for the hit ratio.

Every number is read from the engines or measured by the client: hit ratio = sum(hits)/sum(queries)
of the engines' ``vllm:prefix_cache_*_total`` counters; prefill load per engine = its uncached prompt
tokens (queries - hits); TTFT client-side. The client's schedule lag and the CPU time of every
process of the run (engines, router, this client) are reported, so a run that saturated the
machine shows it.

    .venv/bin/python scripts/bench_routing_fleet.py [--dilation 3] [--window 940:1023]
        [--routers dyad-round_robin,dyad-kv_aware,...] [--json out.json] [--virtual-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.bench.fleet_virtual import run_virtual_routing  # noqa: E402
from orchestrator.bench.processes import Proc, Processes, wait_http  # noqa: E402
from orchestrator.bench.runner import BenchOptions, percentile, run_bench  # noqa: E402
from orchestrator.bench.trace_paths import trace_path  # noqa: E402
from orchestrator.bench.traces import (  # noqa: E402
    ideal_prefix_hit_ratio,
    load_mooncake,
    rescale_time,
    summarize,
    time_window,
)
from orchestrator.ports import free_port  # noqa: E402
from orchestrator.sim.profiles import GPU_LIKE, EngineProfile  # noqa: E402

MODEL = "fleet-model"
TRACE = "mooncake_synthetic_trace.jsonl"  # default --trace, in orchestrator/bench/trace_paths.py's directory
DEFAULT_ANCHORS = Path.home() / ".cache/dyad/anchors/venv"
ALL_ROUTERS = ("dyad-round_robin", "dyad-least_load", "dyad-kv_aware", "vllm-router-kv_aware",
               "vllm-router-cache_aware", "sglang-router-cache_aware")


@dataclass
class Engine:
    url: str
    port: int
    kv_port: int
    replay_port: int

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


def start_fleet(ps: Processes, args: argparse.Namespace, profile_path: Path, engines: list[Engine] | None,
                dialect: str = "vllm") -> tuple[list[Engine], list[Proc]]:
    py = str(ROOT / ".venv/bin/python")
    if engines is None:
        engines = []
        for _ in range(args.workers):
            port = free_port()
            engines.append(Engine(f"http://127.0.0.1:{port}", port, free_port(), free_port()))
    procs = []
    for i, e in enumerate(engines):
        procs.append(ps.start(f"engine{i}", [
            py, "-m", "orchestrator.cli", "sim-engine", "--host", "127.0.0.1", "--port", str(e.port), "--model", MODEL,
            "--profile", str(profile_path), "--seed", str(i), "--dialect", dialect,
            "--kv-events-port", str(e.kv_port), "--kv-replay-port", str(e.replay_port)]))
    for e, p in zip(engines, procs, strict=True):
        wait_http(f"{e.url}/health", p)
    return engines, procs


def start_router(ps: Processes, name: str, engines: list[Engine], args: argparse.Namespace, block_size: int) -> tuple[str, Proc]:
    py = str(ROOT / ".venv/bin/python")
    venv = Path(args.anchors_venv).expanduser()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    urls = [e.url for e in engines]
    if name.startswith("dyad-"):
        policy = name.removeprefix("dyad-")
        workers = []
        for i, e in enumerate(engines):
            w = {"id": f"w{i}", "url": e.url, "engine": "sim", "models": [MODEL]}
            if policy == "kv_aware":
                w["kv_events"] = {"endpoint": e.kv_endpoint, "replay_endpoint": e.replay_endpoint}
            workers.append(w)
        cfg = ps.logdir / f"{name}.yaml"
        cfg.write_text(json.dumps({
            "models": [{"name": MODEL, "block_size": block_size}], "workers": workers,
            "router": {"policy": policy, "seed": 0}, "gateway": {"host": "127.0.0.1", "port": port},
            "scrape": {"interval_s": 0.5}}))
        proc = ps.start(name, [py, "-m", "orchestrator.cli", "serve", "--config", str(cfg)])
        wait_http(f"{url}/ready", proc)
        return url, proc
    if name.startswith("vllm-router-"):
        policy = name.removeprefix("vllm-router-")
        argv = [str(venv / "bin/vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                "--policy", policy, "--log-level", "warning", "--prometheus-port", str(free_port()),
                "--worker-startup-check-interval", "1"]
        if policy == "kv_aware":
            for e in engines:
                argv += ["--kv-event-source", f"{e.url}={e.kv_endpoint}",
                         "--kv-event-replay-source", f"{e.url}={e.replay_endpoint}"]
            argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", MODEL]
        proc = ps.start(name, argv)
        wait_http(f"{url}/v1/models", proc)
        return url, proc
    if name.startswith("sglang-router-"):
        policy = name.removeprefix("sglang-router-")
        proc = ps.start(name, [str(venv / "bin/python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                               "--port", str(port), "--worker-urls", *urls, "--policy", policy, "--log-level", "warn",
                               "--prometheus-port", str(free_port())])
        wait_http(f"{url}/v1/models", proc)
        return url, proc
    raise ValueError(f"unknown router {name}")




def dilated_profile(dilation: float, scale_len: float) -> dict:
    """gpu-like with every cost x K; per-token costs x 1/scale_len and chunk budget / KV capacity
    x scale_len, so a length-scaled prompt costs and occupies what the unscaled one would."""
    g = GPU_LIKE
    return {"base": "gpu-like", "name": f"gpu-like-x{dilation:g}-len{scale_len:g}",
            "step_fixed_s": g.step_fixed_s * dilation,
            "per_prefill_token_s": g.per_prefill_token_s * dilation / scale_len,
            "per_running_seq_s": g.per_running_seq_s * dilation,
            "per_context_token_s": g.per_context_token_s * dilation / scale_len,
            "request_overhead_s": g.request_overhead_s * dilation,
            "max_num_batched_tokens": max(g.block_size, round(g.max_num_batched_tokens * scale_len)),
            "num_gpu_blocks": max(64, round(g.num_gpu_blocks * scale_len)),
            "max_model_len": 1 << 20}  # the trace is the ground truth: never reject a long prompt


_TICK = os.sysconf("SC_CLK_TCK")


def session_cpu_s(sids: set[int]) -> float:
    """CPU seconds (user+system, including reaped children) of every live process in these sessions."""
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2:].split()
        if int(f[3]) in sids:  # f: state ppid pgrp session ... utime(11) stime(12) cutime(13) cstime(14)
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / _TICK


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def live_row(s: dict, k: float, cpu: dict) -> dict:
    """The table's numbers for one live run (TTFT divided by the dilation)."""
    lags = s.get("send_lags") or [0.0]
    return {"ok": s["ok"], "requests": s["requests"], "hit_ratio": s["cache"]["hit_ratio"],
            "ttft_mean_s": (s["ttft_s"]["mean"] or 0) / k, "ttft_p50_s": (s["ttft_s"]["p50"] or 0) / k,
            "ttft_p99_s": (s["ttft_s"]["p99"] or 0) / k, "prefill_max_over_mean": s["prefill_load"]["max_over_mean"],
            "lag_p99_s": percentile(lags, 99), "lag_max_s": s["max_send_lag_s"], **cpu}


def print_table(title: str, rows: dict[str, dict], ideal: float) -> None:
    print(f"\n{title}")
    print(f"{'router':<28}{'ok':>10}{'hit':>8}{'% ideal':>9}{'TTFT mean':>11}{'p50':>8}{'p99 (s)':>9}"
          f"{'prefill max/mean':>18}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<28}  could not run: {r['error'][:90]}")
            continue
        hr = r["hit_ratio"] or 0.0
        print(f"{name:<28}{r.get('ok', r.get('finished', 0)):>5}/{r['requests']:<4}{100 * hr:>7.1f}%"
              f"{100 * hr / ideal if ideal else 0:>8.0f}%{r['ttft_mean_s']:>11.3f}{r['ttft_p50_s']:>8.3f}"
              f"{r['ttft_p99_s']:>9.3f}{r['prefill_max_over_mean'] or 0:>18.2f}")


def virtual_rows(reqs, profile: EngineProfile, workers: int, policies: list[str]) -> dict[str, dict]:
    rows = {}
    for pol in policies:
        v = run_virtual_routing(reqs, profile, workers=workers, policy=pol)
        rows[f"dyad-{pol} (virtual)"] = {
            "finished": v["finished"], "requests": v["requests"], "hit_ratio": v["hit_ratio"],
            "ttft_mean_s": v["ttft_s"]["mean"], "ttft_p50_s": v["ttft_s"]["p50"], "ttft_p99_s": v["ttft_s"]["p99"],
            "prefill_max_over_mean": v["prefill_load"]["max_over_mean"], "wall_s": v["wall_s"]}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", default=",".join(ALL_ROUTERS))
    ap.add_argument("--trace", default=None, help=f"trace file (default: {TRACE} in the traces directory)")
    ap.add_argument("--window", default="940:1023", help="trace seconds START:END to replay live")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--dilation", type=float, default=3.0, help="K: engine costs x K, arrivals stretched x K")
    ap.add_argument("--scale-len", type=float, default=0.125)
    ap.add_argument("--limit", type=int, help="first N requests of the window only (quick checks)")
    ap.add_argument("--anchors-venv", default=str(DEFAULT_ANCHORS))
    ap.add_argument("--virtual-only", action="store_true", help="only the virtual-time tables")
    ap.add_argument("--no-virtual", action="store_true", help="skip the virtual-time tables")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--keep-logs", help="copy process logs to this directory")
    args = ap.parse_args()
    args.trace = args.trace or str(trace_path(TRACE))
    k = args.dilation
    w0, w1 = (float(x) for x in args.window.split(":", 1))

    full = load_mooncake(args.trace)
    window = time_window(full, w0, w1)[: args.limit]
    live_reqs = rescale_time(time_window(load_mooncake(args.trace, scale_len=args.scale_len, scale_output=1.0),
                                         w0, w1)[: args.limit], k)
    ideal_w, ideal_full = ideal_prefix_hit_ratio(window), ideal_prefix_hit_ratio(full)
    # What finite memory allows: one pooled LRU of the whole fleet's KV capacity, in trace blocks.
    cap_blocks = args.workers * (GPU_LIKE.cache_tokens // 512)
    cap_w, cap_full = ideal_prefix_hit_ratio(window, cap_blocks), ideal_prefix_hit_ratio(full, cap_blocks)
    info = summarize(window)
    print(f"trace {Path(args.trace).name}, window {w0:g}-{w1:g} s: {info['requests']} requests over "
          f"{info['duration_s']:.0f} s ({info['rate_rps']:.2f} req/s; live x{k:g} slower: "
          f"{info['rate_rps'] / k:.2f} req/s over {info['duration_s'] * k:.0f} s), input mean {info['input_mean']:.0f} "
          f"tokens (live x{args.scale_len:g}), output mean {info['output_mean']:.0f}; ideal hit ratio of the window "
          f"{100 * ideal_w:.1f}% (whole trace {100 * ideal_full:.1f}%); with the fleet's finite KV memory pooled "
          f"({cap_blocks} blocks of 512) at best {100 * cap_w:.1f}% (whole trace {100 * cap_full:.1f}%)", flush=True)
    out: dict = {"args": vars(args), "ideal_hit_ratio_window": ideal_w, "ideal_hit_ratio_full": ideal_full,
                 "capacity_bound_window": cap_w, "capacity_bound_full": cap_full,
                 "window_info": info}
    policies = [r.removeprefix("dyad-") for r in ALL_ROUTERS if r.startswith("dyad-")]
    if not args.no_virtual:
        vw = virtual_rows(window, GPU_LIKE, args.workers, policies)
        vf = virtual_rows(full, GPU_LIKE, args.workers, policies)
        out["virtual_window"], out["virtual_full"] = vw, vf
        print_table(f"virtual time, gpu-like, window {w0:g}-{w1:g} s (TTFT in s)", vw, ideal_w)
        print_table("virtual time, gpu-like, whole trace (TTFT in s)", vf, ideal_full)
    if args.virtual_only:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    results: dict[str, dict] = {}
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dyad-fleet-") as tmp:
        ps = Processes(Path(tmp))
        prof = dilated_profile(k, args.scale_len)
        profile_path = Path(tmp) / "profile.json"
        profile_path.write_text(json.dumps(prof))
        out["profile"] = prof
        print(f"\nlive engine profile: {prof}", flush=True)
        engines: list[Engine] | None = None
        try:
            for name in routers:
                engines, eprocs = start_fleet(ps, args, profile_path, engines, "vllm")
                try:
                    url, rproc = start_router(ps, name, engines, args, 16)
                except (RuntimeError, OSError) as e:
                    print(f"{name}: could not start: {e}", flush=True)
                    ps.stop(eprocs)
                    rows[name] = {"error": str(e)}
                    continue
                time.sleep(2.0)  # let the router connect to the KV event streams before the first request
                sids = {p.popen.pid for p in (rproc, *eprocs)}
                load0, cpu0, own0, t0 = loadavg(), session_cpu_s(sids), own_cpu_s(), time.time()
                opts = BenchOptions(url=url, model=MODEL, speed=1.0, api="completions",
                                    engines=[e.url for e in engines], progress=False, timeout_s=600)
                res = asyncio.run(run_bench(live_reqs, opts))
                wall = time.time() - t0
                cpu = {"wall_s": wall, "cpu_s_engines_router": session_cpu_s(sids) - cpu0,
                       "cpu_s_client": own_cpu_s() - own0, "load_start": load0, "load_end": loadavg()}
                s = res.summary
                s["send_lags"] = [r.sent_s - r.scheduled_s for r in res.results]
                results[name] = s
                rows[name] = row = live_row(s, k, cpu)
                print(f"{name:<28} ok {s['ok']}/{s['requests']}  hit {100 * (row['hit_ratio'] or 0):.1f}%  "
                      f"TTFT/K p50 {row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s  prefill max/mean "
                      f"{row['prefill_max_over_mean'] or 0:.2f}  lag p99/max {row['lag_p99_s']:.3f}/"
                      f"{row['lag_max_s']:.3f} s  CPU {cpu['cpu_s_engines_router']:.0f}+{cpu['cpu_s_client']:.0f} s "
                      f"in {wall:.0f} s  load {load0}->{cpu['load_end']}  errors {s['error_kinds'] or '-'}", flush=True)
                ps.stop([rproc, *eprocs])
        finally:
            if args.keep_logs:
                import shutil
                shutil.copytree(tmp, args.keep_logs, dirs_exist_ok=True)
            ps.stop_all()
    out["live"], out["live_summaries"] = rows, results
    print_table(f"live, {args.workers} sim-engine processes, gpu-like x{k:g}, window {w0:g}-{w1:g} s "
                f"(TTFT = client TTFT / {k:g}, in s)", rows, ideal_w)
    print(f"{'router':<28}{'lag p99/max (s)':>17}{'CPU engines+router':>20}{'CPU client':>12}{'wall':>7}  load")
    for name, r in rows.items():
        if "error" not in r:
            print(f"{name:<28}{r['lag_p99_s']:>8.3f}/{r['lag_max_s']:<8.3f}{r['cpu_s_engines_router']:>19.0f}s"
                  f"{r['cpu_s_client']:>11.0f}s{r['wall_s']:>6.0f}s  {r['load_start']}->{r['load_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
