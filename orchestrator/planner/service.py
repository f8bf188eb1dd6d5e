"""The live planner loop: observe → ``Planner.step`` → actuator, every ``interval_s``.

The gateway owns one ``PlannerService`` (``runtime.planner``) when ``planner.enabled``; the admin
route ``GET /admin/planner`` (``routes.py``) shows its last decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from orchestrator.clock import Clock
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.actuators import Actuator, export_metrics
from orchestrator.planner.core import PlanDecision, Planner, WorkerView
from orchestrator.planner.metrics_source import Observation
from orchestrator.telemetry import audit
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.planner")


class Source(Protocol):
    async def observe(self, now: float) -> Observation: ...


def views_from_workers(workers: Iterable[Worker],
                       stoppable: Callable[[Worker], bool] | None = None) -> list[WorkerView]:
    """Registry workers → what the planner sees (a pending role change counts as the new role).
    ``stoppable`` says which workers the actuator can stop (default: all)."""
    out = []
    for w in workers:
        state = {WorkerState.HEALTHY: "healthy", WorkerState.DRAINING: "draining"}.get(w.state, "unhealthy")
        role = w.target_role or w.role
        out.append(WorkerView(w.id, role, state, w.inflight, int(w.load.waiting),
                              stoppable=True if stoppable is None else stoppable(w)))
    return out


class PlannerService:
    def __init__(self, planner: Planner, source: Source, actuator: Actuator,
                 fleet: Callable[[], list[WorkerView]], clock: Clock, metrics: DyadMetrics | None = None,
                 history: int = 50) -> None:
        self.planner = planner
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
        obs = await self.source.observe(now)
        decision = self.planner.step(obs, self.fleet(), now)
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

    def status(self) -> dict[str, Any]:
        s = self.planner.settings
        return {
            "actuator": self.actuator.name, "interval_s": s.interval_s,
            "targets": {"ttft_s": s.targets.ttft_s, "itl_s": s.targets.itl_s},
            "limits": vars(s.limits), "last_error": self.last_error,
            "draining": self.planner.draining(),
            "last": self.history[-1] if self.history else None,
            "history": list(self.history),
            "timeline": list(self.timeline),
        }
