#!/usr/bin/env python3
"""Prefix-aware routing on a simulated 8-worker fleet, replaying the Mooncake synthetic trace:
Dyad's round_robin, least_load and kv_aware, and the anchors vllm-router (kv_aware fed by the
simulator's KV events; cache_aware) and sglang-router (cache_aware), in front of the same fleet, in
one run. The fleet is restarted (empty caches, zeroed counters) before every router.

The fleet is the project's simulator (``dyad sim-engine``), one process per worker, because this
machine cannot run 8 real engines (2 cores, no GPU). Its profile is ``gpu-like`` with the overrides
below, and the trace is scaled so that one router's run takes about two minutes here:

- lengths x ``--scale-len`` (default 1/8: every 512-token Mooncake block becomes 64 words, which the
  simulator's tokenizer counts as 64 tokens; block sharing is preserved exactly), outputs x
  ``--scale-output`` (default 1/8);
- time x 1/``--speed`` (default 8: the 1,022 s trace in ~128 s);
- KV capacity per worker x ``--scale-len`` (26,880 → 3,360 blocks of 16), so that cache capacity
  relative to the trace's distinct prefix tokens stays what it would be unscaled (8 workers hold
  ~15% of them: eviction and placement matter);
- prefill cost per (scaled) token set so that the fleet's prefill utilization at the trace's ideal hit
  ratio is about ``--utilization`` (default 0.6), i.e. caching and balancing both matter.

Every number in the table is read from the engines or measured by the client: the hit ratio is
Σhits/Σqueries of the engines' ``vllm:prefix_cache_*_total`` counters; prefill load per engine is its
uncached prompt tokens (queries - hits); TTFT is client-side.

    .venv/bin/python scripts/bench_routing_fleet.py [--routers dyad-round_robin,dyad-kv_aware,...]
        [--limit N] [--speed 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.bench.runner import BenchOptions, run_bench  # noqa: E402
from orchestrator.bench.traces import ideal_prefix_hit_ratio, load_mooncake, summarize  # noqa: E402

MODEL = "fleet-model"
TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
DEFAULT_ANCHORS = Path.home() / ".cache/dyad/anchors/venv"
ALL_ROUTERS = ("dyad-round_robin", "dyad-least_load", "dyad-kv_aware", "vllm-router-kv_aware",
               "vllm-router-cache_aware", "sglang-router-cache_aware")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class Processes:
    """Processes this script started; stopped through their own process groups."""

    logdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str]) -> Proc:
        log = self.logdir / f"{name}.log"
        p = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def stop(self, procs: list[Proc]) -> None:
        for proc in procs:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(5)
            if proc in self.procs:
                self.procs.remove(proc)

    def stop_all(self) -> None:
        self.stop(list(reversed(self.procs)))


def wait_http(url: str, proc: Proc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}): {proc.log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready at {url} after {timeout_s:g} s: {proc.log.read_text()[-2000:]}")


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


def fleet_profile(args: argparse.Namespace, reqs) -> dict:
    """gpu-like, with KV capacity scaled like the lengths and prefill cost set for the target utilization."""
    from orchestrator.sim.profiles import GPU_LIKE

    ideal = ideal_prefix_hit_ratio(reqs)
    info = summarize(reqs)
    uncached_per_s = info["input_mean"] * (1 - ideal) * info["rate_rps"]  # reqs are already time-scaled
    per_token = args.utilization * args.workers / uncached_per_s
    return {"base": "gpu-like", "name": "gpu-like-fleet-bench",
            "num_gpu_blocks": max(64, round(GPU_LIKE.num_gpu_blocks * args.scale_len)),
            "per_prefill_token_s": per_token}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", default=",".join(ALL_ROUTERS))
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--scale-len", type=float, default=0.125)
    ap.add_argument("--scale-output", type=float, default=0.125)
    ap.add_argument("--speed", type=float, default=8.0)
    ap.add_argument("--utilization", type=float, default=0.6)
    ap.add_argument("--limit", type=int, help="first N requests only (for quick checks)")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--anchors-venv", default=str(DEFAULT_ANCHORS))
    ap.add_argument("--sglang-dialect", action="store_true",
                    help="serve sglang-router from engines speaking the SGLang dialect (no token hit counters)")
    ap.add_argument("--json", help="write all summaries here")
    ap.add_argument("--keep-logs", help="copy process logs to this directory")
    args = ap.parse_args()

    reqs = load_mooncake(args.trace, scale_len=args.scale_len, scale_output=args.scale_output,
                         time_scale=1.0 / args.speed, limit=args.limit)
    full = load_mooncake(args.trace, limit=args.limit)
    ideal = ideal_prefix_hit_ratio(reqs)
    info = summarize(reqs)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    print(f"trace {Path(args.trace).name}: {info['requests']} requests over {info['duration_s']:.0f} s "
          f"(time x1/{args.speed:g}), input mean {info['input_mean']:.0f} tokens (x{args.scale_len:g}), output mean "
          f"{info['output_mean']:.0f} (x{args.scale_output:g}); ideal prefix hit ratio {100 * ideal:.1f}% "
          f"(unscaled {100 * ideal_prefix_hit_ratio(full):.1f}%)", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="dyad-fleet-") as tmp:
        ps = Processes(Path(tmp))
        prof = fleet_profile(args, reqs)
        profile_path = Path(tmp) / "profile.json"
        profile_path.write_text(json.dumps(prof))
        print(f"engine profile: {prof}", flush=True)
        block_size = 16
        engines: list[Engine] | None = None
        try:
            for name in routers:
                # One fleet for all: the vLLM dialect (its prefix-cache counters give the hit ratio);
                # sglang-router only needs the OpenAI endpoints, which both dialects serve.
                dialect = "sglang" if name.startswith("sglang-router") and args.sglang_dialect else "vllm"
                engines, eprocs = start_fleet(ps, args, profile_path, engines, dialect)
                try:
                    url, rproc = start_router(ps, name, engines, args, block_size)
                except (RuntimeError, OSError) as e:
                    print(f"{name}: could not start: {e}", flush=True)
                    ps.stop(eprocs)
                    results[name] = {"error": str(e)}
                    continue
                t0 = time.time()
                opts = BenchOptions(url=url, model=MODEL, speed=1.0, api="completions",
                                    engines=[e.url for e in engines], slo_ttft_s=args.slo_ttft, progress=False,
                                    timeout_s=300)
                res = asyncio.run(run_bench(reqs, opts))
                s = res.summary
                results[name] = s
                pl, cache = s["prefill_load"], s["cache"]
                print(f"{name:<28} ok {s['ok']}/{s['requests']}  hit {100 * (cache['hit_ratio'] or 0):.1f}%  "
                      f"TTFT p50 {1e3 * (s['ttft_s']['p50'] or 0):.0f} ms p99 {1e3 * (s['ttft_s']['p99'] or 0):.0f} ms  "
                      f"prefill max/mean {pl['max_over_mean'] or 0:.2f}  ({time.time() - t0:.0f} s)", flush=True)
                ps.stop([rproc, *eprocs])
        finally:
            if args.keep_logs:
                import shutil
                shutil.copytree(tmp, args.keep_logs, dirs_exist_ok=True)
            ps.stop_all()

    print(f"\n{'router':<28}{'ok':>11}{'hit ratio':>11}{'% of ideal':>12}{'TTFT p50':>10}{'p99 (ms)':>10}"
          f"{'prefill max/mean':>18}{'goodput':>9}")
    for name, s in results.items():
        if "error" in s:
            print(f"{name:<28}  could not run: {s['error'][:80]}")
            continue
        hr = s["cache"]["hit_ratio"] or 0.0
        print(f"{name:<28}{s['ok']:>6}/{s['requests']:<4}{100 * hr:>10.1f}%{100 * hr / ideal if ideal else 0:>11.0f}%"
              f"{1e3 * (s['ttft_s']['p50'] or 0):>10.0f}{1e3 * (s['ttft_s']['p99'] or 0):>10.0f}"
              f"{s['prefill_load']['max_over_mean'] or 0:>18.2f}{s['slo']['goodput_rps'] or 0:>9.2f}")
    print(f"(goodput: requests/s with TTFT <= {args.slo_ttft:g} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ideal_hit_ratio": ideal, "profile": prof,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
