"""Clocks: decision code asks a Clock for the time instead of reading the wall clock.

The router, the prefix index and the planner take a ``Clock`` so the same code runs live
(``MonotonicClock``) and inside the virtual-time simulator (``VirtualClock``), where time moves
only when the simulator advances it.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (origin unspecified)."""
        ...


class MonotonicClock:
    """The live clock: ``time.monotonic()`` (called directly: ``now`` is the builtin, no Python frame;
    the request path reads the clock about ten times per request)."""

    now = staticmethod(time.monotonic)


class VirtualClock:
    """A clock that only moves when told to; used by the virtual-time simulator and tests."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a virtual clock cannot go backwards")
        self._t += seconds
        return self._t

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError("a virtual clock cannot go backwards")
        self._t = float(t)


SYSTEM_CLOCK = MonotonicClock()
