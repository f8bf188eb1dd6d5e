"""What one worker can do, from a profiling sweep, corrected by what the fleet actually shows.

A profile is JSON (written by ``dyad profile``)::

    {"version": 1, "source": "...", "kv_capacity_tokens": 400000,
     "prefill": [{"isl": 512, "ttft_s": 0.04}, ...],            # one request alone on an idle engine
     "decode":  [{"concurrency": 8, "context": 1024, "itl_s": 0.013}, ...]}

Prefill throughput at an input length is ``isl / ttft``; decode throughput at a concurrency and
context is ``concurrency / itl``. Between sweep points the model interpolates linearly and beyond
them it extrapolates from the last two points, so a coarse sweep still answers everywhere.

Queueing: a prefill worker is modelled as a single server with deterministic service time S
(M/D/1). Mean wait is ``rho*S / (2*(1-rho))``; ``tail_factor`` scales it towards a percentile
target. Solving for the highest utilization that keeps TTFT under the target gives a closed form
(``max_prefill_utilization``).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ProfileError(ValueError):
    """The profile file is missing, unreadable or malformed; the message names the field."""


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs sorted, distinct), linear extrapolation at both ends."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class PerfModel:
    prefill_isl: list[float]
    prefill_ttft: list[float]
    decode_contexts: list[float]  # sorted distinct contexts
    decode_curves: dict[float, tuple[list[float], list[float]]]  # context → (concurrencies, itls)
    kv_capacity_tokens: float | None = None
    max_concurrency: int = 1024
    tail_factor: float = 2.0  # wait multiplier: percentile targets vs the M/D/1 mean wait
    max_utilization: float = 0.85
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    # ---------- construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PerfModel:
        if not isinstance(d, dict):
            raise ProfileError("profile: the top level must be an object")
        pre = d.get("prefill")
        dec = d.get("decode")
        if not isinstance(pre, list) or not pre:
            raise ProfileError("profile.prefill: a non-empty list of {isl, ttft_s} is required")
        if not isinstance(dec, list) or not dec:
            raise ProfileError("profile.decode: a non-empty list of {concurrency, context, itl_s} is required")
        pts: dict[float, float] = {}
        for i, p in enumerate(pre):
            try:
                isl, ttft = float(p["isl"]), float(p["ttft_s"])
            except (KeyError, TypeError, ValueError) as e:
                raise ProfileError(f"profile.prefill.{i}: needs numeric isl and ttft_s ({e})") from None
            if isl <= 0 or ttft <= 0:
                raise ProfileError(f"profile.prefill.{i}: isl and ttft_s must be positive")
            pts[isl] = ttft
        xs = sorted(pts)
        curves: dict[float, dict[float, float]] = {}
        for i, p in enumerate(dec):
            try:
                c, ctx, itl = float(p["concurrency"]), float(p["context"]), float(p["itl_s"])
            except (KeyError, TypeError, ValueError) as e:
                raise ProfileError(f"profile.decode.{i}: needs numeric concurrency, context and itl_s ({e})") from None
            if c < 1 or ctx <= 0 or itl <= 0:
                raise ProfileError(f"profile.decode.{i}: concurrency >= 1, context > 0 and itl_s > 0 required")
            curves.setdefault(ctx, {})[c] = itl
        dcurves = {ctx: (sorted(v), [v[k] for k in sorted(v)]) for ctx, v in curves.items()}
        kv = d.get("kv_capacity_tokens")
        return cls(prefill_isl=xs, prefill_ttft=[pts[x] for x in xs], decode_contexts=sorted(dcurves),
                   decode_curves=dcurves, kv_capacity_tokens=float(kv) if kv else None,
                   max_concurrency=int(d.get("max_concurrency", 1024)), source=str(d.get("source", "")),
                   meta={k: v for k, v in d.items() if k not in ("prefill", "decode")})

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ProfileError(f"cannot read profile {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"profile {path}: not valid JSON ({e})") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.meta)
        out.update({
            "version": 1, "source": self.source,
            "prefill": [{"isl": x, "ttft_s": y} for x, y in zip(self.prefill_isl, self.prefill_ttft, strict=True)],
            "decode": [{"concurrency": c, "context": ctx, "itl_s": itl}
                       for ctx in self.decode_contexts
                       for c, itl in zip(*self.decode_curves[ctx], strict=True)],
            "max_concurrency": self.max_concurrency,
        })
        if self.kv_capacity_tokens:
            out["kv_capacity_tokens"] = self.kv_capacity_tokens
        return out

    # ---------- prefill
    def prefill_time(self, isl: float) -> float:
        """Seconds to prefill ``isl`` uncached tokens on an idle worker (floored at the smallest sweep point's share)."""
        t = _interp(self.prefill_isl, self.prefill_ttft, max(1.0, isl))
        floor = self.prefill_ttft[0] * min(1.0, max(1.0, isl) / self.prefill_isl[0])
        return max(t, floor, 1e-6)

    def prefill_throughput(self, isl: float) -> float:
        """Tokens per second one prefill worker sustains on requests of ``isl`` uncached tokens."""
        return max(1.0, isl) / self.prefill_time(isl)

    def max_prefill_utilization(self, isl: float, ttft_target: float, correction: float = 1.0) -> float:
        """Highest utilization rho at which TTFT stays under the target (0 when even an idle worker misses it)."""
        s = self.prefill_time(isl) * correction
        if s >= ttft_target:
            return 0.0
        r = 2.0 * (ttft_target / s - 1.0) / self.tail_factor
        return min(self.max_utilization, r / (1.0 + r))

    def expected_ttft(self, rate: float, isl: float, workers: int, tail: float | None = None) -> float:
        """Model TTFT for ``rate`` req/s of ``isl`` uncached tokens over ``workers``.

        ``tail=1`` gives the mean (what corrections compare against); the default, ``tail_factor``,
        approximates the percentile the target is about.
        """
        k = self.tail_factor if tail is None else tail
        s = self.prefill_time(isl)
        if workers <= 0:
            return math.inf
        rho = rate * s / workers
        if rho >= 1.0:
            return math.inf
        return s * (1.0 + k * rho / (2.0 * (1.0 - rho)))

    # ---------- decode
    def decode_itl(self, concurrency: float, context: float) -> float:
        c = max(1.0, concurrency)
        ctxs = self.decode_contexts
        vals = [_interp(*self.decode_curves[x], c) for x in ctxs]
        return max(1e-6, _interp(ctxs, vals, context) if len(ctxs) > 1 else vals[0])

    def max_decode_concurrency(self, itl_target: float, context: float, correction: float = 1.0,
                               kv_context: float | None = None) -> int:
        """Largest concurrency whose ITL (corrected) meets the target and whose KV fits; 0 if none.

        ``context`` is the mean context a step attends over (ITL); ``kv_context`` (default: the same)
        the tokens a stream's KV must hold: the planner passes a stream's final length (ISL + OSL),
        since long outputs live longest and hold the most KV (a pool sized on the mean context runs out
        of KV and preempts)."""
        cap = self.max_concurrency
        if self.kv_capacity_tokens:
            cap = min(cap, int(self.kv_capacity_tokens // max(1.0, kv_context or context)))
        if cap < 1 or self.decode_itl(1, context) * correction > itl_target:
            return 0
        lo, hi = 1, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_itl(mid, context) * correction <= itl_target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def decode_batch_cap(self, context: float) -> int:
        """Most streams one decode worker can hold at ``context`` tokens each: the batch cap
        (``max_concurrency``, vLLM's max_num_seqs) or the KV capacity, whichever binds first."""
        cap = self.max_concurrency
        if self.kv_capacity_tokens:
            cap = min(cap, int(self.kv_capacity_tokens // max(1.0, context)))
        return max(1, cap)

    def decode_throughput(self, itl_target: float, context: float, correction: float = 1.0,
                          kv_context: float | None = None) -> float:
        """Output tokens/s one decode worker sustains while every stream keeps the ITL target."""
        c = self.max_decode_concurrency(itl_target, context, correction, kv_context)
        if c == 0:
            return 0.0
        return self.max_utilization * c / (self.decode_itl(c, context) * correction)


@dataclass
class LatencyCorrection:
    """Observed/expected latency factors, smoothed, one per role; multiply the model's latencies.

    Dynamo's planner does the same (actual/expected TTFT and ITL). Each factor is bounded by what
    the model can explain:

    - ``ttft`` (prefill) is capped at ``ttft_hi`` = 1 by default, as Dynamo caps its prefill
      correction: a TTFT above the model's includes time the prefill model does not describe (KV
      transfer, the decode side's first step, burst queueing the solver already sizes for through
      the burst floor), and folding that into the prefill service time would grow the prefill pool
      for a decode problem. Below 1 it credits what the model misses (prefix hits, a faster engine).
    - ``itl`` (decode) may go both ways within [``lo``, ``itl_hi``]: ITL is measured per token of
      running streams, so it is a property of the decode pool alone.

    The planner learns each only from intervals in which that role's serving workers did not change
    (a worker still starting takes no traffic, and counting it would make the pool look slow).
    """

    ttft: float = 1.0
    itl: float = 1.0
    alpha: float = 0.5
    lo: float = 0.5
    ttft_hi: float = 1.0
    itl_hi: float = 2.0

    @staticmethod
    def _blend(old: float, ratio: float, alpha: float, lo: float, hi: float) -> float:
        ratio = min(hi, max(lo, ratio))
        return min(hi, max(lo, alpha * ratio + (1 - alpha) * old))

    def update(self, *, observed_ttft: float | None = None, expected_ttft: float | None = None,
               observed_itl: float | None = None, expected_itl: float | None = None) -> None:
        if observed_ttft and expected_ttft and math.isfinite(expected_ttft) and expected_ttft > 0:
            self.ttft = self._blend(self.ttft, observed_ttft / expected_ttft, self.alpha, self.lo, self.ttft_hi)
        if observed_itl and expected_itl and math.isfinite(expected_itl) and expected_itl > 0:
            self.itl = self._blend(self.itl, observed_itl / expected_itl, self.alpha, self.lo, self.itl_hi)
