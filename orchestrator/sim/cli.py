"""``dyad sim-engine``: run one simulated engine (vLLM or SGLang dialect) in the foreground."""

from __future__ import annotations

import argparse
import sys

import zmq

from orchestrator.sim.profiles import PROFILES, load_profile
from orchestrator.sim.server import SimServerConfig, run_forever


def _port(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: any free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, not {port}")
    return port


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=_port, required=True, help="HTTP port (0 = any free port)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--profile", default="cpu-tiny", help=f"engine profile: one of {', '.join(PROFILES)} or a JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--kv-events-port", type=_port, default=None, help="ZMQ PUB port for KV events (default: free port)")
    p.add_argument("--kv-replay-port", type=_port, default=None, help="ZMQ ROUTER port for event replay")
    p.add_argument("--no-kv-events", action="store_true", help="do not publish KV events")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null",
                   help="SGLang dialect: P/D role")
    p.add_argument("--bootstrap-timeout", type=float, default=30.0, help="SGLang decode: wait for the prefill (s)")
    p.add_argument("--kv-pull-timeout", type=float, default=5.0, help="vLLM decode: KV pull timeout (s)")
    p.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail")
    p.add_argument("--prefill-delay", type=float, default=0.0, help="fault: delay every request by this many s")
    p.add_argument("--fail-next", type=int, default=0, help="fault: the next N requests answer 500")
    p.add_argument("--die-after-tokens", type=int, default=None, help="fault: exit after N generated tokens")


def run(args: argparse.Namespace) -> int:
    try:
        profile = load_profile(args.profile)
    except ValueError as e:
        print(f"dyad sim-engine: {e}", file=sys.stderr)
        return 2
    kw = {}
    if args.engine_id:
        kw["engine_id"] = args.engine_id
    cfg = SimServerConfig(
        model=args.model, profile=profile, seed=args.seed, dialect=args.dialect, host=args.host,
        kv_events=not args.no_kv_events, kv_events_port=args.kv_events_port, replay_port=args.kv_replay_port,
        disaggregation_mode=args.disaggregation_mode, bootstrap_timeout_s=args.bootstrap_timeout,
        kv_pull_timeout_s=args.kv_pull_timeout, kv_load_failure_policy=args.kv_load_failure_policy,
        prefill_delay_s=args.prefill_delay, fail_next=args.fail_next, die_after_tokens=args.die_after_tokens, **kw)
    print(f"dyad sim-engine: model={args.model} profile={profile.name} dialect={args.dialect}",
          file=sys.stderr, flush=True)
    try:
        run_forever(cfg, args.port)
    except OSError as e:  # a port in use: one line, not a traceback
        print(f"dyad sim-engine: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    except zmq.ZMQError as e:  # the KV-event or replay port (its message names the address)
        print(f"dyad sim-engine: cannot bind the KV-event sockets: {e}", file=sys.stderr)
        return 2
    return 0
