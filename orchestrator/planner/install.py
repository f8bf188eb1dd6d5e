"""Plug the planner into a running gateway: ``install(runtime, read_metrics)`` builds the
``PlannerService`` that ``planner.*`` configures and runs it beside the request path.

Inputs: the gateway's own metrics (``DirectSource`` over ``read_metrics``, no HTTP round trip) or,
when ``planner.prometheus_url`` is set, a Prometheus that scrapes the gateway (``PrometheusSource``).
Actuators: recommend-only, local processes (added to / removed from the registry as they start and
stop), Kubernetes, or role changes through the disagg ``RoleManager`` (``runtime.roles``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from adapters.base import Role
from orchestrator.config import PlannerConfig
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.actuators import (
    Actuator,
    KubernetesActuator,
    LocalProcess,
    LocalProcessActuator,
    RecommendOnly,
    RoleChangeActuator,
)
from orchestrator.planner.core import Planner, PlannerSettings
from orchestrator.planner.inputs import InputGate
from orchestrator.planner.metrics_source import DirectSource, PrometheusSource
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.service import PlannerService, Source, views_from_workers
from orchestrator.planner.solver import Limits, Targets

log = logging.getLogger("dyad.planner")

STOP_GRACE_S = 30.0  # longest a stop waits (in the background) for requests routed after the planner saw it idle
ROLE_CHANGE_S = 1.0  # what a role change costs when the config does not say: a drain, no restart


def settings_from_config(cfg: PlannerConfig) -> PlannerSettings:
    role_change_s = cfg.role_change_s
    if cfg.actuator == "role_change" and role_change_s is None:
        role_change_s = ROLE_CHANGE_S
    if cfg.actuator not in ("role_change", "local"):
        role_change_s = None  # only these actuators can carry a role change out
    return PlannerSettings(
        targets=Targets(cfg.ttft_target_s, cfg.itl_target_s),
        limits=Limits(budget=cfg.max_workers, min_prefill=cfg.min_prefill, max_prefill=cfg.max_prefill,
                      min_decode=cfg.min_decode, max_decode=cfg.max_decode, prefill_cost=cfg.prefill_cost,
                      decode_cost=cfg.decode_cost, cost_budget=cfg.cost_budget),
        interval_s=cfg.interval_s, predictor=cfg.predictor, season=cfg.season,
        scale_in_margin=cfg.scale_in_margin, scale_in_intervals=cfg.scale_in_intervals,
        scale_in_step=cfg.scale_in_step, decode_headroom=cfg.decode_headroom, fast_interval_s=cfg.fast_interval_s,
        cooldown_s=cfg.cooldown_s, role_change_s=role_change_s, start_s=cfg.start_s,
        correct_from_latency=cfg.correct_from_latency, headroom=cfg.headroom,
        burst_window_s=cfg.burst_window_s, fixed_fleet=cfg.actuator == "role_change")


# Shipped as package data: `dyad profile --sim gpu-like --out orchestrator/planner/profiles/gpu-like.json`
# (a virtual-time sweep of the simulator's GPU-like engine). The gateway reads the JSON; it never runs
# the simulator (tests/unit/test_sim_is_a_leaf.py keeps it that way and checks the file is current).
DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "gpu-like.json"


def perf_model_from_config(cfg: PlannerConfig) -> PerfModel:
    """The configured profile, or the shipped pre-swept gpu-like profile (a stand-in)."""
    if cfg.profile:
        return PerfModel.load(cfg.profile)
    log.warning("planner.profile is not set: planning with the shipped profile of a simulated GPU-like engine "
                "(%s); run `dyad profile --url <engine>` and set planner.profile", DEFAULT_PROFILE.name)
    return PerfModel.load(DEFAULT_PROFILE)


def source_from_config(cfg: PlannerConfig, read_metrics: Callable[[], bytes | str], http: Any = None) -> Source:
    if cfg.prometheus_url:
        window = cfg.prometheus_window_s or cfg.interval_s
        return PrometheusSource(cfg.prometheus_url, window_s=window, model=cfg.model)
    return DirectSource(read=read_metrics)


def actuator_from_config(cfg: PlannerConfig, runtime: Any) -> Actuator:
    if cfg.actuator == "recommend":
        return RecommendOnly(runtime.metrics)
    if cfg.actuator == "kubernetes":
        return kubernetes_actuator(cfg, runtime)
    roles = getattr(runtime, "roles", None)

    def set_role(worker_id: str, role: Role) -> None:
        if roles is None:
            raise RuntimeError("role changes need the disagg RoleManager (disagg.install)")
        roles.request(worker_id, role)  # returns at once; the worker drains, then switches

    if cfg.actuator == "role_change":
        return RoleChangeActuator(set_role)
    # local processes, plus role changes when they are configured as faster than a start
    local = LocalProcessActuator(dict(cfg.local_commands), on_started=_registrar(runtime, cfg),
                                 on_stopped=lambda p: _unregister(runtime, p))
    if cfg.role_change_s is not None and cfg.role_change_s < cfg.start_s:
        return RoleChangeActuator(set_role, drain=lambda wid: runtime.fleet.drain(wid), fallback=local)
    return _DrainingLocal(local, runtime)


def kubernetes_actuator(cfg: PlannerConfig, runtime: Any) -> KubernetesActuator:
    """The k8s actuator, with the drain protocol of ``discovery.kubernetes`` (same annotation) and an
    idleness check that reads the victim pod's engine ``/metrics`` (running + waiting = 0)."""
    from orchestrator.fleet.discovery.kubernetes import container_port
    from orchestrator.fleet.kube_api import KubeApi

    disc = runtime.config.discovery.kubernetes
    api = KubeApi(cfg.kubernetes_api, token=cfg.kubernetes_token, token_file=cfg.kubernetes_token_file,
                  ca_file=cfg.kubernetes_ca_file)

    async def engine_idle(pod: dict[str, Any]) -> bool | None:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            return True  # never got an address: nothing can be running there
        port = container_port(pod, disc.port)
        if port is None:
            log.warning("scale-in: pod %s has no container port %r (discovery.kubernetes.port): cannot read its "
                        "engine; waiting for planner.kubernetes_drain_timeout_s", pod["metadata"]["name"], disc.port)
            return None
        worker = runtime.fleet.get(pod["metadata"]["name"])
        if worker is not None and worker.inflight > 0:
            return False  # this process itself still has requests there
        host = f"[{ip}]" if ":" in ip else ip
        try:
            load = await runtime.adapter_for(disc.engine).scrape(runtime.http, f"{disc.scheme}://{host}:{port}",
                                                                 runtime.config.scrape.timeout_s,
                                                                 runtime.clock.now(), None)
        except httpx.ConnectError:
            return True  # the engine is not listening: nothing to finish
        except Exception:
            return None  # cannot tell: wait (bounded by the drain timeout)
        return load.running == 0 and load.waiting == 0

    return KubernetesActuator(api, cfg.kubernetes_namespace, dict(cfg.kubernetes_workloads), is_idle=engine_idle,
                              draining_annotation=disc.draining_annotation, settle_s=cfg.kubernetes_drain_settle_s,
                              drain_timeout_s=cfg.kubernetes_drain_timeout_s, clock=runtime.clock)


