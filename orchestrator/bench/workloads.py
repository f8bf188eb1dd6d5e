"""Seeded synthetic workloads with a daily load curve, for planner benchmarks.

A spec string names one (``dyad plan --trace synthetic:daily,peak=4,trough=0.5,seed=1``)::

    synthetic:<shape>[,key=value ...]

shapes
    ``daily``    one smooth day: trough at the start and end, peak in the middle (raised cosine)
    ``twopeak``  a working day: a morning peak, a dip at noon, a higher afternoon peak
    ``ramp``     trough → peak → trough in straight lines (a launch/spike day)
    ``spiky``    a low day (a quarter-height daily swell) with eight short spikes to the peak at seeded
                 random times, each about 1.5% of the day wide (batch jobs, retries, a viral link)
    ``decline``  peak at the start, a slow convex decline to the trough at the end (an evening)
    ``steps``    a staircase: trough, then three abrupt steps up to the peak and three down again, seven
                 levels at 0, 1/3, 2/3, 1, 2/3, 1/3, 0 of the swing, the step times seeded (each level
                 lasts 1/7 of the day ± 1/28): load that jumps within seconds, not along a curve

keys (defaults in ``DailySpec``)
    duration  seconds the compressed day lasts         peak, trough   request rate, req/s
    isl       mean input tokens (lognormal)            osl_ratio      mean output = osl_ratio × isl
    osl       mean output tokens (overrides osl_ratio) sigma          lognormal spread of lengths
    noise     per-minute multiplicative rate noise (lognormal sigma) seed   random seed

Arrivals are a non-homogeneous Poisson process (thinning) over the curve; lengths are independent
lognormals with the given means, capped at ``max_len``. No prefix sharing (no block ids).
Same spec → the same requests, on any machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields

from orchestrator.bench.traces import TraceRequest

PREFIX = "synthetic:"
SHAPES = ("daily", "twopeak", "ramp", "spiky", "decline", "steps")
STEP_LEVELS = (0.0, 1 / 3, 2 / 3, 1.0, 2 / 3, 1 / 3, 0.0)


@dataclass
class DailySpec:
    shape: str = "daily"
    duration: float = 3600.0
    peak: float = 4.0
    trough: float = 0.5
    isl: float = 1000.0
    osl_ratio: float = 4.0
    osl: float | None = None
    sigma: float = 0.5
    noise: float = 0.15
    max_len: int = 32768
    seed: int = 0

    def shape_at(self, x: float) -> float:
        """Load between trough (0) and peak (1) at fraction ``x`` of the day."""
        if self.shape == "daily":
            return 0.5 * (1.0 - math.cos(2.0 * math.pi * x))
        if self.shape == "twopeak":
            a = math.exp(-((x - 0.3) / 0.09) ** 2) * 0.75
            b = math.exp(-((x - 0.68) / 0.11) ** 2)
            return min(1.0, a + b)
        if self.shape == "ramp":
            return max(0.0, 1.0 - abs(2.0 * x - 1.0))
        if self.shape == "spiky":
            spikes = sum(math.exp(-((x - c) / 0.0075) ** 2) for c in self._spike_centres())
            return min(1.0, 0.25 * 0.5 * (1.0 - math.cos(2.0 * math.pi * x)) + spikes)
        if self.shape == "decline":
            return (1.0 - x) ** 1.5
        if self.shape == "steps":
            edges = self._step_edges()
            return STEP_LEVELS[sum(x >= e for e in edges)]
        raise ValueError(f"synthetic shape {self.shape!r}: choose from {', '.join(SHAPES)}")

    def _spike_centres(self) -> list[float]:
        rng = random.Random(self.seed * 7919 + 1)  # its own stream: the arrivals' draws stay as they were
        return [rng.uniform(0.05, 0.95) for _ in range(8)]

    def _step_edges(self) -> list[float]:
        """The six step times of ``steps``, as fractions of the day: k/7 each moved by up to ±1/28."""
        rng = random.Random(self.seed * 7919 + 2)  # its own stream, as ``_spike_centres``
        return [k / 7 + rng.uniform(-1 / 28, 1 / 28) for k in range(1, len(STEP_LEVELS))]

    def rate_at(self, t: float) -> float:
        return self.trough + (self.peak - self.trough) * self.shape_at(t / self.duration)


def parse_spec(spec: str) -> DailySpec:
    """``synthetic:daily,peak=4,seed=1`` → ``DailySpec`` (errors name the key)."""
    body = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    parts = [p.strip() for p in body.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"synthetic workload {spec!r}: name a shape ({', '.join(SHAPES)})")
    out = DailySpec(shape=parts[0])
    if out.shape not in SHAPES:
        raise ValueError(f"synthetic workload {spec!r}: unknown shape {out.shape!r} (choose from {', '.join(SHAPES)})")
    kinds = {f.name: f.type for f in fields(DailySpec)}
    for p in parts[1:]:
        key, sep, value = p.partition("=")
        if not sep or key not in kinds or key == "shape":
            raise ValueError(f"synthetic workload {spec!r}: unknown key {key!r} "
                             f"(keys: {', '.join(k for k in kinds if k != 'shape')})")
        try:
            v: float | int = int(value) if key in ("seed", "max_len") else float(value)
        except ValueError:
            raise ValueError(f"synthetic workload {spec!r}: {key} must be a number (got {value!r})") from None
        setattr(out, key, v)
    if out.duration <= 0 or out.peak <= 0 or out.trough < 0 or out.trough > out.peak:
        raise ValueError(f"synthetic workload {spec!r}: need duration > 0 and 0 <= trough <= peak")
    if out.isl < 1 or (out.osl is not None and out.osl < 1) or out.osl_ratio <= 0:
        raise ValueError(f"synthetic workload {spec!r}: isl/osl must be >= 1 and osl_ratio > 0")
    return out


def _lognormal(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2.0  # so the mean (before the cap) is ``mean``
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def generate(spec: DailySpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    minutes = int(spec.duration // 60) + 2
    wobble = [rng.lognormvariate(-spec.noise ** 2 / 2, spec.noise) if spec.noise > 0 else 1.0
              for _ in range(minutes)]
    bound = spec.peak * max(wobble)
    osl_mean = spec.osl if spec.osl is not None else spec.osl_ratio * spec.isl
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(bound)
        if t >= spec.duration:
            return out
        if rng.random() * bound > spec.rate_at(t) * wobble[int(t // 60)]:
            continue
        out.append(TraceRequest(index=len(out), arrival_s=t,
                                input_len=_lognormal(rng, spec.isl, spec.sigma, spec.max_len),
                                output_len=_lognormal(rng, osl_mean, spec.sigma, spec.max_len)))


def is_synthetic(path: str) -> bool:
    return path.startswith(PREFIX)


def load_synthetic(spec: str, *, time_scale: float = 1.0, scale_len: float = 1.0) -> list[TraceRequest]:
    """A spec string → trace requests (``time_scale`` < 1 compresses time, like ``--speed``)."""
    reqs = generate(parse_spec(spec))
    if time_scale != 1.0 or scale_len != 1.0:
        reqs = [TraceRequest(index=r.index, arrival_s=r.arrival_s * time_scale,
                             input_len=max(1, round(r.input_len * scale_len)),
                             output_len=max(1, round(r.output_len * scale_len))) for r in reqs]
    return reqs
