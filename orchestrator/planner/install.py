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
from orchestrator.clock import SYSTEM_CLOCK
from orchestrator.config import PlannerConfig
from orchestrator.deadline import within
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.actuators import (
    Actuator,
    KubernetesActuator,
    LocalProcess,
    LocalProcessActuator,
    RecommendOnly,
    RoleChangeActuator,
    keep_reason,
    started_line,
)
from orchestrator.planner.core import Planner, PlannerSettings
from orchestrator.planner.inputs import InputGate
from orchestrator.planner.metrics_source import DirectSource, PrometheusSource
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.service import PlannerService, Source, views_from_workers
from orchestrator.planner.solver import Limits, Targets

log = logging.getLogger("dyad.planner")

STOP_GRACE_S = 30.0  # longest a stop waits (in the background) for requests routed after the planner saw it idle
START_BACKOFF_MAX = 5  # doublings of the pause after starts that do not come up (32 × the first pause)
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
        fast_lookahead=cfg.fast_lookahead,
        cooldown_s=cfg.cooldown_s, role_change_s=role_change_s, start_s=cfg.start_s,
        correct_from_latency=cfg.correct_from_latency, headroom=cfg.headroom,
        burst_window_s=None if cfg.burst_window_s == "auto" else cfg.burst_window_s,
        fixed_fleet=cfg.actuator == "role_change",
        standby_prefill=cfg.standby_prefill, standby_decode=cfg.standby_decode, standby_wake_s=cfg.standby_wake_s,
        standby_auto=cfg.standby_auto, standby_net_of_spare=cfg.standby_net_of_spare,
        standby_shared=cfg.standby_shared, standby_confirm=cfg.standby_confirm,
        scale_in_insured=cfg.scale_in_insured,
        rise_quantile=cfg.rise_quantile, cold_backlog=cfg.cold_backlog, insurance=cfg.insurance)


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


def source_from_config(cfg: PlannerConfig, read_metrics: Callable[[], bytes | str], http: Any = None,
                       fleet: Any = None) -> Source:
    """The planner's inputs. With ``fleet`` (the gateway's registry), a window without streamed
    requests takes its latency from the engines' own histograms: Prometheus's scrape of the engines
    (mapped to roles by the workers' addresses), or the gateway's scrape of their /metrics."""
    if cfg.prometheus_url:
        window = cfg.prometheus_window_s or cfg.interval_s
        return PrometheusSource(cfg.prometheus_url, window_s=window, model=cfg.model,
                                engines=(lambda: [(w.role, w.url) for w in fleet.workers()]) if fleet else None)
    return DirectSource(read=read_metrics,
                        engines=(lambda: [(w.id, w.role, w.load) for w in fleet.workers()
                                          if w.state is not WorkerState.UNHEALTHY]) if fleet else None)


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
                                 on_stopped=lambda p: _unregister(runtime, p),
                                 clock=getattr(runtime, "clock", None) or SYSTEM_CLOCK)
    draining = _DrainingLocal(local, runtime, min_serve_s=min_serve_s(cfg), start_timeout_s=start_timeout_s(cfg),
                              start_backoff_s=cfg.interval_s)
    if cfg.role_change_s is not None and cfg.role_change_s < cfg.start_s:
        return RoleChangeActuator(set_role, drain=lambda wid: runtime.fleet.drain(wid), fallback=draining)
    return draining


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
            url = f"{disc.scheme}://{host}:{port}"
            timeout = runtime.config.scrape.timeout_s
            load = await within(timeout, runtime.adapter_for(disc.engine).scrape(
                runtime.http, url, timeout, runtime.clock.now(), None), f"{url}/metrics")
        except Exception as e:
            # the adapter wraps transport errors (AdapterError from httpx.ConnectError): look underneath
            if isinstance(e, httpx.ConnectError) or isinstance(e.__cause__, httpx.ConnectError):
                return True  # the engine is not listening: nothing to finish
            return None  # cannot tell: wait (bounded by the drain timeout)
        return load.running == 0 and load.waiting == 0

    standby = {r: n for r, n in ((Role.PREFILL, cfg.standby_prefill), (Role.DECODE, cfg.standby_decode)) if n}
    return KubernetesActuator(api, cfg.kubernetes_namespace, dict(cfg.kubernetes_workloads), is_idle=engine_idle,
                              draining_annotation=disc.draining_annotation, standby=standby,
                              standby_annotation=disc.standby_annotation, settle_s=cfg.kubernetes_drain_settle_s,
                              drain_timeout_s=cfg.kubernetes_drain_timeout_s, clock=runtime.clock,
                              min_serve_s=min_serve_s(cfg), start_timeout_s=start_timeout_s(cfg))


