#!/usr/bin/env python3
"""Gateway added latency and throughput: direct to a zero-cost simulated engine vs through Dyad (and,
when installed, vllm-router and sglang-router), all in one run.

Every target fronts the SAME engine process (``dyad sim-engine --profile zero``: answers at once), so
the difference between a target and "direct" is what that router adds. Latency is measured one
request at a time, interleaving the targets in a fresh random order at every step so that machine noise
(2 shared cores) hits all of them alike, in ``--rounds`` rounds; the p50 reported is the median of the
per-round p50s (a noisy stretch spoils one round, not the result); throughput is closed-loop at ``--concurrency`` for
``--duration`` seconds per target, repeated ``--rounds`` times in shuffled order.

The client is ``orchestrator.bench.loadgen`` (raw keep-alive HTTP/1.1), so its own cost stays small.

    .venv/bin/python scripts/bench_gateway_overhead.py [--requests 1000] [--duration 5] [--rounds 3]
        [--anchors-venv ~/.cache/dyad/anchors/venv] [--json out.json]

The anchors are benchmark-only and live in their own venv:
``python3 -m venv ~/.cache/dyad/anchors/venv && ~/.cache/dyad/anchors/venv/bin/pip install vllm-router sglang-router``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.bench.loadgen import RawConnection, encode_request  # noqa: E402
from orchestrator.bench.processes import Processes, wait_http  # noqa: E402
from orchestrator.bench.runner import percentile  # noqa: E402
from orchestrator.ports import free_port  # noqa: E402

MODEL = "bench"
DEFAULT_ANCHORS = Path.home() / ".cache/dyad/anchors/venv"


def start_targets(ps: Processes, args: argparse.Namespace) -> dict[str, str]:
    py = str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable
    eport = free_port()
    eng = ps.start("engine", [py, "-m", "orchestrator.cli", "sim-engine", "--port", str(eport), "--model", MODEL,
                              "--profile", "zero"])
    engine = f"http://127.0.0.1:{eport}"
    wait_http(f"{engine}/health", eng)
    targets = {"direct": engine}
    for plane in args.data_planes.split(","):
        for policy in args.policies.split(","):
            gport = free_port()
            name = f"dyad-{policy}" if plane == "python" else f"dyad-{plane}-{policy}"
            cfg = ps.logdir / f"{name}.yaml"
            cfg.write_text(json.dumps({
                "models": [{"name": MODEL, **({"tokenizer": args.tokenizer} if args.tokenizer else {})}],
                "workers": [{"id": "e0", "url": engine, "engine": "sim", "models": [MODEL]}],
                "router": {"policy": policy},
                "gateway": {"host": "127.0.0.1", "port": gport, "data_plane": plane},
            }))
            g = ps.start(name, [py, "-m", "orchestrator.cli", "serve", "--config", str(cfg)])
            wait_http(f"http://127.0.0.1:{gport}/ready", g)
            targets[f"dyad ({policy})" if plane == "python" else f"dyad {plane} ({policy})"] = f"http://127.0.0.1:{gport}"
    for mode in args.floor:  # the least a Python proxy on the same machinery costs (not a gateway)
        port = free_port()
        if mode == "native":  # the compiled plane with a lane that does no Dyad work
            p = ps.start("floor-native", [py, str(ROOT / "scripts/bench_native_floor.py"), "--engine", engine,
                                          "--port", str(port)])
            wait_http(f"http://127.0.0.1:{port}/health", p, ok=(200, 502, 503))
            targets["native floor"] = f"http://127.0.0.1:{port}"
            continue
        p = ps.start(f"floor-{mode}", [py, str(ROOT / "scripts/bench_gateway_floor.py"), "--engine", engine,
                                       "--port", str(port), "--mode", mode])
        wait_http(f"http://127.0.0.1:{port}/ready", p)
        targets[f"python floor ({mode})"] = f"http://127.0.0.1:{port}"
    for spec in args.native_spike:  # experiments/native_plane (a spike: built by its build.sh, never shipped)
        mode, _, threads = spec.partition(":")
        port = free_port()
        p = ps.start(f"native-{mode}-{threads or 1}", [
            py, str(ROOT / "experiments/native_plane/run.py"), "--engine", engine, "--port", str(port),
            "--model", MODEL, "--mode", mode, "--threads", threads or "1"])
        wait_http(f"http://127.0.0.1:{port}/v1/models", p)
        targets[f"native spike ({spec})"] = f"http://127.0.0.1:{port}"
    venv = Path(args.anchors_venv).expanduser()
    if not args.no_anchors and (venv / "bin/vllm-router").exists():
        port = free_port()
        p = ps.start("vllm-router", [str(venv / "bin/vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                                     "--worker-urls", engine, "--policy", "round_robin", "--log-level", "warning",
                                     "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"])
        wait_http(f"http://127.0.0.1:{port}/v1/models", p)
        targets["vllm-router (round_robin)"] = f"http://127.0.0.1:{port}"
    if not args.no_anchors and (venv / "bin/python").exists() and (venv / "bin/sglang-router").exists():
        port = free_port()
        p = ps.start("sglang-router", [str(venv / "bin/python"), "-m", "sglang_router.launch_router", "--host",
                                       "127.0.0.1", "--port", str(port), "--worker-urls", engine, "--policy",
                                       "round_robin", "--log-level", "warn", "--prometheus-port", str(free_port())])
        wait_http(f"http://127.0.0.1:{port}/v1/models", p)
        targets["sglang-router (round_robin)"] = f"http://127.0.0.1:{port}"
    return targets


PROMPT = {"words": 0, "fresh": False, "n": 0}  # --prompt-tokens / --fresh-prompts (set in main)


def request_bytes(base: str, stream: bool, max_tokens: int) -> tuple[str, int, bytes]:
    prompt = "The quick brown fox jumps over the lazy dog"
    if PROMPT["words"]:  # the simulator's tokenizer: one token per word, so this is the prompt's length in tokens
        PROMPT["n"] += 1
        head = f"fresh{PROMPT['n']} " if PROMPT["fresh"] else ""
        prompt = head + " ".join(f"w{i % 997}x{i // 997}" for i in range(PROMPT["words"] - (1 if head else 0)))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    return encode_request(f"{base}/v1/completions", body)


async def latency_phase(targets: dict[str, str], n: int, stream: bool, max_tokens: int, seed: int,
                        rounds: int) -> dict[str, dict[str, list[float]]]:
    """``n`` requests per target, one at a time, each step sending one request to every target in a new
    random order; split into ``rounds`` consecutive rounds whose p50s are kept (``round_p50``,
    ``round_first_p50``): the median of per-round p50s is robust to a noisy stretch on a shared machine."""
    rng = random.Random(seed)
    conns, reqs = {}, {}
    fresh: dict[str, list[bytes]] = {}  # --fresh-prompts: a new prompt for every request (nothing cached)
    for name, base in targets.items():
        host, port, raw = request_bytes(base, stream, max_tokens)
        conns[name], reqs[name] = RawConnection(host, port), raw
        if PROMPT["fresh"]:
            fresh[name] = [request_bytes(base, stream, max_tokens)[2] for _ in range(n + 50)]
    out: dict[str, dict[str, list[float]]] = {name: {"total": [], "first": [], "round_p50": [], "round_first_p50": []}
                                              for name in targets}
    names = list(targets)
    for _ in range(50):  # warm-up: connections, caches
        for name in names:
            await conns[name].send(fresh[name].pop() if fresh else reqs[name])
    per_round = max(1, n // rounds)
    for _ in range(rounds):
        this: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in targets}
        for _ in range(per_round):
            rng.shuffle(names)
            for name in names:
                t = await conns[name].send(fresh[name].pop() if fresh else reqs[name])
                if t.status != 200:
                    raise RuntimeError(f"{name}: HTTP {t.status}: {t.body[:300]!r}")
                this[name][0].append(t.total_s)
                this[name][1].append(t.first_byte_s)
        for name, (total, first) in this.items():
            out[name]["total"].extend(total)
            out[name]["first"].extend(first)
            out[name]["round_p50"].append(percentile(total, 50))
            out[name]["round_first_p50"].append(percentile(first, 50))
    for c in conns.values():
        await c.close()
    return out


async def throughput_once(base: str, concurrency: int, duration_s: float, max_tokens: int) -> tuple[float, list[float], int]:
    host, port, raw = request_bytes(base, False, max_tokens)
    lat: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration_s

    async def worker() -> None:
        nonlocal errors
        conn = RawConnection(host, port)
        try:
            while time.perf_counter() < stop_at:
                try:
                    t = await conn.send(raw)
                except (TimeoutError, OSError):
                    errors += 1
                    continue
                if t.status == 200:
                    lat.append(t.total_s)
                else:
                    errors += 1
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(lat) / (time.perf_counter() - t0), lat, errors


async def throughput_phase(targets: dict[str, str], concurrency: int, duration_s: float, rounds: int,
                           max_tokens: int, seed: int) -> dict[str, dict[str, float]]:
    rng = random.Random(seed + 1)
    rps: dict[str, list[float]] = {n: [] for n in targets}
    lats: dict[str, list[float]] = {n: [] for n in targets}
    errs: dict[str, int] = dict.fromkeys(targets, 0)
    names = list(targets)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            r, lat, e = await throughput_once(targets[name], concurrency, duration_s, max_tokens)
            rps[name].append(r)
            lats[name].extend(lat)
            errs[name] += e
    return {n: {"rps_median": statistics.median(rps[n]), "rps_rounds": rps[n],
                "p50_s": percentile(lats[n], 50), "p99_s": percentile(lats[n], 99), "errors": errs[n]}
            for n in targets}


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="latency samples per target and mode")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per throughput measurement")
    ap.add_argument("--rounds", type=int, default=3,
                    help="latency rounds (p50 = median of per-round p50s) and throughput rounds per target")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per response")
    ap.add_argument("--policies", default="round_robin", help="Dyad policies to measure, comma-separated")
    ap.add_argument("--data-planes", default="python,native",
                    help="gateway.data_plane values to measure, comma-separated (native: scripts/build_dataplane.sh)")
    ap.add_argument("--anchors-venv", default=str(DEFAULT_ANCHORS))
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--native-spike", action="append", default=[], metavar="MODE[:THREADS]",
                    help="also measure experiments/native_plane (run its build.sh first): a Rust data plane "
                         "with the decision in Python (a spike, not part of Dyad); MODE native, py-rr or py-dyad, "
                         "THREADS its tokio worker threads (1)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="prompt length in tokens (simulator tokenizer: words); 0 = a 9-word sentence")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="a new prompt for every latency request (nothing tokenized or cached before)")
    ap.add_argument("--tokenizer", help="a directory with HF tokenizer files: Dyad tokenizes with it "
                                        "(models[].tokenizer) instead of the simulator's word tokenizer; "
                                        "--prompt-tokens then counts words, and the tokens are printed")
    ap.add_argument("--floor", action="append", default=[], choices=("protocol", "asgi-dyad", "asgi", "native"),
                    help="also measure a Python proxy that only forwards bytes (scripts/bench_gateway_floor.py, "
                         "this server mode; repeatable): what no Python gateway on this machinery can beat")
    args = ap.parse_args()
    PROMPT["words"], PROMPT["fresh"] = args.prompt_tokens, args.fresh_prompts
    if args.tokenizer and args.prompt_tokens:
        from tokenizers import Tokenizer
        words = " ".join(f"w{i % 997}x{i // 997}" for i in range(args.prompt_tokens))
        n = len(Tokenizer.from_file(str(Path(args.tokenizer).expanduser() / "tokenizer.json")).encode(words).ids)
        print(f"prompt: {args.prompt_tokens} words = {n} tokens of {args.tokenizer}", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="dyad-overhead-") as tmp:
        ps = Processes(Path(tmp))
        try:
            targets = start_targets(ps, args)
            print(f"targets: {', '.join(f'{k} {v}' for k, v in targets.items())}", file=sys.stderr)
            t_start = time.time()
            load_before = os.getloadavg()
            lat_ns = asyncio.run(latency_phase(targets, args.requests, False, args.max_tokens, args.seed, args.rounds))
            lat_st = asyncio.run(latency_phase(targets, args.requests, True, args.max_tokens, args.seed + 7,
                                               args.rounds))
            thr = asyncio.run(throughput_phase(targets, args.concurrency, args.duration, args.rounds,
                                               args.max_tokens, args.seed))
            elapsed = time.time() - t_start
            load_after = os.getloadavg()
        finally:
            ps.stop_all()

    def p50(name: str, lat: dict[str, dict[str, list[float]]], key: str = "round_p50") -> float:
        return statistics.median(lat[name][key])  # median of the per-round p50s

    base_ns, base_st = p50("direct", lat_ns), p50("direct", lat_st)
    base_ns99 = percentile(lat_ns["direct"]["total"], 99)
    base_ttfb = p50("direct", lat_st, "round_first_p50")
    rows = []
    print(f"\nOne request at a time ({args.requests} per target and mode, interleaved, in {args.rounds} rounds), "
          f"{args.max_tokens} output tokens; latency in ms; p50 = median of the per-round p50s, p99 over all "
          f"requests; 'added' = target - direct:")
    print(f"{'target':<28}{'non-stream p50':>15}{'p99':>9}{'added p50':>11}{'added p99':>11}"
          f"{'stream p50':>12}{'p99':>9}{'added p50':>11}{'first-chunk p50':>17}{'added':>9}")
    for name in targets:
        ns, st = lat_ns[name]["total"], lat_st[name]["total"]
        row = {
            "target": name,
            "nonstream_p50_s": p50(name, lat_ns), "nonstream_p99_s": percentile(ns, 99),
            "nonstream_added_p50_s": p50(name, lat_ns) - base_ns,
            "nonstream_added_p99_s": percentile(ns, 99) - base_ns99,
            "nonstream_round_p50s_s": lat_ns[name]["round_p50"],
            "stream_p50_s": p50(name, lat_st), "stream_p99_s": percentile(st, 99),
            "stream_added_p50_s": p50(name, lat_st) - base_st,
            "stream_round_p50s_s": lat_st[name]["round_p50"],
            "stream_first_chunk_p50_s": p50(name, lat_st, "round_first_p50"),
            "stream_first_chunk_added_p50_s": p50(name, lat_st, "round_first_p50") - base_ttfb,
            "throughput": thr[name],
        }
        rows.append(row)
        print(f"{name:<28}{ms(row['nonstream_p50_s']):>15}{ms(row['nonstream_p99_s']):>9}"
              f"{ms(row['nonstream_added_p50_s']):>11}{ms(row['nonstream_added_p99_s']):>11}"
              f"{ms(row['stream_p50_s']):>12}{ms(row['stream_p99_s']):>9}{ms(row['stream_added_p50_s']):>11}"
              f"{ms(row['stream_first_chunk_p50_s']):>17}{ms(row['stream_first_chunk_added_p50_s']):>9}")
    print(f"\nThroughput, closed loop at concurrency {args.concurrency}, non-streaming, {args.rounds} x "
          f"{args.duration:g} s per target (median of rounds):")
    print(f"{'target':<28}{'req/s':>9}{'rounds':>26}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}")
    for name in targets:
        t = thr[name]
        rounds = "/".join(f"{r:.0f}" for r in t["rps_rounds"])
        print(f"{name:<28}{t['rps_median']:>9.0f}{rounds:>26}{ms(t['p50_s']):>9}{ms(t['p99_s']):>9}{t['errors']:>8}")
    print(f"\n(measurement took {elapsed:.0f} s; load average before {load_before[0]:.2f}, after {load_after[0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "elapsed_s": elapsed,
                                               "loadavg_before": load_before, "loadavg_after": load_after}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
