"""The composition root: the one place a gateway is built from its configuration.

``build_runtime`` makes the ``GatewayRuntime`` (config, clock, metrics, fleet registry, router and its
prefix tracker, the pooled engine client, breakers, the in-flight attempt registry, the access log),
then wires in what other packages contribute — P/D pair selection, the P/D executor and role changes
(``orchestrator.disagg.build``), intake (``admission.Intake``: keys, rate limits, admission control,
the priority queue) — and ``start`` runs it, adding the SLO planner's loop when ``planner.enabled``
(``orchestrator.planner.install.build_service``). ``app.create_app`` calls both from its lifespan and
mounts the routes (OpenAI, health, metrics, admin, P/D admin, planner, UI). Nothing else assigns to
a runtime after this: no start-up patching.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator import disagg
from orchestrator.clock import Clock
from orchestrator.config import DyadConfig
from orchestrator.gateway import loop_guard, responses_api
from orchestrator.gateway.admission import Intake
from orchestrator.gateway.runtime import GatewayRuntime
from orchestrator.gateway.shutdown import ShuttingDown
from orchestrator.telemetry import setup as telemetry
from orchestrator.telemetry.metrics import DyadMetrics
from orchestrator.ui import start_history


def build_runtime(config: DyadConfig, *, clock: Clock | None = None, metrics: DyadMetrics | None = None,
                  runtime: GatewayRuntime | None = None) -> GatewayRuntime:
    """A complete runtime for ``config`` (``runtime``: a pre-built base, e.g. with a test transport)."""
    rt = runtime or GatewayRuntime(config, clock=clock, metrics=metrics)
    # every probe, scrape and model-card read carries this gateway's mark too (requests: executor.worker_headers)
    rt.http.headers[loop_guard.HEADER] = loop_guard.GATEWAY_ID
    telemetry.configure(rt)  # the access log and tracing from the config (orchestrator/telemetry/setup.py)
    parts = disagg.build(rt.config, rt.fleet, rt.router.policy, rt.http, rt.metrics, rt.clock, rt.adapter_for,
                         breakers=rt.breakers)
    rt.roles = parts.roles
    if parts.policy is not None:
        rt.router.policy = parts.policy
        rt.pd_executor = parts.executor
    rt.intake = Intake(rt)
    rt.response_owners = responses_api.build_owners(rt.config)  # /v1/responses ids → their engine
    gate = rt.intake.gate
    if gate is not None:  # a drain out of grace: whoever still waits gets 503 + Retry-After (shutdown.py)
        retry_after = rt.config.gateway.retry_after_s
        rt.shutdown.on_give_up(lambda: gate.close(lambda: ShuttingDown(retry_after)))
    return rt


async def start(rt: GatewayRuntime, read_metrics: Callable[[], bytes | str]) -> None:
    """Start the loops: health, scrape, KV events (``GatewayRuntime.start``), intake, and the planner; connect
    the shared response-owner map and the shared rate-limit buckets."""
    rt.add_task(rt.intake.run(), name="dyad-intake")
    await rt.start()
    await responses_api.connect_owners(rt)
    await rt.intake.limiter.connect()  # (shared rate-limit buckets: a first connection before the first request)
    if rt.config.planner.enabled:
        from orchestrator.planner.install import build_service
        service = build_service(rt, read_metrics)
        rt.planner = service
        rt.add_task(service.run(), name="dyad-planner")
    start_history(rt)  # the fleet page's last hour, sampled from rt.metrics (orchestrator/ui/history.py)


async def stop(rt: GatewayRuntime) -> None:
    """Stop the loops, close the engine client, flush telemetry."""
    await rt.stop()
    await responses_api.close_owners(rt)
    telemetry.close(rt)