def _registrar(runtime: Any, cfg: PlannerConfig) -> Callable[[LocalProcess], None]:
    def register(p: LocalProcess) -> None:
        # Unhealthy until the health loop sees the engine up: no request goes to a starting engine. A
        # standby worker is registered in standby: probed, never routed to until ``activate``.
        runtime.fleet.add(Worker(id=p.worker_id, url=p.url, engine=cfg.local_engine, role=p.role,
                                 models=list(cfg.local_models), configured_models=bool(cfg.local_models),
                                 state=WorkerState.STANDBY if p.standby else WorkerState.UNHEALTHY))
    return register


def _unregister(runtime: Any, p: LocalProcess) -> None:
    if runtime.fleet.get(p.worker_id) is not None:
        runtime.fleet.remove(p.worker_id)


def min_serve_s(cfg: PlannerConfig) -> float:
    """Shortest time a worker the planner started serves before the actuator lets it go: as long as
    the planner itself takes to decide a scale-in (``scale_in_intervals`` intervals below capacity).
    A worker stopped sooner cost a start for nothing; it derives from the interval, not a constant."""
    return cfg.scale_in_intervals * cfg.interval_s


def start_timeout_s(cfg: PlannerConfig) -> float:
    """After this long a start that has not become ready is no longer "in progress" (it may be stopped)."""
    return 3 * cfg.start_s + cfg.interval_s


def _never_served(w: Worker) -> bool:
    """Not once ready, in rotation or given a request (a start that has not come up)."""
    return (w.ready_at is None and not w.health_ok and w.last_served_at is None and w.inflight == 0
            and w.state in (WorkerState.UNHEALTHY, WorkerState.STANDBY))


