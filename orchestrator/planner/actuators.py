"""Actuators: carry out a ``PlanDecision``. The planner decides; these only act.

One interface, ``Actuator.apply(decision) -> list[str]`` (what was done, for logs and
``/admin/planner``), and four implementations:

- ``RecommendOnly``: does nothing but export the decision as metrics and keep it for the admin API.
- ``LocalProcessActuator``: starts/stops engine processes on this host from a command template per
  role (``{port}`` is filled with a free port); ``on_started``/``on_stopped`` hooks let the gateway
  add/remove the worker from its registry.
- ``KubernetesActuator``: sets ``spec.replicas`` of one Deployment/StatefulSet per role through the
  API server's ``scale`` subresource (a merge-patch), with a bearer token.
- ``RoleChangeActuator``: moves a worker between pools without a restart through a ``set_role``
  callable (the gateway's, from the P/D work); ``drain`` goes to a ``drain`` callable.
Role changes are only emitted by the planner when ``PlannerSettings.role_change_s`` is set, i.e.
when this kind of actuator is in use and faster than starting an engine.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx

from adapters.base import Role
from orchestrator.planner.core import PlanDecision
from orchestrator.ports import free_port
from orchestrator.telemetry.metrics import DyadMetrics


class Actuator(Protocol):
    name: str

    async def apply(self, decision: PlanDecision) -> list[str]: ...


def export_metrics(decision: PlanDecision, metrics: DyadMetrics) -> None:
    """Predictions, desired workers per role and action counts → the dyad_planner_* series."""
    if decision.forecast is not None:
        metrics.planner_predicted.labels("request_rate").set(decision.forecast.request_rate)
        metrics.planner_predicted.labels("isl").set(decision.forecast.isl)
        metrics.planner_predicted.labels("osl").set(decision.forecast.osl)
    for role, n in decision.desired.items():
        metrics.planner_desired_workers.labels(role).set(n)
    for a in decision.actions:
        metrics.planner_decisions.labels(a.kind).inc()
    if not decision.actions:
        metrics.planner_decisions.labels("hold").inc()


class RecommendOnly:
    name = "recommend"

    def __init__(self, metrics: DyadMetrics | None = None) -> None:
        self.metrics = metrics
        self.last: PlanDecision | None = None

    async def apply(self, decision: PlanDecision) -> list[str]:
        self.last = decision
        if self.metrics is not None:
            export_metrics(decision, self.metrics)
        return [f"recommend {a.kind} {a.role.value} {a.worker_id or ''}".strip() for a in decision.actions]


@dataclass
class LocalProcess:
    worker_id: str
    role: Role
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class LocalProcessActuator:
    """Engines as child processes. ``commands`` maps a role to a template such as
    ``"dyad sim-engine --port {port} --role {role}"`` or a vLLM command line."""

    commands: dict[Role, str]
    env: dict[str, str] | None = None
    on_started: Callable[[LocalProcess], Awaitable[None] | None] | None = None
    on_stopped: Callable[[LocalProcess], Awaitable[None] | None] | None = None
    stop_timeout_s: float = 10.0
    name: str = "local"
    processes: dict[str, LocalProcess] = field(default_factory=dict)
    _n: int = 0

    async def _hook(self, hook: Callable[[LocalProcess], Any] | None, p: LocalProcess) -> None:
        if hook is not None:
            r = hook(p)
            if asyncio.iscoroutine(r):
                await r

    async def start(self, role: Role) -> LocalProcess:
        if role not in self.commands:
            raise ValueError(f"no command template for role '{role.value}'")
        port = free_port()
        self._n += 1
        wid = f"local-{role.value}-{self._n}"
        argv = shlex.split(self.commands[role].format(port=port, role=role.value, worker_id=wid))
        proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        p = LocalProcess(wid, role, port, proc)
        self.processes[wid] = p
        await self._hook(self.on_started, p)
        return p

    async def stop(self, worker_id: str) -> bool:
        p = self.processes.pop(worker_id, None)
        if p is None:
            return False
        p.proc.terminate()
        try:
            await asyncio.to_thread(p.proc.wait, self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            await asyncio.to_thread(p.proc.wait)
        await self._hook(self.on_stopped, p)
        return True

    async def apply(self, decision: PlanDecision) -> list[str]:
        done = []
        for a in decision.actions:
            if a.kind == "start":
                p = await self.start(a.role)
                done.append(f"started {p.worker_id} ({a.role.value}) on port {p.port}")
            elif a.kind == "stop" and a.worker_id and await self.stop(a.worker_id):
                done.append(f"stopped {a.worker_id}")
        return done

    async def close(self) -> None:
        for wid in list(self.processes):
            await self.stop(wid)


@dataclass
class KubernetesActuator:
    """Scale one workload per role: ``workloads = {Role.PREFILL: "deployments/llm-prefill", ...}``.

    Uses ``PATCH {api}/apis/apps/v1/namespaces/{ns}/{kind}/{name}/scale`` with
    ``application/merge-patch+json`` ``{"spec": {"replicas": n}}``; pods drain through their own
    termination grace period (the engine finishes in-flight requests on SIGTERM).
    """

    api_url: str
    namespace: str
    workloads: dict[Role, str]
    token: str | None = None
    verify: bool | str = True
    client: httpx.AsyncClient | None = None
    name: str = "kubernetes"

    def _url(self, role: Role) -> str:
        kind, _, wname = self.workloads[role].partition("/")
        if kind not in ("deployments", "statefulsets") or not wname:
            raise ValueError(f"workload for {role.value} must be deployments/<name> or statefulsets/<name>")
        return f"{self.api_url.rstrip('/')}/apis/apps/v1/namespaces/{self.namespace}/{kind}/{wname}/scale"

    async def replicas(self, role: Role) -> int:
        c = self.client or httpx.AsyncClient(verify=self.verify)
        try:
            r = await c.get(self._url(role), headers=self._headers())
            r.raise_for_status()
            return int(r.json()["spec"].get("replicas", 0))
        finally:
            if self.client is None:
                await c.aclose()

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    async def apply(self, decision: PlanDecision) -> list[str]:
        c = self.client or httpx.AsyncClient(verify=self.verify)
        done = []
        try:
            for role in (Role.PREFILL, Role.DECODE):
                if role not in self.workloads or role.value not in decision.desired:
                    continue
                n = decision.desired[role.value]
                headers = {**self._headers(), "Content-Type": "application/merge-patch+json"}
                r = await c.patch(self._url(role), json={"spec": {"replicas": n}}, headers=headers)
                r.raise_for_status()
                done.append(f"scaled {self.workloads[role]} to {n}")
        finally:
            if self.client is None:
                await c.aclose()
        return done


@dataclass
class RoleChangeActuator:
    """Role changes and drains through the gateway's own calls; starts/stops go to ``fallback``."""

    set_role: Callable[[str, Role], Awaitable[None] | None]
    drain: Callable[[str], Awaitable[None] | None] | None = None
    fallback: Actuator | None = None
    name: str = "role_change"
    _requested: set[str] = field(default_factory=set)

    async def apply(self, decision: PlanDecision) -> list[str]:
        done = []
        rest = []
        for a in decision.actions:
            if a.kind == "drain" and a.worker_id and a.then not in (None, "stop"):
                a = replace(a, kind="set_role", role=Role(a.then))  # the gateway drains before switching
            if a.kind == "set_role" and a.worker_id:
                if a.worker_id in self._requested:
                    self._requested.discard(a.worker_id)  # already asked for when the drain began
                    continue
                try:
                    r = self.set_role(a.worker_id, a.role)
                    if asyncio.iscoroutine(r):
                        await r
                except Exception as e:  # e.g. the last decoder: refused; the next interval re-plans
                    done.append(f"{a.worker_id} → {a.role.value} refused: {e}")
                    continue
                if any(x.kind == "drain" and x.worker_id == a.worker_id for x in decision.actions):
                    self._requested.add(a.worker_id)
                done.append(f"{a.worker_id} → {a.role.value}")
            elif a.kind == "drain" and a.worker_id and self.drain is not None:
                r = self.drain(a.worker_id)
                if asyncio.iscoroutine(r):
                    await r
                done.append(f"draining {a.worker_id}")
            else:
                rest.append(a)
        if rest and self.fallback is not None:
            done += await self.fallback.apply(replace(decision, actions=rest))
        return done

    async def close(self) -> None:
        close = getattr(self.fallback, "close", None)
        if close is not None:
            await close()
