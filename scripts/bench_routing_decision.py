"""Routing decision cost for prefix-aware routing: an 8k-token prompt over 64 workers.

One decision = hash the prompt's blocks + look up every candidate's cached prefix in the index +
the prefixes this gateway has in flight on each worker (``router.inflight``: two prompts sharing
the system prompt in flight on every worker) + the kv_aware policy's choice (the work
PrefixTracker.annotate, Router.route and KvAwarePolicy.choose do once the token ids are known). Measured with the in-memory index and with Redis (a real redis-server this
script starts on a free loopback port). Tokenization is measured separately (local tokenizer files,
simulator tokenizer) since it depends on the model.

    .venv/bin/python scripts/bench_routing_decision.py [--iterations 2000] [--workers 64] [--tokens 8192]

With Redis the lookup is measured alone and together with the shared in-flight load read
(``SharedLoad.peer_loads``, issued concurrently as the tracker does).

Index contents: every worker holds a shared 2k-token system prompt; each worker also holds
``--prompts-per-worker`` distinct 8k-token prompts; the measured request shares the system prompt
and continues one worker's cached prompt for half its length (so the walk goes deep for one worker
and stops at 64 blocks for the others).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from orchestrator.config import KvAwareConfig
from orchestrator.fleet.worker import Worker
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.index import PrefixIndex
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.kv.redis_index import RedisPrefixIndex
from orchestrator.kv.shared_load import SharedLoad
from orchestrator.router.inflight import InflightLedger
from orchestrator.router.policies.kv_aware import KvAwarePolicy
from orchestrator.router.types import RouteRequest
from orchestrator.stats import percentile

BS = 32
WARMUP = 300  # decisions discarded first (also lets Redis finish rehashing after the bulk fill)


async def fill(index: PrefixIndex, workers: int, prompts_per_worker: int, tokens: int, rng: random.Random,
               hasher: BlockHasher) -> tuple[list[int], list[int]]:
    """Fill the index; the measured request's token ids and the shared system prompt."""
    system = [rng.randrange(50_000) for _ in range(2048)]
    target: list[int] = []
    for w in range(workers):
        for p in range(prompts_per_worker):
            prompt = system + [rng.randrange(50_000) for _ in range(tokens - len(system))]
            if w == 7 and p == 0:
                target = prompt
            await index.store(f"w{w}", hasher.hash_blocks(prompt))
    # The request: the system prompt + the first half of worker 7's prompt + a fresh tail.
    half = len(system) + (tokens - len(system)) // 2
    return target[:half] + [rng.randrange(50_000) for _ in range(tokens - half)], system


def inflight_ledger(workers: list[Worker], system: list[int], tokens: int, hasher: BlockHasher) -> InflightLedger:
    """Two prompts sharing the system prompt in flight on every worker (each lookup walks that far)."""
    rng = random.Random(2)
    ledger = InflightLedger()
    for w in workers:
        for k in range(2):
            prompt = system + [rng.randrange(50_000) for _ in range(tokens - len(system))]
            ledger.charge((w.id, k), w, tokens - len(system), hasher.hash_blocks(prompt))
    return ledger


async def measure(index: PrefixIndex, request_ids: list[int], workers: list[Worker], iterations: int,
                  hasher: BlockHasher, ledger: InflightLedger, shared: SharedLoad | None = None) -> dict[str, float]:
    """``shared``: also read other replicas' in-flight load, concurrently, as PrefixTracker does."""
    policy = KvAwarePolicy(KvAwareConfig(), seed=0)
    totals, lookups, hashes_t, cpu = [], [], [], []
    chosen = None
    for i in range(iterations + WARMUP):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        hashes = hasher.hash_blocks(request_ids)
        t1 = time.perf_counter()
        ids = [w.id for w in workers]
        if shared is None:
            overlaps = await index.overlaps(hashes, workers=ids)
        else:
            overlaps, _peers = await asyncio.gather(index.overlaps(hashes, workers=ids), shared.peer_loads(ids))
        t2 = time.perf_counter()
        req = RouteRequest(request_id=str(i), model="m", prompt_tokens=len(request_ids), block_size=BS,
                           token_ids=request_ids, block_hashes=hashes, overlaps=overlaps,
                           inflight_overlaps=ledger.covered_by_worker(workers, hashes))
        d = policy.choose(req, workers, 0.0)
        t3 = time.perf_counter()
        c3 = time.thread_time()
        chosen = d
        if i >= WARMUP:  # warm-up excluded
            totals.append(t3 - t0)
            cpu.append(c3 - c0)
            lookups.append(t2 - t1)
            hashes_t.append(t1 - t0)
    assert chosen is not None and chosen.worker.id == "w7", chosen.worker.id
    return {
        "decision_p50_ms": statistics.median(totals) * 1e3, "decision_p99_ms": percentile(totals, 99) * 1e3,
        # This process's CPU time only (no scheduler waits; for Redis, not the server's work).
        "decision_cpu_p50_ms": statistics.median(cpu) * 1e3, "decision_cpu_p99_ms": percentile(cpu, 99) * 1e3,
        "lookup_p50_ms": statistics.median(lookups) * 1e3, "lookup_p99_ms": percentile(lookups, 99) * 1e3,
        "hash_p50_ms": statistics.median(hashes_t) * 1e3, "hash_p99_ms": percentile(hashes_t, 99) * 1e3,
        "predicted_cached_tokens": chosen.predicted_cached_tokens,
    }


