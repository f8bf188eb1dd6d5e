"""The scrape loop: read each worker's ``/metrics`` through its adapter into ``Worker.load``.

Unhealthy workers are skipped (their load is meaningless and the probe is the health loop's job).
A failed scrape keeps the previous snapshot and counts ``dyad_worker_scrape_errors_total``. A scrape that
finds the engine's generated-token counter risen since the last one sets ``Worker.generating_at``: the
engine is working, which outranks a missed health probe (``FleetRegistry.record_health``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from adapters.base import EngineAdapter, EngineKind
from orchestrator.clock import Clock
from orchestrator.config import ScrapeConfig
from orchestrator.deadline import within
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.telemetry.metrics import DyadMetrics


class MetricsScraper:
    def __init__(self, fleet: FleetRegistry, http: httpx.AsyncClient, config: ScrapeConfig, clock: Clock,
                 adapter_for: Callable[[EngineKind], EngineAdapter], metrics: DyadMetrics | None = None) -> None:
        self.fleet = fleet
        self.http = http
        self.config = config
        self.clock = clock
        self.adapter_for = adapter_for
        self.metrics = metrics

    async def scrape_worker(self, worker: Worker) -> bool:
        adapter = self.adapter_for(worker.engine)
        model = worker.models[0] if len(worker.models) == 1 else None
        try:
            # the whole answer (``deadline.within``): a trickling engine must not hold the round, in which
            # every other worker's load waits for this one
            load = await within(self.config.timeout_s, adapter.scrape(
                self.http, worker.url, self.config.timeout_s, self.clock.now(), model), f"{worker.url}/metrics")
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
        if workers:
            await asyncio.gather(*(self.scrape_worker(w) for w in workers))

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.config.interval_s)
