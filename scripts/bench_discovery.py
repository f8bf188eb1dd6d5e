"""What one Kubernetes discovery report costs the gateway's event loop, by fleet size.

A report maps the watched pods to workers (``desired_from_pods``, memoized by resourceVersion) and
reconciles them with the registry (``Reconciler.update``). It runs on the gateway's event loop, so
its cost is time the request path waits; reports are coalesced (one per 50 ms at most). The baseline
in the same run is the same report without the memo (every pod re-mapped each time).

    .venv/bin/python scripts/bench_discovery.py --sizes 10 100 1000 --reports 50
"""

from __future__ import annotations

import argparse
import time

from adapters.base import Role
from orchestrator.config import KubernetesDiscoveryConfig
from orchestrator.fleet.discovery.kubernetes import desired_from_pods
from orchestrator.fleet.discovery.reconcile import Reconciler
from orchestrator.fleet.registry import FleetRegistry


def pod(i: int, rv: int = 1) -> dict:
    return {"metadata": {"name": f"e-{i}", "labels": {"dyad.dev/role": "decode"}, "annotations": {},
                         "resourceVersion": str(rv)},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": f"10.{i // 62500}.{i // 250 % 250}.{i % 250}",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def run(n: int, reports: int, memoize: bool) -> tuple[float, float]:
    cfg = KubernetesDiscoveryConfig(selectors={Role.DECODE: "app=engine"})
    pods = {f"e-{i}": pod(i) for i in range(n)}
    fleet, memo = FleetRegistry(), ({} if memoize else None)
    r = Reconciler(fleet, "kubernetes", grace_s=30)
    t = time.perf_counter()
    r.update(desired_from_pods([(Role.DECODE, pods)], cfg, memo), 0.0)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for k in range(reports):  # one pod changes per report (an annotation, a readiness flip)
        changed = k % n
        pods[f"e-{changed}"] = pod(changed, rv=k + 2)
        r.update(desired_from_pods([(Role.DECODE, pods)], cfg, memo), 1.0 + k)
    return first, (time.perf_counter() - t) / reports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--reports", type=int, default=50)
    args = ap.parse_args()
    print("| pods | first report (ms) | later report, memoized (ms) | later report, no memo (ms) |")
    print("|---|---|---|---|")
    for n in args.sizes:
        first, memo = run(n, args.reports, True)
        _, plain = run(n, args.reports, False)
        print(f"| {n} | {first * 1e3:.1f} | {memo * 1e3:.2f} | {plain * 1e3:.2f} |")


if __name__ == "__main__":
    main()
