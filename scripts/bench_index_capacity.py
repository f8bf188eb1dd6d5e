#!/usr/bin/env python3
"""Capacity of the shared prefix index: one Redis node vs a 3-node Redis Cluster (issue 16).

For each fleet size (64 / 256 / 1,024 simulated engines; a generator, no engines run) the index is
first filled with what such a fleet holds (``--blocks-per-engine`` entries each: shared system-prompt
chains held by many engines plus each engine's own conversations), then:

- **ingest**: ``--writers`` concurrent writers replay KV events as the gateway's tracker writes them
  (a BlockStored of a ``--batch``-block chain piece, then the BlockRemoved of an older piece: the
  steady state of a full GPU cache) as fast as they can for ``--seconds``. Reported: block
  operations per second, and the Redis servers' own CPU time per million block operations
  (``INFO cpu`` deltas summed over the nodes), which is what sizes the servers — one Python client
  on this 2-core machine cannot saturate even one node, so ops/s here is a lower bound;
- **lookup**: while ingest runs paced at ``--paced-ops`` block ops/s, one client issues lookups of
  ``--prompt-blocks``-block prompts (a shared prefix + a private tail) and records p50/p99 latency.

A GPU-like engine (``gpu-like`` profile: 12k prefill tokens/s, 16-token blocks) at full prefill load
stores 750 blocks/s and evicts as many: ~1,500 block operations/s per engine. The required rate per
fleet size is printed next to the measured cost.

    nice -n 10 .venv/bin/python scripts/bench_index_capacity.py --json capacity.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from orchestrator.kv.index import Tier, chain_anchors  # noqa: E402
from orchestrator.kv.redis_cluster_index import RedisClusterPrefixIndex  # noqa: E402
from orchestrator.kv.redis_index import RedisPrefixIndex  # noqa: E402
from orchestrator.stats import percentile  # noqa: E402
from tests.fixtures.redis import RedisServer  # noqa: E402
from tests.fixtures.redis_cluster import RedisCluster  # noqa: E402

OPS_PER_ENGINE_S = 1500  # 750 stored + 750 removed blocks/s: 12k tokens/s of prefill, 16-token blocks


def chain(tag: int, n: int, start: int = 0) -> list[int]:
    return [((tag * 1_000_003 + i) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF for i in range(start, start + n)]


class Fleet:
    """Generated KV state and events of ``engines`` engines."""

    def __init__(self, engines: int, blocks_per_engine: int, shared_chains: int = 32, shared_len: int = 64,
                 seed: int = 0) -> None:
        self.engines = engines
        self.rng = random.Random(seed)
        self.shared = [chain(10_000_000 + s, shared_len) for s in range(shared_chains)]
        self.blocks_per_engine = blocks_per_engine
        self.cursor = [0] * engines  # next private block position per engine

    def worker(self, e: int) -> str:
        return f"engine-{e:04d}"

    def private(self, e: int, n: int, start: int) -> tuple[list[int], list[int]]:
        hs = chain(e + 1, n, start)
        anchors = chain_anchors(hs, first_position=start, first_anchor=chain(e + 1, 1, start - start % 16)[0])
        return hs, anchors


async def fill(index, fleet: Fleet) -> int:
    n = 0
    for e in range(fleet.engines):
        w = fleet.worker(e)
        for s in fleet.rng.sample(range(len(fleet.shared)), 4):  # each engine holds 4 system prompts
            await index.store(w, fleet.shared[s])
            n += len(fleet.shared[s])
        own = fleet.blocks_per_engine - 4 * len(fleet.shared[0])
        for start in range(0, own, 256):
            hs, anchors = fleet.private(e, min(256, own - start), start)
            await index.store(w, hs, Tier.DEVICE, anchors=anchors)
            n += len(hs)
        fleet.cursor[e] = own
    return n


async def ingest(index, fleet: Fleet, seconds: float, writers: int, batch: int, paced_ops: float | None = None) -> int:
    """Store a new piece and remove the oldest piece of a random engine's chain, until the time is up."""
    ops = 0
    stop_at = time.perf_counter() + seconds
    own = fleet.blocks_per_engine - 4 * len(fleet.shared[0])
    interval = (2 * batch * writers / paced_ops) if paced_ops else 0.0

    async def one(k: int) -> None:
        nonlocal ops
        rng = random.Random(k)
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            e = rng.randrange(fleet.engines)
            w = fleet.worker(e)
            start = fleet.cursor[e]
            fleet.cursor[e] += batch
            hs, anchors = fleet.private(e, batch, start)
            await index.store(w, hs, Tier.DEVICE, anchors=anchors)
            old, _ = fleet.private(e, batch, start - own)
            await index.remove(w, old, Tier.DEVICE)
            ops += 2 * batch
            if interval:
                await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t0)))

    await asyncio.gather(*(one(k) for k in range(writers)))
    return ops


