"""``dyad check-config FILE``: validate a configuration and print every bad field (exit 2)."""

from __future__ import annotations

import argparse
import sys

from orchestrator.config import ConfigError, load_config


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML configuration file")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"ok: {len(cfg.workers)} worker(s), policy {cfg.router.policy}, index {cfg.index.backend}")
    return 0
