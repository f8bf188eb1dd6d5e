#!/usr/bin/env python3
"""A/B of the gateway's own cost: the gateways of two (or more) git revisions, side by side in one run.

Each revision is exported (``git archive``) to a temporary directory and started as its own
``dyad serve`` process in front of ONE zero-cost simulated engine (``dyad sim-engine --profile zero``);
"direct" is the engine itself. Requests go one at a time, in ``--rounds`` rounds of ``--per-round``
requests per target, the targets in a new random order each round; a target's latency is the median
of its per-round p50s. Beside latency it reports each process's CPU time per request (user+system,
from /proc, measured over its own rounds) and context switches per request, which are far less noisy
than latency on a shared 2-core machine. ``--concurrency N`` adds a closed-loop throughput pass.

    .venv/bin/python scripts/bench_gateway_ab.py 34a6f56 HEAD [--stream] [--rounds 15] [--concurrency 32]

Pass ``.`` as a revision for the working tree as it is, a directory path (with a ``/``) for that source tree
as it is (e.g. a copy with modules compiled in place by ``scripts/build_native.py``), and ``REV@POLICY``
(e.g. ``main@round_robin``) to run that revision with another routing policy than ``--policy`` (e.g.
kv_aware's cost over round_robin for two revisions in one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from scripts.bench_gateway_overhead import free_port  # noqa: E402

POLICIES = ("round_robin", "least_load", "power_of_two", "random", "kv_aware")
PY = str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable


def proc_stats(pid: int) -> tuple[float, int, int]:
    """(CPU seconds user+system, voluntary, involuntary context switches) of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    switches = {k: int(v) for k, v in (line.split(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                       if "ctxt_switches" in line)}
    return cpu, switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"]


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


def export(rev: str, into: Path) -> Path:
    if rev == ".":
        return ROOT
    if os.sep in rev and Path(rev).is_dir():  # a source tree as it is (e.g. one with compiled modules built in)
        return Path(rev).resolve()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


async def measure(targets: dict[str, tuple[int, int]], args: argparse.Namespace) -> dict[str, dict]:
    body = {"model": "bench", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 8,
            "temperature": 0.0, "stream": args.stream}
    if args.prompt_tokens:  # the simulator's tokenizer: one token per word
        body["prompt"] = " ".join(f"w{i % 997}x{i // 997}" for i in range(args.prompt_tokens - 1))
    conns, reqs = {}, {}
    for name, (port, _) in targets.items():
        host, p, raw = encode_request(f"http://127.0.0.1:{port}/v1/completions", body, args.extra_headers)
        conns[name], reqs[name] = RawConnection(host, p), raw
    fresh = iter(range(1 << 62))

    def request_for(name: str) -> bytes:
        """The same request every time, or with --fresh-prompts a prompt no target has seen before."""
        if not args.fresh_prompts:
            return reqs[name]
        return encode_request(f"http://127.0.0.1:{targets[name][0]}/v1/completions",
                              {**body, "prompt": f"fresh{next(fresh)} {body['prompt']}"}, args.extra_headers)[2]
    for _ in range(100):  # warm-up
        for name in targets:
            await conns[name].send(request_for(name))
    out = {name: {"round_p50_s": [], "cpu_s": 0.0, "vcs": 0, "ivcs": 0, "n": 0} for name in targets}
    rng = random.Random(args.seed)
    names = list(targets)
    for _ in range(args.rounds):
        rng.shuffle(names)
        for name in names:
            pid = targets[name][1]
            lat = []
            batch = [request_for(name) for _ in range(args.per_round)]
            cpu0, v0, i0 = proc_stats(pid)
            for raw in batch:
                t = await conns[name].send(raw)
                if t.status != 200:
                    raise RuntimeError(f"{name}: HTTP {t.status}: {t.body[:200]!r}")
                lat.append(t.total_s)
            cpu1, v1, i1 = proc_stats(pid)
            o = out[name]
            o["round_p50_s"].append(statistics.median(lat))
            o["cpu_s"] += cpu1 - cpu0
            o["vcs"] += v1 - v0
            o["ivcs"] += i1 - i0
            o["n"] += args.per_round
    for c in conns.values():
        await c.close()
    if args.concurrency:
        for name in names:
            out[name]["rps"] = await throughput(targets[name][0], {**body, "stream": False}, args.concurrency,
                                                args.duration, args.extra_headers)
    return out


async def throughput(port: int, body: dict, concurrency: int, duration_s: float,
                     headers: dict[str, str] | None = None) -> float:
    """Closed loop: ``concurrency`` connections each sending the next request as soon as one is answered."""
    host, p, raw = encode_request(f"http://127.0.0.1:{port}/v1/completions", body, headers)
    stop_at = time.perf_counter() + duration_s
    done = 0

    async def worker() -> None:
        nonlocal done
        conn = RawConnection(host, p)
        while time.perf_counter() < stop_at:
            if (await conn.send(raw)).status == 200:
                done += 1
        await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revisions", nargs="+", help="git revisions to compare ('.' = the working tree; a path "
                                                "with a '/' = that source tree as it is)")
    ap.add_argument("--stream", action="store_true", help="streamed requests (8 tokens)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-round", type=int, default=200)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--concurrency", type=int, default=0, help="also closed-loop throughput at this concurrency")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per throughput measurement")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of this many words (simulator tokens)")
    ap.add_argument("--fresh-prompts", action="store_true", help="a prompt never seen before for every request")
    ap.add_argument("--floor", action="store_true",
                    help="also run the floor targets (scripts/bench_gateway_floor.py: bare uvicorn ASGI and a bare "
                         "asyncio protocol, each forwarding through FastTransport with nothing else)")
    ap.add_argument("--tokenizer", help="a directory with HF tokenizer files: the gateways tokenize with it "
                                        "(models[].tokenizer) instead of the simulator's word tokenizer")
    ap.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                    help="an extra request header (repeatable), e.g. 'X-Forwarded-For: 203.0.113.9' as a load "
                         "balancer in front would add")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    args.extra_headers = {k.strip(): v.strip() for k, v in (h.split(":", 1) for h in args.header)}

    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="dyad-ab-") as tmp:
        try:
            eport = free_port()
            engine = subprocess.Popen([PY, "-m", "orchestrator.cli", "sim-engine", "--port", str(eport), "--model",
                                       "bench", "--profile", "zero"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(engine)
            wait_ready(f"http://127.0.0.1:{eport}/health", engine)
            targets = {"direct": (eport, engine.pid)}
            for i, target in enumerate(args.revisions):
                rev, policy = target, args.policy
                head, _, tail = target.rpartition("@")
                if head and tail in POLICIES:
                    rev, policy = head, tail
                tree = export(rev, Path(tmp) / f"rev{i}")
                port = free_port()
                cfg = Path(tmp) / f"gw{i}.json"
                cfg.write_text(json.dumps({
                    "models": [{"name": "bench", **({"tokenizer": args.tokenizer} if args.tokenizer else {})}],
                    "workers": [{"id": "e0", "url": f"http://127.0.0.1:{eport}", "engine": "sim", "models": ["bench"]}],
                    "router": {"policy": policy}, "gateway": {"host": "127.0.0.1", "port": port}}))
                gw = subprocess.Popen([PY, "-m", "orchestrator.cli", "serve", "--config", str(cfg)], cwd=tree,
                                      env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
                procs.append(gw)
                wait_ready(f"http://127.0.0.1:{port}/ready", gw)
                name = f"dyad @ {target}"
                targets[name + (f" #{i}" if name in targets else "")] = (port, gw.pid)
            for mode in ("asgi", "asgi-dyad", "protocol") if args.floor else ():
                port = free_port()
                fl = subprocess.Popen([PY, str(ROOT / "scripts/bench_gateway_floor.py"), "--engine",
                                       f"http://127.0.0.1:{eport}", "--port", str(port), "--mode", mode], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                procs.append(fl)
                wait_ready(f"http://127.0.0.1:{port}/ready", fl)
                targets[f"floor ({mode})"] = (port, fl.pid)
            load_before = os.getloadavg()
            out = asyncio.run(measure(targets, args))
            load_after = os.getloadavg()
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()

    base = statistics.median(out["direct"]["round_p50_s"])
    mode = "streamed" if args.stream else "non-streamed"
    print(f"{mode}, {args.rounds} rounds x {args.per_round} requests per target, policy {args.policy}; "
          f"p50 = median of per-round p50s")
    print(f"{'target':<28}{'p50 ms':>9}{'added ms':>10}{'CPU us/req':>12}{'vol cs/req':>12}{'invol cs/req':>14}"
          f"{'req/s':>9}")
    for name, o in out.items():
        p50 = statistics.median(o["round_p50_s"])
        rps = f"{o['rps']:.0f}" if "rps" in o else "-"
        print(f"{name:<28}{p50 * 1e3:>9.3f}{(p50 - base) * 1e3:>10.3f}{o['cpu_s'] / o['n'] * 1e6:>12.0f}"
              f"{o['vcs'] / o['n']:>12.2f}{o['ivcs'] / o['n']:>14.2f}{rps:>9}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "targets": out, "loadavg_before": load_before,
                                               "loadavg_after": load_after}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
