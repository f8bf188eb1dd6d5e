"""Percentiles of raw samples: the one definition the benchmarks, the simulator and the scripts use.

``percentile(values, q)`` interpolates linearly between the two nearest ranks (numpy's default
method, ``q`` in [0, 100]). It needs every sample. A quantile of a Prometheus histogram is a
different estimate, made from bucket counts only: ``adapters.base.Histogram.quantile`` interpolates
inside a bucket as PromQL's ``histogram_quantile`` does, and is exact only at bucket bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``values``, linearly interpolated; ``None`` when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
