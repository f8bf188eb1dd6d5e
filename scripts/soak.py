"""Soak: minutes of steady simulated load through a real `dyad serve` process; memory and latency over time.

    .venv/bin/python scripts/soak.py --minutes 10 --rate 20 --out docs/figures/soak

The gateway runs as its own process (``python -m orchestrator.cli serve``) so its RSS is its own; the
engines are Dyad's simulated engines (``SimEngineThread``, profile ``gpu-like``: GPU-scale timing
that this 2-core machine cannot produce with real engines) in this process, and so is the load
generator: an open-loop Poisson arrival process at ``--rate`` requests/s, half streamed chat, half
non-streamed completions, prompts drawn from a few shared prefixes. Every ``--fault-every`` seconds
one engine answers its next requests with HTTP 500 (the gateway retries them on another engine),
so retries and circuit breakers run throughout.

Every ``--sample-s`` seconds it prints and records: gateway RSS, requests finished and failed in the
window, end-to-end latency p50/p99, time to first token p50/p99 (streams). At the end: a markdown
table (for docs/benchmarks.md), ``<out>.json`` and ``<out>.png`` (when matplotlib is installed).
Exit status 1 if any request failed or the RSS grew by more than ``--max-rss-growth`` between the
first full window and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.ports import wait_ready  # noqa: E402
from orchestrator.sim.server import SimEngineThread  # noqa: E402
from orchestrator.stats import percentile  # noqa: E402

MODEL = "soak"
PREFIXES = [" ".join(f"ctx{p}-{i}" for i in range(200)) for p in range(6)]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Window:
    ok: int = 0
    failed: int = 0
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


async def one_request(client: httpx.AsyncClient, rng: random.Random, win: list[Window]) -> None:
    prefix = rng.choice(PREFIXES)
    tail = f" question {rng.randrange(10**6)}"
    started = time.perf_counter()
    try:
        if rng.random() < 0.5:
            body = {"model": MODEL, "messages": [{"role": "user", "content": prefix + tail}], "stream": True,
                    "max_tokens": rng.randint(8, 64), "ignore_eos": True}
            ttft = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                last = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        last = line
                        if '"error"' in line:
                            raise RuntimeError(f"error event: {line[:200]}")
                if last != "data: [DONE]":
                    raise RuntimeError("stream ended without [DONE]")
            win[0].ttft.append(ttft or 0.0)
        else:
            body = {"model": MODEL, "prompt": prefix + tail, "max_tokens": rng.randint(8, 64), "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        win[0].ok += 1
        win[0].e2e.append(time.perf_counter() - started)
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        win[0].failed += 1
        key = f"{type(e).__name__}: {str(e)[:80]}"
        win[0].errors[key] = win[0].errors.get(key, 0) + 1


async def drive(url: str, gateway_pid: int, engines: list[SimEngineThread], args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    win = [Window()]
    rows: list[dict] = []
    tasks: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=256)
    started = time.monotonic()
    end = started + args.minutes * 60
    next_sample = started + args.sample_s
    next_fault = started + args.fault_every if args.fault_every > 0 else float("inf")
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        while (now := time.monotonic()) < end:
            if now >= next_fault:
                victim = rng.choice(engines)
                async with httpx.AsyncClient(timeout=5) as c:
                    await c.post(f"{victim.url}/sim/faults", json={"fail_next": args.fault_burst})
                next_fault += args.fault_every
            if now >= next_sample:
                w, win[0] = win[0], Window()
                row = {"t_s": round(now - started), "load_1m": round(os.getloadavg()[0], 1),
                       "rss_mb": round(rss_mb(gateway_pid), 1), "ok": w.ok,
                       "failed": w.failed, "rps": round((w.ok + w.failed) / args.sample_s, 1),
                       "e2e_p50_ms": _ms(percentile(w.e2e, 50)), "e2e_p99_ms": _ms(percentile(w.e2e, 99)),
                       "ttft_p50_ms": _ms(percentile(w.ttft, 50)),
                       "ttft_p99_ms": _ms(percentile(w.ttft, 99)), "errors": w.errors}
                rows.append(row)
                print(json.dumps(row), flush=True)
                next_sample += args.sample_s
            task = asyncio.create_task(one_request(client, rng, win))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(args.rate))
        if tasks:
            await asyncio.wait(tasks, timeout=60)
    w = win[0]
    rows.append({"t_s": round(time.monotonic() - started), "load_1m": round(os.getloadavg()[0], 1),
                 "rss_mb": round(rss_mb(gateway_pid), 1), "ok": w.ok,
                 "failed": w.failed, "rps": None, "e2e_p50_ms": _ms(percentile(w.e2e, 50)),
                 "e2e_p99_ms": _ms(percentile(w.e2e, 99)), "ttft_p50_ms": _ms(percentile(w.ttft, 50)),
                 "ttft_p99_ms": _ms(percentile(w.ttft, 99)), "errors": w.errors})
    return rows



def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 1) if seconds is not None else None  # None: no sample in the window

def markdown(rows: list[dict]) -> str:
    lines = ["| t (s) | load 1m | gateway RSS (MB) | ok | failed | req/s | e2e p50 (ms) | e2e p99 (ms) "
             "| TTFT p50 (ms) | TTFT p99 (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['t_s']} | {r.get('load_1m', '-')} | {r['rss_mb']} | {r['ok']} | {r['failed']} "
                     f"| {r['rps'] if r['rps'] is not None else '-'} "
                     f"| {r['e2e_p50_ms']} | {r['e2e_p99_ms']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = [r["t_s"] / 60 for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(t, [r["rss_mb"] for r in rows], marker=".")
    ax1.set_ylabel("gateway RSS (MB)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Soak: simulated load through dyad serve")
    for key, label in (("e2e_p50_ms", "e2e p50"), ("e2e_p99_ms", "e2e p99"), ("ttft_p50_ms", "TTFT p50"),
                       ("ttft_p99_ms", "TTFT p99")):
        ax2.plot(t, [r[key] for r in rows], marker=".", label=label)
    ax2.set_ylabel("latency (ms)")
    ax2.set_xlabel("minutes")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=20.0, help="arrivals per second (Poisson)")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between injected 500 bursts (0 = none)")
    ap.add_argument("--fault-burst", type=int, default=5, help="requests answered 500 per burst")
    ap.add_argument("--max-rss-growth", type=float, default=0.25, help="allowed relative RSS growth")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.png")
    ap.add_argument("--gateway-log", default=None,
                    help="keep the gateway's log (info level) here, to explain any failure afterwards")
    args = ap.parse_args()

    engines = [SimEngineThread(model=MODEL, profile="gpu-like", seed=i, kv_events=False).start()
               for i in range(args.engines)]
    with socket_port() as port, tempfile.TemporaryDirectory() as tmp:
        cfg = {"models": [{"name": MODEL}],
               "workers": [{"id": f"sim{i}", "url": e.url, "engine": "sim", "models": [MODEL]}
                           for i, e in enumerate(engines)],
               "router": {"policy": "least_load"},
               "health": {"interval_s": 2.0}}
        cfg_path = Path(tmp) / "soak.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        log_path = Path(args.gateway_log) if args.gateway_log else Path(tmp) / "gateway.log"
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(cfg_path),
                                 "--port", str(port), "--log-level", "info" if args.gateway_log else "warning"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))  # noqa: SIM115
        url = f"http://127.0.0.1:{port}"
        try:
            if not wait_ready(f"{url}/ready", proc, timeout_s=30, interval_s=0.2):
                print(log_path.read_text()[-2000:], file=sys.stderr)
                return 2
            print(f"soak: gateway pid {proc.pid} on {url}, {args.engines} simulated engines (gpu-like), "
                  f"{args.rate:g} req/s for {args.minutes:g} min", flush=True)
            rows = asyncio.run(drive(url, proc.pid, engines, args))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
            for e in engines:
                e.stop()
    table = markdown(rows)
    print(table)
    total_ok = sum(r["ok"] for r in rows)
    total_failed = sum(r["failed"] for r in rows)
    errors: dict[str, int] = {}
    for r in rows:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    base = rows[1]["rss_mb"] if len(rows) > 2 else rows[0]["rss_mb"]
    growth = (rows[-1]["rss_mb"] - base) / base if base else 0.0
    all_e2e = [r["e2e_p50_ms"] for r in rows if r["ok"]]
    print(f"\nsoak: {total_ok} ok, {total_failed} failed {errors or ''}; RSS {base} MB after the first window -> "
          f"{rows[-1]['rss_mb']} MB at the end ({growth:+.1%}); median of window e2e p50s "
          f"{statistics.median(all_e2e) if all_e2e else float('nan'):.1f} ms")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        if plot(rows, out.with_suffix(".png")):
            print(f"soak: wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0 if total_failed == 0 and growth <= args.max_rss_growth else 1


class socket_port:
    """A free loopback port (bound and released: `dyad serve` binds it right after)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
