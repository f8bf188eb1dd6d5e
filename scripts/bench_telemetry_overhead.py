"""Per-request CPU cost of the access log and of tracing, each against its "off" baseline in the same run.

One simulated request = what the gateway does per request: a root span with admission, route and
attempt children, one ``inject`` for the engine's headers, and one access-log line. Measured as the
process's CPU time over a tight loop (all threads, median of ``--repeats`` runs of ``--n`` requests);
the OTLP case exports through the SDK's batch processor to a real collector (rotel), flushed before
the clock stops, so the export thread's work (protobuf, HTTP) is counted.

    python scripts/bench_telemetry_overhead.py --n 20000 --repeats 5 --out-dir DIR
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from orchestrator.config import AccessLogConfig, TracingConfig
from orchestrator.telemetry import tracing
from orchestrator.telemetry.access_log import AccessLog, AccessRecord

QUEUE = 1_000_000  # nothing dropped: every span's export is paid for and counted


def one_request(access: AccessLog, i: int) -> None:
    with tracing.span("dyad.request", model="tiny", endpoint="/v1/chat/completions", stream=True) as root:
        with tracing.span("dyad.admission", model="tiny"):
            pass
        with tracing.span("dyad.route", policy="kv_aware", worker="w1", predicted_cached_tokens=96):
            pass
        with tracing.span("dyad.attempt", worker="w1", role="both") as att:
            tracing.inject({"content-type": "application/json"})
            att.set_attribute("outcome", "answered")
        trace_id = root.trace_id_hex()
    access.emit(AccessRecord(request_id=f"req-{i}", model="tiny", endpoint="/v1/chat/completions", stream=True,
                             workers=[("w1", "both")], attempts=1, status=200, prompt_tokens=106, cached_tokens=96,
                             generated_tokens=8, ttft_s=0.0383, itl_mean_s=0.0117, total_s=0.12,
                             client_key_id="team-a", trace_id=trace_id))


def measure(access: AccessLog, n: int, repeats: int) -> float:
    """CPU time of every thread of the process (the exporter's too, flushed at the end), per request."""
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        for i in range(n):
            one_request(access, i)
        tracing.force_flush(60)
        runs.append((time.process_time() - t0) / n)
    return statistics.median(runs) * 1e6  # µs per request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", help="where the access-log files and the collector's output go (default: a temp dir)")
    args = ap.parse_args()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="dyad-telemetry-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    tracing.shutdown()
    off = AccessLog(False)
    base = measure(off, args.n, args.repeats)
    rows.append(("everything off (baseline)", base))
    for fmt in ("json", "kv"):
        log = AccessLog.from_config(AccessLogConfig(enabled=True, format=fmt, output=str(out / f"access.{fmt}")))
        rows.append((f"access log on ({fmt}, to a file)", measure(log, args.n, args.repeats)))
        log.close()
    sampled = AccessLog.from_config(AccessLogConfig(enabled=True, sample_rate=0.01, output=str(out / "access.1pct")))
    rows.append(("access log on, sample_rate 0.01", measure(sampled, args.n, args.repeats)))
    sampled.close()
    from tests.fixtures.otel_collector import RotelCollector

    with RotelCollector(out / "otel") as otel:
        for ratio in (1.0, 0.1):
            tracing.configure(TracingConfig(enabled=True, endpoint=otel.traces_endpoint, sample_ratio=ratio,
                                            max_queue_size=QUEUE))
            rows.append((f"tracing on (OTLP to a collector), sample_ratio {ratio}", measure(off, args.n, args.repeats)))
            tracing.shutdown()
        tracing.configure(TracingConfig(enabled=True, endpoint=otel.traces_endpoint, max_queue_size=QUEUE))
        log = AccessLog.from_config(AccessLogConfig(enabled=True, output=str(out / "access.both")))
        rows.append(("tracing + access log (json)", measure(log, args.n, args.repeats)))
        log.close()
        tracing.shutdown()
    print(f"{'case':58s} {'µs/request':>10s} {'+ vs off':>9s}")
    for name, us in rows:
        print(f"{name:58s} {us:10.1f} {us - base:+9.1f}")


if __name__ == "__main__":
    main()
