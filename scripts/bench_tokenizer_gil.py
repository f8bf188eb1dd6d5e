#!/usr/bin/env python3
"""Does a tokenizer call on a thread leave the event loop's thread free? (``tokenizers``: ``encode``
vs ``encode_batch``.)

Tokenizes one long text on a thread with each call while the main thread counts how often it gets
to run (a busy loop, as the event loop would be with requests to serve), and prints the main
thread's turns per millisecond: with the GIL held by the call, the main thread barely runs.

    .venv/bin/python scripts/bench_tokenizer_gil.py --tokenizer ~/.cache/dyad/models/tiny-llama-512 [--words 20000]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from tokenizers import Tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    ap.add_argument("--words", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(Path(args.tokenizer).expanduser() / "tokenizer.json"))
    text = " ".join(f"w{i % 997}x{i // 997}" for i in range(args.words))
    # "sleep": a thread that holds nothing for 100 ms, for scale
    calls = {"sleep": lambda: time.sleep(0.1), "encode": lambda: tok.encode(text),
             "encode_batch": lambda: tok.encode_batch([text])}
    print(f"{len(tok.encode(text).ids)} tokens")
    for name, fn in calls.items():
        rates, walls = [], []
        for _ in range(args.rounds):
            done = threading.Event()
            th = threading.Thread(target=lambda f=fn, d=done: (f(), d.set()))
            n, t0 = 0, time.perf_counter()
            th.start()
            while not done.is_set():
                n += 1
            wall = time.perf_counter() - t0
            th.join()
            rates.append(n / (wall * 1e3))
            walls.append(wall * 1e3)
        print(f"{name:13s} the call took {statistics.median(walls):7.1f} ms; main-thread turns per ms meanwhile: "
              f"{statistics.median(rates):8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