async def lookups(index, fleet: Fleet, seconds: float, prompt_blocks: int) -> list[float]:
    rng = random.Random(7)
    lat: list[float] = []
    stop_at = time.perf_counter() + seconds
    while time.perf_counter() < stop_at:
        shared = fleet.shared[rng.randrange(len(fleet.shared))]
        e = rng.randrange(fleet.engines)
        tail = chain(e + 1, max(0, prompt_blocks - len(shared)), 0)
        q = shared[:prompt_blocks] + tail
        t0 = time.perf_counter()
        await index.overlaps(q)
        lat.append(time.perf_counter() - t0)
    return lat


async def server_cpu(urls: list[str]) -> float:
    tot = 0.0
    for u in urls:
        r = aioredis.Redis.from_url(u)
        info = await r.info("cpu")
        tot += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        await r.aclose()
    return tot


async def server_memory(urls: list[str]) -> int:
    tot = 0
    for u in urls:
        r = aioredis.Redis.from_url(u)
        tot += int((await r.info("memory"))["used_memory"])
        await r.aclose()
    return tot


async def run_one(kind: str, url: str, node_urls: list[str], engines: int, args: argparse.Namespace) -> dict:
    prefix = f"cap{engines}"
    if kind == "cluster":
        index = RedisClusterPrefixIndex(url, prefix, max_blocks=50_000_000, call_timeout_s=5.0, socket_timeout_s=5.0)
    else:
        index = RedisPrefixIndex(url, prefix, max_blocks=50_000_000, socket_timeout_s=5.0)
    fleet = Fleet(engines, args.blocks_per_engine)
    t0 = time.perf_counter()
    entries = await fill(index, fleet)
    fill_s = time.perf_counter() - t0
    mem = await server_memory(node_urls)
    cpu0 = await server_cpu(node_urls)
    t0 = time.perf_counter()
    ops = await ingest(index, fleet, args.seconds, args.writers, args.batch)
    wall = time.perf_counter() - t0
    cpu = await server_cpu(node_urls) - cpu0
    ing, lat = await asyncio.gather(ingest(index, fleet, args.seconds, 2, args.batch, args.paced_ops),
                                    lookups(index, fleet, args.seconds, args.prompt_blocks))
    assert getattr(index, "available", True), f"{kind}: index fell back to its mirror during the run"
    await index.close()
    res = {
        "backend": kind, "engines": engines, "entries": entries, "fill_s": fill_s,
        "memory_bytes": mem, "bytes_per_entry": mem / max(1, entries),
        "ingest_ops_s": ops / wall, "server_cpu_s_per_million_ops": 1e6 * cpu / max(1, ops),
        "server_cpu_share": cpu / wall,
        "ops_per_server_core_s": ops / cpu if cpu > 0 else None,
        "required_ops_s": engines * OPS_PER_ENGINE_S,
        "lookup_p50_ms": 1e3 * percentile(lat, 50), "lookup_p99_ms": 1e3 * percentile(lat, 99),
        "lookup_mean_ms": 1e3 * statistics.mean(lat), "lookups": len(lat),
        "paced_ingest_ops_s": ing / args.seconds,
    }
    print(f"| {kind} | {engines} | {entries:,} | {mem / 2**20:.0f} MiB ({res['bytes_per_entry']:.0f} B) | "
          f"{res['ingest_ops_s']:,.0f} | {res['server_cpu_s_per_million_ops']:.1f} s "
          f"(≈ {res['ops_per_server_core_s'] or 0:,.0f} ops/core-s) | {res['required_ops_s']:,} | "
          f"{res['lookup_p50_ms']:.2f} / {res['lookup_p99_ms']:.2f} ms ({len(lat)}) |", flush=True)
    return res


async def main_async(args: argparse.Namespace) -> list[dict]:
    sizes = [int(x) for x in args.engines.split(",")]
    out = []
    print("| index | engines | entries | Redis memory (per entry) | ingest block ops/s (1 client) | "
          "Redis CPU per 1M block ops | required (1,500/engine) | lookup p50 / p99 (n) |")
    print("|---|---|---|---|---|---|---|---|")
    if "single" in args.backends:
        with RedisServer() as r:
            for n in sizes:
                out.append(await run_one("single", r.url, [r.url], n, args))
    if "cluster" in args.backends:
        with RedisCluster(primaries=3, replicas=0) as c:
            nodes = [f"redis://127.0.0.1:{p}/0" for p in c.ports]
            for n in sizes:
                out.append(await run_one("cluster", c.url, nodes, n, args))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="64,256,1024")
    ap.add_argument("--backends", default="single,cluster")
    ap.add_argument("--blocks-per-engine", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="blocks per event batch")
    ap.add_argument("--paced-ops", type=float, default=5000.0, help="ingest rate while measuring lookups")
    ap.add_argument("--prompt-blocks", type=int, default=128)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
