"""Everything one gateway owns while it runs, in one object: ``app.state.runtime``.

Other parts of Dyad read these attributes by name: ``config``, ``clock``, ``metrics``, ``fleet``,
``router``, ``http`` (the one pooled ``httpx.AsyncClient`` used for every engine call),
``prefix_tracker`` (set by the kv package; None means plain load routing), ``planner`` (None
until the planner plugs in), ``executor`` / ``pd_executor``. ``start``/``stop`` run the
background loops (health, metrics scrape) beside the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Callable
from typing import Any

import httpx

from adapters.base import EngineAdapter, EngineKind
from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.config import DyadConfig
from orchestrator.fleet.discovery import build_discovery
from orchestrator.fleet.health import HealthChecker
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.scrape import MetricsScraper
from orchestrator.gateway.attempt import AttemptRegistry
from orchestrator.gateway.executor import AggregatedExecutor, Executor
from orchestrator.gateway.resilience import Backoff, CircuitBreakers
from orchestrator.gateway.shutdown import ShutdownState
from orchestrator.gateway.tls import engine_ssl_context
from orchestrator.gateway.transport import EngineClient, FastTransport
from orchestrator.router.policies import make_policy
from orchestrator.router.router import PrefixTracker, Router
from orchestrator.router.types import RouteDecision
from orchestrator.telemetry.access_log import AccessLog
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.gateway")

# Fallback when adapters.get_adapter is not available: engine kind → (module, class).
_ADAPTER_CLASSES = {
    EngineKind.VLLM: ("adapters.vllm", "VllmAdapter"),
    EngineKind.SIM: ("adapters.vllm", "VllmAdapter"),  # the simulator speaks vLLM's dialect
    EngineKind.SGLANG: ("adapters.sglang", "SglangAdapter"),
}


def default_adapter_for(kind: EngineKind) -> EngineAdapter:
    adapters = importlib.import_module("adapters")
    get_adapter = getattr(adapters, "get_adapter", None)
    if get_adapter is not None:
        return get_adapter(kind)
    module, name = _ADAPTER_CLASSES[EngineKind(kind)]
    return getattr(importlib.import_module(module), name)()


def http_client(config: DyadConfig, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The pooled client for every engine call, on the lean HTTP/1.1 transport (``transport.py``), as an
    ``EngineClient`` (no reference cycle per answer).
    Read timeout = first-byte timeout (also the longest silence allowed between streamed chunks);
    the whole request is bounded by the proxy."""
    gw = config.gateway
    if transport is None:  # https:// engines: httpx's transport with gateway.engine_tls (orchestrator.gateway.tls)
        transport = FastTransport(https=httpx.AsyncHTTPTransport(
            verify=engine_ssl_context(gw.engine_tls), trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=60)))
    return EngineClient(
        timeout=httpx.Timeout(connect=gw.connect_timeout_s, read=gw.first_byte_timeout_s,
                              write=gw.connect_timeout_s, pool=gw.connect_timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=60),
        transport=transport,
        trust_env=False,
    )