class _DrainingLocal:
    """The local actuator with drains, warm standby and the churn guard carried out on the registry.

    - ``drain``: out of rotation, requests in flight finish; ``stop`` follows once idle.
    - ``activate``: a standby worker goes into rotation (a registry state change: no I/O, well
      under a second; the router picks it at its next request).
    - ``park``: a worker goes to standby: drained first (nothing new, in-flight finishes), then held
      out of rotation with its process kept (probed and scraped, ready for ``activate``).
    - churn guard (``keep_reason``): a worker still starting, or in rotation for less than
      ``min_serve_s``, is not stopped or drained-to-stop unless the action says ``force``; the
      refusal is one line in what was applied, and the planner re-plans next interval.
    - starts that do not come up (``_reap``): a process that exited, a start past ``start_timeout_s``
      and an engine removed from the registry are stopped; each failed start of a role doubles the
      pause before the next start of that role (``start_held_back``), one that comes up resets it.
    """

    name = "local"

    def __init__(self, local: LocalProcessActuator, runtime: Any, min_serve_s: float = 0.0,
                 start_timeout_s: float = 0.0, start_backoff_s: float = 0.0) -> None:
        self.local = local
        self.runtime = runtime
        self.min_serve_s = min_serve_s
        self.start_timeout_s = start_timeout_s
        # starts that did not come up, in a row, per role; the next start of that role waits
        # start_backoff_s × 2^(n-1) (capped at START_BACKOFF_MAX doublings); one that comes up resets it
        self.start_backoff_s = start_backoff_s
        self.failed_starts: dict[Role, int] = {}
        self._retry_at: dict[Role, float] = {}
        self._last_failure: dict[Role, str] = {}
        self._stopping: dict[str, asyncio.Task[None]] = {}  # worker id → stop once idle
        self._parking: dict[str, asyncio.Task[None]] = {}  # worker id → park once idle
        self._rotation_at: dict[str, float] = {}  # worker id → when it was last activated from standby

    async def close(self) -> None:
        tasks = [*self._stopping.values(), *self._parking.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.local.close()

    def keep_reason(self, worker: Worker, now: float) -> str | None:
        p = self.local.processes.get(worker.id)
        if p is None or (self.min_serve_s <= 0 and self.start_timeout_s <= 0):
            return None
        ready = worker.ready_at
        if ready is not None and worker.id in self._rotation_at:
            ready = max(ready, self._rotation_at[worker.id])
        return keep_reason(now, started_at=p.started_at, ready_at=ready, alive=p.proc is not None and p.proc.poll() is None,
                           min_serve_s=self.min_serve_s, start_timeout_s=self.start_timeout_s)

    async def _stop_when_idle(self, worker: Worker) -> None:
        try:
            deadline = asyncio.get_running_loop().time() + STOP_GRACE_S
            while worker.inflight > 0 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            await self.local.stop(worker.id)
        finally:
            self._stopping.pop(worker.id, None)

    async def _park_when_idle(self, worker: Worker) -> None:
        try:
            while worker.inflight > 0:
                await asyncio.sleep(0.05)
            if self.runtime.fleet.get(worker.id) is worker and worker.state is WorkerState.DRAINING:
                self.runtime.fleet.park(worker.id)
        finally:
            self._parking.pop(worker.id, None)

    def start_in_progress(self, worker: Worker, now: float) -> bool:
        """Is this never-ready engine still starting? Only while its process lives and for at most
        ``start_timeout_s`` (when set): past that it is not capacity on its way, and the planner must
        not count it as such (it would never start a replacement)."""
        p = self.local.processes.get(worker.id)
        if p is None or (p.proc is not None and p.proc.poll() is not None):
            return False
        return self.start_timeout_s <= 0 or now - p.started_at < self.start_timeout_s

    async def _reap(self) -> list[str]:
        """Engines that will not serve leave the registry and the book:

        - the process exited (crashed at start, killed): a dead standby engine would otherwise hold a
          place in the pool for good, and a dead serving one would stay an unhealthy worker the
          planner counts as its own;
        - it never became ready within ``start_timeout_s`` (hung loading, wrong port, a probe that
          never passes): its process holds the host's memory and accelerators that a replacement
          needs, and the planner no longer counts it;
        - an operator removed it from the registry (``DELETE /admin/workers/{id}``): the process
          would otherwise run on, out of every view, until the gateway exits."""
        done = []
        now = self.local.clock.now()
        fleet = self.runtime.fleet
        going: list[str] = []  # stopped together below (each stop may wait for its engine to exit)
        for wid, p in list(self.local.processes.items()):
            if wid in self._stopping:
                continue
            rc = p.proc.poll() if p.proc is not None else None
            w = fleet.get(wid)
            if w is not None and not _never_served(w):
                self.failed_starts.pop(p.role, None)  # this role's engines do come up
                self._retry_at.pop(p.role, None)
            if rc is not None:
                going.append(wid)
                done.append(f"reaped {wid}: its process exited with {rc}")
                if w is not None and _never_served(w):
                    self._start_failed(p.role, now, f"{wid} exited with {rc} before it was ready")
            elif w is None:
                going.append(wid)
                done.append(f"stopped {wid}: removed from the registry, its process is not left running")
            elif (self.start_timeout_s > 0 and now - p.started_at >= self.start_timeout_s and _never_served(w)):
                going.append(wid)
                done.append(f"reaped {wid}: not ready {now - p.started_at:.0f} s after its start "
                            f"(start timeout {self.start_timeout_s:g} s)")
                self._start_failed(p.role, now, f"{wid} was not ready {now - p.started_at:.0f} s after its start")
        await self.local.stop_all(going)
        return done

    def _start_failed(self, role: Role, now: float, why: str) -> None:
        n = self.failed_starts.get(role, 0) + 1
        self.failed_starts[role] = n
        self._last_failure[role] = why
        if self.start_backoff_s > 0:
            self._retry_at[role] = now + self.start_backoff_s * 2 ** min(n - 1, START_BACKOFF_MAX)

    def start_held_back(self, role: Role, now: float) -> str | None:
        """Why a start of ``role`` must wait (None: it may go)."""
        at = self._retry_at.get(role)
        if at is None or now >= at:
            return None
        n = self.failed_starts.get(role, 0)
        return (f"start of {role.value} held back {at - now:.0f} s: {n} start(s) in a row did not come up "
                f"(last: {self._last_failure.get(role, '?')})")

    async def apply(self, decision: Any) -> list[str]:
        done = await self._reap()
        fleet = self.runtime.fleet
        now = self.local.clock.now()
        rest = []
        for a in decision.actions:
            w = fleet.get(a.worker_id) if a.worker_id else None
            to_stop = a.kind == "stop" or (a.kind == "drain" and a.then in (None, "stop"))
            if to_stop and w is not None and not a.force and (why := self.keep_reason(w, now)):
                done.append(f"kept {w.id}: {why}")
                continue
            if a.kind == "drain" and w is not None:
                fleet.drain(w.id)
                done.append(f"draining {w.id}" + (f" (then {a.then})" if a.then else ""))
            elif a.kind == "activate" and w is not None:
                task = self._parking.pop(w.id, None)
                if task is not None:
                    task.cancel()
                fleet.activate(w.id)
                self._rotation_at[w.id] = now
                done.append(f"activated {w.id} ({w.state.value})")
            elif a.kind == "park" and w is not None:
                # drain first: what it has finishes, nothing new arrives; the process is kept
                if w.state is not WorkerState.DRAINING:
                    fleet.drain(w.id)
                if w.inflight > 0:
                    if w.id not in self._parking:
                        self._parking[w.id] = asyncio.create_task(self._park_when_idle(w))
                    done.append(f"parking {w.id} once its {w.inflight} request(s) finish")
                else:
                    fleet.park(w.id)
                    done.append(f"parked {w.id} (standby)")
            elif a.kind == "stop" and w is not None:
                # The planner saw it idle, but the router may have sent it a request since: take it out of
                # rotation first; if something is in flight, stop it once that finished (the loop goes on).
                if w.state is not WorkerState.DRAINING:
                    fleet.drain(w.id)
                if w.inflight > 0 and w.id in self.local.processes:
                    if w.id not in self._stopping:
                        self._stopping[w.id] = asyncio.create_task(self._stop_when_idle(w))
                    done.append(f"stopping {w.id} once its {w.inflight} request(s) finish")
                else:
                    rest.append(a)
            elif a.kind == "start" and (why := self.start_held_back(a.role, now)):
                if why not in done:
                    done.append(why)
            elif a.kind == "start":
                done.append(await self._start(a.role, standby=a.then == "standby", now=now))
            elif a.kind == "stop":
                rest.append(a)
        return done + await self.local.apply(replace(decision, actions=rest))

    async def _start(self, role: Role, standby: bool, now: float) -> str:
        """One start; a command that cannot be run (no such program, no permission) is a failed start of
        the role (paused like one that exits), not an exception that fails the interval's other actions."""
        try:
            p = await self.local.start(role, standby=standby)
        except (OSError, ValueError) as e:
            self._start_failed(role, now, f"could not run its command: {type(e).__name__}: {e}")
            return f"start of {role.value} failed: {type(e).__name__}: {e}"
        return started_line(p)


def _draining_of(actuator: Actuator) -> _DrainingLocal | None:
    inner = actuator if isinstance(actuator, _DrainingLocal) else getattr(actuator, "fallback", None)
    return inner if isinstance(inner, _DrainingLocal) else None


def _local_of(actuator: Actuator) -> LocalProcessActuator | None:
    wrapper = _draining_of(actuator)
    if wrapper is not None:
        return wrapper.local
    inner = getattr(actuator, "fallback", None)
    return inner if isinstance(inner, LocalProcessActuator) else None


def stoppable_by(actuator: Actuator) -> Callable[[Worker], bool] | None:
    """Which workers ``actuator`` can stop (None: any). A local actuator stops only the engines it
    started; role changes alone stop nothing. The planner never drains the others to stop them: a
    drained worker that is then not stopped would stay out of service for good.

    Under the local actuator an engine still starting, or in rotation for less than the minimum
    serve time, is not stoppable yet (``_DrainingLocal.keep_reason``): the planner then picks an
    older worker, or none, instead of asking for a stop the actuator would refuse."""
    wrapper = _draining_of(actuator)
    if wrapper is not None:
        local, now = wrapper.local, wrapper.local.clock.now
        return lambda w: w.id in local.processes and wrapper.keep_reason(w, now()) is None
    local = _local_of(actuator)
    if local is not None:
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
    local = _local_of(actuator)
    if local is None:
        return None
    wrapper = _draining_of(actuator)
    served: set[str] = set()

    def starting(w: Worker) -> bool:
        if w.id not in local.processes:
            return False
        if w.health_ok or w.last_served_at is not None:
            served.add(w.id)
        if w.id in served:
            return False
        # a start that died or timed out is not capacity on its way (the actuator reaps it)
        return wrapper is None or wrapper.start_in_progress(w, local.clock.now())

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
    return PlannerService(planner, source_from_config(cfg, read_metrics, fleet=runtime.fleet), actuator,
                          fleet=lambda: views_from_workers(runtime.fleet.workers(), stoppable, starting), clock=runtime.clock,
                          metrics=runtime.metrics, gate=gate)


