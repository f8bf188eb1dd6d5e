"""How long one engine scrape takes to read: our parser vs prometheus_client's, on a real vLLM page.

    .venv/bin/python scripts/bench_prometheus_text.py [--file PATH] [--rounds N]

The gateway scrapes every engine about once a second, so parsing cost is paid per engine per
second on the gateway's event loop. Prints milliseconds per page (median of rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from adapters.prometheus_text import parse_samples
from adapters.vllm import parse_vllm_metrics

DEFAULT = Path(__file__).resolve().parent.parent / "tests/unit/data/vllm-0.32-metrics.txt"


def per_call_ms(fn: Callable[[], object], rounds: int, inner: int = 20) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", type=Path, default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    text = args.file.read_text()
    print(f"page: {args.file} ({len(text.splitlines())} lines, {len(text)} bytes)")
    rows = [
        ("parse_samples, all lines", lambda: parse_samples(text)),
        ("parse_samples, vllm: lines only", lambda: parse_samples(text, ("vllm:",))),
        ("parse_vllm_metrics -> LoadSnapshot", lambda: parse_vllm_metrics(text, 0.0)),
        ("prometheus_client text_string_to_metric_families", lambda: list(text_string_to_metric_families(text))),
    ]
    for name, fn in rows:
        print(f"{name:52s} {per_call_ms(fn, args.rounds):8.3f} ms")


if __name__ == "__main__":
    main()
