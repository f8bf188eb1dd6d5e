#!/usr/bin/env python3
"""What prefix-aware routing adds to a request: direct vs Dyad `round_robin` vs Dyad `kv_aware`.

One zero-cost simulated engine process (``dyad sim-engine --profile zero``, KV events on) behind
``dyad serve`` processes: ``round_robin`` (the gateway's own cost), ``kv_aware`` with the in-memory
index fed by the engine's events, and, unless ``--no-redis``, ``kv_aware`` with a Redis index on a
redis-server this script starts. Requests go one at a time, every target once per round in a fresh
random order (noise on the 2 shared cores hits all targets alike). ``kv_aware`` does, per request:
tokenize (the simulator's tokenizer, as for any ``engine: sim`` fleet; cached), hash blocks, look
up the index, choose, record.

Workloads (completions, ``max_tokens`` 1, not streamed):
- ``short``: a ~40-token prompt, distinct per request (tokenization cache misses);
- ``long-new``: an 8k-token prompt = shared 6k-token prefix + a distinct 2k-token tail (misses);
- ``long-same``: the same 8k-token prompt every time (tokenization cache hits).

    .venv/bin/python scripts/bench_kv_overhead.py [--rounds 300] [--no-redis] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.bench.loadgen import RawConnection, encode_request  # noqa: E402
from orchestrator.ports import free_port  # noqa: E402
from orchestrator.stats import percentile  # noqa: E402

MODEL = "bench"
BLOCK = 16  # the zero profile's block size


class Procs:
    """Processes this script started, each in its own session; stopped by their pids on exit."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dyad-kv-overhead-"))
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.dir / f"{name}.log").open("wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        self.procs.append((name, p))
        return p

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text()[-2000:]

    def stop(self) -> None:
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for _name, p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_ready(url: str, procs: Procs, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} not ready at {url}: {procs.log(name)}")


def start_targets(procs: Procs, with_redis: bool) -> dict[str, str]:
    py = str(ROOT / ".venv/bin/python")
    eport, kport, rport = free_port(), free_port(), free_port()
    procs.start("engine", [py, "-m", "orchestrator.cli", "sim-engine", "--port", str(eport), "--model", MODEL,
                           "--profile", "zero", "--kv-events-port", str(kport), "--kv-replay-port", str(rport)])
    engine = f"http://127.0.0.1:{eport}"
    wait_ready(f"{engine}/health", procs, "engine")
    worker = {"id": "e0", "url": engine, "engine": "sim", "models": [MODEL],
              "kv_events": {"endpoint": f"tcp://127.0.0.1:{kport}", "replay_endpoint": f"tcp://127.0.0.1:{rport}"}}
    variants: dict[str, dict] = {"round_robin": {"router": {"policy": "round_robin"}},
                                 "kv_aware": {"router": {"policy": "kv_aware"}}}
    if with_redis:
        redis_port = free_port()
        procs.start("redis", [shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
                              "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(procs.dir)])
        time.sleep(0.5)
        variants["kv_aware+redis"] = {"router": {"policy": "kv_aware"},
                                      "index": {"backend": "redis", "redis_url": f"redis://127.0.0.1:{redis_port}/0",
                                                "key_prefix": "bench"}}
    targets = {"direct": engine}
    for name, extra in variants.items():
        gport = free_port()
        cfg = procs.dir / f"{name}.json"
        cfg.write_text(json.dumps({"models": [{"name": MODEL, "block_size": BLOCK}], "workers": [worker],
                                   "gateway": {"host": "127.0.0.1", "port": gport}, **extra}))
        procs.start(name, [py, "-m", "orchestrator.cli", "serve", "--config", str(cfg)])
        wait_ready(f"http://127.0.0.1:{gport}/ready", procs, name)
        targets[f"dyad {name}"] = f"http://127.0.0.1:{gport}"
    return targets


VOCABULARY = [f"word{i}" for i in range(5000)]  # text reuses words, as natural language does


def words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


SHARED = words("shared", 6144)
SAME_TAIL = words("same", 2048)


def prompt_for(workload: str, i: int) -> str:
    if workload == "short":
        return f"request {i}: " + words(f"short{i}", 38)
    if workload == "long-new":
        return SHARED + " " + words(f"tail{i}", 2048)
    return SHARED + " " + SAME_TAIL


async def run(targets: dict[str, str], rounds: int, seed: int) -> dict[str, dict[str, dict[str, float]]]:
    rng = random.Random(seed)
    conns = {}
    for name, base in targets.items():
        host, port, _ = encode_request(f"{base}/v1/completions", {})
        conns[name] = RawConnection(host, port)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for workload in ("short", "long-new", "long-same"):
        times: dict[str, list[float]] = {name: [] for name in targets}
        for r in range(-20, rounds):  # 20 warm-up rounds
            order = list(targets)
            rng.shuffle(order)
            raws = {}
            for name in order:
                body = {"model": MODEL, "prompt": prompt_for(workload, (r + 20) * 16 + order.index(name)),
                        "max_tokens": 1, "temperature": 0.0}
                raws[name] = encode_request(f"{targets[name]}/v1/completions", body)[2]
            for name in order:
                t = await conns[name].send(raws[name])
                if t.status != 200:
                    raise RuntimeError(f"{name}: HTTP {t.status}: {t.body[:300]!r}")
                if r >= 0:
                    times[name].append(t.total_s)
        direct = statistics.median(times["direct"])
        results[workload] = {}
        for name, xs in times.items():
            p50 = statistics.median(xs)
            results[workload][name] = {"p50_ms": p50 * 1e3, "p99_ms": percentile(xs, 99) * 1e3,
                                       "added_p50_ms": (p50 - direct) * 1e3}
    for c in conns.values():
        await c.close()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    procs = Procs()
    try:
        targets = start_targets(procs, with_redis=not args.no_redis and shutil.which("redis-server") is not None)
        results = asyncio.run(run(targets, args.rounds, args.seed))
    finally:
        procs.stop()
    print(f"# one request at a time, {args.rounds} rounds per workload; load average {os.getloadavg()[0]:.1f}")
    print(f"{'workload':<10} {'target':<22} {'p50 ms':>8} {'p99 ms':>8} {'added p50 ms':>13}")
    for workload, per in results.items():
        for name, r in per.items():
            print(f"{workload:<10} {name:<22} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['added_p50_ms']:>13.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
