"""Baselines the planner is measured against, behind the planner's own ``step`` interface.

``QueueAutoscaler`` is the reactive, KEDA/HPA-style autoscaler many deployments use (vLLM
production-stack ships one on queue length): per role, desired = ceil(requests in the role's
engines / target per worker) (the HPA formula), scale-up at once, scale-down only to the highest
recommendation of the last ``stabilization_s`` seconds (HPA's default window is 300 s). It knows
nothing about latency targets or input/output lengths.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from adapters.base import Role
from orchestrator.planner.core import ROLES, Action, PlanDecision, WorkerView
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.solver import Limits


class QueueAutoscaler:
    def __init__(self, limits: Limits, prefill_target: float = 1.0, decode_target: float = 32.0,
                 stabilization_s: float = 300.0, tolerance: float = 0.1) -> None:
        self.limits = limits
        self.targets = {Role.PREFILL: prefill_target, Role.DECODE: decode_target}
        self.stabilization_s = stabilization_s
        self.tolerance = tolerance
        self._history: dict[Role, deque[tuple[float, int]]] = {r: deque() for r in ROLES}
        self._draining: set[str] = set()

    def complete_drains(self, fleet: Sequence[WorkerView]) -> list[Action]:
        out = []
        for w in fleet:
            if w.id in self._draining and w.inflight == 0:
                out.append(Action("stop", w.role, w.id))
                self._draining.discard(w.id)
        return out

    def step(self, obs: Observation | None, fleet: Sequence[WorkerView], now: float) -> PlanDecision:
        actions = self.complete_drains(fleet)
        lim = self.limits
        mins = {Role.PREFILL: lim.min_prefill, Role.DECODE: lim.min_decode}
        maxs = {Role.PREFILL: lim.max_prefill or lim.budget, Role.DECODE: lim.max_decode or lim.budget}
        current, desired = {}, {}
        for r in ROLES:
            mine = [w for w in fleet if w.role is r and w.id not in self._draining and w.state != "draining"]
            ready = [w for w in mine if w.state == "healthy"]
            have = len(mine)
            load = sum(w.inflight for w in ready)
            ratio = load / (self.targets[r] * max(1, len(ready)))
            want = have if abs(ratio - 1.0) <= self.tolerance else math.ceil(ratio * max(1, len(ready)))
            want = max(mins[r], min(maxs[r], want))
            h = self._history[r]
            h.append((now, want))
            while h and h[0][0] < now - self.stabilization_s:
                h.popleft()
            target = want if want >= have else min(have, max(v for _, v in h))
            current[r], desired[r] = have, target
        over = sum(desired.values()) - lim.budget
        for r in sorted(ROLES, key=lambda r: desired[r] - current[r], reverse=True):
            if over <= 0:
                break
            cut = min(over, desired[r] - mins[r], max(0, desired[r] - current[r]))
            desired[r] -= cut
            over -= cut
        for r in ROLES:
            if desired[r] > current[r]:
                actions += [Action("start", r) for _ in range(desired[r] - current[r])]
            elif desired[r] < current[r]:
                mine = sorted((w for w in fleet if w.role is r and w.id not in self._draining and w.state != "draining"),
                              key=lambda w: (w.state == "healthy", w.inflight))
                for w in mine[: current[r] - desired[r]]:
                    if w.inflight == 0:
                        actions.append(Action("stop", r, w.id))
                    else:
                        self._draining.add(w.id)
                        actions.append(Action("drain", r, w.id, "stop"))
        return PlanDecision(now, obs, None, None, {r.value: desired[r] for r in ROLES},
                            {r.value: current[r] for r in ROLES}, actions, {}, {}, ["queue-length autoscaler"])
