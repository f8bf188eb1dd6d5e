"""``dyad demo``: a gateway over a simulated fleet, on embedded defaults, in one process.

Starts ``--workers`` simulated engines (profile ``cpu-tiny``: timing calibrated to the tiny real vLLM
used in the tests) as in-process threads, and a gateway in front of them with in-memory state and no
external services. Without ``--requests`` it prints the URL and a curl example and serves until
Ctrl-C. With ``--requests K`` it sends a short shared-prefix chat workload through the gateway,
prints a summary (requests per worker, TTFT p50/p99, errors, the engines' prefix-cache hit ratio)
and exits: 0 when every request succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys
import threading
import time
from typing import Any, get_args

import httpx

from orchestrator.bench.runner import BenchOptions, run_bench
from orchestrator.bench.traces import TraceRequest, words_to_text
from orchestrator.config import PolicyName, load_config

DEFAULT_MODEL = "dyad-demo"


def _at_least_1(text: str) -> int:
    """argparse type: an integer >= 1 (a bad value is argparse's one-line usage error, not a traceback)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8000, help="gateway port (0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    p.add_argument("--workers", type=_at_least_1, default=2, help="number of simulated engines")
    p.add_argument("--requests", type=_at_least_1,
                   help="send this many shared-prefix chat requests, print a summary, exit")
    p.add_argument("--concurrency", type=_at_least_1, default=8, help="requests in flight for --requests")
    p.add_argument("--policy", default=None, choices=get_args(PolicyName), help="routing policy (default: kv_aware)")
    p.add_argument("--profile", default="cpu-tiny", help="simulated engine profile (cpu-tiny, gpu-like, zero)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name the fleet serves")
    p.add_argument("--seed", type=int, default=0)


def default_policy() -> str:
    """kv_aware once the prefix-aware router is installed, else round_robin."""
    try:
        import orchestrator.router.policies.kv_aware  # noqa: F401
    except ImportError:
        return "round_robin"
    return "kv_aware"


def demo_workload(n: int, *, groups: int = 4, system_words: int = 256, user_words: int = 24, max_tokens: int = 16,
                  seed: int = 0) -> list[TraceRequest]:
    """``n`` chat requests in ``groups`` conversations-types: each group shares a long system prompt,
    each request has its own question, so a prefix-aware router has something to exploit."""
    rng = random.Random(seed)
    systems = [words_to_text(rng.randrange(6400) for _ in range(system_words)) for _ in range(groups)]
    out = []
    for i in range(n):
        g = rng.randrange(groups)
        question = words_to_text(rng.randrange(6400) for _ in range(user_words))
        msgs = ({"role": "system", "content": f"You are assistant number {g}. {systems[g]}"},
                {"role": "user", "content": question})
        out.append(TraceRequest(index=i, arrival_s=0.0, input_len=system_words + user_words + 5, output_len=max_tokens,
                                messages=msgs, session_id=f"group-{g}"))
    return out


class DemoFleet:
    """N simulated engines + one gateway, started and stopped together."""

    def __init__(self, *, workers: int, port: int, host: str, policy: str, profile: str, model: str,
                 seed: int) -> None:
        if workers < 1:
            raise ValueError("--workers must be >= 1")
        self.n, self.port, self.host, self.policy = workers, port, host, policy
        self.profile, self.model, self.seed = profile, model, seed
        self.engines: list[Any] = []
        self.gateway: Any = None

    def start(self) -> DemoFleet:
        from orchestrator.gateway.serve import GatewayThread
        from orchestrator.sim.server import SimEngineThread

        kv_events = self.policy == "kv_aware"
        try:
            for i in range(self.n):
                eng = SimEngineThread(model=self.model, profile=self.profile, seed=self.seed + i, kv_events=kv_events)
                eng.start()
                self.engines.append(eng)
            workers = []
            for i, eng in enumerate(self.engines):
                w: dict[str, Any] = {"id": f"sim-{i}", "url": eng.url, "engine": "sim", "models": [self.model]}
                endpoint = getattr(eng, "kv_events_endpoint", None)
                if kv_events and endpoint:
                    w["kv_events"] = {"endpoint": endpoint,
                                      "replay_endpoint": getattr(eng, "replay_endpoint", None)}
                workers.append(w)
            from orchestrator.sim.profiles import load_profile

            block = load_profile(self.profile).block_size
            config = load_config({
                "models": [{"name": self.model, "block_size": block}],
                "workers": workers,
                "router": {"policy": self.policy, "debug_headers": True, "seed": self.seed},
                "gateway": {"host": self.host, "port": self.port},
                "health": {"interval_s": 1.0},
                "scrape": {"interval_s": 0.5},
            }, environ={})
            self.gateway = GatewayThread(config, port=self.port).start()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        with httpx.Client(trust_env=False) as c:
            while time.monotonic() < deadline:
                try:
                    r = c.get(f"{self.url}/ready", timeout=2.0)
                    if r.status_code == 200:
                        return
                    last = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as e:
                    last = repr(e)
                time.sleep(0.1)
        raise RuntimeError(f"gateway not ready after {timeout_s:g} s: {last}")

    @property
    def url(self) -> str:
        return self.gateway.url

    def stop(self) -> None:
        if self.gateway is not None:
            with contextlib.suppress(Exception):
                self.gateway.stop()
            self.gateway = None
        for eng in reversed(self.engines):
            with contextlib.suppress(Exception):
                eng.stop()
        self.engines.clear()


def curl_example(url: str, model: str) -> str:
    return (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
            f"\"max_tokens\": 16}}'")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def summary_table(summary: dict[str, Any], ids: dict[str, str]) -> str:
    lines = [f"{'worker':<8}{'requests':>10}{'prompt tokens':>15}{'cache hit':>11}"]
    per_header = summary.get("requests_per_worker", {})
    for e in summary.get("engines", []):
        wid = ids.get(e["url"], e["url"])
        n = per_header.get(wid, e["requests"] or 0)
        hr = e["hit_ratio"]
        lines.append(f"{wid:<8}{n:>10.0f}{e['prompt_tokens'] or 0:>15.0f}"
                     f"{'-' if hr is None else f'{100 * hr:.1f}%':>11}")
    t = summary["ttft_s"]
    cache = summary.get("cache") or {}
    hr = cache.get("hit_ratio")
    lines.append(f"TTFT p50 {_ms(t['p50'])}, p99 {_ms(t['p99'])}  |  end-to-end p50 {_ms(summary['e2e_s']['p50'])}"
                 f"  |  errors {summary['errors']} of {summary['requests']}  |  "
                 f"prefix-cache hit {'-' if hr is None else f'{100 * hr:.1f}%'}")
    if summary.get("error_kinds"):
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in summary["error_kinds"].items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    policy = args.policy or default_policy()
    fleet = DemoFleet(workers=args.workers, port=args.port, host=args.host, policy=policy, profile=args.profile,
                      model=args.model, seed=args.seed)
    # Serving until Ctrl-C: SIGINT/SIGTERM are blocked before the engine and gateway threads start (they
    # inherit the mask), and the main thread takes them with sigtimedwait. Relying on KeyboardInterrupt
    # instead lost the signal in two fresh-clone CI runs: the main thread was still waiting 30 s later
    # (thread stacks in the test's failure), with the engines' and gateway's event loops in threads.
    stops = {signal.SIGINT, signal.SIGTERM}
    wait_signals = args.requests is None and hasattr(signal, "sigtimedwait")
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops) if wait_signals else None
    try:
        fleet.start()
    except (RuntimeError, ValueError, OSError) as e:
        print(f"dyad demo: could not start: {e}", file=sys.stderr)
        if previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        return 1
    try:
        print(f"Dyad demo: gateway {fleet.url} over {args.workers} simulated engines "
              f"(profile {args.profile}, model {args.model}), policy {policy}", flush=True)
        print("engines: " + ",".join(e.url for e in fleet.engines), flush=True)
        print(curl_example(fleet.url, args.model), flush=True)
        if args.requests is not None:
            reqs = demo_workload(args.requests, seed=args.seed)
            opts = BenchOptions(url=fleet.url, model=args.model, concurrency=max(1, args.concurrency), api="chat",
                                engines=[e.url for e in fleet.engines], progress=False, timeout_s=120)
            result = asyncio.run(run_bench(reqs, opts))
            ids = {e.url: f"sim-{i}" for i, e in enumerate(fleet.engines)}
            print(f"\n{args.requests} shared-prefix chat requests ({opts.concurrency} in flight):")
            print(summary_table(result.summary, ids), flush=True)
            return 0 if result.summary["errors"] == 0 else 1
        print("Serving; press Ctrl-C to stop.", flush=True)
        if wait_signals:
            while signal.sigtimedwait(stops, 0.5) is None:
                pass
        else:  # (no sigtimedwait on this platform)
            stop = threading.Event()
            previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            finally:
                signal.signal(signal.SIGTERM, previous)
        print("\nstopping...", flush=True)
        return 0
    finally:
        fleet.stop()
        if previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
