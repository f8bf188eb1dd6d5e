"""The scrape loop: read each worker's ``/metrics`` through its adapter into ``Worker.load``.

Unhealthy workers are skipped (their load is meaningless and the probe is the health loop's job).
A failed scrape keeps the previous snapshot and counts ``dyad_worker_scrape_errors_total``; so does a
scrape whose load no engine can have (``impossible_load``: a gauge not finite or negative). A scrape that
finds the engine's generated-token counter risen since the last one sets ``Worker.generating_at``: the
engine is working, which outranks a missed health probe (``FleetRegistry.record_health``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

import httpx

from adapters.base import EngineAdapter, EngineKind, LoadSnapshot
from orchestrator.clock import Clock
from orchestrator.config import ScrapeConfig
from orchestrator.deadline import within
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger(__name__)

LOAD_GAUGES = ("running", "waiting", "kv_usage")


def impossible_load(load: LoadSnapshot) -> str | None:
    """The first gauge of ``load`` no engine can have (not finite, or negative), described; None: fine.
    Such a snapshot is garbage from the engine (a bug, a proxy's arithmetic): one ``waiting = +Inf`` made
    every planner interval fail, a negative ``running`` made its worker look emptier than empty."""
    for name in LOAD_GAUGES:
        v = getattr(load, name)
        if not math.isfinite(v) or v < 0:
            return f"{name} = {v:g}"
    return None


class MetricsScraper:
    def __init__(self, fleet: FleetRegistry, http: httpx.AsyncClient, config: ScrapeConfig, clock: Clock,
                 adapter_for: Callable[[EngineKind], EngineAdapter], metrics: DyadMetrics | None = None) -> None:
        self.fleet = fleet
        self.http = http
        self.config = config
        self.clock = clock
        self.adapter_for = adapter_for
        self.metrics = metrics
        self._refused: dict[str, str] = {}  # worker id → why its last scrape was refused (logged once)

    async def scrape_worker(self, worker: Worker) -> bool:
        adapter = self.adapter_for(worker.engine)
        model = worker.models[0] if len(worker.models) == 1 else None
        try:
            # the whole answer (``deadline.within``): a trickling engine must not hold the round, in which
            # every other worker's load waits for this one
            load = await within(self.config.timeout_s, adapter.scrape(
                self.http, worker.url, self.config.timeout_s, self.clock.now(), model), f"{worker.url}/metrics")
            bad = impossible_load(load)
            if bad is not None:  # a failed scrape: the last good load stays
                if self._refused.get(worker.id) != bad:
                    log.warning("worker %s: its engine reports %s at %s/metrics: not a load, the scrape is refused",
                                worker.id, bad, worker.url)
                self._refused[worker.id] = bad
                raise ValueError(bad)
            self._refused.pop(worker.id, None)
            before = worker.load.generation_tokens
            if before is not None and load.generation_tokens is not None and load.generation_tokens > before:
                worker.generating_at = load.scraped_at  # evidence of work the health loop weighs (registry)
            worker.load = load
            return True
        except Exception:
            if self.metrics is not None:
                self.metrics.scrape_errors.labels(worker.id).inc()
            return False

    async def scrape_all(self) -> None:
        workers = [w for w in self.fleet.workers() if w.state is not WorkerState.UNHEALTHY]
        if self._refused:  # forget workers that left (ids churn with every rollout)
            ids = {w.id for w in self.fleet.workers()}
            self._refused = {k: v for k, v in self._refused.items() if k in ids}
        if workers:
            await asyncio.gather(*(self.scrape_worker(w) for w in workers))

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.config.interval_s)
