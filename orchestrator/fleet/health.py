"""The health loop: probe every worker on an interval and report to the registry.

The registry applies the thresholds (``HealthConfig``); this module only does the probing. A worker
whose models were not configured learns them from the engine (``/v1/models``) at its first
successful probe, and is not marked healthy before it has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

from adapters.base import EngineAdapter, EngineKind
from orchestrator.clock import Clock
from orchestrator.config import HealthConfig
from orchestrator.deadline import within
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker
from orchestrator.gateway.transport import drop_idle

log = logging.getLogger(__name__)

T = TypeVar("T")


class HealthChecker:
    def __init__(self, fleet: FleetRegistry, http: httpx.AsyncClient, config: HealthConfig, clock: Clock,
                 adapter_for: Callable[[EngineKind], EngineAdapter],
                 quiet_for: Callable[[Worker], float | None] | None = None) -> None:
        """``quiet_for``: seconds since a stream on the worker last delivered data (the gateway's attempts);
        a failed probe of a worker whose streams are delivering is not held against it (the registry's
        ``serving_window_s``: an engine answering /health late under load is still up)."""
        self.quiet_for = quiet_for
        self.fleet = fleet
        self.http = http
        self.config = config
        self.clock = clock
        self.adapter_for = adapter_for

    async def _bounded(self, worker: Worker, call: Awaitable[T]) -> T:
        """``call`` within ``timeout_s`` in all (``deadline.within``): an engine that trickles its answer
        would otherwise hold this probe, and with it the whole round (``check_all`` waits for every worker)."""
        return await within(self.config.timeout_s, call, worker.url)

    async def check_worker(self, worker: Worker) -> bool:
        adapter = self.adapter_for(worker.engine)
        error: str | None = None
        timed_out = False  # took the probe, did not answer in time (the registry's last resort)
        timeout = self.config.timeout_s
        try:
            ok = await self._bounded(worker, adapter.health(self.http, worker.url, timeout))
            if not ok:
                error = "health probe failed"
            elif not worker.models:
                cards = await self._bounded(worker, adapter.model_cards(self.http, worker.url, timeout))
                self._learn_limits(worker, cards)
                if cards:
                    worker.models = list(cards)
                else:
                    ok, error = False, "engine reports no models"
            elif not worker.model_cards_read:  # configured models: read the context lengths once
                try:
                    self._learn_limits(worker, await self._bounded(worker, adapter.model_cards(self.http, worker.url, timeout)))
                except Exception:  # noqa: BLE001 - optional information: a failure here is not a failed probe
                    worker.model_cards_read = True
        except TimeoutError as e:  # (``within``, or the adapter's: the engine took the probe, no answer in time)
            ok, error, timed_out = False, f"TimeoutError: {e}", True
        except Exception as e:  # any failure of the probe is a failed probe, never a dead loop
            ok, error = False, f"{type(e).__name__}: {e}"
        if not ok:  # the next probe (and request) opens a fresh connection: pooled ones may lead nowhere
            drop_idle(self.http, worker.url)
        was = worker.state
        quiet = self.quiet_for(worker) if not ok and self.quiet_for is not None else None
        self.fleet.record_health(worker, ok, self.clock.now(), error, quiet, timed_out)
        if worker.state is not was:
            log.log(logging.INFO if ok else logging.WARNING,"worker %s (%s): %s -> %s%s", worker.id, worker.url, was.value, worker.state.value,
                        f" ({error})" if error else "")
        return ok

    @staticmethod
    def _learn_limits(worker: Worker, cards: dict[str, int | None]) -> None:
        worker.model_cards_read = True
        worker.max_model_len = {m: n for m, n in cards.items() if n is not None}

    async def check_all(self) -> None:
        workers = self.fleet.workers()
        if workers:
            await asyncio.gather(*(self.check_worker(w) for w in workers))

    async def run(self) -> None:
        """Probe forever; the first round starts immediately."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.interval_s)
