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
from dataclasses import dataclass

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


@dataclass
class OracleSettings:
    fast_interval_s: float = 0.0  # > 0: the fleet also calls ``react`` this often (acting between interval ticks)


class HindsightOracle:
    """An upper bound, not a planner: the best case for a planner that starts from the same neutral split
    and has no foresight before a given moment, and knows the future perfectly from then on.

    ``stages`` is a list of ``(at, target)``: from its first look at or after ``at`` (an interval tick, or a
    fast look when the fleet runs the load-reactive loop) the fleet holds at least ``target`` workers per
    role. Before the first stage it holds the fleet it was given. Workers are cold-started (serving
    ``start_s`` later, as any planner's would) and never stopped: a fleet larger than a target stays.
    One stage at the first interval's end with the split chosen in hindsight for the whole trace bounds
    what a planner without foresight before its first decision can reach from that start; a stage at
    ``first_overload`` bounds a planner that grows only on load it has seen. Pure decision logic (no
    clock, no I/O); it never reads the future itself: whoever builds the stages does.
    """

    def __init__(self, stages: Sequence[tuple[float, dict[Role, int]]], fast_interval_s: float = 0.0) -> None:
        if not stages:
            raise ValueError("an oracle needs at least one stage")
        for _, target in stages:
            if any(n < 0 for n in target.values()):
                raise ValueError("oracle target counts must be >= 0")
        self.stages = sorted(((float(at), {r: int(t.get(r, 0)) for r in ROLES}) for at, t in stages),
                             key=lambda st: st[0])
        self.acted: list[float] = []  # when each stage took effect
        # the virtual fleet's hook for fast looks (``react``): set to act between interval ticks
        self.settings = OracleSettings(fast_interval_s)

    @staticmethod
    def _counts(fleet: Sequence[WorkerView]) -> dict[Role, int]:
        return {r: sum(1 for w in fleet if w.role is r and w.state != "draining") for r in ROLES}

    def target_at(self, now: float) -> dict[Role, int] | None:
        """The largest count per role over the stages due by ``now`` (None before the first)."""
        due = [t for at, t in self.stages if now >= at - 1e-9]
        if not due:
            return None
        return {r: max(t[r] for t in due) for r in ROLES}

    def _decide(self, obs: Observation | None, fleet: Sequence[WorkerView], now: float,
                mode: str) -> PlanDecision | None:
        counts = self._counts(fleet)
        target = self.target_at(now)
        while len(self.acted) < len(self.stages) and now >= self.stages[len(self.acted)][0] - 1e-9:
            self.acted.append(now)
        actions: list[Action] = []
        if target is not None:
            for r in ROLES:
                actions += [Action("start", r) for _ in range(max(0, target[r] - counts[r]))]
        if mode == "load" and not actions:
            return None
        desired = {r.value: counts[r] if target is None else max(counts[r], target[r]) for r in ROLES}
        why = ("oracle: holding the start split" if target is None
               else f"oracle: at least {target[Role.PREFILL]}:{target[Role.DECODE]}")
        return PlanDecision(now, obs, None, None, desired, {r.value: counts[r] for r in ROLES}, actions, {}, {},
                            [why], mode=mode)

    def step(self, obs: Observation | None, fleet: Sequence[WorkerView], now: float) -> PlanDecision:
        d = self._decide(obs, fleet, now, "interval")
        assert d is not None
        return d

    def react(self, fleet: Sequence[WorkerView], now: float) -> PlanDecision | None:
        return self._decide(None, fleet, now, "load")


def first_overload(arrivals: Sequence[float], first_s: float, window_s: float) -> float | None:
    """The first moment a planner without foresight could see that the load outgrew its start split: the
    first arrival at which the arrivals of the trailing ``window_s`` outnumber the largest such count
    within the first ``first_s`` seconds (what the neutral start split was sized for). ``arrivals``
    sorted, in seconds from the trace's start; None if the load never exceeds that count."""
    if not arrivals:
        return None
    t0 = arrivals[0]
    lo, peak = 0, 0
    for i, t in enumerate(arrivals):
        while arrivals[lo] <= t - window_s:
            lo += 1
        n = i - lo + 1
        if t < t0 + first_s:
            peak = max(peak, n)
        elif n > peak:
            return t
    return None
