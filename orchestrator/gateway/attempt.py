"""One try of a request on one worker (or one prefill/decode pair): its accounting, from start to end.

An ``Attempt`` is created when a routing decision is dispatched and owns, until it ends, everything
that try changes: the router's in-flight ledger (``Router.begin`` / ``first_token`` / ``finish``),
the worker's circuit breaker (half-open probe slot, success or failure), the upstream-error metric
and the fleet's view of the worker (marked failed when it looks down). It ends exactly once, with a
classified outcome (``classify.py``):

* ``ok`` — answered (a 4xx the engine gives for this request's own fault is also "ok" for the worker);
* ``worker`` — the worker is at fault (connect error, stall, a reset, garbage or 5xx the same request does
  not get elsewhere): the breaker counts it, and ``down=True`` takes the worker out of rotation now;
* ``request`` — the request is at fault (an engine 4xx, the same error on a second worker, a slow
  answer while the worker serves others): nothing counts against the worker;
* ``cancelled`` — the client left, or the gateway gave up on it.

Attempts register in ``AttemptRegistry`` by worker, so a worker the health loop marks down can fail
its in-flight attempts over at once (``abort``), instead of leaving their clients to a timeout. A stream
that is demonstrably progressing (a data event within the fleet's serving window) is left to finish: it
breaks by itself if the engine really died (and is continued elsewhere then), and once it goes quiet that
long while its worker is still down it is pulled as well (``AttemptRegistry.sweep``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx

from orchestrator.fleet.worker import WorkerState
from orchestrator.gateway.resilience import stall_budget, worked_since
from orchestrator.router.types import RouteDecision, RouteRequest

if TYPE_CHECKING:
    from orchestrator.gateway.runtime import GatewayRuntime

OK = "ok"
WORKER = "worker"
REQUEST = "request"
CANCELLED = "cancelled"


class Attempt:
    __slots__ = ("rt", "req", "decision", "response", "started", "gen_at_start", "task", "aborted", "outcome",
                 "stalled", "abortable", "_probe", "deadline", "_first", "progress", "spared")

    def __init__(self, rt: GatewayRuntime, req: RouteRequest, decision: RouteDecision, task: Any = None) -> None:
        """``task``: what ``abort`` cancels (``.cancel()``, ``.done()``): the current asyncio task unless given
        (the native data plane passes its request's cancel handle: native/lane.py)."""
        self.rt = rt
        self.req = req
        self.decision = decision
        self.response: httpx.Response | None = None
        self.started = rt.clock.now()
        self.gen_at_start = decision.worker.load.generation_tokens
        self.task = task if task is not None else asyncio.current_task()
        self.aborted: str | None = None  # why the gateway pulled this attempt (worker marked down)
        self.outcome: str | None = None
        self.stalled = False
        self.abortable = True  # False once the answer is complete (nothing left to fail over)
        self._first = False
        self.deadline: float | None = None  # stall check due (clock time); None = not watched
        self.progress: Any = None  # its stream's idle timer (failover.IdleTimer: ``quiet_for``), once relayed
        self.spared: tuple[str, float] | None = None  # (reason, window): left running on a worker marked down
        rt.router.begin(decision, req)
        self._probe = rt.breakers.dispatched(decision.worker.id)
        rt.attempts.add(self)

    @property
    def worker_id(self) -> str:
        return self.decision.worker.id

    def workers(self) -> Iterator[tuple[str, str]]:
        """(worker id, role) of this attempt's legs, as the access log records them."""
        d = self.decision
        if d.prefill_worker is not None:
            yield d.prefill_worker.id, "prefill"
            yield d.worker.id, "decode"
        else:
            yield d.worker.id, "both"

    # --- progress -----------------------------------------------------------------------------

    def stall_budget(self) -> float:
        """How long to wait for the first byte before asking whether the worker is stalled: the base
        ``resilience.stall_timeout_s`` plus this prompt's and the worker's queued prefill at the
        slowest assumed rate (``stall_prefill_tokens_per_s``)."""
        return stall_budget(self.rt.config.resilience, self.req.prompt_tokens,
                            self.decision.worker.queued_prefill_tokens)

    def watch(self) -> None:
        """Start the stall watchdog (until ``first_token``): past the budget, a worker that did no
        work since this attempt started is stalled and the attempt is pulled (``abort``); a worker
        that is busy with other requests is checked again one ``stall_timeout_s`` later. The checks
        run in ``AttemptRegistry.sweep`` (one runtime loop for all attempts: no timer per request)."""
        self.deadline = self.started + self.stall_budget()

    def check_stall(self, now: float) -> None:
        """Called by the sweep once ``deadline`` has passed."""
        if self.outcome is not None or self.aborted is not None or self._first:
            self.deadline = None
            return
        if self.worker_progressed():
            self.started = now  # progress is judged per window from here on
            self.gen_at_start = self.decision.worker.load.generation_tokens
            self.deadline = now + self.rt.config.resilience.stall_timeout_s
            return
        self.deadline = None
        self.stalled = True
        self.abort(f"worker {self.worker_id} did no work for {now - self.started:.1f} s (stalled)")

    def unwatch(self) -> None:
        self.deadline = None

    def first_token(self) -> None:
        """Prefill is over; the worker is alive (once per attempt: later calls cost one check)."""
        if self._first:
            return
        self._first = True
        self.unwatch()
        now = self.rt.clock.now()
        self.decision.worker.last_progress_at = now
        self.rt.router.first_token(self.decision, self.req)

    def quiet_for(self) -> float | None:
        """Seconds since this try's stream last delivered a data event (after its first token); None when it
        has delivered none yet, or is no stream being relayed. Read only when asked: no cost per chunk."""
        if not self._first or self.progress is None or self.outcome is not None:
            return None
        return self.progress.quiet_for()

    def worker_progressed(self) -> bool:
        """Has the worker done any work since this attempt started (for another request, or by its
        engine's generated-token counter)? Tells a stalled worker from a slow request.

        Under P/D the request first waits on its prefill leg (disagg/executor.py), which has its own
        bound (``disagg.prefill_timeout_s``, then the decode worker prefills locally): while it runs
        the decode worker has nothing to do for this request, so its idleness is no stall; once the
        leg has ended the decode worker gets a window of its own."""
        d = self.decision
        if d.prefill_legs > 0 or (d.prefill_ended_at is not None and d.prefill_ended_at > self.started):
            return True
        return worked_since(d.worker, self.started, self.gen_at_start)

    # --- the end ------------------------------------------------------------------------------

    def succeeded(self) -> None:
        if self.outcome is not None:
            return
        now = self.rt.clock.now()
        self.rt.breakers.record_success(self.worker_id, now)
        self.decision.worker.last_progress_at = now
        self._end(OK, True)

    def request_failed(self, *, alive: bool = False) -> None:
        """The request's own fault (or not yet attributable): nothing counts against the worker.
        ``alive``: the worker answered (an engine 4xx), which is a success for its breaker."""
        if alive and self.outcome is None:
            self.rt.breakers.record_success(self.worker_id, self.rt.clock.now())
        self._end(REQUEST, False)

    def worker_failed(self, kind: str, message: str, *, down: bool = False) -> None:
        """The worker's fault: count it in its breaker; ``down`` takes it out of rotation now."""
        if self.outcome is not None:
            return
        rt = self.rt
        now = rt.clock.now()
        rt.metrics.upstream_errors.labels(self.worker_id, kind).inc()
        rt.breakers.record_failure(self.worker_id, now)
        self._end(WORKER, False)  # (before mark_failed: its listeners abort the worker's attempts)
        if down:
            rt.fleet.mark_failed(self.decision.worker, now, message)

    def cancelled(self) -> None:
        self._end(CANCELLED, False)

    def _end(self, outcome: str, ok: bool) -> None:
        if self.outcome is not None:
            return
        self.unwatch()
        self.outcome = outcome
        rt = self.rt
        rt.router.finish(self.decision, self.req, ok=ok)
        if self._probe:
            rt.breakers.probe_done(self.worker_id)
        rt.attempts.discard(self)

    def abort(self, reason: str) -> None:
        """Pull the attempt now (its worker was marked down): the proxy sees the cancellation, fails
        this attempt over to another worker, or ends the answer with an error."""
        if (self.outcome is None and self.abortable and self.aborted is None and self.task is not None
                and not self.task.done()):
            self.aborted = reason
            self.task.cancel()


class AttemptRegistry:
    """Attempts in flight, by worker id (what a worker marked down fails over)."""

    def __init__(self) -> None:
        self._by_worker: dict[str, set[Attempt]] = {}

    def add(self, attempt: Attempt) -> None:
        # By the worker that answers (decode, or the only one): a prefill worker that goes down mid-request is
        # the P/D executor's to handle (local prefill on the decode worker, or another prefill worker).
        self._by_worker.setdefault(attempt.decision.worker.id, set()).add(attempt)

    def discard(self, attempt: Attempt) -> None:
        wid = attempt.decision.worker.id
        s = self._by_worker.get(wid)
        if s is not None:
            s.discard(attempt)
            if not s:
                del self._by_worker[wid]

    def on_worker(self, worker_id: str) -> list[Attempt]:
        return list(self._by_worker.get(worker_id, ()))

    def quiet_for(self, worker_id: str) -> float | None:
        """Seconds since any stream on ``worker_id`` last delivered a data event (None: no stream on it has
        delivered one): evidence the engine is up, whatever its health probe says."""
        best: float | None = None
        for a in self._by_worker.get(worker_id, ()):
            q = a.quiet_for()
            if q is not None and (best is None or q < best):
                best = q
        return best

    def abort_worker(self, worker_id: str, reason: str, spare_within: float | None = None) -> int:
        """Pull every attempt on ``worker_id``; returns how many. ``spare_within``: a stream that delivered a
        data event within this many seconds is left running (``spared``) and pulled by the sweep only once it
        has been quiet that long while its worker is still out of rotation."""
        pulled = 0
        for a in self.on_worker(worker_id):
            if spare_within is not None:
                q = a.quiet_for()
                if q is not None and q < spare_within:
                    a.spared = (reason, spare_within)
                    continue
            a.abort(reason)
            pulled += 1
        return pulled

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_worker.values())

    def sweep(self, now: float) -> None:
        """Run the due stall checks (``Attempt.watch``), and pull a stream left running on a worker marked
        down (``abort_worker``'s ``spare_within``) once it has gone quiet (back in rotation: no longer watched)."""
        for attempts in list(self._by_worker.values()):
            for a in list(attempts):
                if a.deadline is not None and now >= a.deadline:
                    a.check_stall(now)
                if a.spared is not None:
                    reason, within = a.spared
                    if a.decision.worker.state is WorkerState.HEALTHY:
                        a.spared = None
                    else:
                        q = a.quiet_for()
                        if q is None or q >= within:
                            a.spared = None
                            a.abort(reason)

    async def run(self, clock: Any, interval_s: float = 0.25) -> None:
        """The sweep loop (a runtime task)."""
        while True:
            await asyncio.sleep(interval_s)
            if self._by_worker:
                self.sweep(clock.now())


def aborted_by_gateway(attempt: Attempt | None) -> bool:
    """True when a CancelledError now in flight is the gateway pulling ``attempt`` (not the client
    leaving); the cancellation is then consumed (``uncancel``)."""
    if attempt is None or attempt.aborted is None:
        return False
    task: Any = attempt.task
    if task is not None:
        task.uncancel()
    return True
