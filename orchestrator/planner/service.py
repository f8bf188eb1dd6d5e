"""The live planner loop: observe → ``Planner.step`` → actuator, every ``interval_s``.

The gateway owns one ``PlannerService`` (``runtime.planner``) when ``planner.enabled``; the admin
route ``GET /admin/planner`` (``routes.py``) shows its last decisions.

Inputs or no action: every observation passes the ``InputGate`` (``inputs.py``) first. When the
source fails or the rate, ISL/OSL or latency are missing or stale, the service *holds*: it does not
call the planner (which would plan from defaults), only completes drains already under way, counts
``dyad_planner_held_total{reason}``, shows ``held`` on ``/admin/planner`` and logs one line each time
the reason changes (and one when it plans again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from orchestrator.clock import Clock
from orchestrator.deadline import within
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.actuators import Actuator, export_metrics
from orchestrator.planner.core import PlanDecision, Planner, WorkerView
from orchestrator.planner.inputs import SOURCE_UNAVAILABLE, Hold, InputGate, held_decision
from orchestrator.planner.metrics_source import Observation
from orchestrator.telemetry import audit
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.planner")


class Source(Protocol):
    async def observe(self, now: float) -> Observation: ...


def views_from_workers(workers: Iterable[Worker],
                       stoppable: Callable[[Worker], bool] | None = None,
                       starting: Callable[[Worker], bool] | None = None) -> list[WorkerView]:
    """Registry workers → what the planner sees (a pending role change counts as the new role).
    ``stoppable`` says which workers the actuator can stop (default: all); ``starting`` which of the
    not-yet-healthy ones the actuator is still starting (counted as capacity on its way, so the
    planner does not start them twice)."""
    out = []
    for w in workers:
        state = {WorkerState.HEALTHY: "healthy", WorkerState.DRAINING: "draining"}.get(w.state, "unhealthy")
        is_starting = starting is not None and starting(w)  # called for every worker: it tracks which were up once
        standby = False
        if w.state is WorkerState.STANDBY:  # warm standby: ready ones can be activated; others are on their way
            state, standby = ("standby", False) if w.health_ok else ("starting", True)
        elif is_starting and state == "unhealthy":
            state = "starting"
        role = w.target_role or w.role
        waiting = w.load.waiting  # a count: whatever a load holds, it must not fail the interval (int(inf))
        waiting = int(waiting) if math.isfinite(waiting) and waiting > 0 else 0
        out.append(WorkerView(w.id, role, state, w.inflight, waiting,
                              stoppable=True if stoppable is None else stoppable(w), standby=standby))
    return out


class PlannerService:
    def __init__(self, planner: Planner, source: Source, actuator: Actuator,
                 fleet: Callable[[], list[WorkerView]], clock: Clock, metrics: DyadMetrics | None = None,
                 history: int = 50, gate: InputGate | None = None, observe_timeout_s: float | None = None) -> None:
        self.planner = planner
        s = planner.settings
        # a source that does not answer in this long is unavailable this interval (the loop holds and
        # says so; without a bound, one hung read would stop the planner, and its status, for good)
        self.observe_timeout_s = observe_timeout_s if observe_timeout_s is not None else max(s.interval_s, 10.0)
        self.gate = gate or InputGate(max_age_s=3 * s.interval_s, need_latency=s.correct_from_latency)
        self.held: dict[str, Any] | None = None  # why the last interval held (None: it planned)
        self.source = source
        self.actuator = actuator
        self.fleet = fleet
        self.clock = clock
        self.metrics = metrics
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        # one row per decision (interval and load mode), what /admin/planner shows as the timeline
        self.timeline: deque[dict[str, Any]] = deque(maxlen=max(history, 240))
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None

    async def run_once(self) -> PlanDecision:
        now = self.clock.now()
        try:
            raw = await within(self.observe_timeout_s, self.source.observe(now), "the metrics source")
        except Exception as e:  # the source is down or has no data: hold (never plan on nothing)
            checked: Observation | Hold = Hold(SOURCE_UNAVAILABLE, f"{type(e).__name__}: {e}")
            raw = None
        else:
            checked = self.gate.check(raw, now)
        fleet = self.fleet()
        if isinstance(checked, Hold):
            decision = self._hold(checked, raw, fleet, now)
        else:
            self._set_held(None, now)
            decision = self.planner.step(checked, fleet, now)
        if self.actuator.name == "recommend" or not decision.actions:
            done = await self.actuator.apply(decision)
        else:  # the planner changes the fleet: an audit line, as for an admin action
            actions = [" ".join(str(x) for x in (a.kind, a.role.value, a.worker_id) if x) for a in decision.actions]
            try:
                done = await self.actuator.apply(decision)
            except Exception as e:
                audit.record("planner.apply", actor="planner", result="error", actuator=self.actuator.name,
                             actions=actions, error=f"{type(e).__name__}: {e}"[:300])
                raise
            audit.record("planner.apply", actor="planner", result="ok", actuator=self.actuator.name,
                         actions=actions, applied=done)
        if self.metrics is not None and self.actuator.name != "recommend":
            export_metrics(decision, self.metrics)
        self._record(decision, done)
        return decision

    def _record(self, decision: PlanDecision, done: Any) -> None:
        entry = decision.to_dict()
        entry["applied"] = done
        entry["actuator"] = self.actuator.name
        self.history.append(entry)
        self.timeline.append(decision.timeline_row())

    async def react_once(self) -> PlanDecision | None:
        """The fast load-reactive look (``Planner.react``) between intervals; acts only to scale out."""
        decision = self.planner.react(self.fleet(), self.clock.now())
        if decision is not None:
            done = await self.actuator.apply(decision)
            self._record(decision, done)
        return decision

    async def _sleep_until_next_interval(self) -> None:
        """Sleep one interval; with the load mode on, look at the queues every ``fast_interval_s`` meanwhile."""
        s = self.planner.settings
        fast = s.fast_interval_s
        if fast <= 0 or fast >= s.interval_s:
            await asyncio.sleep(s.interval_s)
            return
        left = s.interval_s
        while left > fast + 1e-9:
            await asyncio.sleep(fast)
            left -= fast
            try:
                await self.react_once()
            except Exception as e:  # keep planning; show the error on /admin/planner
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("planner load-mode look failed: %s", self.last_error)
        await asyncio.sleep(left)

    def _hold(self, hold: Hold, obs: Observation | None, fleet: list[WorkerView], now: float) -> PlanDecision:
        self._set_held(hold, now)
        if self.metrics is not None:
            self.metrics.planner_held.labels(hold.reason).inc()
        return held_decision(self.planner, hold, obs, fleet, now)

    def _set_held(self, hold: Hold | None, now: float) -> None:
        before = self.held["reason"] if self.held else None
        after = hold.reason if hold else None
        if before != after:
            if hold is None:
                log.info("planner: inputs are fresh again, planning (held since %.0f for %s)",
                         self.held["since"] if self.held else now, before)
            else:
                log.warning("planner: holding the current sizes (%s): %s", hold.reason, hold.detail)
        if hold is None:
            self.held = None
        else:
            since = self.held["since"] if self.held and before == after else now
            self.held = {"reason": hold.reason, "detail": hold.detail, "since": since}

    async def run(self) -> None:
        """Plan every ``interval_s`` until cancelled (``GatewayRuntime.add_task`` runs it); on the way
        out the actuator is closed (engines a local actuator started do not outlive the gateway)."""
        try:
            while True:
                await self._sleep_until_next_interval()
                try:
                    await self.run_once()
                    self.last_error = None
                except Exception as e:  # keep planning; show the error on /admin/planner
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.warning("planner interval failed: %s", self.last_error)
        finally:
            close = getattr(self.actuator, "close", None)
            if close is not None:
                await close()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="dyad-planner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def standby_status(self) -> dict[str, Any]:
        """Warm standby: how many the config keeps per role, and the workers held out of rotation now."""
        s = self.planner.settings
        try:
            fleet = self.fleet()
        except Exception:  # noqa: BLE001 - a status page never fails on the fleet view
            fleet = []
        workers = [{"id": w.id, "role": w.role.value, "ready": w.state == "standby"}
                   for w in fleet if w.state == "standby" or w.standby]
        counts = {r: sum(1 for w in workers if w["role"] == r) for r in ("prefill", "decode")}
        return {"wanted": {"prefill": s.standby_prefill, "decode": s.standby_decode},
                "kept_now": self.planner.standby_wanted(), "insurance": self.planner.insurance_status(),
                "count": counts, "workers": workers}

    def status(self) -> dict[str, Any]:
        s = self.planner.settings
        return {
            "actuator": self.actuator.name, "interval_s": s.interval_s,
            "targets": {"ttft_s": s.targets.ttft_s, "itl_s": s.targets.itl_s},
            "limits": vars(s.limits), "last_error": self.last_error, "held": self.held,
            "draining": self.planner.draining(),
            "standby": self.standby_status(),
            "last": self.history[-1] if self.history else None,
            "history": list(self.history),
            "timeline": list(self.timeline),
        }
