"""Actuators: carry out a ``PlanDecision``. The planner decides; these only act.

One interface, ``Actuator.apply(decision) -> list[str]`` (what was done, for logs and
``/admin/planner``), and four implementations:

- ``RecommendOnly``: does nothing but export the decision as metrics and keep it for the admin API.
- ``LocalProcessActuator``: starts/stops engine processes on this host from a command template per
  role (``{port}`` is filled with a free port); ``on_started``/``on_stopped`` hooks let the gateway
  add/remove the worker from its registry. A ``start`` with ``then="standby"`` starts a warm standby
  worker (``LocalProcess.standby``: the gateway registers it out of rotation); ``activate``/``park``
  are registry state changes, carried out by the gateway's wrapper (``planner/install.py``).
- ``KubernetesActuator``: sets ``spec.replicas`` of one Deployment/StatefulSet per role through the
  API server's ``scale`` subresource; scale-in marks the pods that will go draining and waits for
  them to drain before the replicas go down (the gateways' pod discovery honours the mark).
- ``RoleChangeActuator``: moves a worker between pools without a restart through a ``set_role``
  callable (the gateway's, from the P/D work); ``drain`` goes to a ``drain`` callable.
Role changes are only emitted by the planner when ``PlannerSettings.role_change_s`` is set, i.e.
when this kind of actuator is in use and faster than starting an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from adapters.base import Role
from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.fleet.kube_api import KubeApi
from orchestrator.planner.core import PlanDecision
from orchestrator.ports import free_port
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.planner")


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
    for role, n in decision.standby.items():
        metrics.planner_standby_workers.labels(role).set(n)
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
    standby: bool = False  # started as warm standby (held out of rotation until activated)
    started_at: float = 0.0  # clock time of the start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def started_line(p: LocalProcess) -> str:
    """What a start did, as the planner's applied actions list it."""
    return f"started {p.worker_id} ({p.role.value}{', standby' if p.standby else ''}) on port {p.port}"


TEMPLATE_FIELDS = ("port", "role", "worker_id")


def fill_template(template: str, **fields: Any) -> str:
    """``{port}``, ``{role}`` and ``{worker_id}`` filled in; every other character, braces included, as
    written. (``str.format`` read a JSON argument's braces, vLLM's ``--kv-transfer-config '{"kv_connector":
    ...}'``, as fields: KeyError out of the actuator, every interval.)"""
    for name in TEMPLATE_FIELDS:
        template = template.replace("{" + name + "}", str(fields[name]))
    return template


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
    clock: Clock = SYSTEM_CLOCK
    processes: dict[str, LocalProcess] = field(default_factory=dict)
    _n: int = 0

    async def _hook(self, hook: Callable[[LocalProcess], Any] | None, p: LocalProcess) -> None:
        if hook is not None:
            r = hook(p)
            if asyncio.iscoroutine(r):
                await r

    async def start(self, role: Role, standby: bool = False) -> LocalProcess:
        if role not in self.commands:
            raise ValueError(f"no command template for role '{role.value}'")
        port = free_port()
        self._n += 1
        wid = f"local-{role.value}-{self._n}"
        argv = shlex.split(fill_template(self.commands[role], port=port, role=role.value, worker_id=wid))
        proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        p = LocalProcess(wid, role, port, proc, standby=standby, started_at=self.clock.now())
        self.processes[wid] = p
        await self._hook(self.on_started, p)
        return p

    async def stop(self, worker_id: str) -> bool:
        p = self.processes.pop(worker_id, None)
        if p is None:
            return False
        if p.proc is not None:
            await asyncio.to_thread(stop_process_group, p.proc, self.stop_timeout_s)
        await self._hook(self.on_stopped, p)
        return True

    async def apply(self, decision: PlanDecision) -> list[str]:
        done = []
        for a in decision.actions:
            if a.kind == "start":
                done.append(started_line(await self.start(a.role, standby=a.then == "standby")))
        # stops together: each may wait ``stop_timeout_s`` for its engine to exit (one after another, a
        # scale-in of N slow-to-exit engines held the planner loop N times that long)
        ids = list(dict.fromkeys(a.worker_id for a in decision.actions if a.kind == "stop" and a.worker_id))
        stopped = await self.stop_all(ids)
        return done + [f"stopped {wid}" for wid, ok in zip(ids, stopped, strict=True) if ok]

    async def stop_all(self, worker_ids: list[str]) -> list[bool]:
        """``stop`` each, concurrently."""
        return list(await asyncio.gather(*(self.stop(wid) for wid in worker_ids)))

    async def close(self) -> None:
        await self.stop_all(list(self.processes))


