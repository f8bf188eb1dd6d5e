#!/usr/bin/env python3
"""A deterministic profile of the gateway's own code per request (cProfile, thread CPU time).

Starts one zero-cost simulated engine (``dyad sim-engine --profile zero``) as a process and a real
gateway in this process (``GatewayThread``: uvicorn and the gateway's connection protocol, on a free
loopback port), then profiles only the gateway's event-loop thread while a client *process* sends
``--requests`` requests one at a time over one keep-alive connection. The profiler's clock is the
thread's own CPU time, so the client and other processes on a shared machine do not count.

Prints, per function, calls per request and CPU µs per request (own time, then with callees), sorted
both ways, for Dyad's own code (``orchestrator/``, ``adapters/``) and for everything.
cProfile adds its own cost per call: compare functions with each other, not with the A/B benchmark.

    nice -n 10 .venv/bin/python scripts/profile_gateway.py --requests 3000 [--stream] [--top 40] [--out gw.prof]
    nice -n 10 .venv/bin/python scripts/profile_gateway.py --policy kv_aware --prompt-tokens 8000 --fresh-prompts [--chat]
    nice -n 10 .venv/bin/python scripts/profile_gateway.py --stages --policy kv_aware --prompt-tokens 8000 --fresh-prompts

``--stages`` replaces cProfile with wall-clock timers around the routing stages only (``STAGES``: no
per-call profiler cost, so the numbers are real), the garbage collector's pauses (``gc.callbacks``)
and the gateway thread's CPU per request.

``--path`` splits each request's wall time inside the gateway at its hops (wall clock, no profiler):
client bytes in → engine request written (*ingress*: parse, admit, annotate, decide, build the engine
body), engine bytes in → client answer written (*egress*: check, relay), and client answer written →
request task done (*after*: accounting the client no longer waits for). Ingress and egress are what a
client waits for; *after* only costs CPU.

    nice -n 10 .venv/bin/python scripts/profile_gateway.py --path [--stream] [--requests 3000]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.config import load_config  # noqa: E402
from orchestrator.gateway.serve import GatewayThread  # noqa: E402
from orchestrator.ports import free_port, wait_ready  # noqa: E402

CLIENT = """
import asyncio, json, sys
from orchestrator.bench.loadgen import RawConnection, encode_request
url, n, body, fresh = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
def fresh_body(i):  # a prompt no request had before: a new first word changes every block hash
    if "messages" in body:
        msgs = [dict(m) for m in body["messages"]]
        msgs[0]["content"] = f"fresh{fresh}x{i} " + msgs[0]["content"]
        return {**body, "messages": msgs}
    return {**body, "prompt": f"fresh{fresh}x{i} " + body["prompt"]}
async def main():
    host, port, raw = encode_request(url, body)
    raws = [encode_request(url, fresh_body(i))[2] for i in range(n)] if fresh else None
    conn = RawConnection(host, port)
    for i in range(n):
        t = await conn.send(raws[i] if raws else raw)
        if t.status != 200:
            raise SystemExit(f"HTTP {t.status}: {t.body[:200]!r}")
    await conn.close()
