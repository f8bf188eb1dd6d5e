"""``dyad profile``: sweep an engine into the planner's performance profile (JSON).

    dyad profile --url http://127.0.0.1:8001 --model tiny --out profile.json   # a live engine (HTTP)
    dyad profile --sim gpu-like --out profile.json                             # the simulator, virtual time

Prefill: one request alone per input length (``max_tokens: 1``, streamed): TTFT. Decode: ``c``
concurrent streams with contexts of ``ctx`` tokens: mean time between streamed tokens. Prompts are
token-id lists (``/v1/completions`` accepts them), so lengths are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def configure(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="engine base URL (OpenAI-compatible /v1/completions)")
    src.add_argument("--sim", help="engine profile of the simulator (gpu-like, cpu-tiny or a JSON file)")
    parser.add_argument("--model", default=None, help="--url: model name (default: the engine's first model)")
    parser.add_argument("--out", required=True, help="write the profile JSON here")
    parser.add_argument("--isl", default="128,512,1024,2048", help="--url: prefill input lengths (--sim sweeps its own grid)")
    parser.add_argument("--concurrency", default="1,4,8,16", help="--url: decode concurrencies")
    parser.add_argument("--context", default="256,1024", help="--url: decode context lengths")
    parser.add_argument("--decode-tokens", type=int, default=32, help="--url: tokens generated per decode stream")
    parser.add_argument("--repeats", type=int, default=2, help="--url: prefill samples per length (median kept)")
    parser.add_argument("--timeout", type=float, default=120.0, help="--url: seconds per request")


def _ints(s: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag}: values must be >= 1")
    return vals


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                  timeout: float) -> list[float]:
    """Arrival times of streamed chunks carrying text, relative to the send."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"engine answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter() - t0)
    return times


def _prompt(n: int, salt: int) -> list[int]:
    # distinct per request so the prefix cache cannot help (ids kept small for tiny vocabularies)
    return [(salt * 7919 + i * 31) % 500 + 10 for i in range(n)]


async def sweep_http(args: argparse.Namespace) -> dict[str, Any]:
    url = args.url.rstrip("/")
    async with httpx.AsyncClient() as client:
        model = args.model
        if model is None:
            r = await client.get(f"{url}/v1/models", timeout=args.timeout)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        salt = int(time.time())
        prefill = []
        for n in _ints(args.isl, "--isl"):
            samples = []
            for _ in range(args.repeats):
                salt += 1
                t = await _stream(client, url, model, _prompt(n, salt), 1, args.timeout)
                samples.append(t[0])
            prefill.append({"isl": n, "ttft_s": sorted(samples)[len(samples) // 2]})
        decode = []
        for ctx in _ints(args.context, "--context"):
            for c in _ints(args.concurrency, "--concurrency"):
                salt += c
                runs = await asyncio.gather(*[_stream(client, url, model, _prompt(ctx, salt + i),
                                                      args.decode_tokens, args.timeout) for i in range(c)])
                gaps = [(t[-1] - t[0]) / (len(t) - 1) for t in runs if len(t) > 1]
                if gaps:
                    decode.append({"concurrency": c, "context": ctx, "itl_s": sum(gaps) / len(gaps)})
    return {"version": 1, "source": f"HTTP sweep of {url} ({model})", "prefill": prefill, "decode": decode}


def run(args: argparse.Namespace) -> int:
    from orchestrator.planner.perf_model import PerfModel

    try:
        if args.sim:
            from orchestrator.sim.profiles import load_profile
            from orchestrator.sim.virtual_time import sweep_profile
            profile = sweep_profile(load_profile(args.sim))
        else:
            profile = asyncio.run(sweep_http(args))
        PerfModel.from_dict(profile)  # refuse to write something the planner cannot load
    except httpx.TransportError as e:  # (its message alone, "All connection attempts failed", names nothing)
        print(f"dyad profile: cannot reach {args.url}: {e or type(e).__name__}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, httpx.HTTPError, OSError) as e:
        print(f"dyad profile: {e}", file=sys.stderr)
        return 2
    try:
        Path(args.out).write_text(json.dumps(profile, indent=2))
    except OSError as e:
        print(f"dyad profile: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(profile['prefill'])} prefill points, {len(profile['decode'])} decode points")
    return 0
