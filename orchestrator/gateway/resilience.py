"""Isolation of failing workers: retry backoff with jitter and per-worker circuit breakers.

Both are decision logic (plain data, a ``now`` from the caller's clock, no I/O), used by the proxy:

* ``Backoff.delay(retry_no, rng)`` is how long to wait before the ``retry_no``-th retry of a request
  that has not sent a byte to its client yet: exponential (``base * 2**(retry_no - 1)``, capped),
  with "equal jitter" (half fixed, half random) so that the retries of many requests that failed
  together (an engine died under load) do not arrive together at the next worker.
* ``CircuitBreakers`` keeps one breaker per worker. The health loop notices a dead engine within
  ``health.failure_threshold * (interval_s + timeout_s)`` at most; a breaker reacts to what the traffic itself sees — an
  engine that accepts connections but answers 5xx, stalls, or breaks streams. Only worker-caused
  failures reach it (``classify.py``, ``attempt.py``): an engine 4xx, or the same 5xx on a second
  worker, is the request's doing and counts against nobody. ``failure_threshold`` consecutive
  worker-caused failures open it (the router skips the worker), after ``open_s`` it is
  half-open (up to ``half_open_probes`` requests at a time may try it), and ``success_threshold``
  successes close it again; a failure while half-open re-opens it for another ``open_s``.
* ``stall_budget`` / ``worked_since``: the stall watchdog's budget and its evidence of work, shared by
  decode tries (``attempt.py``) and P/D prefill legs (``disagg/executor.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from orchestrator.config import ResilienceConfig

if TYPE_CHECKING:
    from orchestrator.fleet.worker import Worker


def stall_budget(res: ResilienceConfig, prompt_tokens: int, queued_tokens: float) -> float:
    """How long a try may wait for its first sign of work before its worker is asked whether it is stalled:
    ``stall_timeout_s`` plus the prompt's and the worker's queued prefill at the slowest assumed rate."""
    return res.stall_timeout_s + (prompt_tokens + queued_tokens) / res.stall_prefill_tokens_per_s


def worked_since(worker: Worker, since: float, gen_at_start: float | None) -> bool:
    """Has ``worker`` done any work since ``since`` (a first token or a whole answer for any request, or
    generated tokens in its metrics scraped after ``since``, against ``gen_at_start`` read then)?"""
    if worker.last_progress_at is not None and worker.last_progress_at > since:
        return True
    gen = worker.load.generation_tokens
    return gen is not None and gen_at_start is not None and worker.load.scraped_at > since and gen > gen_at_start


@dataclass(frozen=True)
class Backoff:
    base_s: float = 0.05
    max_s: float = 1.0

    def delay(self, retry_no: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry_no`` (1 = the first retry); 0 for ``retry_no < 1``."""
        if retry_no < 1 or self.base_s <= 0:
            return 0.0
        ceiling = min(self.max_s, self.base_s * (2 ** min(retry_no - 1, 30)))
        r = (rng or random).random()
        return ceiling / 2 + r * ceiling / 2


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class Breaker:
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0  # consecutive failed attempts
    successes: int = 0  # consecutive successes while half-open
    opened_at: float = 0.0
    probes: int = 0  # requests in flight on a half-open worker


# Called with (worker_id, new_state) on every transition (metrics, logs).
BreakerListener = Callable[[str, BreakerState], None]


class CircuitBreakers:
    """One breaker per worker id, created on first use. See the module docstring for the states."""

    def __init__(self, failure_threshold: int = 5, open_s: float = 10.0, success_threshold: int = 2,
                 half_open_probes: int = 1, on_change: BreakerListener | None = None) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.success_threshold = success_threshold
        self.half_open_probes = half_open_probes
        self.on_change = on_change
        self._breakers: dict[str, Breaker] = {}
        self._not_closed: set[str] = set()  # fast path: nothing to check while every breaker is closed

    @classmethod
    def from_config(cls, config: ResilienceConfig, on_change: BreakerListener | None = None) -> CircuitBreakers:
        return cls(config.breaker_failure_threshold, config.breaker_open_s, config.breaker_success_threshold,
                   config.breaker_half_open_probes, on_change)

    @property
    def enabled(self) -> bool:
        return self.failure_threshold > 0

    def state(self, worker_id: str) -> BreakerState:
        b = self._breakers.get(worker_id)
        return b.state if b is not None else BreakerState.CLOSED

    def _get(self, worker_id: str) -> Breaker:
        b = self._breakers.get(worker_id)
        if b is None:
            b = self._breakers[worker_id] = Breaker()
        return b

    def _move(self, worker_id: str, b: Breaker, state: BreakerState, now: float) -> None:
        b.state = state
        b.successes = 0
        if state is BreakerState.OPEN:
            b.opened_at = now
            b.probes = 0
        if state is BreakerState.CLOSED:
            b.failures = 0
            b.probes = 0
            self._not_closed.discard(worker_id)
        else:
            self._not_closed.add(worker_id)
        if self.on_change is not None:
            self.on_change(worker_id, state)

    def blocked(self, now: float) -> frozenset[str]:
        """Worker ids that must not get a new request now (open, or half-open with its probes taken).
        Moves open breakers whose ``open_s`` has passed to half-open."""
        if not self._not_closed:
            return frozenset()
        out = set()
        for wid in list(self._not_closed):
            b = self._breakers[wid]
            if b.state is BreakerState.OPEN and now - b.opened_at >= self.open_s:
                self._move(wid, b, BreakerState.HALF_OPEN, now)
            if b.state is BreakerState.OPEN or (b.state is BreakerState.HALF_OPEN
                                                and b.probes >= self.half_open_probes):
                out.add(wid)
        return frozenset(out)

    def dispatched(self, worker_id: str) -> bool:
        """A request goes to ``worker_id``; True when it is a half-open probe (call ``probe_done`` after)."""
        if worker_id not in self._not_closed:
            return False
        b = self._breakers[worker_id]
        if b.state is BreakerState.HALF_OPEN:
            b.probes += 1
            return True
        return False

    def probe_done(self, worker_id: str) -> None:
        b = self._breakers.get(worker_id)
        if b is not None and b.probes > 0:
            b.probes -= 1

    def record_success(self, worker_id: str, now: float) -> None:
        if worker_id not in self._not_closed:
            b = self._breakers.get(worker_id)
            if b is not None:
                b.failures = 0
            return
        b = self._breakers[worker_id]
        if b.state is BreakerState.HALF_OPEN:
            b.successes += 1
            if b.successes >= self.success_threshold:
                self._move(worker_id, b, BreakerState.CLOSED, now)

    def record_failure(self, worker_id: str, now: float) -> None:
        if not self.enabled:
            return
        b = self._get(worker_id)
        b.failures += 1
        if b.state is BreakerState.HALF_OPEN:
            self._move(worker_id, b, BreakerState.OPEN, now)
        elif b.state is BreakerState.CLOSED and b.failures >= self.failure_threshold:
            self._move(worker_id, b, BreakerState.OPEN, now)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet."""
        self._breakers.pop(worker_id, None)
        self._not_closed.discard(worker_id)

    def snapshot(self) -> dict[str, str]:
        """worker id → state, for workers whose breaker is not closed (admin views, tests)."""
        return {wid: self._breakers[wid].state.value for wid in self._not_closed}
