"""Worker counts for the next interval: pure arithmetic over a forecast and a performance model.

prefill = ceil(rate * ISL * (1 - prefix_hit) / (prefill_throughput(uncached ISL) * rho_max))
    where rho_max is the utilization that keeps TTFT under its target (M/D/1, see perf_model);
decode  = ceil(rate * OSL / decode_throughput(ITL target, context = ISL + OSL/2))
This is Dynamo's SLA-planner arithmetic with queueing made explicit and the prefix cache credited.
Counts are then clamped to per-role minimum/maximum and fitted into the worker budget.
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
    budget: int = 8  # total workers (prefill + decode)
    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None

    def __post_init__(self) -> None:
        if self.min_prefill + self.min_decode > self.budget:
            raise ValueError(f"budget {self.budget} is below min_prefill + min_decode "
                             f"({self.min_prefill} + {self.min_decode})")


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


def solve(forecast: LoadForecast, perf: PerfModel, targets: Targets, limits: Limits,
          prefix_hit_ratio: float = 0.0, correction: LatencyCorrection | None = None) -> Sizing:
    corr = correction or LatencyCorrection()
    hit = min(0.99, max(0.0, prefix_hit_ratio))
    uncached = max(1.0, forecast.isl * (1.0 - hit))
    infeasible: list[str] = []

    rho = perf.max_prefill_utilization(uncached, targets.ttft_s, corr.ttft)
    if rho <= 0.0:
        infeasible.append("ttft")
        rho = perf.max_utilization  # cannot meet it; at least keep up with the load
    per_prefill = perf.prefill_throughput(uncached) / corr.ttft * rho
    p_exact = forecast.request_rate * uncached / per_prefill

    context = forecast.isl + forecast.osl / 2.0
    per_decode = perf.decode_throughput(targets.itl_s, context, corr.itl)
    if per_decode <= 0.0:
        infeasible.append("itl")
        per_decode = perf.max_utilization / (perf.decode_itl(1, context) * corr.itl)
    d_exact = forecast.request_rate * forecast.osl / per_decode

    p = _clamp(math.ceil(p_exact - 1e-9), limits.min_prefill, limits.max_prefill)
    d = _clamp(math.ceil(d_exact - 1e-9), limits.min_decode, limits.max_decode)
    over = p + d > limits.budget
    if over:
        p, d = fit_budget(p_exact, d_exact, limits)
    return Sizing(p, d, p_exact, d_exact, over, infeasible)


def fit_budget(p_exact: float, d_exact: float, limits: Limits) -> tuple[int, int]:
    """Share the budget in proportion to need (largest remainder), never below the per-role minimum."""
    total = max(p_exact + d_exact, 1e-9)
    share_p = limits.budget * p_exact / total
    p = _clamp(round(share_p), limits.min_prefill, limits.max_prefill)
    p = min(p, limits.budget - limits.min_decode)
    d = _clamp(limits.budget - p, limits.min_decode, limits.max_decode)
    return p, d
