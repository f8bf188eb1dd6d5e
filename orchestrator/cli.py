"""The ``dyad`` command. Each subcommand lives in its own module with ``configure(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so ``dyad demo`` does
not pay for the planner or the benchmark client."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import os
import signal
import sys

# subcommand → (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("orchestrator.gateway.serve", "run the gateway (from flags, a config file, or both)"),
    "demo": ("orchestrator.demo", "gateway + simulated fleet on embedded defaults"),
    "sim-engine": ("orchestrator.sim.cli", "run one simulated engine (vLLM or SGLang dialect)"),
    "bench": ("orchestrator.bench.cli", "replay a trace against any OpenAI endpoint"),
    "sim": ("orchestrator.sim.virtual_cli", "replay a trace against a simulated fleet in virtual time"),
    "plan": ("orchestrator.planner.plan_cli", "what-if: which prefill/decode split a trace needs"),
    "profile": ("orchestrator.planner.profile_cli", "sweep an engine into a performance profile"),
    "check-config": ("orchestrator.config_cli", "validate configuration files"),
    "hash-key": ("orchestrator.gateway.hash_key_cli", "the SHA-256 digest of a client API key (auth.keys)"),
}


# Files a command writes once its work is done (dest → flag): checked before the work starts, so a typo in the
# directory is one line at once, not a traceback after minutes of simulation or benchmark.
OUTPUT_FLAGS: dict[str, str] = {"json_out": "--json", "plot": "--plot", "out": "--out"}


def unwritable_output(args: argparse.Namespace) -> str | None:
    """Why a file named by an output flag could not be written (None: all can)."""
    for dest, flag in OUTPUT_FLAGS.items():
        path = getattr(args, dest, None)
        if not isinstance(path, str) or not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return f"{flag} {path}: there is no directory {parent}"
        if os.path.isdir(path):
            return f"{flag} {path}: is a directory"
        if not os.access(path if os.path.exists(path) else parent, os.W_OK):
            return f"{flag} {path}: not writable"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dyad", description="Dyad: one OpenAI-compatible service over a vLLM/SGLang fleet")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    name = argv[0]
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack to stderr (a hung process)
        with contextlib.suppress(OSError, ValueError):  # (no file descriptor behind stderr: called in-process)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    if name not in COMMANDS:
        top.print_usage(sys.stderr)
        print(f"dyad: unknown command '{name}' (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"dyad {name}", description=COMMANDS[name][1])
    module.configure(parser)
    args = parser.parse_args(argv[1:])
    problem = unwritable_output(args)
    if problem:
        print(f"dyad {name}: {problem}", file=sys.stderr)
        return 2
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
