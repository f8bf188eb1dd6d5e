"""The planner's memory between intervals and the decision it emits.

``Planner.step(observation, fleet, now)`` is pure apart from the planner's own state: it feeds
the predictors, corrects the performance model from observed latency, sizes the next interval
(``solver.solve``), applies hysteresis and cooldown, and turns "how many" into concrete actions
on the fleet it was shown. It never touches a worker: actuators carry out the ``PlanDecision``.

What it plans for, and why (issue 14):

- **Lead time.** A worker started now serves ``start_s`` later, so scale-out is sized for the
  highest rate forecast over the next ``ceil(start_s / interval_s) + 1`` intervals, not the next one.
- **Decode from concurrency.** Decode is sized from the peak number of streams in flight within the
  interval (sampled by the fast loop) plus ``decode_headroom``, at the streams one worker holds
  within the ITL target; never below what the streams in flight need at the batch cap.
- **Separate, bounded corrections** (``LatencyCorrection``), learned only from intervals in which
  the role's serving workers did not change.
- **Slow scale-in.** A role shrinks only after ``scale_in_intervals`` intervals below its capacity,
  by at most ``scale_in_step`` workers per interval (0: down to the need plus the margin at once),
  always through ``drain``. With ``scale_in_insured`` (the default) a decline so confirmed keeps
  giving back one worker per interval while the pool without it still holds what proportional
  insurance measured for the re-start horizon (docs/benchmarks.md, Issue 14, helper plan15).
- **A fast load-reactive mode** (``react``, every ``fast_interval_s``): between intervals, queued
  prefill work or decode streams beyond what the serving workers hold scale that role out at once.
  It never scales in.
- **Warm standby.** ``standby_prefill``/``standby_decode`` workers are kept started but out of
  rotation; growth activates them first (seconds) and cold starts refill the standby pool.
  With ``standby_shared`` (the default; it applies when both roles run on the same hardware at the
  same price and a role change is faster than a start) the two roles share one pool sized for their
  measured *joint* shortfall instead of the sum of their pools (``_pool_want``): a standby worker
  wakes into whichever role needs it, through a role change when it was parked in the other
  (docs/benchmarks.md, Issue 14, helper plan10).
- **Proportional insurance** (``insurance="proportional"``, the default). The burst floor and the
  warm standby are insurance against load the serving pool cannot absorb before a worker started now
  would serve (the re-start horizon ``start_s + interval_s``). Once the planner has measured how far
  the load rose within such a horizon beyond what the horizon before it held (``horizon_rise``, per
  role), it keeps only the capacity that the horizon's largest need times that rise asks for: the
  floor at most that, the standby pool only what that needs beyond the serving pool. A ratio, so it
  scales with the load; a calm load releases insurance, a load that has stepped up keeps it.
  ``burst_window_s`` and ``standby_*`` stay the upper bounds and the insurance while the rise is unknown.

Scale-in is always two steps: ``drain`` a worker (it finishes its requests, takes no new ones),
then, once the fleet shows it idle, ``stop`` it, ``park`` it in standby or ``set_role`` it to the
other pool. A role change is preferred over stop+start when the actuator says it is faster than
starting an engine.
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
# Prefill keeps the burst floor: arrivals queue for prefill at once (TTFT grows linearly with the
# queue); decode too with ``decode_floor`` (a decode pool at its KV or batch cap queues new streams).
FLOORED_ROLES = ROLES
# the prefill correction is learned only from intervals at or below this utilization (model's own
# service time), where TTFT is mostly service time rather than queueing
PREFILL_LEARN_UTILIZATION = 0.5


@dataclass
class WorkerView:
    """A worker as the planner sees it (built from the registry, or by the virtual-time fleet)."""

    id: str
    role: Role
    state: str = "healthy"  # starting | healthy | unhealthy | draining | standby (started, out of rotation)
    inflight: int = 0
    waiting: int = 0  # engine-reported queue (used by the queue-length baseline)
    stoppable: bool = True  # False: the actuator cannot stop it (e.g. a configured worker under the
    # local actuator); never drained to be stopped, only switched to the other role
    standby: bool = False  # starting, but bound for the standby pool (not for rotation)


@dataclass
class Action:
    kind: Literal["start", "drain", "stop", "set_role", "activate", "park"]
    role: Role  # start: role to start; drain/stop/activate/park: current role; set_role: the new role
    worker_id: str | None = None
    then: str | None = None  # drain: "stop", "standby" or the new role's value; start: "standby" or None
    force: bool = False  # stop/drain: past the actuator's churn guard (``keep_reason``: still starting, or in
    # rotation for less than its minimum serving time)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "role": self.role.value, "worker_id": self.worker_id, "then": self.then,
                "force": self.force}


def cold_prefill_need(mode: str, queue: float, forecast_rate: float, observed_rate: float | None,
                      service: float, start_s: float) -> int:
    """Prefill workers worth a cold start in the load mode: a cold worker serves only after ``start_s``,
    so it is worth starting for the work the pool cannot clear by then — the queue drained within
    ``start_s`` while arrivals keep coming: ``ceil((queue / start_s + rate) x service)``. A backlog that
    clears sooner is not worth a start (warm standby is: it serves in seconds).

    ``rate`` is what is arriving now: in mode "observed" the larger of the forecast and the rate seen
    in the load-mode window (the forecast lags a burst, and a burst is when this decides); in mode
    "forecast" the forecast alone. Mode "off" (or ``start_s`` <= 0) never holds a cold start back
    (returns a need no shortfall reaches)."""
    if mode == "off" or start_s <= 0:
        return 1 << 30
    if mode not in ("observed", "forecast"):
        raise ValueError(f"cold_backlog must be observed, forecast or off, not {mode!r}")
    rate = forecast_rate
    if mode == "observed" and observed_rate is not None:
        rate = max(rate, observed_rate)
    return math.ceil((queue / start_s + rate) * service - 1e-9)


@dataclass
class PlannerSettings:
    targets: Targets = field(default_factory=Targets)
    limits: Limits = field(default_factory=Limits)
    interval_s: float = 60.0
    predictor: str = "auto"  # constant | ewma | linear | holt_winters | auto
    season: int = 24  # Holt-Winters season, in intervals
    scale_in_margin: float = 0.15  # keep this much headroom before giving a worker back
    scale_in_intervals: int = 2  # consecutive intervals below capacity before scaling in
    scale_in_step: int = 1  # most workers of one role given back per interval; 0 = all above the need plus
    # scale_in_margin (cheaper on 8-14-worker fleets, but on a 28-worker day it gave back 3 decode workers on a
    # two-interval dip at the peak and missed the SLO: docs/benchmarks.md, Issue 14, helper planner3)
    cooldown_s: float = 0.0  # after a change to a role, no scale-in of that role for this long
    role_change_s: float | None = None  # time a role change takes (None: actuator cannot)
    start_s: float = 60.0  # time an engine takes to start: the lead time of a scale-out
    correct_from_latency: bool = True
    prefill_correction_max: float = 1.0  # cap of the prefill (TTFT) correction (Dynamo's: 1)
    decode_correction_max: float = 2.0  # cap of the decode (ITL) correction
    headroom: float = 0.0  # plan for (1 + headroom) x the forecast rate: room for surges during start-up
    decode_headroom: float = 0.25  # decode sized for (1 + this) x the interval's peak streams in flight
    burst_window_s: float | None = 0.0  # burst floor: prefill sized for seconds-scale peaks, kept this long
    # (0 = off; None = the re-start horizon ``start_s + interval_s``: a worker given back now cannot serve
    # again before that, so a peak older than it is not worth holding capacity for)
    decode_floor: bool = False  # the burst floor keeps decode's peak sizing too (default: prefill's only;
    # decode bursts are met by the interval's peak streams + decode_headroom and by warm standby)
    fast_interval_s: float = 0.0  # load-reactive mode: look at queues every this many seconds (0 = off)
    fast_confirm: int = 1  # consecutive fast looks over capacity before it wakes warm standby
    fast_confirm_cold: int = 3  # ... and before it starts cold workers (a spike is left to the standby)
    fast_queue_share: float = 0.5  # fast mode: a prefill queue beyond what clears in this share of the TTFT target
    fast_lookahead: bool = True  # fast mode wakes warm decode standby for the streams it extrapolates to when a
    # worker woken at the next look would serve (``fast_interval_s + standby_wake_s`` ahead, from the growth over
    # that span; ``project_ahead``), not for the streams now; cold starts stay on the load now. Decode only: the
    # prefill trigger already acts before its target is breached (``fast_queue_share``), and on a queue of a few
    # long prompts the extrapolation woke standby on single arrivals (docs/benchmarks.md, Issue 14, plan12)
    standby_prefill: int = 0  # warm standby workers kept per role (started, out of rotation)
    standby_decode: int = 0
    standby_auto: bool = False  # size the standby pools from observed bursts (``standby_*`` are then floors): the
    # upper ``jump_quantile`` of how far a peak rose above the burst floor, over the last ``jump_memory``
    # intervals; 0 in calm periods
    jump_quantile: float = 0.9
    jump_memory: int = 20  # intervals of burst history (chosen a priori, not tuned)
    rise_quantile: float = 0.0  # size prefill for the lead forecast times this quantile of how far the
    # arrivals outran it recently (``rise_factor``; 0 = off)
    standby_wake_s: float = 5.0  # seconds a standby worker takes to serve once activated
    standby_net_of_spare: bool = True  # warm standby is insurance for load beyond what the serving pool holds;
    # serving workers the pool keeps beyond the model's sizing (the burst floor, scale-in hysteresis) are the
    # same insurance in rotation already, so the standby pool wanted is ``standby_*`` minus that spare (>= 0)
    standby_shared: bool = True  # one warm standby pool for both roles (``standby_pooled``): when prefill and
    # decode run on the same hardware at the same price and a role change is possible (``role_change_s``), a
    # standby worker can serve either role, so the pool keeps the upper quantile of the roles' joint shortfall over
    # the measured history (``_pool_want``: between the larger role's want and the sum) and wakes a worker into the
    # role that needs it (a role change, ``role_change_s``, if it was parked in the other). Inert where it does not
    # apply (``standby_pooled``): the per-role pools (docs/benchmarks.md, Issue 14, helper plan10)
    cold_backlog: str = "observed"  # load mode: start cold prefill workers only for a backlog that outlasts the
    # start-up (``cold_prefill_need``), judged against the arrivals seen now ("observed": the larger of the forecast
    # and the rate measured from the queue's growth between fast looks) or the forecast only ("forecast", lags a
    # burst); "off" = every confirmed shortfall starts cold workers, sized on the queue. "observed" is the default
    # since session 16: on three workloads no default was chosen on (two held-out days, N3) "off" started workers
    # for backlogs gone before they served (up to 2.4x the static split's worker-hours); on Azure code x2 those
    # starts happened to be insurance for the next burst, and it loses 2.8 points there (docs/benchmarks.md, Issue 14)
    fixed_fleet: bool = False  # the fleet's size is given (role changes only): re-split it, never start/stop
    insurance: str = "proportional"  # "fixed": the burst floor keeps the peak sizing for ``burst_window_s`` and
    # ``standby_*`` warm workers are kept. "proportional": once the load's own rise within a re-start horizon is
    # measured (``horizon_rise``), each role keeps only the insurance that rise calls for: the burst floor holds
    # at most the horizon's largest sizing times that rise, and warm standby only what that capacity needs beyond
    # the serving pool; ``burst_window_s`` and ``standby_*`` stay the bounds, and the insurance until the rise is
    # known (docs/benchmarks.md, Issue 14, helper planner4)
    standby_confirm: bool = True  # a want of the warm standby pool that comes without growth (no role grew this
    # interval, the load mode grew none since the last one, and the load rose no further than its measured rise,
    # ``_rose_beyond_noise``: the serving pool's spare gone for an interval, its rounding wobbling) is cold-started
    # only once it held over the last ``scale_in_intervals`` intervals (the count that confirms a scale-in): a worker
    # started into the pool is insurance only once ready, ``start_s`` later, and idle extras are stopped at once, so
    # such a want started a worker that was stopped as soon as it was ready. A want that comes with growth, or before
    # the rise is measured, is started at once; parking a worker given back is never held back (docs/benchmarks.md,
    # Issue 14, plan13: cheaper on 15 of 18 workloads, the 3-hour day 0.811x -> 0.801x, no >= 99% lost)
    scale_in_insured: bool = True  # a confirmed decline keeps giving back: once a role stepped down and every interval
    # since was below its capacity, the next worker goes back the next interval (not after the confirmation and the
    # cooldown again) when the pool without it still holds what proportional insurance measured for the re-start horizon
    # (``_insured``) and the hysteresis keep (``_insured_step``); never within the cooldown after a growth, nor before
    # the rise is measured. No parameter (docs/benchmarks.md, Issue 14, plan15: cheaper or equal on 17 of 18
    # workloads and on 3 held-out days, no >= 99% lost)
    rise_memory: int = 2880  # intervals of history ``insurance="proportional"`` measures the rise over (a day at
    # 30-s intervals: every run measured here is shorter, so it is "all seen so far"; ``jump_memory``'s 20
    # intervals forgot the two-peak day's first climb and the spiky day's spikes too soon: docs/benchmarks.md)


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
    mode: str = "interval"  # interval (the SLO planner) | load (the fast load-reactive mode)
    lead_rate: float | None = None  # highest forecast rate over the start-up lead
    peak_decode_streams: float | None = None  # peak streams in flight on decode within the interval
    standby: dict[str, int] = field(default_factory=dict)
    changes: dict[str, str] = field(default_factory=dict)  # role → why its count changes
    # role → workers the model sized for (incl. the latency guard's +1) and the count after the burst
    # floor: what serving capacity is for (``dyad plan``'s worker-hour breakdown); empty when not planned
    sized: dict[str, int] = field(default_factory=dict)
    floored: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at, "mode": self.mode,
            "observation": self.observation.to_dict() if self.observation else None,
            "forecast": asdict(self.forecast) if self.forecast else None,
            "lead_rate": self.lead_rate, "peak_decode_streams": self.peak_decode_streams,
            "sizing": asdict(self.sizing) if self.sizing else None,
            "desired": self.desired, "current": self.current, "standby": self.standby,
            "actions": [a.to_dict() for a in self.actions],
            "correction": self.correction, "predictors": self.predictors, "reasons": self.reasons,
            "changes": self.changes, "sized": self.sized, "floored": self.floored,
        }

    def timeline_row(self) -> dict[str, Any]:
        """One line of the per-interval timeline (``dyad plan`` JSON, ``/admin/planner``)."""
        o, f = self.observation, self.forecast

        def r(v: float | None, n: int = 3) -> float | None:
            return None if v is None or not math.isfinite(v) else round(v, n)

        return {
            "t": round(self.at, 3), "mode": self.mode,
            "rate_observed": r(o.request_rate) if o else None,
            "rate_predicted": r(f.request_rate) if f else None, "rate_lead": r(self.lead_rate),
            "peak_rate": r(o.peak_rate) if o else None,
            "isl": r(o.mean_isl, 1) if o else None, "osl": r(o.mean_osl, 1) if o else None,
            # where this interval's TTFT/ITL came from: "gateway" (streams), "engines" (their histograms) or None
            "latency_source": o.latency_source if o else None,
            "ttft_mean_s": r(o.ttft_mean, 4) if o else None, "ttft_p90_s": r(o.ttft_p90, 4) if o else None,
            "itl_mean_s": r(o.itl_mean, 5) if o else None,
            "peak_decode_streams": r(self.peak_decode_streams, 1),
            "prefill": self.current.get("prefill"), "decode": self.current.get("decode"),
            "desired_prefill": self.desired.get("prefill"), "desired_decode": self.desired.get("decode"),
            "standby": dict(self.standby),
            "correction": {k: r(v) for k, v in self.correction.items() if k in ("ttft", "itl")},
            "changes": dict(self.changes),
            "floor_held": {k: max(0, self.floored.get(k, v) - v) for k, v in self.sized.items()},
            "actions": [f"{a.kind} {a.role.value}" + (f" {a.worker_id}" if a.worker_id else "")
                        + (f" -> {a.then}" if a.then else "") + (" (forced)" if a.force else "") for a in self.actions],
            "forced": any(a.force for a in self.actions),  # an action overrides the actuators' churn guard
        }


class Planner:
    def __init__(self, perf: PerfModel, settings: PlannerSettings | None = None,
                 decode_perf: PerfModel | None = None) -> None:
        self.perf = perf  # the prefill workers' profile (and decode's, unless ``decode_perf`` is given)
        self.decode_perf = decode_perf or perf
        self.settings = settings or PlannerSettings()
        s = self.settings
        self.load = LoadPredictor(s.predictor, s.season)
        self.correction = LatencyCorrection(ttft_hi=s.prefill_correction_max, itl_hi=s.decode_correction_max)
        self.hit_ratio = 0.0
        self._pending: dict[str, str] = {}  # worker id → "stop" | "standby" | role value, while draining
        self._below: dict[Role, int] = dict.fromkeys(ROLES, 0)
        # ``scale_in_insured``: the role stepped down and every interval since was below its capacity again
        self._declining: dict[Role, bool] = dict.fromkeys(ROLES, False)
        self._last_grow: dict[Role, float] = dict.fromkeys(ROLES, -math.inf)  # when a role last grew
        self._last_change: dict[Role, float] = dict.fromkeys(ROLES, -math.inf)
        self._sized: deque[tuple[float, dict[Role, float]]] = deque()  # (time, exact need) for the floor
        self._first_plan: float | None = None
        self._serving_prev: dict[Role, int] | None = None
        self._peak_streams: dict[Role, float] = dict.fromkeys(ROLES, 0.0)  # fast-loop samples, this interval
        self._stream_sum: dict[Role, float] = dict.fromkeys(ROLES, 0.0)
        self._samples = 0
        self._over: dict[Role, int] = dict.fromkeys(ROLES, 0)
        self._last_look: tuple[float, float] | None = None  # fast mode: (when, prefill requests in flight)
        self._looks: deque[tuple[float, dict[Role, float]]] = deque()  # fast mode: (when, decode streams), one lead
        self._over_ahead = 0  # fast mode: consecutive looks whose decode streams extrapolate beyond the pool
        # fast mode: cold prefill starts ``cold_backlog`` held back since the last interval (the largest shortfall
        # held, and the look that held it: queue, arrivals, seconds), said in the next interval's reasons
        self._held_cold: tuple[int, float, float, float] | None = None
        self._forecast: LoadForecast | None = None
        self._grown: dict[Role, tuple[float, float]] = {}  # role → (when it last grew, the need that grew it)
        # per interval: (5-s peak arrival rate, peak decode streams) — the burst history of ``standby_auto``
        self._bursts: deque[tuple[float, float]] = deque(maxlen=max(2, self.settings.jump_memory + self.horizon_steps()))
        self._standby_sized: dict[Role, int] = dict.fromkeys(ROLES, 0)
        # ``insurance="proportional"``: per interval, what each role's pool absorbed (5-s peak arrival rate, peak
        # decode streams), the exact needs of the last re-start horizon, and what that insurance asks for
        self._absorbed: deque[tuple[float, float]] = deque(maxlen=self.settings.rise_memory + 2 * self.horizon_steps())
        self._recent: deque[tuple[float, dict[Role, float]]] = deque()
        self._insured: dict[Role, float] | None = None
        self._target: dict[Role, int] = {}
        # ``standby_confirm``: the standby pool's want (per role, and "shared") at the last intervals
        self._want_hist: deque[dict[str, int]] = deque(maxlen=max(1, self.settings.scale_in_intervals))
        self._drawn = False  # the load mode grew a role (woke standby or started workers) since the last interval
        self._spare: dict[Role, int] = {}  # serving workers kept beyond the model's sizing, this interval
        # per interval: [observed rate, the lead rate forecast after it] (``rise_factor``)
        self._leads: deque[list[float | None]] = deque(maxlen=max(2, self.settings.jump_memory + self.lead_steps() + 1))
        self.last: PlanDecision | None = None

    # ------------------------------------------------------------ inputs
    def _learn(self, obs: Observation, serving: dict[Role, int], mean_streams: dict[Role, float | None],
               reasons: list[str]) -> None:
        if obs.window_s <= 0:
            return
        self.load.observe(obs.request_rate, obs.mean_isl, obs.mean_osl)
        if obs.prefix_hit_ratio is not None:
            self.hit_ratio = 0.5 * self.hit_ratio + 0.5 * min(1.0, max(0.0, obs.prefix_hit_ratio))
        prev, self._serving_prev = self._serving_prev, dict(serving)
        if not self.settings.correct_from_latency or obs.request_rate <= 0 or not obs.mean_isl:
            return
        # learn a role's correction only when the same workers served it the whole interval
        steady = {r: prev is not None and prev[r] == serving[r] and serving[r] > 0 for r in ROLES}
        exp_ttft = exp_itl = None
        if steady[Role.PREFILL]:
            uncached = max(1.0, obs.mean_isl * (1.0 - self.hit_ratio))
            rho = obs.request_rate * self.perf.prefill_time(uncached) / serving[Role.PREFILL]
            # only where TTFT is mostly service time: the correction scales the service time, and the
            # M/D/1 queueing term is not what it may correct (a pool queues better than M/D/1 per
            # worker, which would read as a faster engine and pack the pool to overload)
            if rho <= PREFILL_LEARN_UTILIZATION:
                exp_ttft = self.perf.expected_ttft(obs.request_rate, uncached, serving[Role.PREFILL], tail=1.0)
        if steady[Role.DECODE] and obs.itl_mean and obs.mean_osl:
            streams = mean_streams.get(Role.DECODE)
            if streams is None:  # no fast-loop samples: Little's law
                streams = obs.request_rate * obs.mean_osl * obs.itl_mean
            exp_itl = self.decode_perf.decode_itl(streams / serving[Role.DECODE], obs.mean_isl + obs.mean_osl / 2)
        before = (self.correction.ttft, self.correction.itl)
        self.correction.update(observed_ttft=obs.ttft_mean, expected_ttft=exp_ttft,
                               observed_itl=obs.itl_mean, expected_itl=exp_itl)
        if (self.correction.ttft, self.correction.itl) != before:
            reasons.append(f"correction prefill x{self.correction.ttft:.2f} decode x{self.correction.itl:.2f}")

    def _counts(self, fleet: Sequence[WorkerView]) -> dict[Role, int]:
        """Workers that serve (or are about to serve) each role; draining-for-stop/standby ones and the
        standby pool do not count."""
        counts = dict.fromkeys(ROLES, 0)
        for w in fleet:
            then = self._pending.get(w.id)
            if then in ("stop", "standby") or w.standby or w.state == "standby":
                continue
            role = Role(then) if then else w.role
            if role in counts and w.state in ("starting", "healthy", "draining"):
                if w.state == "draining" and not then:
                    continue  # drained by someone else (an operator)
                counts[role] += 1
        return counts

    @staticmethod
    def _serving(fleet: Sequence[WorkerView]) -> dict[Role, int]:
        out = dict.fromkeys(ROLES, 0)
        for w in fleet:
            if w.state == "healthy" and w.role in out and not w.standby:
                out[w.role] += 1
        return out

    def _standby_pool(self, fleet: Sequence[WorkerView]) -> dict[Role, list[WorkerView]]:
        """Standby workers per role (ready ones first), and those draining into standby."""
        pool: dict[Role, list[WorkerView]] = {r: [] for r in ROLES}
        for w in fleet:
            if w.role in pool and (w.state == "standby" or w.standby or self._pending.get(w.id) == "standby"):
                pool[w.role].append(w)
        for r in ROLES:
            pool[r].sort(key=lambda w: (w.state != "standby", w.id))
        return pool

    def _sample(self, fleet: Sequence[WorkerView]) -> dict[Role, float]:
        streams = dict.fromkeys(ROLES, 0.0)
        for w in fleet:
            if w.role in streams and not w.standby and w.state != "standby":
                streams[w.role] += w.inflight
        for r in ROLES:
            self._peak_streams[r] = max(self._peak_streams[r], streams[r])
            self._stream_sum[r] += streams[r]
        self._samples += 1
        return streams

    def _standby_want(self) -> dict[Role, int]:
        s = self.settings
        fixed = {Role.PREFILL: s.standby_prefill, Role.DECODE: s.standby_decode}
        want = {r: max(fixed[r], self._standby_sized[r]) for r in ROLES} if s.standby_auto else fixed
        if s.standby_net_of_spare:
            want = {r: max(0, want[r] - self._spare.get(r, 0)) for r in ROLES}
        if self._insured is not None:  # proportional: only what the measured rise needs beyond the serving pool
            want = {r: min(want[r], max(0, math.ceil(self._insured[r] - 1e-9) - self._target.get(r, 0)))
                    for r in ROLES}
        return want

    def same_hardware(self) -> bool:
        """Prefill and decode workers are interchangeable machines: one performance model and one price per
        worker-hour (``decode_perf`` defaults to ``perf``; a separate decode profile or price means they
        differ, and a worker moved to the other role would keep its own hardware)."""
        lim = self.settings.limits
        return (self.decode_perf is self.perf or self.decode_perf == self.perf) and lim.prefill_cost == lim.decode_cost

    def standby_pooled(self) -> bool:
        """``standby_shared`` applies: the roles share one warm standby pool. Only when a standby worker of
        one role can serve the other — same hardware and price (``same_hardware``) and a role change the
        actuator can carry out, faster than a cold start (``role_change_s`` < ``start_s``, as for any role
        change the planner emits) — and the fleet is not fixed."""
        s = self.settings
        return (s.standby_shared and s.role_change_s is not None and s.role_change_s < s.start_s and not s.fixed_fleet
                and self.same_hardware())

    def _pool_want(self, want: dict[Role, int]) -> int:
        """Standby workers the shared pool keeps: what the two roles' shortfalls *together* asked for, measured.

        Per-role pools insure each role for the upper ``jump_quantile`` of its own rise; their sum is the
        pool's size only if both roles' worst rises come together. Where the load's own history shows when
        each role's need rose (``horizon_ratios`` of the 5-s peak arrival rate and the peak decode streams,
        aligned on the same re-start horizons), the pool keeps the upper ``jump_quantile`` of the *joint*
        shortfall instead: for every past horizon, the workers each role would have needed beyond its
        current target had the horizon's largest need risen as it did then, summed over the roles. A
        quantile of a sum is at most the sum of the quantiles, equal when the roles rise together (a load
        step moves both: no saving, no loss); it is less only for the diversification the history shows.
        Bounded by the larger role's want and the sum of the wants. Until the rise is measured (proportional
        insurance not yet known) nothing says the roles come apart: the sum."""
        lo, hi = max(want.values(), default=0), sum(want.values())
        if self._insured is None or lo == hi or not self._recent:
            return hi
        s = self.settings
        hist = list(self._absorbed)
        m = self.horizon_steps()
        ratios = {r: horizon_ratios([h[i] for h in hist], m)[-s.rise_memory:] for i, r in enumerate(ROLES)}
        peak = {r: max(e[r] for _, e in self._recent) for r in ROLES}
        n = min(len(v) for v in ratios.values())
        short = [sum(max(0, math.ceil(peak[r] * ratios[r][k] - 1e-9) - self._target.get(r, 0)) for r in ROLES)
                 for k in range(n)]
        if not short:
            return hi
        return min(hi, max(lo, math.ceil(_quantile(short, s.jump_quantile) - 1e-9)))

    @staticmethod
    def _fill_role(want: dict[Role, int], pool: dict[Role, list[WorkerView]]) -> Role:
        """The role a new or parked shared-standby worker is held in: the one whose own want its pool
        covers least (so its wake is an activation, not a role change); prefill on a tie (arrivals queue
        for prefill at once)."""
        return max(ROLES, key=lambda r: (want[r] - len(pool[r]), r is Role.PREFILL))

    def standby_wanted(self) -> dict[str, int]:
        """The warm standby pool per role this planner keeps now (``standby_*`` net of the serving pool's
        spare and, with proportional insurance, of what the measured rise does not need)."""
        want = self._standby_want()
        out = {r.value: n for r, n in want.items()}
        if self.standby_pooled():
            out["shared"] = self._pool_want(want)  # one pool for both roles: their joint shortfall, measured
        return out

    def insurance_status(self) -> dict[str, Any]:
        """What proportional insurance measured: the rise per role and the capacity it insures (None
        while the rise is not known yet, when the fixed insurance applies)."""
        known = self._insured is not None
        return {"mode": self.settings.insurance, "rise_known": known,
                "rise": {r.value: round(v, 3) for r, v in self.horizon_rises().items()} if known else None,
                "insured": {r.value: round(v, 3) for r, v in self._insured.items()} if self._insured else None}

    def rise_known(self) -> bool:
        """Enough complete re-start windows for ``horizon_rise``'s quantile to mean something: 1 / (1 - q)."""
        q = self.settings.jump_quantile
        windows = max(1, math.ceil(1.0 / max(1e-9, 1.0 - q) - 1e-9))
        return len(self._absorbed) >= 2 * self.horizon_steps() + windows - 1

    def horizon_rises(self) -> dict[Role, float]:
        """``horizon_rise`` per role over this planner's history (``jump_quantile`` over ``rise_memory``)."""
        s = self.settings
        hist = list(self._absorbed)
        m = self.horizon_steps()
        return {r: horizon_rise([h[i] for h in hist], m, s.rise_memory, s.jump_quantile) for i, r in enumerate(ROLES)}

    def _insure(self, exact: dict[Role, float], now: float, reasons: list[str]) -> None:
        """``insurance="proportional"``: the capacity each role should hold (serving or warm) for the next
        re-start horizon — the largest exact need of the last horizon times the rise the load showed within
        a horizon (``horizon_rises``). None until that rise is measured (``rise_known``)."""
        self._recent.append((now, dict(exact)))
        while self._recent and self._recent[0][0] < now - self.horizon_s() + 1e-9:
            self._recent.popleft()
        if self.settings.insurance != "proportional" or not self.rise_known():
            self._insured = None
            return
        rises = self.horizon_rises()
        self._insured = {r: max(e[r] for _, e in self._recent) * rises[r] for r in ROLES}
        reasons.append("insurance: the horizon's largest need x its measured rise ("
                       + ", ".join(f"{r.value} {self._insured[r]:.2f} = x{rises[r]:.2f}" for r in ROLES) + ")")

    def burst_jumps(self) -> tuple[float, float]:
        """How far the load rose above what the burst floor held, in the recent past, as a factor:
        the upper ``jump_quantile``, over the last ``jump_memory`` intervals, of (an interval's 5-s peak
        arrival rate, its peak decode streams) divided by the largest of the ``horizon_steps``
        intervals before it (1 = never rose). Load varies multiplicatively, so a factor carries over
        from a quiet hour to a busy one. Cold capacity cannot meet such a rise (it comes within the
        start-up time); warm standby can."""
        s = self.settings
        hist = list(self._bursts)
        m = self.horizon_steps()
        out = []
        for i in (0, 1):
            jumps = []
            for k in range(1, len(hist)):
                before = max(h[i] for h in hist[max(0, k - m):k])
                if before > 0:
                    jumps.append(max(1.0, hist[k][i] / before))
            jumps = jumps[-s.jump_memory:]
            out.append(_quantile(jumps, s.jump_quantile) if jumps else 1.0)
        return out[0], out[1]

    def rise_factor(self) -> float:
        """How far the arrivals outran the planner's own lead forecast, recently — a conformal upper
        bound: over the last ``jump_memory`` intervals whose lead has fully passed, (the highest rate
        seen in the ``lead_steps`` intervals after a step) / (the lead rate forecast at that step); its
        upper ``rise_quantile``, at least 1. A worker given back now cannot return within the re-start
        horizon, so prefill is sized for the lead forecast times this factor: where the predictors have
        been right it is near 1 (interval noise only); where the load has climbed faster than they
        follow, the next climb gets the capacity the last ones lacked."""
        s = self.settings
        hist = list(self._leads)
        h = self.lead_steps()
        ratios = []
        for j in range(len(hist) - h):
            lead = hist[j][1]
            if lead is not None and lead > 0:
                ratios.append(max(x[0] for x in hist[j + 1:j + 1 + h]) / lead)
        ratios = ratios[-s.jump_memory:]
        return max(1.0, _quantile(ratios, s.rise_quantile)) if ratios else 1.0

    def stream_rise_factor(self) -> float:
        """The same bound for decode, on its own demand: (the highest peak of streams in flight over the
        ``lead_steps`` intervals after an interval) / (that interval's peak). Long outputs keep streams in
        flight for minutes, so their count moves slowly and the factor stays near 1; short outputs make
        it follow the arrivals."""
        s = self.settings
        hist = [b[1] for b in self._bursts]
        h = self.lead_steps()
        ratios = [max(hist[j + 1:j + 1 + h]) / hist[j] for j in range(len(hist) - h) if hist[j] > 0]
        ratios = ratios[-s.jump_memory:]
        return max(1.0, _quantile(ratios, s.rise_quantile)) if ratios else 1.0

    def _size_standby(self, planned: LoadForecast, reasons: list[str]) -> None:
        """``standby_auto``: warm workers per role for the recent bursts (see ``burst_jumps``): what the
        burst floor's load times the jump factor needs beyond what the floor itself needs."""
        if not self.settings.standby_auto:
            return
        hist = list(self._bursts)[-self.horizon_steps():]
        jump_rate, jump_streams = self.burst_jumps()
        base_rate = max([planned.request_rate] + [h[0] for h in hist])
        base_streams = max([0.0] + [h[1] for h in hist])

        def prefill_need(rate: float) -> int:
            z = solve(LoadForecast(rate, planned.isl, planned.osl), self.perf, self.settings.targets,
                      replace(self.settings.limits, budget=10**6, max_prefill=None), self.hit_ratio,
                      self.correction, decode_perf=self.decode_perf)
            return math.ceil(z.prefill_exact - 1e-9)

        per = self._decode_per_worker(planned)
        h = 1 + self.settings.decode_headroom
        sized = {Role.PREFILL: max(0, prefill_need(base_rate * jump_rate) - prefill_need(base_rate))
                 if jump_rate > 1 and base_rate > 0 else 0,
                 Role.DECODE: max(0, math.ceil(base_streams * jump_streams * h / per - 1e-9)
                                  - math.ceil(base_streams * h / per - 1e-9)) if jump_streams > 1 else 0}
        if sized != self._standby_sized:
            reasons.append(f"standby: {sized[Role.PREFILL]}P/{sized[Role.DECODE]}D for recent bursts of "
                           f"x{jump_rate:.2f} req/s, x{jump_streams:.2f} decode streams within {self.horizon_s():g}s")
        self._standby_sized = sized

    # ------------------------------------------------------------ the step
    def complete_drains(self, fleet: Sequence[WorkerView]) -> list[Action]:
        """Stop, park or switch the workers this planner drained that are now idle.

        ``step`` calls it first; a fleet may also call it whenever a worker goes idle, so a drained
        worker is released at once instead of at the next interval.
        """
        ids = {w.id for w in fleet}
        self._pending = {k: v for k, v in self._pending.items() if k in ids}
        out: list[Action] = []
        for w in fleet:
            then = self._pending.get(w.id)
            if then is not None and w.inflight == 0:
                if then == "stop":
                    out.append(Action("stop", w.role, w.id))
                elif then == "standby":
                    out.append(Action("park", w.role, w.id))
                else:
                    out.append(Action("set_role", Role(then), w.id))
                del self._pending[w.id]
        return out

    def draining(self) -> dict[str, str]:
        """Worker id → what happens when it is idle ("stop", "standby" or the new role)."""
        return dict(self._pending)

    def horizon_s(self) -> float:
        """The re-start horizon: a worker stopped now cannot serve again before ``start_s`` has passed and
        the next interval has looked. Capacity is worth keeping only for load expected within it (a
        ski-rental bound), and a worker started for a forecast is kept at least this long."""
        s = self.settings
        return s.start_s + s.interval_s

    def horizon_steps(self) -> int:
        s = self.settings
        return max(1, math.ceil(self.horizon_s() / s.interval_s - 1e-9)) if s.interval_s > 0 else 1

    def burst_window(self) -> float:
        """Seconds the burst floor keeps a peak's sizing: as set, or (None) the re-start horizon."""
        w = self.settings.burst_window_s
        return self.horizon_s() if w is None else w

    def lead_steps(self) -> int:
        """Intervals a scale-out must look ahead: until a worker started now serves, plus one."""
        s = self.settings
        return max(1, math.ceil(s.start_s / s.interval_s - 1e-9) + 1) if s.interval_s > 0 else 1

    def step(self, obs: Observation | None, fleet: Sequence[WorkerView], now: float) -> PlanDecision:
        s = self.settings
        reasons: list[str] = []
        actions: list[Action] = self.complete_drains(fleet)
        counts = self._counts(fleet)
        serving = self._serving(fleet)
        current = {r.value: counts[r] for r in ROLES}
        streams_now = self._sample(fleet)
        peak_streams = dict(self._peak_streams)
        mean_streams: dict[Role, float | None] = {
            r: (self._stream_sum[r] / self._samples if self._samples > 1 else None) for r in ROLES}
        self._peak_streams = dict.fromkeys(ROLES, 0.0)
        self._stream_sum = dict.fromkeys(ROLES, 0.0)
        self._samples = 0
        if obs is not None:
            self._learn(obs, serving, mean_streams, reasons)
            if obs.window_s > 0:
                self._leads.append([obs.request_rate, None])
        if self._held_cold is not None:
            n, queue, rate, when = self._held_cold
            self._held_cold = None
            reasons.append(f"load mode: {n} cold prefill start{'s' if n > 1 else ''} held back at t={when:g}s: "
                           f"{queue:.0f} prompts at prefill clear within the {s.start_s:g}s start-up at {rate:.1f} req/s "
                           f"arriving (cold_backlog: {s.cold_backlog})")
        forecast = self.load.forecast()
        standby = self._standby_pool(fleet)
        standby_n = {r.value: len(standby[r]) for r in ROLES}
        if forecast is None:
            self.last = PlanDecision(now, obs, None, None, dict(current), current, actions,
                                     asdict(self.correction), self.load.chosen(), reasons + ["no load observed yet"],
                                     standby=standby_n)
            return self.last
        lead = self.load.peak_ahead(self.lead_steps()) or forecast.request_rate
        lead = max(lead, forecast.request_rate)
        if lead > forecast.request_rate * 1.0001:
            reasons.append(f"lead: sized for {lead:.2f} req/s forecast within the {s.start_s:g}s start-up")
        if obs is not None and obs.window_s > 0 and self._leads:
            self._leads[-1][1] = lead
        planned = LoadForecast(lead * (1 + s.headroom), forecast.isl, forecast.osl)
        self._forecast = planned
        sizing = solve(planned, self.perf, s.targets, s.limits, self.hit_ratio, self.correction,
                       decode_perf=self.decode_perf)
        rise = self.rise_factor() if s.rise_quantile > 0 else 1.0
        if rise > 1.0001:
            # prefill only: arrivals queue for prefill at once; decode is sized from the streams in
            # flight (which integrate arrivals over a stream's life) and its own burst standby
            risen = solve(replace(planned, request_rate=planned.request_rate * rise), self.perf, s.targets,
                          s.limits, self.hit_ratio, self.correction, decode_perf=self.decode_perf)
            if risen.prefill_exact > sizing.prefill_exact:
                reasons.append(f"rise: prefill sized for x{rise:.2f} the lead forecast, how far arrivals "
                               "recently outran it")
                p, d = risen.prefill, sizing.decode
                over = not s.limits.fits(p, d)
                if over:
                    p, d = fit_budget(risen.prefill_exact, sizing.decode_exact, s.limits)
                sizing = replace(sizing, prefill=p, decode=d, prefill_exact=risen.prefill_exact,
                                 over_budget=sizing.over_budget or over)
        if self.burst_window() > 0:
            sizing = self._burst_sizing(sizing, planned, obs, reasons)
        sizing = self._decode_streams(sizing, planned, max(peak_streams[Role.DECODE], streams_now[Role.DECODE]),
                                      reasons)
        peak_d = max(peak_streams[Role.DECODE], streams_now[Role.DECODE])
        if obs is not None and obs.window_s > 0:
            self._bursts.append((obs.peak_rate if obs.peak_rate is not None else obs.request_rate, peak_d))
            self._absorbed.append(self._bursts[-1])
        self._size_standby(planned, reasons)
        decode_saturated = counts[Role.DECODE] > 0 and peak_d >= 0.9 * counts[Role.DECODE] * self._decode_per_worker(planned)
        if sizing.infeasible:
            reasons.append("targets unreachable at any count: " + ", ".join(sizing.infeasible))
        if sizing.over_budget:
            reasons.append(f"budget {s.limits.budget} workers" + (
                f" / {s.limits.cost_budget:g} per hour" if s.limits.cost_budget is not None else "") + " caps the fleet")
        want = {Role.PREFILL: sizing.prefill, Role.DECODE: sizing.decode}
        exact = {Role.PREFILL: sizing.prefill_exact, Role.DECODE: sizing.decode_exact}
        self._insure(exact, now, reasons)
        budget = s.limits.budget
        total = sum(counts.values())
        if s.fixed_fleet and total >= s.limits.min_prefill + s.limits.min_decode:
            budget = total  # split the workers we have in proportion to need
            p, d = fit_budget(sizing.prefill_exact, sizing.decode_exact, replace(s.limits, budget=total))
            want = {Role.PREFILL: p, Role.DECODE: d}
            floored = dict(want)
        elif self.burst_window() > 0:
            floored, exact = self._capacity_floor(want, exact, counts, now, reasons)
        else:
            floored = dict(want)
        guarded = self._latency_guard(floored, counts, obs, reasons, decode_saturated)
        sized = {r.value: guarded[r] if guarded[r] != floored[r] else want[r] for r in ROLES}
        want = guarded
        target = self._hysteresis(want, exact, counts, now, reasons, budget)
        target = self._decode_floor(target, counts, streams_now[Role.DECODE], planned, reasons)
        for r in ROLES:
            if target[r] > counts[r]:
                self._grown[r] = (now, exact[r])
        self._spare = {r: max(0, target[r] - sized[r.value]) for r in ROLES}
        self._target = dict(target)
        changes = self._explain(target, counts, want, reasons)
        actions += self._actions(target, counts, fleet, now, standby)
        desired = {r.value: target[r] for r in ROLES}
        self.last = PlanDecision(now, obs, forecast, sizing, desired, current, actions,
                                 asdict(self.correction), self.load.chosen(), reasons, lead_rate=lead,
                                 peak_decode_streams=max(peak_streams[Role.DECODE], streams_now[Role.DECODE]),
                                 standby=standby_n, changes=changes, sized=sized,
                                 floored={r.value: max(sized[r.value], want[r]) for r in ROLES})
        return self.last

    def _explain(self, target: dict[Role, int], counts: dict[Role, int], want: dict[Role, int],
                 reasons: list[str]) -> dict[str, str]:
        out = {}
        for r in ROLES:
            if target[r] == counts[r]:
                continue
            why = [x for x in reasons if x.startswith((r.value, "lead", "burst", "budget", "correction"))
                   or (r is Role.DECODE and x.startswith("decode"))]
            verb = "grow" if target[r] > counts[r] else "shrink"
            out[r.value] = f"{verb} {counts[r]}->{target[r]} (model wants {want[r]})" + (
                "; " + "; ".join(why) if why else "")
        return out

    def _latency_guard(self, want: dict[Role, int], counts: dict[Role, int], obs: Observation | None,
                       reasons: list[str], decode_saturated: bool = False) -> dict[Role, int]:
        """What the model cannot explain, met by measurement instead of by a correction: when the
        interval's observed TTFT (p90) or ITL (mean) broke the target while the model asked for no more
        workers, add one to the pool at fault (and never give one back in that interval). A TTFT
        broken while decode streams queued is decode's fault (a stream waits for a decode slot before
        its first token), not prefill's."""
        if obs is None or self.settings.fixed_fleet:
            return want
        s = self.settings
        out = dict(want)
        lim = s.limits
        ttft_pool = Role.DECODE if decode_saturated else Role.PREFILL
        checks = ((ttft_pool, obs.ttft_p90, s.targets.ttft_s, "TTFT p90"),
                  (Role.DECODE, obs.itl_mean, s.targets.itl_s, "ITL"))
        for r, seen, target, name in checks:
            if seen is None or seen <= target or out[r] > counts[r]:
                continue
            grown = {**out, r: counts[r] + 1}
            if lim.fits(grown[Role.PREFILL], grown[Role.DECODE]):
                out = grown
                reasons.append(f"{r.value}: observed {name} {seen:.3g}s > target {target:g}s, +1 beyond the model")
        return out

    def _decode_per_worker(self, planned: LoadForecast) -> int:
        """Streams one decode worker holds within the ITL target (KV and batch cap included)."""
        s = self.settings
        context = planned.isl + planned.osl / 2.0
        full = planned.isl + planned.osl  # KV a stream holds at its end
        per = self.decode_perf.max_decode_concurrency(s.targets.itl_s, context, self.correction.itl, kv_context=full)
        return per if per > 0 else self.decode_perf.decode_batch_cap(full)

    def _decode_streams(self, sizing: Sizing, planned: LoadForecast, peak: float, reasons: list[str]) -> Sizing:
        """The decode burst floor: size decode for the interval's peak streams in flight plus headroom.

        A decode pool at its batch cap (or out of KV) queues new streams; their first token waits for
        a whole stream to finish, so TTFT, not ITL, is what breaks. The mean rate hides this: streams
        arrive in bursts and long outputs keep them in flight for minutes.
        """
        s = self.settings
        if peak <= 0:
            return sizing
        per = self._decode_per_worker(planned)
        rise = self.stream_rise_factor() if s.rise_quantile > 0 else 1.0
        need = peak * rise * (1 + s.decode_headroom) / per
        if need <= sizing.decode_exact:
            return sizing
        reasons.append(f"decode: {peak:.0f} streams in flight at peak" + (f" x{rise:.2f} (recent rises)" if rise > 1.0001
                                                                          else "")
                       + f", {per} per worker within the ITL target")
        lim = s.limits
        d = max(lim.min_decode, math.ceil(need - 1e-9))
        d = d if lim.max_decode is None else min(lim.max_decode, d)
        p = sizing.prefill
        over = not lim.fits(p, d)
        if over:
            p, d = fit_budget(sizing.prefill_exact, need, lim)
        return replace(sizing, prefill=p, decode=d, decode_exact=need, over_budget=sizing.over_budget or over)

    def _decode_floor(self, target: dict[Role, int], counts: dict[Role, int], streams: float,
                      planned: LoadForecast, reasons: list[str]) -> dict[Role, int]:
        """Never shrink decode below what the streams in flight need at the batch cap."""
        if target[Role.DECODE] >= counts[Role.DECODE] or streams <= 0:
            return target
        cap = self.decode_perf.decode_batch_cap(planned.isl + planned.osl / 2.0)
        floor = min(counts[Role.DECODE], math.ceil(streams / cap - 1e-9))
        if floor > target[Role.DECODE]:
            reasons.append(f"decode: {streams:.0f} streams in flight need {floor} workers at the batch cap {cap}")
            return {**target, Role.DECODE: floor}
        return target

    # ------------------------------------------------------------ the fast, load-reactive mode
    def react(self, fleet: Sequence[WorkerView], now: float) -> PlanDecision | None:
        """Between SLO intervals (every ``fast_interval_s``): scale a role out at once when its queue
        is beyond what its workers clear within target. Like Dynamo's load mode, from queue and KV
        pressure only; it never scales in (that is the interval's job, with hysteresis)."""
        s = self.settings
        streams = self._sample(fleet)
        f = self._forecast
        if f is None or s.fixed_fleet:
            return None
        counts = self._counts(fleet)
        serving = self._serving(fleet)
        hit = min(0.99, max(0.0, self.hit_ratio))
        service = self.perf.prefill_time(max(1.0, f.isl * (1 - hit))) * self.correction.ttft
        # requests one worker clears within a share of the target: act before the target is breached
        per_prefill = max(1.0, s.fast_queue_share * s.targets.ttft_s / service)
        per_decode = self._decode_per_worker(f)
        need = {Role.PREFILL: math.ceil(streams[Role.PREFILL] / per_prefill - 1e-9),
                Role.DECODE: math.ceil(streams[Role.DECODE] * (1 + s.decode_headroom) / per_decode - 1e-9)}
        # a cold worker serves only after start_s: start one only for work that the pool cannot clear by
        # then — the queue drained within start_s while the forecast arrivals keep coming (a backlog that
        # clears sooner is not worth a start; warm standby is, it serves in seconds)
        arriving = self._arrival_now(now, streams[Role.PREFILL], serving[Role.PREFILL], service)
        cold_need = dict(need)
        cold_need[Role.PREFILL] = min(need[Role.PREFILL], cold_prefill_need(
            s.cold_backlog, streams[Role.PREFILL], f.request_rate, arriving, service, s.start_s))
        target = dict(counts)
        reasons: list[str] = []
        lead = s.fast_interval_s + s.standby_wake_s
        ahead = dict(streams)
        if s.fast_lookahead:  # decode streams only (``PlannerSettings.fast_lookahead``)
            ahead = {**ahead, **project_ahead(self._looks, now, {Role.DECODE: streams[Role.DECODE]}, lead)}
        ahead_need = math.ceil(ahead[Role.DECODE] * (1 + s.decode_headroom) / per_decode - 1e-9)
        for r in ROLES:
            if need[r] > max(counts[r], serving[r]):
                self._over[r] += 1
                if self._over[r] >= s.fast_confirm:
                    target[r] = need[r]
                    reasons.append(f"{r.value}: load {streams[r]:.0f} in flight > {counts[r]} workers hold")
            else:
                self._over[r] = 0
        # warm decode standby for the streams a worker woken at the next look would meet when it serves
        if ahead_need > max(counts[Role.DECODE], serving[Role.DECODE], target[Role.DECODE]):
            self._over_ahead += 1
            if self._over_ahead >= s.fast_confirm:
                target[Role.DECODE] = ahead_need
                reasons.append(f"decode: {streams[Role.DECODE]:.0f} streams in flight rising to "
                               f"{ahead[Role.DECODE]:.0f} within {lead:g}s > {counts[Role.DECODE]} workers hold")
        else:
            self._over_ahead = 0
        if target == counts:
            return None
        lim = s.limits
        caps = {Role.PREFILL: lim.max_prefill, Role.DECODE: lim.max_decode}
        target = {r: target[r] if caps[r] is None else min(caps[r], target[r]) for r in ROLES}
        standby = self._standby_pool(fleet)
        pool = {r: [w for w in standby[r] if self._pending.get(w.id) is None] for r in ROLES}
        actions: list[Action] = []
        used = dict(counts)
        pooled = self.standby_pooled()

        def fits(r: Role, n: int) -> bool:  # role ``r`` at ``n`` workers within the budget (standby included)
            grown = {**used, r: n}
            pool_n = sum(len(pool[x]) for x in ROLES)
            return lim.fits(grown[Role.PREFILL] + (pool_n if r is Role.PREFILL else 0),
                            grown[Role.DECODE] + (pool_n if r is Role.DECODE else 0))

        def cold(r: Role) -> None:
            # cold starts only for pressure that lasts, and within the budget (standby included)
            if self._over[r] < s.fast_confirm_cold:
                return
            # what ``cold_backlog`` holds back (that the budget would allow), said in the next interval's reasons
            held, start = 0, max(used[r], cold_need[r])
            while start + held < min(target[r], need[r]) and fits(r, start + held + 1):
                held += 1
            if held > 0 and (self._held_cold is None or held > self._held_cold[0]):
                self._held_cold = (held, streams[r], max(f.request_rate, arriving or 0.0), now)
            while min(target[r], need[r], cold_need[r]) > used[r] and fits(r, used[r] + 1):
                actions.append(Action("start", r))
                used[r] += 1

        for r in ROLES:
            # warm standby first: a false alarm costs nothing (the interval parks it again)
            while target[r] > used[r] and pool[r]:
                actions.append(Action("activate", r, pool[r].pop(0).id))
                used[r] += 1
            if not pooled:
                cold(r)
        for r in ROLES if pooled else ():
            if target[r] > used[r]:  # the other role's standby beyond its own growth, by a role change
                woken = self._wake_other(r, {**used, r: target[r] - used[r]}, pool)
                actions += woken
                used[r] += len(woken) // 2
            cold(r)
        if not actions:
            return None
        for r in ROLES:
            if used[r] > counts[r]:
                self._grown[r] = (now, float(used[r]))
                self._last_change[r] = now
                self._last_grow[r] = now
                self._below[r] = 0
                self._declining[r] = False
                self._over[r] = 0 if used[r] >= target[r] else self._over[r]
        if any(used[r] > counts[r] for r in ROLES):
            self._drawn = True
        current = {r.value: counts[r] for r in ROLES}
        return PlanDecision(now, None, f, None, {r.value: used[r] for r in ROLES}, current, actions,
                            asdict(self.correction), self.load.chosen(), reasons, mode="load",
                            standby={r.value: len(standby[r]) for r in ROLES},
                            changes={r.value: f"grow {counts[r]}->{used[r]} (load-reactive)" for r in ROLES
                                     if used[r] > counts[r]})

    def _arrival_now(self, now: float, queue: float, serving: int, service: float) -> float | None:
        """The prefill arrival rate seen between the last fast look and this one, from the fleet alone:
        the queue's growth plus what the serving workers cleared meanwhile (each clears one request per
        ``service`` while it has work). None at the first look or after no time passed."""
        last, self._last_look = self._last_look, (now, queue)
        if last is None or now <= last[0]:
            return None
        dt = now - last[0]
        busy = min(float(serving), max(queue, last[1]))
        return max(0.0, (queue - last[1]) / dt + busy / service)

    def _burst_sizing(self, sizing: Sizing, forecast: LoadForecast, obs: Observation | None,
                      reasons: list[str]) -> Sizing:
        """Size the prefill pool for the interval's burst, not its mean.

        Arrivals queue for prefill at once, so what TTFT feels is the arrival rate over seconds
        (``Observation.peak_rate``), not over the interval. Decode has its own burst floor, from the
        streams in flight (``_decode_streams``).
        """
        s = self.settings
        peak = obs.peak_rate if obs is not None and obs.peak_rate is not None else 0.0
        peak *= 1 + s.headroom
        if peak <= forecast.request_rate:
            return sizing
        burst = solve(LoadForecast(peak, forecast.isl, forecast.osl), self.perf, s.targets, s.limits,
                      self.hit_ratio, self.correction, decode_perf=self.decode_perf)
        reasons.append(f"burst: prefill sized for the {PEAK_WINDOW_S:g}s peak {peak:.2f} req/s")
        p, d = burst.prefill, sizing.decode
        over = not s.limits.fits(p, d)
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
        window = self.burst_window()
        while self._sized and self._sized[0][0] < now - window:
            self._sized.popleft()
        warming = now - self._first_plan < window
        lim = s.limits
        caps = {Role.PREFILL: lim.max_prefill, Role.DECODE: lim.max_decode}
        floor_exact: dict[Role, float] = {}
        for r in ROLES:
            floored_role = r in FLOORED_ROLES and (r is Role.PREFILL or s.decode_floor)
            f = max(e[r] for _, e in self._sized) if floored_role else exact[r]
            if self._insured is not None:  # proportional: the window's peak only as far as the measured rise asks
                f = min(f, self._insured[r])
            if warming:
                f = max(f, float(counts[r]))
            floor_exact[r] = max(exact[r], f)
        floored = {r: max(want[r], math.ceil(floor_exact[r] - 1e-9)) for r in ROLES}
        floored = {r: floored[r] if caps[r] is None else min(caps[r], floored[r]) for r in ROLES}
        if not lim.fits(floored[Role.PREFILL], floored[Role.DECODE]):
            p, d = fit_budget(floor_exact[Role.PREFILL], floor_exact[Role.DECODE], lim)
            floored = {Role.PREFILL: p, Role.DECODE: d}
        if floored != want:
            reasons.append("burst floor: " + ("warming up, holding" if warming else
                                              f"keeping the {window:g}s peak sizing") +
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
                self._declining[r] = False
                target[r] = want[r]
                continue
            keep = max(mins[r], math.ceil(exact[r] * (1 + s.scale_in_margin) - 1e-9))
            if keep >= have:
                self._below[r] = 0
                self._declining[r] = False
                target[r] = have
                continue
            self._below[r] += 1
            if self._started_for_forecast(r, exact[r], now):
                target[r] = have
                t0, need = self._grown[r]
                reasons.append(f"{r.value}: holding {have} (grown at t={t0:g}s for a need of {need:.2f}; kept until "
                               f"t={t0 + self.horizon_s():g}s unless the need falls clearly)")
            elif self._below[r] >= s.scale_in_intervals and now - self._last_change[r] >= s.cooldown_s:
                target[r] = max(keep, want[r], have - (s.scale_in_step if s.scale_in_step > 0 else have))
            elif self._insured_step(r, have, keep, now):
                target[r] = have - 1
                reasons.append(f"{r.value}: {have - 1} still hold the measured insurance ({self._insured[r]:.2f}) "
                               "and the decline is confirmed: one more back")
            else:
                target[r] = have
                reasons.append(f"{r.value}: holding {have} (wants {max(keep, want[r])}, hysteresis/cooldown)")
        # the budget beats hysteresis: a growing role takes what the shrinking one is holding
        over_w = sum(target.values()) - budget
        for r in ROLES:
            give = min(max(0, over_w), target[r] - max(want[r], mins[r]))
            if give > 0:
                target[r] -= give
                over_w -= give
        if lim.cost_budget is not None:
            for r in ROLES:
                while (lim.cost(target[Role.PREFILL], target[Role.DECODE]) > lim.cost_budget + 1e-9
                       and target[r] > max(want[r], mins[r])):
                    target[r] -= 1
        return target

    def _insured_step(self, r: Role, have: int, keep: int, now: float) -> bool:
        """``scale_in_insured``: a role in a confirmed decline (it stepped down, and every interval since was below its
        capacity) gives one more worker back this interval, without waiting out the confirmation and the cooldown that
        follow a step down, when the pool without it still holds what proportional insurance measured for the re-start
        horizon (the horizon's largest need x the load's measured rise, ``_insured``) and the hysteresis keep. Never
        within the cooldown after a growth, and not before the rise is measured."""
        s = self.settings
        if (not s.scale_in_insured or self._insured is None or not self._declining[r]
                or now - self._last_grow[r] < s.cooldown_s):
            return False
        return have - 1 >= max(keep, math.ceil(self._insured[r] - 1e-9))

    def _started_for_forecast(self, role: Role, need: float, now: float) -> bool:
        """The churn rule: a role grown for a forecast keeps its workers until the re-start horizon
        (``horizon_s``) after the growth has passed — stopping one earlier means paying its start-up
        again if the forecast was right — unless the need fell clearly: below the need that grew it by
        more than ``scale_in_margin`` and more than the load's own recent jumps (``burst_jumps``: a fall
        no larger than a rise seen within the horizon is noise, not a trend)."""
        grown = self._grown.get(role)
        if grown is None:
            return False
        t0, need0 = grown
        jump = self.burst_jumps()[0 if role is Role.PREFILL else 1]
        return now < t0 + self.horizon_s() and need * (1 + self.settings.scale_in_margin) * jump >= need0

    def _rose_beyond_noise(self) -> bool:
        """``standby_confirm``: whether this interval's load rose beyond what the load's own variability explains — the
        pool's absorbed load (5-s peak arrival rate, peak decode streams) above the largest of the re-start horizon
        before it by more than the rise measured for that role (``horizon_rises``). True while that rise is not
        measured yet (``_insured`` None): until then a wobble cannot be told from a step."""
        if self._insured is None:
            return True
        hist = list(self._absorbed)
        m = self.horizon_steps()
        if len(hist) < m + 1:
            return True
        rises = self.horizon_rises()
        for i, r in enumerate(ROLES):
            held = max(h[i] for h in hist[-m - 1:-1])
            if held > 0 and hist[-1][i] > held * rises[r] + 1e-9:
                return True
        return False

    def _actions(self, target: dict[Role, int], counts: dict[Role, int], fleet: Sequence[WorkerView],
                 now: float, standby: dict[Role, list[WorkerView]] | None = None) -> list[Action]:
        s = self.settings
        standby = standby if standby is not None else self._standby_pool(fleet)
        grow = {r: max(0, target[r] - counts[r]) for r in ROLES}
        shrink = {r: max(0, counts[r] - target[r]) for r in ROLES}
        pool = {r: [w for w in standby[r] if self._pending.get(w.id) is None] for r in ROLES}
        want_pool = self._standby_want()
        pooled = self.standby_pooled()
        shared_want = self._pool_want(want_pool)
        # what a cold start may refill the pool to: the want, or with ``standby_confirm`` the least want of the last
        # ``scale_in_intervals`` intervals (stopping idle extras still follows the want now)
        self._want_hist.append({**{r.value: want_pool[r] for r in ROLES}, "shared": shared_want})
        start_to = dict(want_pool)
        start_shared = shared_want
        drawn, self._drawn = self._drawn, False
        if s.standby_confirm and not (drawn or any(grow[r] > 0 for r in ROLES) or self._rose_beyond_noise()):
            start_to = {r: min(h[r.value] for h in self._want_hist) for r in ROLES}
            start_shared = min(h["shared"] for h in self._want_hist)

        def short(r: Role) -> bool:  # the standby pool that role ``r`` parks into wants another worker
            return sum(len(pool[x]) for x in ROLES) < shared_want if pooled else len(pool[r]) < want_pool[r]

        actions: list[Action] = []
        prefer_switch = s.role_change_s is not None and s.role_change_s < s.start_s
        for r in ROLES:
            if grow[r] == 0 and shrink[r] == 0:
                continue
            self._last_change[r] = now
            self._below[r] = 0
            if grow[r] > 0:
                self._last_grow[r] = now
            self._declining[r] = s.scale_in_insured and shrink[r] > 0
        for r in ROLES:
            if shrink[r] == 0:
                continue
            other = Role.DECODE if r is Role.PREFILL else Role.PREFILL
            victims = sorted((w for w in fleet if w.role is r and w.id not in self._pending and not w.standby
                              and w.state in ("healthy", "unhealthy", "starting")),
                             key=lambda w: (w.state == "healthy", w.inflight, w.id))
            for w in victims:
                if shrink[r] == 0:
                    break
                if prefer_switch and grow[other] > 0 and not pool[other]:
                    grow[other] -= 1
                    then = other.value
                elif short(r) and w.state == "healthy":
                    then = "standby"
                    pool[r].append(w)
                elif w.stoppable:
                    then = "stop"
                else:
                    continue  # left serving: draining it would take it out of service for good
                shrink[r] -= 1
                if then == "standby":
                    if w.inflight == 0:
                        actions.append(Action("park", r, w.id))
                    else:
                        self._pending[w.id] = then
                        actions.append(Action("drain", r, w.id, then))
                elif w.inflight == 0 or w.state == "starting":
                    actions.append(Action("stop", r, w.id) if then == "stop" else Action("set_role", other, w.id))
                else:
                    self._pending[w.id] = then
                    actions.append(Action("drain", r, w.id, then))
        for r in ROLES:
            # warm standby first (seconds), cold starts for the rest
            while grow[r] > 0 and pool[r]:
                w = pool[r].pop(0)
                actions.append(Action("activate", r, w.id))
                grow[r] -= 1
            if not pooled:
                actions += [Action("start", r) for _ in range(grow[r])]
        for r in ROLES if pooled else ():
            # shared standby: what the other role's pool holds beyond that role's own growth, through a role
            # change (after both roles took their own: a worker parked in a role is that role's insurance first)
            actions += self._wake_other(r, grow, pool)
            actions += [Action("start", r) for _ in range(grow[r])]
        # refill the standby pools, within the budget (serving workers first)
        if pooled:
            return actions + self._refill_shared(target, want_pool, shared_want, pool, start_shared)
        if not s.fixed_fleet and any(want_pool.values()):
            used_p = target[Role.PREFILL] + len(pool[Role.PREFILL])
            used_d = target[Role.DECODE] + len(pool[Role.DECODE])
            for r in ROLES:
                if self._below[r] > 0 or self._declining[r]:
                    continue  # the role is above its need: a worker will be parked, not started
                while len(pool[r]) < start_to[r]:
                    np_, nd = (used_p + 1, used_d) if r is Role.PREFILL else (used_p, used_d + 1)
                    if not s.limits.fits(np_, nd):
                        break
                    used_p, used_d = np_, nd
                    pool[r].append(WorkerView("(new)", r, "starting", standby=True))
                    actions.append(Action("start", r, then="standby"))
        if not s.fixed_fleet:  # a pool larger than wanted (the bursts calmed): stop its idle extras
            for r in ROLES:
                extra = [w for w in pool[r] if w.state == "standby" and w.id != "(new)"]
                while len(pool[r]) > want_pool[r] and extra and extra[-1].stoppable:
                    w = extra.pop()
                    pool[r].remove(w)
                    actions.append(Action("stop", r, w.id))
        return actions

    def _wake_other(self, r: Role, need: dict[Role, int], pool: dict[Role, list[WorkerView]]) -> list[Action]:
        """Shared standby: wake workers parked in the other role into ``r`` (a role change, then into
        rotation; serving after ``role_change_s``), ready ones first, for up to ``need[r]`` workers."""
        other = Role.DECODE if r is Role.PREFILL else Role.PREFILL
        out: list[Action] = []
        while need[r] > 0 and pool[other]:
            w = pool[other].pop(0)
            if w.state == "standby":
                out += [Action("set_role", r, w.id), Action("activate", r, w.id)]
            else:  # still starting into the pool: it serves the other role once ready; keep it
                pool[other].insert(0, w)
                break
            need[r] -= 1
        return out

    def _refill_shared(self, target: dict[Role, int], want: dict[Role, int], shared_want: int,
                       pool: dict[Role, list[WorkerView]], start_to: int | None = None) -> list[Action]:
        """Shared standby: keep ``shared_want`` workers in one pool for both roles (``_pool_want``), within
        the budget; new ones start in the role that ``_fill_role`` names (up to ``start_to``, by default
        ``shared_want``); idle extras are stopped."""
        s = self.settings
        actions: list[Action] = []
        total = sum(len(pool[r]) for r in ROLES)
        used = {r: target[r] + len(pool[r]) for r in ROLES}
        while total < (shared_want if start_to is None else min(shared_want, start_to)):
            r = self._fill_role(want, pool)
            if self._below[r] > 0 or self._declining[r]:  # above its need: a worker will be parked, not started
                break
            grown = {**used, r: used[r] + 1}
            if not s.limits.fits(grown[Role.PREFILL], grown[Role.DECODE]):
                break
            used = grown
            pool[r].append(WorkerView("(new)", r, "starting", standby=True))
            actions.append(Action("start", r, then="standby"))
            total += 1
        extra = {r: [w for w in pool[r] if w.state == "standby" and w.id != "(new)"] for r in ROLES}
        while total > shared_want:
            # stop from the role whose pool is furthest beyond its own want
            cands = [r for r in ROLES if extra[r] and extra[r][-1].stoppable]
            if not cands:
                break
            r = max(cands, key=lambda x: (len(pool[x]) - want[x], x is Role.DECODE))
            w = extra[r].pop()
            pool[r].remove(w)
            actions.append(Action("stop", r, w.id))
            total -= 1
        return actions


def project_ahead(looks: deque[tuple[float, dict[Role, float]]], now: float, load: dict[Role, float],
                  lead: float) -> dict[Role, float]:
    """Where each role's load (requests in flight) will be ``lead`` seconds from ``now`` if it keeps growing as it
    grew over the last ``lead`` seconds: ``load + max(0, growth since the oldest look within lead) x lead / span``.
    A first-order extrapolation over the same span it is measured on (no other parameter); a falling load is not
    extrapolated down. Records this look in ``looks`` (kept to the last ``lead`` seconds)."""
    while looks and now - looks[0][0] > lead + 1e-9:
        looks.popleft()
    out = dict(load)
    if looks and now > looks[0][0]:
        t0, past = looks[0]
        for r in load:
            grew = load[r] - past.get(r, 0.0)
            if grew > 0:
                out[r] = load[r] + grew * lead / (now - t0)
    looks.append((now, dict(load)))
    return out


def _horizon_ratios(series: Sequence[float], steps: int) -> list[float | None]:
    """For every interval ``k`` whose next ``steps`` intervals are known, in order: (the largest value of
    those) / (the largest of the ``steps`` intervals ending at ``k``), at least 1; None where that
    horizon held nothing."""
    m = max(1, steps)
    out: list[float | None] = []
    for k in range(m - 1, len(series) - m):
        held = max(series[k - m + 1:k + 1])
        out.append(max(1.0, max(series[k + 1:k + 1 + m]) / held) if held > 0 else None)
    return out


def horizon_ratios(series: Sequence[float], steps: int) -> list[float]:
    """``horizon_rise``'s ratios, one per interval ``k`` whose next ``steps`` intervals are known, in order
    (1 where the horizon before ``k`` held nothing): the same ``k`` for two roles' series line up, so a
    shortfall of both roles in the same horizon can be told from shortfalls that come apart."""
    return [1.0 if r is None else r for r in _horizon_ratios(series, steps)]


def horizon_rise(series: Sequence[float], steps: int, memory: int, q: float) -> float:
    """How far a load rose within one re-start horizon beyond what the horizon before it held: for every
    interval ``k`` whose next ``steps`` intervals are known, (the largest value of those) / (the largest of
    the ``steps`` intervals ending at ``k``); the upper ``q`` quantile of the last ``memory`` of these
    ratios, at least 1 (1 with none yet).

    ``series`` holds one value per interval of what a role's pool must absorb (the 5-s peak arrival rate
    for prefill, the peak decode streams in flight). Capacity held for the horizon's peak misses exactly
    this rise: a worker started once the rise is seen serves a horizon later. A ratio, so it carries
    over from a quiet hour to a busy one and scales the insurance with the load."""
    ratios = [r for r in _horizon_ratios(series, steps) if r is not None]
    if memory > 0:
        ratios = ratios[-memory:]
    return max(1.0, _quantile(ratios, q)) if ratios else 1.0


def _quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics)."""
    v = sorted(xs)
    if not v:
        return 0.0
    pos = min(1.0, max(0.0, q)) * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(len(v) - 1, lo + 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)
