"""The planner's memory between intervals and the decision it emits.

``Planner.step(observation, fleet, now)`` is pure apart from the planner's own state: it feeds
the predictors, corrects the performance model from observed latency, sizes the next interval
(``solver.solve``), applies hysteresis and cooldown, and turns "how many" into concrete actions
on the fleet it was shown. It never touches a worker: actuators carry out the ``PlanDecision``.

Scale-in is always two steps: ``drain`` a worker (it finishes its requests, takes no new ones),
then, once the fleet shows it idle, ``stop`` it or ``set_role`` it to the other pool. A role change
is preferred over stop+start when the actuator says it is faster than starting an engine.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from adapters.base import Role
from orchestrator.planner.metrics_source import PEAK_WINDOW_S, Observation
from orchestrator.planner.perf_model import LatencyCorrection, PerfModel
from orchestrator.planner.predictors import LoadForecast, LoadPredictor
from orchestrator.planner.solver import Limits, Sizing, Targets, fit_budget, solve

ROLES = (Role.PREFILL, Role.DECODE)
# Bursts are a prefill problem: arrivals queue for prefill at once (TTFT grows linearly with the
# queue), while a decode pool absorbs the burst in its batches (ITL grows slowly with batch size).
FLOORED_ROLES = (Role.PREFILL,)


@dataclass
class WorkerView:
    """A worker as the planner sees it (built from the registry, or by the virtual-time fleet)."""

    id: str
    role: Role
    state: str = "healthy"  # starting | healthy | unhealthy | draining
    inflight: int = 0
    waiting: int = 0  # engine-reported queue (used by the queue-length baseline)
    stoppable: bool = True  # False: the actuator cannot stop it (e.g. a configured worker under the
    # local actuator); never drained to be stopped, only switched to the other role


@dataclass
class Action:
    kind: Literal["start", "drain", "stop", "set_role"]
    role: Role  # start: role to start; drain/stop: current role; set_role: the new role
    worker_id: str | None = None
    then: str | None = None  # drain only: "stop" or the new role's value

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "role": self.role.value, "worker_id": self.worker_id, "then": self.then}


@dataclass
class PlannerSettings:
    targets: Targets = field(default_factory=Targets)
    limits: Limits = field(default_factory=Limits)
    interval_s: float = 60.0
    predictor: str = "auto"  # constant | ewma | linear | holt_winters | auto
    season: int = 24  # Holt-Winters season, in intervals
    scale_in_margin: float = 0.15  # keep this much headroom before giving a worker back
    scale_in_intervals: int = 2  # consecutive intervals below capacity before scaling in
    cooldown_s: float = 0.0  # after a change to a role, no scale-in of that role for this long
    role_change_s: float | None = None  # time a role change takes (None: actuator cannot)
    start_s: float = 60.0  # time an engine takes to start
    correct_from_latency: bool = True
    headroom: float = 0.0  # plan for (1 + headroom) x the forecast rate: room for surges during start-up
    burst_window_s: float = 0.0  # burst floor: prefill sized for seconds-scale peaks, kept this long (0 = off)
    fixed_fleet: bool = False  # the fleet's size is given (role changes only): re-split it, never start/stop


@dataclass
class PlanDecision:
    at: float
    observation: Observation | None
    forecast: LoadForecast | None
    sizing: Sizing | None
    desired: dict[str, int]
    current: dict[str, int]
    actions: list[Action]
    correction: dict[str, float]
    predictors: dict[str, str]
    reasons: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "observation": self.observation.to_dict() if self.observation else None,
            "forecast": asdict(self.forecast) if self.forecast else None,
            "sizing": asdict(self.sizing) if self.sizing else None,
            "desired": self.desired, "current": self.current,
            "actions": [a.to_dict() for a in self.actions],
            "correction": self.correction, "predictors": self.predictors, "reasons": self.reasons,
        }


class Planner:
    def __init__(self, perf: PerfModel, settings: PlannerSettings | None = None) -> None:
        self.perf = perf
        self.settings = settings or PlannerSettings()
        self.load = LoadPredictor(self.settings.predictor, self.settings.season)
        self.correction = LatencyCorrection()
        self.hit_ratio = 0.0
        self._pending: dict[str, str] = {}  # worker id → "stop" | role value, while draining
        self._below: dict[Role, int] = dict.fromkeys(ROLES, 0)
        self._last_change: dict[Role, float] = dict.fromkeys(ROLES, -math.inf)
        self._sized: deque[tuple[float, dict[Role, float]]] = deque()  # (time, exact need) for the floor
        self._first_plan: float | None = None
        self.last: PlanDecision | None = None

    # ------------------------------------------------------------ inputs
    def _learn(self, obs: Observation, counts: dict[Role, int], reasons: list[str]) -> None:
        if obs.window_s <= 0:
            return
        self.load.observe(obs.request_rate, obs.mean_isl, obs.mean_osl)
        if obs.prefix_hit_ratio is not None:
            self.hit_ratio = 0.5 * self.hit_ratio + 0.5 * min(1.0, max(0.0, obs.prefix_hit_ratio))
        if not self.settings.correct_from_latency or obs.request_rate <= 0 or not obs.mean_isl:
            return
        uncached = max(1.0, obs.mean_isl * (1.0 - self.hit_ratio))
        exp_ttft = self.perf.expected_ttft(obs.request_rate, uncached, counts[Role.PREFILL], tail=1.0)
        exp_itl = None
        if obs.itl_mean and obs.mean_osl and counts[Role.DECODE] > 0:
            conc = obs.request_rate * obs.mean_osl * obs.itl_mean / counts[Role.DECODE]  # Little's law
            exp_itl = self.perf.decode_itl(conc, obs.mean_isl + obs.mean_osl / 2)
        before = (self.correction.ttft, self.correction.itl)
        self.correction.update(observed_ttft=obs.ttft_mean, expected_ttft=exp_ttft,
                               observed_itl=obs.itl_mean, expected_itl=exp_itl)
        if (self.correction.ttft, self.correction.itl) != before:
            reasons.append(f"correction ttft x{self.correction.ttft:.2f} itl x{self.correction.itl:.2f}")

    def _counts(self, fleet: Sequence[WorkerView]) -> dict[Role, int]:
        """Workers that serve (or are about to serve) each role; draining-for-stop ones do not count."""
        counts = dict.fromkeys(ROLES, 0)
        for w in fleet:
            then = self._pending.get(w.id)
            if then == "stop":
                continue
            role = Role(then) if then else w.role
            if role in counts and w.state in ("starting", "healthy", "draining"):
                if w.state == "draining" and not then:
                    continue  # drained by someone else (an operator)
                counts[role] += 1
        return counts

    # ------------------------------------------------------------ the step
    def complete_drains(self, fleet: Sequence[WorkerView]) -> list[Action]:
        """Stop (or switch) the workers this planner drained that are now idle.

        ``step`` calls it first; a fleet may also call it whenever a worker goes idle, so a drained
        worker is released at once instead of at the next interval.
        """
        ids = {w.id for w in fleet}
        self._pending = {k: v for k, v in self._pending.items() if k in ids}
        out: list[Action] = []
        for w in fleet:
            then = self._pending.get(w.id)
            if then is not None and w.inflight == 0:
                out.append(Action("stop", w.role, w.id) if then == "stop" else Action("set_role", Role(then), w.id))
                del self._pending[w.id]
        return out

    def draining(self) -> dict[str, str]:
        """Worker id → what happens when it is idle ("stop" or the new role)."""
        return dict(self._pending)

    def step(self, obs: Observation | None, fleet: Sequence[WorkerView], now: float) -> PlanDecision:
        s = self.settings
        reasons: list[str] = []
        actions: list[Action] = self.complete_drains(fleet)
        counts = self._counts(fleet)
        current = {r.value: counts[r] for r in ROLES}
        if obs is not None:
            self._learn(obs, counts, reasons)
        forecast = self.load.forecast()
        if forecast is None:
            self.last = PlanDecision(now, obs, None, None, dict(current), current, actions,
                                     asdict(self.correction), self.load.chosen(), reasons + ["no load observed yet"])
            return self.last
        if s.headroom > 0:
            forecast = LoadForecast(forecast.request_rate * (1 + s.headroom), forecast.isl, forecast.osl)
        sizing = solve(forecast, self.perf, s.targets, s.limits, self.hit_ratio, self.correction)
        if s.burst_window_s > 0:
            sizing = self._burst_sizing(sizing, forecast, obs, reasons)
        if sizing.infeasible:
            reasons.append("targets unreachable at any count: " + ", ".join(sizing.infeasible))
        if sizing.over_budget:
            reasons.append(f"budget {s.limits.budget} caps the fleet")
        want = {Role.PREFILL: sizing.prefill, Role.DECODE: sizing.decode}
        exact = {Role.PREFILL: sizing.prefill_exact, Role.DECODE: sizing.decode_exact}
        budget = s.limits.budget
        total = sum(counts.values())
        if s.fixed_fleet and total >= s.limits.min_prefill + s.limits.min_decode:
            budget = total  # split the workers we have in proportion to need
            p, d = fit_budget(sizing.prefill_exact, sizing.decode_exact, replace(s.limits, budget=total))
            want = {Role.PREFILL: p, Role.DECODE: d}
        elif s.burst_window_s > 0:
            want, exact = self._capacity_floor(want, exact, counts, now, reasons)
        target = self._hysteresis(want, exact, counts, now, reasons, budget)
        actions += self._actions(target, counts, fleet, now)
        desired = {r.value: target[r] for r in ROLES}
        self.last = PlanDecision(now, obs, forecast, sizing, desired, current, actions,
                                 asdict(self.correction), self.load.chosen(), reasons)
        return self.last

    def _burst_sizing(self, sizing: Sizing, forecast: LoadForecast, obs: Observation | None,
                      reasons: list[str]) -> Sizing:
        """Size the prefill pool for the interval's burst, not its mean.

        Arrivals queue for prefill at once, so what TTFT feels is the arrival rate over seconds
        (``Observation.peak_rate``), not over the interval. Decode keeps the mean-rate sizing: a decode
        pool absorbs a burst in its batches (ITL grows slowly with batch size).
        """
        s = self.settings
        peak = obs.peak_rate if obs is not None and obs.peak_rate is not None else 0.0
        peak *= 1 + s.headroom
        if peak <= forecast.request_rate:
            return sizing
        burst = solve(LoadForecast(peak, forecast.isl, forecast.osl), self.perf, s.targets, s.limits,
                      self.hit_ratio, self.correction)
        reasons.append(f"burst: prefill sized for the {PEAK_WINDOW_S:g}s peak {peak:.2f} req/s")
        p, d = burst.prefill, sizing.decode
        over = p + d > s.limits.budget
        if over:
            p, d = fit_budget(burst.prefill_exact, sizing.decode_exact, s.limits)
        return replace(sizing, prefill=p, decode=d, prefill_exact=burst.prefill_exact, over_budget=over,
                       infeasible=sorted(set(sizing.infeasible) | set(burst.infeasible)))

    def _capacity_floor(self, want: dict[Role, int], exact: dict[Role, float], counts: dict[Role, int],
                        now: float, reasons: list[str]) -> tuple[dict[Role, int], dict[Role, float]]:
        """The burst floor in workers: keep the largest sizing of the last ``burst_window_s``.

        A burst shorter than an engine's start time is over before scale-out helps; only capacity
        already running absorbs it. Keeping the sizing of the recent peak for a window longer than
        the start time means a burst that came once is met by running workers when it comes again.
        Until a whole window has been seen the planner does not know the peak, so it keeps what it
        has (no scale-in while warming up).
        """
        s = self.settings
        if self._first_plan is None:
            self._first_plan = now
        self._sized.append((now, dict(exact)))
        while self._sized and self._sized[0][0] < now - s.burst_window_s:
            self._sized.popleft()
        warming = now - self._first_plan < s.burst_window_s
        lim = s.limits
        caps = {Role.PREFILL: lim.max_prefill, Role.DECODE: lim.max_decode}
        floor_exact: dict[Role, float] = {}
        for r in ROLES:
            f = max(e[r] for _, e in self._sized) if r in FLOORED_ROLES else exact[r]
            if warming:
                f = max(f, float(counts[r]))
            floor_exact[r] = max(exact[r], f)
        floored = {r: max(want[r], math.ceil(floor_exact[r] - 1e-9)) for r in ROLES}
        floored = {r: floored[r] if caps[r] is None else min(caps[r], floored[r]) for r in ROLES}
        if sum(floored.values()) > lim.budget:
            p, d = fit_budget(floor_exact[Role.PREFILL], floor_exact[Role.DECODE], lim)
            floored = {Role.PREFILL: p, Role.DECODE: d}
        if floored != want:
            reasons.append("burst floor: " + ("warming up, holding" if warming else
                                              f"keeping the {s.burst_window_s:g}s peak sizing") +
                           f" ({floored[Role.PREFILL]}P/{floored[Role.DECODE]}D)")
        return floored, floor_exact

    def _hysteresis(self, want: dict[Role, int], exact: dict[Role, float], counts: dict[Role, int],
                    now: float, reasons: list[str], budget: int) -> dict[Role, int]:
        s = self.settings
        lim = s.limits
        mins = {Role.PREFILL: lim.min_prefill, Role.DECODE: lim.min_decode}
        target: dict[Role, int] = {}
        for r in ROLES:
            have = counts[r]
            if want[r] >= have:
                self._below[r] = 0
                target[r] = want[r]
                continue
            keep = max(mins[r], math.ceil(exact[r] * (1 + s.scale_in_margin) - 1e-9))
            if keep >= have:
                self._below[r] = 0
                target[r] = have
                continue
            self._below[r] += 1
            if self._below[r] >= s.scale_in_intervals and now - self._last_change[r] >= s.cooldown_s:
                target[r] = max(keep, want[r])
            else:
                target[r] = have
                reasons.append(f"{r.value}: holding {have} (wants {max(keep, want[r])}, hysteresis/cooldown)")
        # the budget beats hysteresis: a growing role takes what the shrinking one is holding
        over = sum(target.values()) - budget
        if over > 0:
            for r in ROLES:
                give = min(over, target[r] - max(want[r], mins[r]))
                if give > 0:
                    target[r] -= give
                    over -= give
        return target

    def _actions(self, target: dict[Role, int], counts: dict[Role, int], fleet: Sequence[WorkerView],
                 now: float) -> list[Action]:
        s = self.settings
        grow = {r: max(0, target[r] - counts[r]) for r in ROLES}
        shrink = {r: max(0, counts[r] - target[r]) for r in ROLES}
        actions: list[Action] = []
        prefer_switch = s.role_change_s is not None and s.role_change_s < s.start_s
        for r in ROLES:
            if grow[r] == 0 and shrink[r] == 0:
                continue
            self._last_change[r] = now
            self._below[r] = 0
        for r in ROLES:
            if shrink[r] == 0:
                continue
            other = Role.DECODE if r is Role.PREFILL else Role.PREFILL
            victims = sorted((w for w in fleet if w.role is r and w.id not in self._pending
                              and w.state in ("healthy", "unhealthy", "starting")),
                             key=lambda w: (w.state == "healthy", w.inflight, w.id))
            for w in victims:
                if shrink[r] == 0:
                    break
                if prefer_switch and grow[other] > 0:
                    grow[other] -= 1
                    then = other.value
                elif w.stoppable:
                    then = "stop"
                else:
                    continue  # left serving: draining it would take it out of service for good
                shrink[r] -= 1
                if w.inflight == 0 or w.state == "starting":
                    actions.append(Action("stop", r, w.id) if then == "stop" else Action("set_role", other, w.id))
                else:
                    self._pending[w.id] = then
                    actions.append(Action("drain", r, w.id, then))
        for r in ROLES:
            actions += [Action("start", r) for _ in range(grow[r])]
        return actions
