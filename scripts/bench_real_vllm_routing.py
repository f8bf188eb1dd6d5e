#!/usr/bin/env python3
"""kv_aware vs round_robin in front of two REAL vLLM engines, on a shared-prefix chat workload.

Two CPU vLLM engines (the tiny Llama, one core each, prefix caching on, KV events on ZMQ) started
through the test harness's ``VllmPool`` (``tests/fixtures/vllm.py``), which holds the machine-wide
machine-wide lock (``MachineLock``) while they run. One ``dyad serve`` process per run, in front of both
engines: ``round_robin``, or ``kv_aware`` fed by the engines' KV events, with router-side
tokenization from the model directory (the model config's ``tokenizer``). Runs alternate
(round_robin, kv_aware, round_robin, ...) and both engines' prefix caches are emptied
(``POST /reset_prefix_cache``) before every run, so every run starts cold.

Workload (deterministic, ``--seed``): ``--prompts`` long system prompts; ``--users`` chat sessions,
user ``u`` uses system prompt ``u % prompts``; each session has ``--turns`` turns, turn ``k`` sends
the system prompt and the whole conversation so far (earlier user messages and fixed assistant
replies), so a turn shares its prefix with the session's previous turn and with every session on
the same system prompt. Sessions start ``--session-gap`` s apart, turns follow ``--think`` s apart.
Every request streams ``--max-tokens`` tokens (``ignore_eos``).

Reported per run: TTFT mean/p50/p99 (client-side, streaming), the engines' real prefix hit ratio
(Σhits/Σqueries of ``vllm:prefix_cache_*_total``), requests per engine, and the workload's ideal hit
ratio (infinite cache, 32-token blocks, from the engines' own ``/tokenize``).

    .venv/bin/python scripts/bench_real_vllm_routing.py [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from orchestrator.bench.runner import BenchOptions, run_bench  # noqa: E402
from orchestrator.bench.traces import TraceRequest, ideal_prefix_hit_ratio_tokens  # noqa: E402
from tests.fixtures.vllm import VllmPaths, VllmPool, free_port  # noqa: E402

WORDS = ("alpha bravo cargo delta engine fabric garden harbor island jacket kernel ladder market "
         "needle orbit parcel quartz river signal timber uniform velvet window yellow zenith anchor "
         "basket candle dinner export forest glacier hammer insect jungle kettle lemon mirror noble "
         "ocean pepper quiet rocket silver tunnel umbrella valley wagon xylophone yogurt zipper").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def shared_prefix_workload(*, prompts: int, users: int, turns: int, system_words: int, user_words: int,
                           reply_words: int, session_gap_s: float, think_s: float, max_tokens: int,
                           seed: int) -> list[TraceRequest]:
    """The chat workload described in the module docstring, as trace requests (chat messages)."""
    rng = random.Random(seed)
    systems = [f"System prompt {p}. " + text(rng, system_words) for p in range(prompts)]
    reqs = []
    for u in range(users):
        history = [{"role": "system", "content": systems[u % prompts]}]
        for k in range(turns):
            history.append({"role": "user", "content": f"User {u} turn {k}: " + text(rng, user_words)})
            reqs.append(TraceRequest(index=0, arrival_s=u * session_gap_s + k * think_s, input_len=0,
                                     output_len=max_tokens, messages=tuple(dict(m) for m in history),
                                     session_id=str(u)))
            history.append({"role": "assistant", "content": text(rng, reply_words)})
    reqs.sort(key=lambda r: (r.arrival_s, r.session_id))
    return [TraceRequest(index=i, arrival_s=r.arrival_s, input_len=r.input_len, output_len=r.output_len,
                         messages=r.messages, session_id=r.session_id) for i, r in enumerate(reqs)]


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"gateway not ready at {url}: {log.read_text()[-2000:]}")


def gateway_config(policy: str, engines, model_dir: Path, port: int) -> dict:
    workers = [{"id": f"v{i}", "url": e.url, "engine": "vllm", "models": [e.model],
                "kv_events": {"endpoint": e.kv_events_endpoint, "replay_endpoint": e.kv_replay_endpoint}}
               for i, e in enumerate(engines)]
    return {"models": [{"name": engines[0].model, "tokenizer": str(model_dir), "block_size": 32}],
            "workers": workers, "router": {"policy": policy, "seed": 0},
            "gateway": {"host": "127.0.0.1", "port": port}, "scrape": {"interval_s": 0.5}}


def vllm_router_argv(policy: str, engines, port: int, venv: Path) -> list[str]:
    """The vllm-router anchor (installed only in the benchmark venv) in front of the same engines."""
    argv = [str(venv / "bin/vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *[e.url for e in engines], "--policy", policy, "--log-level", "warning",
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"]
    if policy == "kv_aware":
        for e in engines:
            argv += ["--kv-event-source", f"{e.url}={e.kv_events_endpoint}",
                     "--kv-event-replay-source", f"{e.url}={e.kv_replay_endpoint}"]
        argv += ["--kv-event-block-size", "32", "--kv-event-model", engines[0].model]
    return argv


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--user-words", type=int, default=20)
    ap.add_argument("--reply-words", type=int, default=20)
    ap.add_argument("--session-gap", type=float, default=1.5)
    ap.add_argument("--think", type=float, default=12.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="runs per policy (alternating)")
    ap.add_argument("--policies", default="round_robin,kv_aware",
                    help="Dyad policies, and vllm-router-<policy> for the anchor")
    ap.add_argument("--anchors-venv", default=str(Path.home() / ".cache/dyad/anchors/venv"))
    ap.add_argument("--scale-out", action="store_true",
                    help="start the engines with --enable-scale-out (its /render endpoints; vllm-router's kv_aware "
                         "tokenizes through them)")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()

    paths = VllmPaths.from_env()
    if why := paths.missing():
        print(f"cannot run real vLLM here: {why}", file=sys.stderr)
        return 2
    reqs = shared_prefix_workload(prompts=args.prompts, users=args.users, turns=args.turns,
                                  system_words=args.system_words, user_words=args.user_words,
                                  reply_words=args.reply_words, session_gap_s=args.session_gap,
                                  think_s=args.think, max_tokens=args.max_tokens, seed=args.seed)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    out: dict = {"args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="dyad-vllm-routing-") as tmp:
        pool = VllmPool(paths, Path(tmp))
        t0 = time.monotonic()
        try:
            engines = (pool.get(2, key="bench-scale-out", extra_args=["--enable-scale-out"]) if args.scale_out
                       else pool.use("default"))
            print(f"2 vLLM engines ready in {time.monotonic() - t0:.0f} s (incl. waiting for the machine lock): "
                  f"{', '.join(e.url for e in engines)}", flush=True)
            # Prompt lengths and the ideal hit ratio, from the engine's own tokenizer.
            seqs = []
            with httpx.Client(trust_env=False, timeout=30) as c:
                for r in reqs:
                    resp = c.post(f"{engines[0].url}/tokenize",
                                  json={"model": engines[0].model, "messages": r.render_messages()})
                    resp.raise_for_status()
                    seqs.append(resp.json()["tokens"])
            lens = [len(s) for s in seqs]
            ideal = ideal_prefix_hit_ratio_tokens(seqs, 32)
            span = reqs[-1].arrival_s
            print(f"workload: {len(reqs)} chat requests over {span:.0f} s ({len(reqs) / span:.2f} req/s), "
                  f"prompt tokens mean {statistics.mean(lens):.0f} (min {min(lens)}, max {max(lens)}), "
                  f"{args.max_tokens} output tokens; ideal hit ratio {100 * ideal:.1f}%", flush=True)
            out.update(ideal_hit_ratio=ideal, prompt_tokens_mean=statistics.mean(lens), requests=len(reqs))
            for rep in range(args.repeats):
                for policy in policies:
                    with httpx.Client(trust_env=False, timeout=30) as c:
                        for e in engines:
                            c.post(f"{e.url}/reset_prefix_cache").raise_for_status()
                    port = free_port()
                    log = Path(tmp) / f"gw-{policy}-{rep}.log"
                    if policy.startswith("vllm-router-"):
                        argv, ready = vllm_router_argv(policy.removeprefix("vllm-router-"), engines, port,
                                                       Path(args.anchors_venv).expanduser()), "/v1/models"
                    else:
                        cfg = Path(tmp) / f"gw-{policy}-{rep}.json"
                        cfg.write_text(json.dumps(gateway_config(policy, engines, paths.model_dir, port)))
                        argv, ready = [str(ROOT / ".venv/bin/python"), "-m", "orchestrator.cli", "serve",
                                       "--config", str(cfg)], "/ready"
                    gw = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
                    try:
                        url = f"http://127.0.0.1:{port}"
                        wait_http(f"{url}{ready}", gw, log)
                        time.sleep(2.0)  # KV event subscriptions connected before the first request
                        load0 = loadavg()
                        res = asyncio.run(run_bench(reqs, BenchOptions(
                            url=url, model=engines[0].model, api="chat", engines=[e.url for e in engines],
                            progress=False, timeout_s=300)))
                    finally:
                        gw.terminate()
                        try:
                            gw.wait(15)
                        except subprocess.TimeoutExpired:
                            gw.kill()
                            gw.wait(5)
                    s = res.summary
                    row = {"policy": policy, "repeat": rep, "ok": s["ok"], "requests": s["requests"],
                           "hit_ratio": s["cache"]["hit_ratio"], "ttft_mean_s": s["ttft_s"]["mean"],
                           "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
                           "per_engine_requests": [e["requests"] for e in s["engines"]],
                           "lag_max_s": s["max_send_lag_s"], "load_start": load0, "load_end": loadavg(),
                           "errors": s["error_kinds"]}
                    out["runs"].append(row)
                    print(f"{policy:<12} run {rep}: ok {s['ok']}/{s['requests']}  hit {100 * (row['hit_ratio'] or 0):.1f}%"
                          f"  TTFT mean {1e3 * (row['ttft_mean_s'] or 0):.0f} ms p50 {1e3 * (row['ttft_p50_s'] or 0):.0f}"
                          f" p99 {1e3 * (row['ttft_p99_s'] or 0):.0f}  per engine {row['per_engine_requests']}  "
                          f"lag max {row['lag_max_s']:.2f} s  load {load0}->{row['load_end']}"
                          f"{'  errors ' + str(row['errors']) if row['errors'] else ''}", flush=True)
        finally:
            pool.stop_all()
    print(f"\n{'policy':<12}{'runs':>5}{'hit ratio':>11}{'TTFT mean':>11}{'p50':>8}{'p99 (ms)':>10}")
    for policy in policies:
        rs = [r for r in out["runs"] if r["policy"] == policy]
        if rs:
            print(f"{policy:<12}{len(rs):>5}{100 * statistics.mean(r['hit_ratio'] or 0 for r in rs):>10.1f}%"
                  f"{1e3 * statistics.mean(r['ttft_mean_s'] or 0 for r in rs):>11.0f}"
                  f"{1e3 * statistics.mean(r['ttft_p50_s'] or 0 for r in rs):>8.0f}"
                  f"{1e3 * statistics.mean(r['ttft_p99_s'] or 0 for r in rs):>10.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