asyncio.run(main())
"""


def run_client(url: str, n: int, body: dict, fresh: str = "") -> None:
    subprocess.run([sys.executable, "-c", CLIENT, url, str(n), json.dumps(body), fresh], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


STAGES = [  # (module, attribute path) timed by --stages
    ("orchestrator.gateway.openai_routes", "_admitted"), ("orchestrator.gateway.openai_routes", "annotate"),
    ("orchestrator.gateway.annotate", "estimate_prompt_tokens"), ("orchestrator.gateway.request", "parse_json_object"),
    ("orchestrator.router.router", "Router.annotate"), ("orchestrator.router.router", "Router.decide"),
    ("orchestrator.router.router", "Router.begin"), ("orchestrator.kv.tokenization", "RequestTokenizer.head_probe"), ("orchestrator.router.router", "Router.first_token"),
    ("orchestrator.kv.tracker", "PrefixTracker.on_routed"), ("orchestrator.kv.tokenization", "RequestTokenizer.tokenize"),
    ("orchestrator.kv.hashing", "BlockHasher.hash_blocks"), ("orchestrator.kv.approximate", "ApproximateRecorder.record"),
    ("orchestrator.kv.approximate", "ApproximateRecorder.flush"), ("orchestrator.kv.memory_index", "MemoryPrefixIndex.store_now"),
    ("orchestrator.kv.memory_index", "MemoryPrefixIndex.flush"), ("orchestrator.router.inflight", "InflightLedger.charge"),
    ("orchestrator.router.inflight", "InflightLedger.release"),
]


def install_stage_timers(samples: dict[str, list[float]], extra: list[str] = ()) -> None:
    """Wrap each of ``STAGES`` (that exists in this tree) and each ``MODULE:ATTR`` of ``extra`` in a
    wall-clock timer."""
    import asyncio
    import importlib

    for module, path in [*STAGES, *(tuple(e.split(":", 1)) for e in extra)]:
        owner: object = importlib.import_module(module)
        *parents, name = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        label = path

        def wrap(fn: object, label: str) -> object:
            if asyncio.iscoroutinefunction(fn):
                async def timed_async(*a: object, **k: object) -> object:
                    t = time.perf_counter()
                    try:
                        return await fn(*a, **k)  # type: ignore[operator]
                    finally:
                        samples.setdefault(label, []).append(time.perf_counter() - t)
                return timed_async

            def timed(*a: object, **k: object) -> object:
                t = time.perf_counter()
                try:
                    return fn(*a, **k)  # type: ignore[operator]
                finally:
                    samples.setdefault(label, []).append(time.perf_counter() - t)
            return timed
        setattr(owner, name, wrap(fn, label))


def ours(filename: str) -> bool:
    return f"{os.sep}orchestrator{os.sep}" in filename or f"{os.sep}adapters{os.sep}" in filename


def table(stats: pstats.Stats, n: int, key: int, top: int, only_ours: bool) -> list[str]:
    rows = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if only_ours and not ours(filename):
            continue
        short = filename.split(str(ROOT) + os.sep, 1)[-1] if str(ROOT) in filename else filename.rsplit(os.sep, 2)[-1]
        rows.append((tottime, cumtime, ncalls, f"{short}:{line}({func})"))
    rows.sort(key=lambda r: r[key], reverse=True)
    out = [f"{'own µs/req':>10} {'cum µs/req':>10} {'calls/req':>9}  function"]
    for tottime, cumtime, ncalls, name in rows[:top]:
        out.append(f"{tottime / n * 1e6:10.2f} {cumtime / n * 1e6:10.2f} {ncalls / n:9.2f}  {name}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--stream", action="store_true", help="streamed requests (8 tokens)")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", help="also write the raw profile here (pstats format)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="a prompt of this many words (the simulator's tokenizer: one token per word)")
    ap.add_argument("--fresh-prompts", action="store_true", help="a prompt never seen before for every request")
    ap.add_argument("--stages", action="store_true",
                    help="wall-clock timers around the routing stages and GC pauses instead of cProfile")
    ap.add_argument("--path", action="store_true",
                    help="wall time per request split at the gateway's hops (ingress, egress, after)")
    ap.add_argument("--tokenizer", help="a directory with HF tokenizer files for the model (models[].tokenizer) "
                                        "instead of the simulator's word tokenizer; --prompt-tokens then counts words")
    ap.add_argument("--chat", action="store_true",
                    help="/v1/chat/completions; with --prompt-tokens the words are split over 8 messages")
    ap.add_argument("--stage", action="append", default=[], metavar="MODULE:ATTR",
                    help="with --stages: also time this function (e.g. orchestrator.gateway.proxy:ProxyResponse._finish)")
    ap.add_argument("--freeze", action="store_true",
                    help="freeze the start-up heap out of garbage collection, as `dyad serve` does (app.freeze_heap)")
    args = ap.parse_args()

    eport = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sim-engine", "--port", str(eport), "--model",
                               "bench", "--profile", "zero"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_ready(f"http://127.0.0.1:{eport}/health", engine), "the simulated engine did not start"
        config = load_config({
            "models": [{"name": "bench", **({"tokenizer": args.tokenizer} if args.tokenizer else {})}],
            "workers": [{"id": "e0", "url": f"http://127.0.0.1:{eport}", "engine": "sim", "models": ["bench"]}],
            "router": {"policy": args.policy}, "gateway": {"host": "127.0.0.1"}}, environ={})
        prompt = "The quick brown fox jumps over the lazy dog"
        if args.prompt_tokens:
            prompt = " ".join(f"w{i % 997}x{i // 997}" for i in range(args.prompt_tokens - 1))
        body: dict = {"model": "bench", "max_tokens": 8, "temperature": 0.0, "stream": args.stream}
        if args.chat:
            words = prompt.split()
            step = -(-len(words) // 8)
            body["messages"] = [{"role": "user" if k % 2 == 0 else "assistant", "content": " ".join(words[j:j + step])}
                                for k, j in enumerate(range(0, len(words), step))]
        else:
            body["prompt"] = prompt
        if args.stages:
            return run_stages(config, body, args)
        if args.path:
            return run_path(config, body, args)
        with GatewayThread(config, freeze=args.freeze) as gw:
            url = f"{gw.url}/v1/{'chat/completions' if args.chat else 'completions'}"
            run_client(url, args.warmup, body, "w" if args.fresh_prompts else "")
            prof = cProfile.Profile(time.thread_time)  # this thread's CPU only (a syscall per reading: inflated)

            async def enable() -> None:
                prof.enable()

            async def disable() -> None:
                prof.disable()

            gw.call(enable())
            t0 = time.perf_counter()
            run_client(url, args.requests, body, "p" if args.fresh_prompts else "")
            gw.call(disable())
            wall = time.perf_counter() - t0
        stats = pstats.Stats(prof)
        if args.out:
            stats.dump_stats(args.out)
        total = sum(tt for (_, _, tt, _, _) in stats.stats.values())  # type: ignore[attr-defined]
        n = args.requests
        print(f"{n} {'streamed' if args.stream else 'non-streamed'} requests, {wall:.1f} s; profiled gateway-thread "
              f"CPU {total / n * 1e6:.0f} µs/request (with cProfile's own overhead)\n")
        for title, key, only in (("Dyad's code by own time", 0, True), ("Dyad's code by time with callees", 1, True),
                                 ("everything by own time", 0, False)):
            print(f"## {title}")
            print("\n".join(table(stats, n, key, args.top, only)))
            print()
    finally:
        engine.terminate()
        engine.wait(10)
    return 0


def run_stages(config: object, body: dict, args: argparse.Namespace) -> int:
    import gc
    import statistics

    samples: dict[str, list[float]] = {}
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    install_stage_timers(samples, args.stage)
    gc.callbacks.append(on_gc)

    async def cpu() -> float:
        return time.thread_time()

    try:
        with GatewayThread(config, freeze=args.freeze) as gw:  # type: ignore[arg-type]
            url = f"{gw.url}/v1/{'chat/completions' if args.chat else 'completions'}"
            run_client(url, args.warmup, body, "w" if args.fresh_prompts else "")
            samples.clear()
            pauses.clear()
            c0 = gw.call(cpu())
            run_client(url, args.requests, body, "p" if args.fresh_prompts else "")
            c1 = gw.call(cpu())
    finally:
        gc.callbacks.remove(on_gc)
    n = args.requests
    print(f"{n} {'streamed' if args.stream else 'non-streamed'} {'chat' if args.chat else 'completions'} requests, "
          f"policy {args.policy}; gateway thread CPU {(c1 - c0) / n * 1e6:.0f} µs/request\n")
    print(f"{'stage':42s} {'calls/req':>9} {'p50 µs':>8} {'mean µs':>8}")
    for label, v in sorted(samples.items(), key=lambda kv: -sum(kv[1])):
        print(f"{label:42s} {len(v) / n:9.2f} {statistics.median(v) * 1e6:8.1f} {statistics.mean(v) * 1e6:8.1f}")
    by_gen: dict[int, list[float]] = {}
    for gen, t in pauses:
        by_gen.setdefault(gen, []).append(t)
    for gen, v in sorted(by_gen.items()):
        print(f"gc generation {gen}: {len(v) / n:.3f} per request, mean {statistics.mean(v) * 1e6:.0f} µs "
              f"-> {sum(v) / n * 1e6:.0f} µs per request")
    return 0


def install_path_marks(marks: list[tuple[str, int]]) -> None:
    """Timestamp the hops of a request (one client connection, one request at a time)."""
    from orchestrator.gateway import http_server, transport

    def mark(cls: type, name: str, label: str, after: bool = False) -> None:
        fn = getattr(cls, name)
        if asyncio.iscoroutinefunction(fn):
            async def marked_async(*a: object, **k: object) -> object:
                try:
                    return await fn(*a, **k)
                finally:
                    marks.append((label, time.perf_counter_ns()))
            setattr(cls, name, marked_async)
            return

        def marked(*a: object, **k: object) -> object:
            if not after:
                marks.append((label, time.perf_counter_ns()))
            try:
                return fn(*a, **k)
            finally:
                if after:
                    marks.append((label, time.perf_counter_ns()))
        setattr(cls, name, marked)

    import asyncio
    mark(http_server.HttpProtocol, "data_received", "client_in")
    mark(transport._Conn, "data_received", "engine_in")
    mark(http_server.HttpProtocol, "_flush", "client_out", after=True)
    mark(http_server._Cycle, "run", "done")
    fn = transport.FastTransport._exchange

    async def exchange(self: object, key: object, head: bytes, body: bytes, *a: object) -> object:
        marks.append(("engine_out", time.perf_counter_ns()))  # (the write follows at once, no await before it)
        return await fn(self, key, head, body, *a)
    transport.FastTransport._exchange = exchange  # type: ignore[method-assign]


def run_path(config: object, body: dict, args: argparse.Namespace) -> int:
    import statistics

    marks: list[tuple[str, int]] = []
    install_path_marks(marks)
    with GatewayThread(config, freeze=args.freeze) as gw:  # type: ignore[arg-type]
        url = f"{gw.url}/v1/{'chat/completions' if args.chat else 'completions'}"
        run_client(url, args.warmup, body, "w" if args.fresh_prompts else "")
        marks.clear()
        run_client(url, args.requests, body, "p" if args.fresh_prompts else "")
    parts: dict[str, list[float]] = {"ingress": [], "engine": [], "egress": [], "client waits (sum)": [], "after": []}
    request: dict[str, int] = {}
    for label, t in marks:
        if label == "client_in" and "done" in request or not request:
            request = {}
        request.setdefault(label, t)
        if label == "client_out":
            request["client_out"] = t  # the last write (a stream writes many)
        if label == "done" and all(k in request for k in ("client_in", "engine_out", "engine_in", "client_out")):
            r = request
            parts["ingress"].append(r["engine_out"] - r["client_in"])
            parts["engine"].append(r["engine_in"] - r["engine_out"])
            parts["egress"].append(r["client_out"] - r["engine_in"])
            parts["client waits (sum)"].append(r["client_out"] - r["client_in"])
            parts["after"].append(r["done"] - r["client_out"])
    n = len(parts["ingress"])
    print(f"{n} {'streamed' if args.stream else 'non-streamed'} requests, policy {args.policy}; wall µs per request "
          f"at each hop (engine = from the engine request written to its first bytes in)\n")
    print(f"{'hop':24s} {'p50 µs':>8} {'p90 µs':>8} {'mean µs':>8}")
    for label, v in parts.items():
        v = sorted(x / 1e3 for x in v)
        print(f"{label:24s} {statistics.median(v):8.1f} {v[int(len(v) * 0.9)]:8.1f} {statistics.mean(v):8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