def _signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """``sig`` to the process group ``proc`` leads (it was started in a session of its own); False when
    no process of the group is left."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # not ours to signal (cannot happen for a group we started): the leader only
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        return proc.poll() is None


def stop_process_group(proc: subprocess.Popen, timeout_s: float, poll_s: float = 0.05) -> None:
    """Stop an engine the actuator started, and everything it started: SIGTERM to its whole process group,
    up to ``timeout_s`` for all of it to exit, then SIGKILL to what is left. Blocking (run in a thread).

    The group, not the pid: a command template that runs the engine under a wrapper (``sh -c 'a; b'``, a
    launch script, a launcher that forks its workers) has the engine as a child; the wrapper's pid alone
    was signalled, it died and the engine ran on, orphaned, holding its port and accelerator memory."""
    deadline = time.monotonic() + timeout_s
    if not _signal_group(proc, signal.SIGTERM):
        proc.poll()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(0.0, deadline - time.monotonic()))
    # the leader may be gone while a child of it still runs (it ignores SIGTERM, or takes its time)
    while time.monotonic() < deadline and _signal_group(proc, 0):
        time.sleep(poll_s)
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def keep_reason(now: float, *, started_at: float, ready_at: float | None, alive: bool, min_serve_s: float,
                start_timeout_s: float) -> str | None:
    """Why an actuator must not stop (or drain to stop) a worker it started yet; None: it may go.

    A start in progress is never cut short (an engine that takes longer than ``start_timeout_s``,
    or whose process died, is no longer "in progress"), and a worker that became ready (or was put
    in rotation) serves at least ``min_serve_s`` before it is let go: stopping an engine seconds
    after paying for its start is churn whatever the forecast says. The planner may override it
    with an action that carries ``force=True``. Pure: times are passed in."""
    if ready_at is None:
        if alive and now - started_at < start_timeout_s:
            return f"still starting ({now - started_at:.1f} s since its start)"
        return None
    if now - ready_at < min_serve_s:
        return f"in rotation for {now - ready_at:.1f} s only (serves at least {min_serve_s:g} s)"
    return None


Pod = dict[str, Any]


def _pod_ready(pod: Pod) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _rfc3339(value: Any) -> float | None:
    """A Kubernetes timestamp (``2026-01-02T03:04:05Z``, optionally with fractions) → epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_keep_reason(pod: Pod, now_epoch: float, min_serve_s: float, start_timeout_s: float) -> str | None:
    """``keep_reason`` for a pod: started at its ``creationTimestamp``, ready since its Ready
    condition's ``lastTransitionTime`` (pure; ``now_epoch`` is wall-clock seconds, as the API's
    timestamps are)."""
    if min_serve_s <= 0 and start_timeout_s <= 0:
        return None
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    created = _rfc3339(meta.get("creationTimestamp"))
    ready_at = None
    if _pod_ready(pod):
        cond = next(c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready")
        ready_at = _rfc3339(cond.get("lastTransitionTime")) or created
    if ready_at is None and created is None:
        return None
    return keep_reason(now_epoch, started_at=created if created is not None else now_epoch, ready_at=ready_at,
                       alive=True, min_serve_s=min_serve_s, start_timeout_s=start_timeout_s)


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"  # ReplicaSets remove the lowest cost first


def pod_ordinal(name: str) -> int | None:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def scale_in_victims(kind: str, pods: list[Pod], target: int, annotation: str,
                     standby_annotation: str | None = None) -> list[str]:
    """The pods a scale-in to ``target`` replicas removes, by name. A StatefulSet removes its highest
    ordinals (no choice); a Deployment's ReplicaSet removes the pods with the lowest deletion cost, so
    we choose: pods already marked draining first, then serving pods before warm standby ones, then
    pods not Ready, then the highest names."""
    if kind == "statefulsets":
        return sorted((p["metadata"]["name"] for p in pods
                       if (pod_ordinal(p["metadata"]["name"]) or 0) >= target), key=lambda n: pod_ordinal(n) or 0)
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    excess = max(0, len(live) - target)

    def rank(p: Pod) -> tuple:
        meta = p["metadata"]
        ann = meta.get("annotations") or {}
        marked = ann.get(annotation) == "true"
        standby = ann.get(standby_annotation) == "true" if standby_annotation else False
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (p.get("status") or {}).get("conditions") or [])
        return (not marked, standby, ready, [-ord(ch) for ch in meta["name"]])  # the standby pool is kept

    return sorted(p["metadata"]["name"] for p in sorted(live, key=rank)[:excess])