def _registrar(runtime: Any, cfg: PlannerConfig) -> Callable[[LocalProcess], None]:
    def register(p: LocalProcess) -> None:
        # Unhealthy until the health loop sees the engine up: no request goes to a starting engine.
        runtime.fleet.add(Worker(id=p.worker_id, url=p.url, engine=cfg.local_engine, role=p.role,
                                 models=list(cfg.local_models), configured_models=bool(cfg.local_models),
                                 state=WorkerState.UNHEALTHY))
    return register


def _unregister(runtime: Any, p: LocalProcess) -> None:
    if runtime.fleet.get(p.worker_id) is not None:
        runtime.fleet.remove(p.worker_id)


class _DrainingLocal:
    """The local actuator with drains carried out on the registry (stop follows once idle)."""

    name = "local"

    def __init__(self, local: LocalProcessActuator, runtime: Any) -> None:
        self.local = local
        self.runtime = runtime
        self._stopping: dict[str, asyncio.Task[None]] = {}  # worker id → stop once idle

    async def close(self) -> None:
        for task in list(self._stopping.values()):
            task.cancel()
        await asyncio.gather(*self._stopping.values(), return_exceptions=True)
        await self.local.close()

    async def _stop_when_idle(self, worker: Worker) -> None:
        try:
            deadline = asyncio.get_running_loop().time() + STOP_GRACE_S
            while worker.inflight > 0 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            await self.local.stop(worker.id)
        finally:
            self._stopping.pop(worker.id, None)

    async def apply(self, decision: Any) -> list[str]:
        done = []
        fleet = self.runtime.fleet
        later = set()
        for a in decision.actions:
            if a.kind == "drain" and a.worker_id and fleet.get(a.worker_id) is not None:
                fleet.drain(a.worker_id)
                done.append(f"draining {a.worker_id}")
            elif a.kind == "stop" and a.worker_id and (w := fleet.get(a.worker_id)) is not None:
                # The planner saw it idle, but the router may have sent it a request since: take it out of
                # rotation first; if something is in flight, stop it once that finished (the loop goes on).
                if w.state is not WorkerState.DRAINING:
                    fleet.drain(w.id)
                if w.inflight > 0 and a.worker_id in self.local.processes:
                    later.add(a.worker_id)
                    if a.worker_id not in self._stopping:
                        self._stopping[a.worker_id] = asyncio.create_task(self._stop_when_idle(w))
                    done.append(f"stopping {a.worker_id} once its {w.inflight} request(s) finish")
        if later:
            decision = replace(decision, actions=[a for a in decision.actions
                                                  if not (a.kind == "stop" and a.worker_id in later)])
        return done + await self.local.apply(decision)


