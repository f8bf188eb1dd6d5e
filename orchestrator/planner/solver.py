"""Worker counts for the next interval: pure arithmetic over a forecast and a performance model.

prefill = ceil(rate * ISL * (1 - prefix_hit) / (prefill_throughput(uncached ISL) * rho_max))
    where rho_max is the utilization that keeps TTFT under its target (M/D/1, see perf_model);
decode  = ceil(rate * OSL / decode_throughput(ITL target, context = ISL + OSL/2))
This is Dynamo's SLA-planner arithmetic with queueing made explicit and the prefix cache credited.
Prefill and decode may run on different hardware: each role has its own performance model
(``decode_perf``) and its own price per worker-hour. Counts are clamped to per-role minimum/maximum
and fitted into the worker budget and, when one is set, the money budget (``Limits.cost_budget``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from orchestrator.planner.perf_model import LatencyCorrection, PerfModel
from orchestrator.planner.predictors import LoadForecast


@dataclass
class Targets:
    ttft_s: float = 0.5
    itl_s: float = 0.05


@dataclass
class Limits:
    budget: int = 8  # total workers (prefill + decode, standby included)
    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None
    prefill_cost: float = 1.0  # price of one prefill worker-hour (any currency)
    decode_cost: float = 1.0  # price of one decode worker-hour
    cost_budget: float | None = None  # most spent per hour on the fleet (None: only the worker budget)

    def __post_init__(self) -> None:
        if self.min_prefill + self.min_decode > self.budget:
            raise ValueError(f"budget {self.budget} is below min_prefill + min_decode "
                             f"({self.min_prefill} + {self.min_decode})")
        if self.prefill_cost < 0 or self.decode_cost < 0:
            raise ValueError("prefill_cost and decode_cost must be >= 0")
        if self.cost_budget is not None and self.cost(self.min_prefill, self.min_decode) > self.cost_budget:
            raise ValueError(f"cost_budget {self.cost_budget} per hour is below the minimum fleet's "
                             f"{self.cost(self.min_prefill, self.min_decode)}")

    def cost(self, prefill: float, decode: float) -> float:
        """Price per hour of a fleet of ``prefill`` + ``decode`` workers."""
        return prefill * self.prefill_cost + decode * self.decode_cost

    def fits(self, prefill: int, decode: int) -> bool:
        return prefill + decode <= self.budget and (
            self.cost_budget is None or self.cost(prefill, decode) <= self.cost_budget + 1e-9)


@dataclass
class Sizing:
    prefill: int
    decode: int
    prefill_exact: float  # fractional need before rounding and limits
    decode_exact: float
    over_budget: bool = False
    infeasible: list[str] = field(default_factory=list)  # targets no worker count can meet


def _clamp(n: int, lo: int, hi: int | None) -> int:
    return max(lo, n if hi is None else min(hi, n))


def prefill_need(rate: float, isl: float, perf: PerfModel, targets: Targets, prefix_hit_ratio: float = 0.0,
                 correction: float = 1.0) -> tuple[float, bool]:
    """Fractional prefill workers for ``rate`` req/s of ``isl`` tokens, and whether TTFT is reachable."""
    hit = min(0.99, max(0.0, prefix_hit_ratio))
    uncached = max(1.0, isl * (1.0 - hit))
    rho = perf.max_prefill_utilization(uncached, targets.ttft_s, correction)
    ok = rho > 0.0
    if not ok:
        rho = perf.max_utilization  # cannot meet it; at least keep up with the load
    per_prefill = perf.prefill_throughput(uncached) / correction * rho
    return rate * uncached / per_prefill, ok


def decode_need(rate: float, isl: float, osl: float, perf: PerfModel, targets: Targets,
                correction: float = 1.0) -> tuple[float, bool]:
    """Fractional decode workers for ``rate`` req/s of ``osl`` output tokens, and whether ITL is reachable."""
    context = isl + osl / 2.0
    per_decode = perf.decode_throughput(targets.itl_s, context, correction, kv_context=isl + osl)
    ok = per_decode > 0.0
    if not ok:
        per_decode = perf.max_utilization / (perf.decode_itl(1, context) * correction)
    return rate * osl / per_decode, ok


def solve(forecast: LoadForecast, perf: PerfModel, targets: Targets, limits: Limits,
          prefix_hit_ratio: float = 0.0, correction: LatencyCorrection | None = None,
          decode_perf: PerfModel | None = None) -> Sizing:
    corr = correction or LatencyCorrection()
    infeasible: list[str] = []
    p_exact, ok = prefill_need(forecast.request_rate, forecast.isl, perf, targets, prefix_hit_ratio, corr.ttft)
    if not ok:
        infeasible.append("ttft")
    d_exact, ok = decode_need(forecast.request_rate, forecast.isl, forecast.osl, decode_perf or perf, targets,
                              corr.itl)
    if not ok:
        infeasible.append("itl")
    p = _clamp(math.ceil(p_exact - 1e-9), limits.min_prefill, limits.max_prefill)
    d = _clamp(math.ceil(d_exact - 1e-9), limits.min_decode, limits.max_decode)
    over = not limits.fits(p, d)
    if over:
        p, d = fit_budget(p_exact, d_exact, limits)
    return Sizing(p, d, p_exact, d_exact, over, infeasible)


def fit_budget(p_exact: float, d_exact: float, limits: Limits) -> tuple[int, int]:
    """Share the budget in proportion to need (largest remainder), never below the per-role minimum;
    then, with a money budget, give back the worker whose role is the most over-served until it fits."""
    total = max(p_exact + d_exact, 1e-9)
    share_p = limits.budget * p_exact / total
    p = _clamp(round(share_p), limits.min_prefill, limits.max_prefill)
    p = min(p, limits.budget - limits.min_decode)
    d = _clamp(limits.budget - p, limits.min_decode, limits.max_decode)
    while not limits.fits(p, d):
        can_p, can_d = p > limits.min_prefill, d > limits.min_decode
        if not (can_p or can_d):
            break
        # cut where one worker less leaves the most of the need covered (ties: the dearer role)
        cover_p = (p - 1) / max(p_exact, 1e-9) if can_p else -math.inf
        cover_d = (d - 1) / max(d_exact, 1e-9) if can_d else -math.inf
        if cover_p > cover_d or (cover_p == cover_d and limits.prefill_cost >= limits.decode_cost):
            p -= 1
        else:
            d -= 1
    return p, d