def replica_change(desired: int, current: int | None) -> str:
    """How a planner decision moves a workload: "grow", "shrink", "hold" or "set" (absolute).

    The planner counts the workers that serve (``current``), not pods still starting or being
    drained, so its ``desired`` is compared with that count, never used blindly as a replica count:
    a hold (desired == current) must not remove pods that are still starting, and a growth is
    ``max(replicas asked for, desired)`` so asking again while pods start does not overshoot.
    Without a count (``current`` None), ``desired`` is the replica count."""
    if current is None:
        return "set"
    if desired > current:
        return "grow"
    return "shrink" if desired < current else "hold"


@dataclass
class DrainingScaleIn:
    """A scale-in of one workload waiting for its victims to drain."""

    target: int
    marked_at: dict[str, float]  # victim pod → when we saw it marked
    idle_reads: dict[str, int] = field(default_factory=dict)  # consecutive idle readings per victim
    replicas: int | None = None  # spec.replicas the victims were chosen against (another value: plan is stale)


def drain_finished(scale_in: DrainingScaleIn, idle: dict[str, bool | None], now: float, settle_s: float,
                   timeout_s: float, reads: int = 2) -> tuple[bool, str]:
    """Pure: may the replicas go down now? Every victim must have been marked for ``settle_s`` (every
    gateway's watch has seen the mark) and read idle by its engine ``reads`` times in a row; past
    ``timeout_s`` since marking, it may go regardless. Updates the idle-read counters."""
    waiting = []
    for pod, since in scale_in.marked_at.items():
        if now - since >= timeout_s:
            continue
        if now - since < settle_s:
            scale_in.idle_reads[pod] = 0
            waiting.append(f"{pod} settling")
            continue
        scale_in.idle_reads[pod] = scale_in.idle_reads.get(pod, 0) + 1 if idle.get(pod) else 0
        if scale_in.idle_reads[pod] < reads:
            waiting.append(f"{pod} busy" if idle.get(pod) is False else f"{pod} not yet idle")
    if waiting:
        return False, ", ".join(waiting)
    late = [p for p, since in scale_in.marked_at.items() if now - since >= timeout_s]
    return True, (f"drain timeout for {', '.join(late)}" if late else "drained")