def stoppable_by(actuator: Actuator) -> Callable[[Worker], bool] | None:
    """Which workers ``actuator`` can stop (None: any). A local actuator stops only the engines it
    started; role changes alone stop nothing. The planner never drains the others to stop them: a
    drained worker that is then not stopped would stay out of service for good."""
    local = actuator.local if isinstance(actuator, _DrainingLocal) else getattr(actuator, "fallback", None)
    if isinstance(local, LocalProcessActuator):
        return lambda w: w.id in local.processes
    if isinstance(actuator, RoleChangeActuator):
        return lambda w: False
    if isinstance(actuator, KubernetesActuator):
        # Kubernetes decides which pods a scale-in removes (a StatefulSet's highest ordinals): the
        # actuator marks and drains those itself from ``desired``; a worker the planner picked would
        # be drained for nothing.
        return lambda w: False
    return None


def starting_by(actuator: Actuator) -> Callable[[Worker], bool] | None:
    """Which unhealthy workers are engines the local actuator started that have not been healthy yet
    (a worker that was healthy once and fell over is unhealthy, not starting)."""
    local = actuator.local if isinstance(actuator, _DrainingLocal) else getattr(actuator, "fallback", None)
    if not isinstance(local, LocalProcessActuator):
        return None
    served: set[str] = set()

    def starting(w: Worker) -> bool:
        if w.id not in local.processes:
            return False
        if w.health_ok or w.last_served_at is not None:
            served.add(w.id)
        return w.id not in served

    return starting


def build_service(runtime: Any, read_metrics: Callable[[], bytes | str]) -> PlannerService:
    cfg: PlannerConfig = runtime.config.planner
    decode_perf = PerfModel.load(cfg.decode_profile) if cfg.decode_profile else None
    planner = Planner(perf_model_from_config(cfg), settings_from_config(cfg), decode_perf=decode_perf)
    runtime.metrics.planner_max_workers.set(cfg.max_workers)
    actuator = actuator_from_config(cfg, runtime)
    stoppable = stoppable_by(actuator)
    starting = starting_by(actuator)
    gate = InputGate(cfg.input_max_age_s or 3 * cfg.interval_s, need_latency=cfg.correct_from_latency)
    return PlannerService(planner, source_from_config(cfg, read_metrics), actuator,
                          fleet=lambda: views_from_workers(runtime.fleet.workers(), stoppable, starting), clock=runtime.clock,
                          metrics=runtime.metrics, gate=gate)