def start_redis() -> tuple[subprocess.Popen[bytes], int, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (scripts/setup_test_deps.sh)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="dyad-bench-redis-")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port, workdir
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def tokenization_cost(tokens: int, iterations: int) -> dict[str, float]:
    from orchestrator.kv.tokenization import HfTokenizer, SimPromptTokenizer
    out: dict[str, float] = {}
    rng = random.Random(1)
    words = ["routing", "prefix", "cache", "engine", "token", "block", "worker", "gateway", "latency"]
    model_dir = Path.home() / ".cache/dyad/models/tiny-llama-512"
    candidates = [("sim", SimPromptTokenizer())]
    if (model_dir / "tokenizer.json").exists():
        candidates.insert(0, ("hf_tiny_llama", HfTokenizer(model_dir)))
    for name, tok in candidates:
        text = ""
        while True:  # grow the text until the tokenizer yields about ``tokens`` ids
            text += " ".join(rng.choice(words) for _ in range(256)) + " "
            n = len(tok.encode_chat([{"role": "user", "content": text}]))
            if n >= tokens:
                break
        msgs = [{"role": "system", "content": text}]
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            ids = tok.encode_chat(msgs)
            times.append(time.perf_counter() - t0)
        out[f"{name}_tokens"] = len(ids)
        out[f"{name}_p50_ms"] = statistics.median(times) * 1e3
        out[f"{name}_p99_ms"] = percentile(times, 99) * 1e3
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts-per-worker", type=int, default=4)
    ap.add_argument("--skip-redis", action="store_true")
    args = ap.parse_args()
    hasher = BlockHasher("m", BS)
    workers = [Worker(id=f"w{i}", url=f"http://w{i}", models=["m"]) for i in range(args.workers)]
    print(f"# {args.workers} workers, {args.tokens}-token prompt ({args.tokens // BS} blocks), "
          f"{args.iterations} decisions per backend")
    mem = MemoryPrefixIndex()
    ids, system = await fill(mem, args.workers, args.prompts_per_worker, args.tokens, random.Random(0), hasher)
    ledger = inflight_ledger(workers, system, args.tokens, hasher)
    print(f"memory: {await mem.size()} index entries, {len(ledger)} prompts in flight")
    for k, v in (await measure(mem, ids, workers, args.iterations, hasher, ledger)).items():
        print(f"  memory {k}: {v:.3f}")
    if not args.skip_redis:
        proc, port, workdir = start_redis()
        try:
            red = RedisPrefixIndex(f"redis://127.0.0.1:{port}/0", key_prefix="bench")
            ids, _ = await fill(red, args.workers, args.prompts_per_worker, args.tokens, random.Random(0), hasher)
            await asyncio.sleep(2.0)  # Redis rehashes its keyspace incrementally after the bulk load
            print(f"redis: {await red.size()} index entries")
            for k, v in (await measure(red, ids, workers, args.iterations, hasher, ledger)).items():
                print(f"  redis {k}: {v:.3f}")
            shared = SharedLoad(red.client, "bench")
            for i in range(0, args.workers, 4):  # another replica has requests in flight on some workers
                await shared.reserve(f"r{i}", f"w{i}", 1000)
            shared.replica_id = "this-replica"
            for k, v in (await measure(red, ids, workers, args.iterations, hasher, ledger, shared)).items():
                if k.startswith(("decision", "lookup")):
                    print(f"  redis+peer_load {k}: {v:.3f}")
            await red.close()
        finally:
            proc.kill()
            proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)
    for k, v in tokenization_cost(args.tokens, max(20, args.iterations // 50)).items():
        print(f"  tokenize {k}: {v:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