class GatewayRuntime:
    def __init__(self, config: DyadConfig, *, clock: Clock | None = None, metrics: DyadMetrics | None = None,
                 adapter_for: Callable[[EngineKind], EngineAdapter] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.clock = clock or SYSTEM_CLOCK
        self.metrics = metrics or DyadMetrics()
        self.fleet = FleetRegistry.from_config(config)
        self.router = Router(make_policy(config.router), self.fleet, self.clock, self.metrics,
                             retry_after_s=config.gateway.retry_after_s)
        self.http = http_client(config, transport)
        # Wired in by the composition root (compose.py): intake, P/D executor, role manager, planner.
        self.planner: Any = None
        self.intake: Any = None  # orchestrator.gateway.admission.Intake
        self.roles: Any = None  # orchestrator.disagg.roles.RoleManager
        self.executor: Executor = AggregatedExecutor(self.http, self.adapter_for)
        self.pd_executor: Executor | None = None  # orchestrator.disagg's PdExecutor when P/D is in use
        self._adapter_factory = adapter_for or default_adapter_for
        self._adapters: dict[EngineKind, EngineAdapter] = {}
        self.discovery = build_discovery(config.discovery, self.fleet, self.clock, self.metrics)  # file / kubernetes workers
        self.health = HealthChecker(self.fleet, self.http, config.health, self.clock, self.adapter_for,
                                    quiet_for=lambda w: self.attempts.quiet_for(w.id))
        self.scraper = MetricsScraper(self.fleet, self.http, config.scrape, self.clock, self.adapter_for,
                                      self.metrics)
        self._tasks: list[asyncio.Task[Any]] = []
        # Failure isolation on the request path (orchestrator/gateway/resilience.py).
        res = config.resilience
        self.backoff = Backoff(res.backoff_base_s, res.backoff_max_s)
        self.breakers = CircuitBreakers.from_config(
            res, on_change=lambda wid, state: self.metrics.breaker_transitions.labels(wid, state.value).inc())
        self.fleet.subscribe(lambda event, w: self.breakers.forget(w.id) if event == "removed" else None)
        # a removed worker's series leave /metrics (ids churn with pods: they would pile up otherwise)
        self.fleet.subscribe(lambda event, w: self.metrics.forget_worker(w.id) if event == "removed" else None)
        # Tries in flight by worker: a worker marked down fails its requests over at once (attempt.py).
        self.attempts = AttemptRegistry()
        self.fleet.subscribe(self._on_fleet_event)
        self.access_log = AccessLog()  # one record per request (orchestrator.telemetry.access_log)
        self.shutdown = ShutdownState(config.gateway.retry_after_s)  # SIGTERM drain (shutdown.py)
        if config.router.policy == "kv_aware":  # prefix-aware routing: tokenizer, index, KV events (orchestrator.kv)
            from orchestrator.kv.tracker import build_prefix_tracker
            self.prefix_tracker = build_prefix_tracker(config, self.fleet, self.metrics, self.clock,
                                                       http=self.http, adapter_for=self.adapter_for)

    def _on_fleet_event(self, event: str, worker: Any) -> None:
        from orchestrator.fleet.worker import WorkerState
        if (event == "removed" or (event == "state" and worker.state is WorkerState.UNHEALTHY)) and self.attempts:
            # A worker marked down: its streams that are delivering tokens go on (they break by themselves if
            # the engine died, and are pulled once quiet for the serving window); a removed one: all pulled.
            self.attempts.abort_worker(worker.id, f"worker {worker.id} was marked down "
                                                  f"({worker.last_error or 'health check failed'})",
                                       None if event == "removed" else self.fleet.serving_window_s)

    @property
    def prefix_tracker(self) -> PrefixTracker | None:
        return self.router.prefix_tracker

    @prefix_tracker.setter
    def prefix_tracker(self, tracker: PrefixTracker | None) -> None:
        self.router.prefix_tracker = tracker

    def adapter_for(self, kind: EngineKind) -> EngineAdapter:
        adapter = self._adapters.get(kind)
        if adapter is None:
            adapter = self._adapters[kind] = self._adapter_factory(kind)
        return adapter

    def executor_for(self, decision: RouteDecision) -> Executor:
        if decision.prefill_worker is not None:
            if self.pd_executor is None:
                raise RuntimeError("the routing decision names a prefill worker but no P/D executor is installed")
            return self.pd_executor
        return self.executor

    async def start(self) -> None:
        """Probe every worker once (so a gateway that starts next to running engines is ready at
        once), then start the health and scrape loops."""
        if self.discovery is not None:
            await self.discovery.start()  # its first worker list, before the first probe round
        try:
            await asyncio.wait_for(self.health.check_all(), self.config.health.timeout_s + 1.0)
        except TimeoutError:
            pass
        self._log_out_of_rotation()
        start_tracker = getattr(self.prefix_tracker, "start", None)
        if start_tracker is not None:  # KV event subscribers, shared-load lease renewal
            await start_tracker()
        self._tasks.append(asyncio.create_task(self._after(self.config.health.interval_s, self.health.run),
                                               name="dyad-health"))
        self._tasks.append(asyncio.create_task(self.scraper.run(), name="dyad-scrape"))
        self._tasks.append(asyncio.create_task(self.attempts.run(self.clock), name="dyad-stall-watch"))

    def _log_out_of_rotation(self) -> None:
        """One line after the start-up probe naming the workers it left out of rotation, and why: a worker that
        starts out of rotation changes no state, so the health loop's transition lines never mention it (a
        gateway in front of engines that are all down answered 503 with nothing in its log)."""
        from orchestrator.fleet.worker import WorkerState
        down = [w for w in self.fleet.workers() if w.state is WorkerState.UNHEALTHY]
        if down:
            shown = "; ".join(f"{w.id} ({w.url}): {w.last_error or 'not probed yet'}" for w in down[:10])
            more = f"; and {len(down) - 10} more" if len(down) > 10 else ""
            log.warning("not in rotation after the start-up health probe: %s%s (each takes requests once a probe "
                        "passes; GET /admin/workers shows last_error)", shown, more)

    @staticmethod
    async def _after(delay: float, loop: Callable[[], Any]) -> None:
        await asyncio.sleep(delay)
        await loop()

    def add_task(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """Run a background loop for as long as the gateway runs (KV event ingestion, planner, ...)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.discovery is not None:
            await self.discovery.stop()
        stop_tracker = getattr(self.prefix_tracker, "stop", None)
        if stop_tracker is not None:
            with contextlib.suppress(Exception):
                await stop_tracker()
        await self.http.aclose()
