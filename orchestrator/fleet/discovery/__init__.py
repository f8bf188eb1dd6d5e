"""Discovery: where workers come from besides the static ``workers`` list.

``discovery.source`` picks one source: ``static`` (the list only: nothing runs), ``file`` (a
YAML/JSON workers file, ``file.py``) or ``kubernetes`` (pods by label selector, ``kubernetes.py``).
A source reports the workers it sees; the ``Reconciler`` (``reconcile.py``) turns each report into
registry changes: new workers are added unhealthy (the health loop brings them into rotation),
departed ones are drained and removed once idle, draining marks are honoured. Static workers are
never touched.

``Discovery(fleet, source, ...)`` is the component the gateway runs: ``start()`` waits (briefly) for
the source's first report so a gateway starts with its fleet, ``stop()`` ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.config import DiscoveryConfig
from orchestrator.fleet.discovery.reconcile import Change, Reconciler, WorkerSpec
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.discovery")

SWEEP_S = 0.5  # how often withdrawn workers are checked for idleness


class Source(Protocol):
    name: str

    async def run(self, report: Any) -> None: ...

    def status(self) -> dict[str, Any]: ...


def _log_change(c: Change) -> None:
    level = logging.WARNING if c.kind == "conflict" else logging.INFO
    log.log(level, "discovery: %s %s%s", c.kind, c.worker_id, f" ({c.reason})" if c.reason else "")


class Discovery:
    def __init__(self, fleet: FleetRegistry, source: Source, grace_s: float, clock: Clock | None = None,
                 start_timeout_s: float = 5.0, metrics: DyadMetrics | None = None) -> None:
        self.fleet = fleet
        self.source = source
        self.clock = clock or SYSTEM_CLOCK
        self.start_timeout_s = start_timeout_s
        self.metrics = metrics
        self.reconciler = Reconciler(fleet, source.name, grace_s, on_change=self._changed)
        self.reports = 0
        self._first = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []

    def _changed(self, c: Change) -> None:
        _log_change(c)
        if self.metrics is not None:
            self.metrics.discovery_changes.labels(self.source.name, c.kind).inc()

    def report(self, desired: dict[str, WorkerSpec]) -> None:
        self.reports += 1
        try:
            self.reconciler.update(desired, self.clock.now())
        except Exception as e:  # noqa: BLE001 - a report that fails to apply must not end the source's loop
            self._failed("applying a report", e)  # the next sweep or report tries again
        finally:
            self._first.set()
        unused = getattr(self.source, "unused_counts", None)  # pods the source sees but does not use
        if unused is not None and self.metrics is not None:
            for reason, n in unused().items():
                self.metrics.discovery_unused_pods.labels(reason).set(n)

    def _failed(self, what: str, e: Exception) -> None:
        log.warning("discovery (%s): %s failed: %s: %s", self.source.name, what, type(e).__name__, e)
        if self.metrics is not None:
            self.metrics.discovery_errors.labels(self.source.name).inc()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            if self.reconciler.owned or self.reconciler.desired:
                try:
                    self.reconciler.sweep(self.clock.now())
                except Exception as e:  # noqa: BLE001 - keep sweeping
                    self._failed("a sweep", e)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self.source.run(self.report), name=f"dyad-discovery-{self.source.name}"),
                       asyncio.create_task(self._sweep(), name="dyad-discovery-sweep")]
        try:
            await asyncio.wait_for(self._first.wait(), self.start_timeout_s)
        except TimeoutError:
            log.warning("discovery (%s): no worker list within %.0fs; continuing, it will join when it comes",
                        self.source.name, self.start_timeout_s)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    def status(self) -> dict[str, Any]:
        return {**self.source.status(), "reports": self.reports,
                "workers": sorted(self.reconciler.owned),
                "withdrawn": sorted(w for w, o in self.reconciler.owned.items() if o.withdrawn_at is not None),
                # workers the source reports but that are not added (their engine is already registered
                # under another id, or their id is a static worker's), and why
                "conflicts": {wid: why for wid, why in sorted(self.reconciler.conflicts())}}


def build_discovery(config: DiscoveryConfig, fleet: FleetRegistry, clock: Clock | None = None,
                    metrics: DyadMetrics | None = None) -> Discovery | None:
    """The configured source as a component (None for ``static``: the workers list is all there is)."""
    source: Source

    def on_error() -> None:
        if metrics is not None:
            metrics.discovery_errors.labels(config.source).inc()

    if config.source == "file":
        from orchestrator.fleet.discovery.file import FileSource
        source = FileSource(config.file, on_error=on_error)
    elif config.source == "kubernetes":
        from orchestrator.fleet.discovery.kubernetes import KubernetesSource
        source = KubernetesSource(config.kubernetes, on_error=on_error)
    else:
        return None
    return Discovery(fleet, source, config.remove_grace_s, clock, metrics=metrics)
