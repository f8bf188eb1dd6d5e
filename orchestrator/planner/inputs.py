"""Inputs or no action: the planner plans only on fresh measurements.

``InputGate.check(obs, now)`` decides, from plain data, whether an interval's ``Observation`` is
good enough to plan on, and if not, why (a short machine reason plus a sentence). The service holds
the current sizes whenever it says no; it never plans from defaults (a forecast whose ISL/OSL fell
back to 1 token would scale the fleet in while it saturates).

What "fresh" means, per input:

- Every value must be one a fleet can produce (``implausible``): a negative or absurdly large one is
  garbage from the source and holds (``invalid_input``).
- **Rate** (arrivals per second) must be measured this interval. ``None`` (the first scrape only
  primes the counters, the series is absent, the source failed) holds. A measured 0 is a real
  answer: nothing arrived, and lengths and latency are then not needed.
- **ISL** comes from what arrived, **OSL** and **latency** (TTFT, and ITL when requests decode
  more than one token) from what finished: latency from the gateway's streams, or, when a window
  has none (non-streamed traffic), from the engines' own histograms (``Observation.latency_source``). A busy interval in which nothing finished (overload,
  long outputs) has no OSL or latency of its own, so each input may be carried from its last
  measurement for at most ``max_age_s``; older than that, or never seen, it holds.

Pure: no I/O, no clock (``now`` is passed in), unit-tested in ``tests/unit/test_planner_inputs.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator.planner.core import ROLES, PlanDecision, Planner, WorkerView
from orchestrator.planner.metrics_source import Observation

# hold reasons (the ``reason`` label of ``dyad_planner_held_total``)
SOURCE_UNAVAILABLE = "source_unavailable"  # the metrics source failed or has no data
RATE_MISSING = "rate_missing"
ISL_MISSING = "isl_missing"
OSL_MISSING = "osl_missing"
LATENCY_MISSING = "latency_missing"
INVALID_INPUT = "invalid_input"  # a value no fleet can produce (negative, or beyond PLAUSIBLE)
REASONS = (SOURCE_UNAVAILABLE, RATE_MISSING, ISL_MISSING, OSL_MISSING, LATENCY_MISSING, INVALID_INPUT)

# Upper bounds of what a measurement can be, far beyond any fleet (not tuned: a value above one is
# garbage from the source, e.g. a misbehaving Prometheus or a proxy before it). Negative values are
# garbage too: a negative rate used to read as a measured zero load (scale in), and values near the
# float range overflowed inside the solver, failing the interval with an OverflowError.
PLAUSIBLE = {"request_rate": 1e6, "peak_rate": 1e6, "mean_isl": 1e8, "mean_osl": 1e8, "ttft_mean": 1e6,
             "ttft_p90": 1e6, "ttft_p99": 1e6, "itl_mean": 1e6, "itl_p90": 1e6}


def implausible(obs: Observation) -> str | None:
    """The first field of ``obs`` that no fleet can produce, described (None: all plausible)."""
    for name, bound in PLAUSIBLE.items():
        v = getattr(obs, name)
        if v is not None and not 0.0 <= v <= bound:
            return f"{name} = {v:g} (expected 0..{bound:g})"
    return None
# what a latency hold names: both places latency can come from (``metrics_source``) had none
NO_LATENCY_SOURCE = (" (sources tried: the gateway's streamed requests, and the engines' own TTFT/ITL histograms "
                     "through the gateway's scrape of their /metrics or Prometheus)")


@dataclass(frozen=True)
class Hold:
    reason: str  # one of REASONS
    detail: str


@dataclass
class _Seen:
    value: float
    at: float


class InputGate:
    """Remembers when each input was last measured; ``check`` returns the observation to plan on
    (lengths carried from their last fresh measurement when this window has none) or a ``Hold``."""

    def __init__(self, max_age_s: float, need_latency: bool = True) -> None:
        if max_age_s <= 0:
            raise ValueError("max_age_s must be > 0")
        self.max_age_s = max_age_s
        self.need_latency = need_latency
        self._seen: dict[str, _Seen] = {}

    def _remember(self, obs: Observation) -> None:
        for name in ("mean_isl", "mean_osl", "ttft_mean", "ttft_p90", "itl_mean", "itl_p90"):
            v = getattr(obs, name)
            if v is not None:
                self._seen[name] = _Seen(float(v), obs.at)

    def _fresh(self, name: str, now: float) -> float | None:
        s = self._seen.get(name)
        return s.value if s is not None and now - s.at <= self.max_age_s else None

    def _age(self, name: str, now: float) -> str:
        s = self._seen.get(name)
        return "never measured" if s is None else f"last measured {now - s.at:.0f} s ago (max age {self.max_age_s:g} s)"

    def check(self, obs: Observation, now: float) -> Observation | Hold:
        if obs.request_rate is None or obs.window_s <= 0:
            return Hold(RATE_MISSING, "no arrival rate measured this interval (first scrape primes the counters, "
                                      "or the gateway exports no dyad_request_arrivals_total)")
        bad = implausible(obs)
        if bad is not None:
            return Hold(INVALID_INPUT, f"the source reported {bad}: not a measurement, nothing to plan on")
        self._remember(obs)
        if obs.request_rate <= 0:
            return obs  # nothing arrived: a measured zero load, no lengths or latency needed
        isl, osl = self._fresh("mean_isl", now), self._fresh("mean_osl", now)
        if isl is None:
            return Hold(ISL_MISSING, f"requests arrive but their prompt length is {self._age('mean_isl', now)}")
        if osl is None:
            return Hold(OSL_MISSING, f"requests arrive but their output length is {self._age('mean_osl', now)}")
        if self.need_latency:
            if self._fresh("ttft_mean", now) is None and self._fresh("ttft_p90", now) is None:
                return Hold(LATENCY_MISSING, f"requests arrive but TTFT is {self._age('ttft_mean', now)}"
                                             f"{NO_LATENCY_SOURCE}")
            if osl > 1.5 and self._fresh("itl_mean", now) is None and self._fresh("itl_p90", now) is None:
                return Hold(LATENCY_MISSING, f"requests decode but ITL is {self._age('itl_mean', now)}"
                                             f"{NO_LATENCY_SOURCE}")
        # lengths carried over; latency is not (the correction compares it with this interval's load)
        return replace(obs, mean_isl=isl, mean_osl=osl)


def held_decision(planner: Planner, hold: Hold, obs: Observation | None, fleet: Sequence[WorkerView],
                  now: float) -> PlanDecision:
    """What a held interval decides: keep the current sizes; only drains the planner started earlier
    complete (stop or switch once idle). Used live (``PlannerService``) and in virtual time."""
    actions = planner.complete_drains(fleet)
    current = dict.fromkeys((r.value for r in ROLES), 0)
    pending = planner.draining()
    for w in fleet:
        if w.role in ROLES and w.state in ("starting", "healthy") and pending.get(w.id) != "stop":
            current[w.role.value] += 1
    return PlanDecision(at=now, observation=obs, forecast=None, sizing=None, desired=dict(current),
                        current=current, actions=actions, correction={}, predictors={},
                        reasons=[f"held ({hold.reason}): {hold.detail}"])