@dataclass
class KubernetesActuator:
    """Scale one workload per role: ``workloads = {Role.PREFILL: "statefulsets/llm-prefill", ...}``,
    through ``{api}/apis/apps/v1/namespaces/{ns}/{kind}/{name}/scale`` (merge-patch of spec.replicas).

    Scale-out patches the replicas up at once; the new pods join every gateway through discovery
    when they turn Ready. Scale-in drains before anything is deleted:

    1. the pods that will go (a StatefulSet's highest ordinals; for a Deployment, pods we choose and
       give the lowest ``pod-deletion-cost``) are annotated ``draining_annotation: "true"``; every
       gateway's pod watch sees it and stops sending them new requests (in-flight ones go on);
    2. after ``settle_s`` (the watch has reached every gateway), the actuator reads each victim's
       engine (``is_idle``: its own ``/metrics``, running + waiting = 0, the truth across all gateway
       replicas) until it is idle twice in a row, or ``drain_timeout_s`` has passed;
    3. only then is ``spec.replicas`` patched down, and Kubernetes deletes exactly the drained pods.

    A later decision that wants the capacity back cancels the drain (the marks are removed). The
    state is level-triggered: every ``apply`` re-reads the scale and the pods, so a restarted
    planner finds marked pods and carries on.

    Warm standby (``standby``: pods per role kept started but out of rotation): the replicas are
    the planner's serving count plus the standby pool; pods are held out with
    ``standby_annotation: "true"``, which every gateway's pod discovery honours (probed, not
    routed). New pods that the pool still needs are annotated while they start (before they turn
    Ready, so no gateway routes to them); ``activate`` removes a pod's mark (in rotation as soon as
    the watch delivers it) and the replicas grow to refill the pool; ``park`` marks a drained pod
    (the planner drains it first, through the draining annotation without a deletion cost).
    """

    api: KubeApi
    namespace: str
    workloads: dict[Role, str]
    is_idle: Callable[[Pod], Awaitable[bool | None]] | None = None
    draining_annotation: str = "dyad.dev/draining"
    standby: dict[Role, int] = field(default_factory=dict)  # warm standby pods kept per role
    standby_annotation: str = "dyad.dev/standby"
    settle_s: float = 5.0
    drain_timeout_s: float = 600.0
    # churn guard (``pod_keep_reason``): a scale-in waits while a pod it would remove is still starting
    # or has been Ready for less than ``min_serve_s`` (0: no guard)
    min_serve_s: float = 0.0
    start_timeout_s: float = 0.0
    wall: Callable[[], float] = time.time  # the API's timestamps are wall-clock
    poll_s: float = 1.0
    clock: Clock = SYSTEM_CLOCK
    name: str = "kubernetes"
    pending: dict[Role, DrainingScaleIn] = field(default_factory=dict)
    owed: dict[Role, int] = field(default_factory=dict)  # standby marks still to put on pods being created
    to_standby: set[str] = field(default_factory=set)  # pods draining to be parked (their mark is not a scale-in's)
    events: list[str] = field(default_factory=list)  # what the background finisher did (also logged)
    asked: dict[Role, int] = field(default_factory=dict)  # the replicas this actuator last set, per role
    _finisher: asyncio.Task | None = None
    _lock: asyncio.Lock | None = None

    def _kind(self, role: Role) -> tuple[str, str]:
        kind, _, wname = self.workloads[role].partition("/")
        if kind not in ("deployments", "statefulsets") or not wname:
            raise ValueError(f"workload for {role.value} must be deployments/<name> or statefulsets/<name>")
        return kind, wname

    def _scale_path(self, role: Role) -> str:
        kind, wname = self._kind(role)
        return f"/apis/apps/v1/namespaces/{self.namespace}/{kind}/{wname}/scale"

    async def replicas(self, role: Role) -> int:
        return int((await self.api.get(self._scale_path(role)))["spec"].get("replicas", 0))

    async def _pods(self, scale: dict[str, Any]) -> list[Pod]:
        selector = (scale.get("status") or {}).get("selector")
        if not selector:
            return []
        body = await self.api.get(f"/api/v1/namespaces/{self.namespace}/pods", {"labelSelector": selector})
        return list(body.get("items") or [])

    def _marked(self, pod: Pod) -> bool:
        return (pod["metadata"].get("annotations") or {}).get(self.draining_annotation) == "true"

    async def _mark(self, role: Role, pod: str, on: bool) -> None:
        ann: dict[str, Any] = {self.draining_annotation: "true" if on else None}
        if self._kind(role)[0] == "deployments":
            ann[DELETION_COST] = "-1000" if on else None
        await self.api.merge_patch(f"/api/v1/namespaces/{self.namespace}/pods/{pod}", {"metadata": {"annotations": ann}})

    async def _set_replicas(self, role: Role, n: int) -> None:
        await self.api.merge_patch(self._scale_path(role), {"spec": {"replicas": n}})
        self.asked[role] = n

    def _outside_change(self, role: Role, replicas: int) -> str | None:
        """A line (logged) when the replicas are not what this actuator last set: someone else scaled
        the workload (``kubectl scale``, an HPA). The planner still owns the size (its next decision
        moves it again), so two owners fight; this says so, once per change."""
        asked = self.asked.get(role)
        self.asked[role] = replicas
        if asked is None or asked == replicas:
            return None
        line = (f"{self.workloads[role]}: replicas are {replicas}, not the {asked} the planner set (changed outside "
                "the planner: kubectl scale, an HPA? the planner keeps sizing it)")
        log.warning("kubernetes actuator: %s", line)
        return line

    async def reconcile(self, role: Role, target: int, grow_only: bool = False) -> list[str]:
        """Move one workload towards ``target`` replicas (scale-out now, scale-in by draining first).
        ``grow_only``: never fewer than the replicas already asked for (pods still starting count)."""
        done: list[str] = []
        scale = await self.api.get(self._scale_path(role))
        replicas = int(scale["spec"].get("replicas", 0))
        if (outside := self._outside_change(role, replicas)) is not None:
            done.append(outside)
        if grow_only:
            pending = self.pending.get(role)
            target = max(target, pending.target if pending is not None else replicas)
        pods = await self._pods(scale)
        kind = self._kind(role)[0]
        victims = (set(scale_in_victims(kind, pods, target, self.draining_annotation, self.standby_annotation))
                   if target < replicas else set())
        for p in pods:
            name = p["metadata"]["name"]
            if (self._marked(p) and name not in victims and name not in self.to_standby
                    and not p["metadata"].get("deletionTimestamp")):
                await self._mark(role, name, False)
                done.append(f"cancelled the drain of {name}")
        if target >= replicas:
            self.pending.pop(role, None)
            if target > replicas:
                await self._set_replicas(role, target)
                done.append(f"scaled {self.workloads[role]} to {target}")
            return done
        fresh = [n for n in sorted(victims) if n not in (self.pending[role].marked_at if role in self.pending else {})]
        keep = [(n, why) for n in fresh
                if (why := pod_keep_reason(next(p for p in pods if p["metadata"]["name"] == n), self.wall(),
                                           self.min_serve_s, self.start_timeout_s))]
        if keep:  # no churn: the scale-in waits (the next decision asks again)
            return done + [f"kept {n}: {why}" for n, why in keep]
        now = self.clock.now()
        prev = self.pending.get(role)
        marked_at = {}
        for name in sorted(victims):
            pod = next(p for p in pods if p["metadata"]["name"] == name)
            costed = kind != "deployments" or (pod["metadata"].get("annotations") or {}).get(DELETION_COST) == "-1000"
            if not self._marked(pod) or not costed:
                await self._mark(role, name, True)
                done.append(f"marked {name} draining")
            marked_at[name] = prev.marked_at.get(name, now) if prev is not None else now
        self.pending[role] = DrainingScaleIn(target, marked_at, dict(prev.idle_reads) if prev else {}, replicas)
        if not victims:  # nothing to drain (pods already gone): scale now
            return done + await self._finish(role)
        self._ensure_finisher()
        return done

    async def _finish(self, role: Role) -> list[str]:
        s = self.pending[role]
        await self._set_replicas(role, s.target)
        # forgotten only once the replicas went down: a failed patch (a 500, a timeout) is tried again by
        # the finisher; dropped before the call, its victims stayed marked, out of rotation, for good (the
        # planner, which counts only serving pods, then holds and never asks again)
        if self.pending.get(role) is s:
            del self.pending[role]
        return [f"scaled {self.workloads[role]} to {s.target}"]

    async def _give_up(self, role: Role, s: DrainingScaleIn, replicas: int, pods: list[Pod]) -> list[str]:
        """The workload's replicas changed under a scale-in (someone scaled it): the victims were chosen
        for the old count, and lowering the replicas to the old target now would delete pods never marked
        nor drained. The scale-in is given up, its marks removed; the next decision plans on what is there."""
        del self.pending[role]
        line = (f"{self.workloads[role]}: replicas changed outside the planner ({s.replicas} -> {replicas}) while "
                f"it drained {', '.join(sorted(s.marked_at))} for a scale-in to {s.target}; that scale-in is given "
                "up, the next decision plans again")
        log.warning("kubernetes actuator: %s", line)
        self.asked[role] = replicas
        done = [line]
        for p in pods:
            name = p["metadata"]["name"]
            if (name in s.marked_at and self._marked(p) and name not in self.to_standby
                    and not p["metadata"].get("deletionTimestamp")):
                await self._mark(role, name, False)
                done.append(f"cancelled the drain of {name}")
        return done

    def _serialized(self) -> asyncio.Lock:
        """``apply`` and the drain finisher never interleave (a decision changing a scale-in while the
        finisher reads engines would otherwise lower the replicas over a victim not yet drained)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def check_drains(self) -> list[str]:
        """One round of the finisher: scale down the workloads whose victims have drained."""
        async with self._serialized():
            return await self._check_drains()

    async def _check_drains(self) -> list[str]:
        done: list[str] = []
        for role in list(self.pending):
            s = self.pending[role]
            idle: dict[str, bool | None] = {}
            scale = await self.api.get(self._scale_path(role))
            replicas = int(scale["spec"].get("replicas", 0))
            if s.replicas is not None and replicas != s.replicas:
                done += await self._give_up(role, s, replicas, await self._pods(scale))
                continue
            now = self.clock.now()
            pods = {p["metadata"]["name"]: p for p in await self._pods(scale)}
            for name in list(s.marked_at):
                # a victim whose mark someone removed is back in rotation everywhere: lowering the replicas
                # once it read idle deleted a pod taking new requests. Marked again, it settles again.
                p = pods.get(name)
                if p is not None and not self._marked(p) and not p["metadata"].get("deletionTimestamp"):
                    await self._mark(role, name, True)
                    s.marked_at[name], s.idle_reads[name] = now, 0
                    done.append(f"marked {name} draining again (its mark was removed outside the planner)")
            if self.is_idle is not None and any(now - t >= self.settle_s for t in s.marked_at.values()):
                # together: one after another, N slow engines held the lock (and every decision) N reads long
                names = [n for n in s.marked_at if n in pods]
                idle = dict.fromkeys(s.marked_at, True)  # gone: nothing can be running there
                idle.update(zip(names, await asyncio.gather(*(self._idle(pods[n]) for n in names)), strict=True))
            elif self.is_idle is None:
                idle = dict.fromkeys(s.marked_at, True)  # no way to ask: settle time only
            ok, why = drain_finished(s, idle, now, self.settle_s, self.drain_timeout_s)
            if ok:
                done += [f"{why}: " + x for x in await self._finish(role)]
        for line in done:
            log.info("kubernetes actuator: %s", line)
        self.events += done
        return done

    async def _idle(self, pod: Pod) -> bool | None:
        """``is_idle``, with a check that raises read as "cannot tell" (the drain timeout bounds that): it
        failed the whole finisher round before the timeout was looked at, and the drain never ended."""
        assert self.is_idle is not None
        try:
            return await self.is_idle(pod)
        except Exception as e:  # noqa: BLE001 - any failure of the check: not known idle
            log.warning("kubernetes actuator: cannot tell whether %s is idle: %s: %s", pod["metadata"]["name"],
                        type(e).__name__, e)
            return None

    def _ensure_finisher(self) -> None:
        if self._finisher is None or self._finisher.done():
            self._finisher = asyncio.create_task(self._finish_loop(), name="dyad-k8s-drain")

    async def _finish_loop(self) -> None:
        while self.pending or any(self.owed.values()):
            # pods being created for the standby pool are marked before they turn Ready: look often then
            await asyncio.sleep(min(self.poll_s, 0.2) if any(self.owed.values()) else self.poll_s)
            try:
                await self.check_drains()
                if any(self.owed.values()):
                    async with self._serialized():
                        for line in [x for role in list(self.owed) for x in await self._fill_standby(role)]:
                            log.info("kubernetes actuator: %s", line)
                            self.events.append(line)
            except Exception as e:  # the API server is briefly away: try again next round
                log.warning("kubernetes actuator: drain check failed: %s: %s", type(e).__name__, e)

    # ------------------------------------------------------------ warm standby
    def _is_standby(self, pod: Pod) -> bool:
        return (pod["metadata"].get("annotations") or {}).get(self.standby_annotation) == "true"

    async def _set_standby(self, pod: str, on: bool) -> None:
        ann: dict[str, Any] = {self.standby_annotation: "true" if on else None}
        if on:
            ann[self.draining_annotation] = None  # parked: drained, no longer leaving
        await self.api.merge_patch(f"/api/v1/namespaces/{self.namespace}/pods/{pod}", {"metadata": {"annotations": ann}})

    async def _drain_to_standby(self, pod: str) -> None:
        """Out of rotation while what it has finishes (no deletion cost: the pod stays)."""
        await self.api.merge_patch(f"/api/v1/namespaces/{self.namespace}/pods/{pod}",
                                   {"metadata": {"annotations": {self.draining_annotation: "true"}}})

    async def _fill_standby(self, role: Role) -> list[str]:
        """Mark pods that are still starting as standby until the role's pool has ``standby[role]``
        (pods leaving in a scale-in do not count). Ready pods are never taken out of rotation here:
        that is the planner's ``park``, after a drain."""
        want = self.standby.get(role, 0)
        if want <= 0:
            self.owed.pop(role, None)
            return []
        scale = await self.api.get(self._scale_path(role))
        pods = await self._pods(scale)
        leaving = set(self.pending[role].marked_at) if role in self.pending else set()
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp") and p["metadata"]["name"] not in leaving]
        have = sum(1 for p in live if self._is_standby(p))
        done = []
        for p in sorted((p for p in live if not self._is_standby(p) and not self._marked(p)
                         and not _pod_ready(p)), key=lambda p: p["metadata"]["name"]):
            if have >= want:
                break
            await self._set_standby(p["metadata"]["name"], True)
            done.append(f"marked {p['metadata']['name']} standby")
            have += 1
        # still owed only while pods are being created or starting (a pod that turned Ready unmarked
        # serves: the planner parks one after a drain if the pool stays short)
        coming = len(pods) < int(scale["spec"].get("replicas", 0)) or any(
            not _pod_ready(p) and not self._is_standby(p) for p in live)
        self.owed[role] = max(0, want - have) if coming else 0
        if self.owed[role]:
            self._ensure_finisher()
        return done

    async def _standby_actions(self, decision: PlanDecision) -> list[str]:
        done = []
        for a in decision.actions:
            if a.role not in self.workloads or not a.worker_id or a.kind not in ("activate", "park", "drain"):
                continue
            # each on its own: a pod gone meanwhile (404) must not keep the rest of the decision from being
            # carried out (it raised out of the whole apply: no role was scaled that interval)
            try:
                done += await self._standby_action(a)
            except Exception as e:  # noqa: BLE001 - a line in what was applied; the next decision re-plans
                line = f"{a.kind} {a.worker_id} failed: {type(e).__name__}: {e}"[:400]
                log.warning("kubernetes actuator: %s", line)
                done.append(line)
        return done

    async def _standby_action(self, a: Any) -> list[str]:
        if a.kind == "activate":
            self.to_standby.discard(a.worker_id)
            await self._set_standby(a.worker_id, False)
            return [f"activated {a.worker_id}"]
        if a.kind == "park":
            self.to_standby.discard(a.worker_id)
            await self._set_standby(a.worker_id, True)
            return [f"parked {a.worker_id} (standby)"]
        if a.kind == "drain" and a.then == "standby":
            self.to_standby.add(a.worker_id)
            await self._drain_to_standby(a.worker_id)
            return [f"draining {a.worker_id} (then standby)"]
        return []

    async def apply(self, decision: PlanDecision) -> list[str]:
        async with self._serialized():
            return await self._apply(decision)

    async def _apply(self, decision: PlanDecision) -> list[str]:
        done = await self._standby_actions(decision)
        failed = []
        for role in (Role.PREFILL, Role.DECODE):
            if role not in self.workloads or role.value not in decision.desired:
                continue
            # each role on its own: a workload the API refuses (deleted, 403, 500, a timeout) must not
            # keep the other role from scaling; its failure is a line here, and the next decision retries
            try:
                done += await self._apply_role(role, decision)
            except Exception as e:  # noqa: BLE001 - named in what was applied; raised when every role failed
                line = f"{self.workloads[role]}: failed: {type(e).__name__}: {e}"[:400]
                log.warning("kubernetes actuator: %s", line)
                done.append(line)
                failed.append(e)
        attempted = [r for r in (Role.PREFILL, Role.DECODE) if r in self.workloads and r.value in decision.desired]
        if failed and len(failed) == len(attempted):
            raise failed[0]  # nothing was carried out: the interval failed (shown as last_error)
        return done

    async def _apply_role(self, role: Role, decision: PlanDecision) -> list[str]:
        done: list[str] = []
        want, seen = decision.desired[role.value], decision.current.get(role.value)
        pool = self.standby.get(role, 0)  # replicas = serving + the standby pool
        direction = replica_change(want, seen)
        if direction == "hold":
            if pool and seen is not None:  # the pool may still be short: grow only (a drain goes on)
                done += await self.reconcile(role, seen + pool, grow_only=True)
        else:
            done += await self.reconcile(role, want + pool, grow_only=direction == "grow")
        if pool:
            done += await self._fill_standby(role)
        return done

    async def close(self) -> None:
        if self._finisher is not None:
            self._finisher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._finisher
        await self.api.aclose()


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
