"""The Router: the one place a request meets the fleet. Usable without the HTTP server (the virtual
fleet drives it the same way the gateway does).

Public API — an annotated request in, a decision out, plus the accounting calls:

* ``await annotate(req, body, endpoint)`` — once per request: the prefix tracker (when one is plugged
  in) fills ``req`` with token ids, block hashes, per-worker cache overlaps and other replicas' load;
* ``await decide(req, exclude=())`` — once per try: candidates (healthy, serving the model, able to
  decode, not in ``exclude``; when none is healthy, the workers out only for probes that timed out,
  ``FleetRegistry.last_resort``), the prefixes each is computing right now (``inflight``), the pure
  policy's ``choose(req, candidates, now)``; raises ``NoHealthyWorker`` when there is no candidate;
* ``await route(req, body, endpoint, exclude=())`` — both, for callers that route a request once;
* ``begin(decision, req)`` / ``first_token(decision, req)`` / ``finish(decision, req, ok)`` — the
  in-flight ledger policies read (the gateway calls them through ``gateway/attempt.py`` only).

The I/O (tokenization, index lookups) is the tracker's; the choice is the policy's; the Router
only sequences them, so the same Router runs in the virtual-time simulator with a ``VirtualClock``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

from adapters.base import Role
from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.errors import NoHealthyWorker
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.router.inflight import InflightLedger
from orchestrator.router.types import RouteDecision, RouteRequest, RoutingPolicy
from orchestrator.telemetry.children import child
from orchestrator.telemetry.metrics import DyadMetrics

RECENT_DECISIONS = 200
LAST_RESORT_LOG_S = 60.0  # at most one log line a minute per model while it is served by last resort

log = logging.getLogger(__name__)


class PrefixTracker(Protocol):
    """What the kv package plugs in (``on_finished`` is optional)."""

    async def annotate(self, req: RouteRequest, body: dict[str, Any], endpoint: str,
                       candidates: list[Worker]) -> RouteRequest: ...

    async def on_routed(self, req: RouteRequest, decision: RouteDecision, now: float) -> None: ...

    # optional: def on_first_token(self, req, decision, now: float) -> None (sync or async)
    # optional: def on_finished(self, req, decision, ok: bool, now: float) -> None (sync or async)


class Router:
    def __init__(self, policy: RoutingPolicy, fleet: FleetRegistry, clock: Clock | None = None,
                 metrics: DyadMetrics | None = None, prefix_tracker: PrefixTracker | None = None,
                 retry_after_s: int = 1) -> None:
        self.policy = policy
        self.fleet = fleet
        self.clock = clock or SYSTEM_CLOCK
        self.metrics = metrics
        self.prefix_tracker = prefix_tracker
        self.retry_after_s = retry_after_s
        self.recent_decisions: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)
        # Prefill dispatched and not yet done, per worker: tokens (released exactly) and prefixes in flight.
        self.inflight = InflightLedger()
        self._background: set[asyncio.Future[Any]] = set()
        self._metric_children: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._last_resort_logged: dict[str, float] = {}  # model -> when it was last logged (configured models)

    def candidates(self, model: str, exclude: Iterable[str] = ()) -> list[Worker]:
        """Workers that may take a try for ``model``: healthy ones able to decode it; when there is none, the
        fleet's last resort (``health.last_resort``: workers out only because their probes timed out). Then
        ``exclude`` is left out: a retry does not turn to the last resort while a healthy worker exists."""
        found = self.fleet.candidates(model, Role.DECODE)
        if not found and self.fleet.health.last_resort:
            found = self.fleet.last_resort(model, Role.DECODE)
        if exclude:
            skip = set(exclude)
            found = [w for w in found if w.id not in skip]
        return found

    def _scope(self, model: str, candidates: list[Worker]) -> list[Worker]:
        """The workers a decision may involve: the candidates, plus the prefill pool under P/D."""
        if any(w.role is Role.DECODE for w in candidates):  # P/D: prefill workers' load and overlaps steer the pair
            return candidates + [w for w in self.fleet.candidates(model, Role.PREFILL) if w.role is Role.PREFILL]
        return candidates

    def _no_candidate(self, req: RouteRequest) -> NoHealthyWorker:
        if self.metrics is not None:
            self.metrics.routing_decisions.labels(self.policy.name, "no_candidate").inc()
        served = any(req.model in w.models for w in self.fleet.workers())
        reason = "every worker serving it is unhealthy, draining or already failed this request" \
            if served else "no worker serves it"
        return NoHealthyWorker(req.model, retry_after=self.retry_after_s, reason=reason)

    async def annotate(self, req: RouteRequest, body: dict[str, Any], endpoint: str) -> RouteRequest:
        """Once per request: ``req`` with what the prefix tracker (when there is one) finds — token ids,
        block hashes, per-worker cached-prefix overlaps, other replicas' load. Never raises for lack of workers."""
        tracker = self.prefix_tracker
        if tracker is None:
            return req
        candidates = self.candidates(req.model)
        if candidates:
            return await tracker.annotate(req, body, endpoint, self._scope(req.model, candidates))
        return req

    async def route(self, req: RouteRequest, body: dict[str, Any], endpoint: str,
                    exclude: Iterable[str] = ()) -> RouteDecision:
        """``annotate`` then ``decide`` (one call, for callers that route a request once)."""
        if not self.candidates(req.model, exclude):
            raise self._no_candidate(req)
        return await self.decide(await self.annotate(req, body, endpoint), exclude)

    async def decide(self, req: RouteRequest, exclude: Iterable[str] = ()) -> RouteDecision:
        """Pick the worker (and, under P/D, the prefill worker) for an annotated request, leaving out
        ``exclude``; raises ``NoHealthyWorker`` (503) when there is none. Called once per try."""
        started = time.perf_counter()
        candidates = self.candidates(req.model, exclude)
        if not candidates:
            raise self._no_candidate(req)
        scope = self._scope(req.model, candidates)
        tracker = self.prefix_tracker
        if tracker is not None:
            if req.block_hashes:  # this try's view: what other requests are prefilling right now
                req = req.with_inflight(self.inflight.covered_by_worker(scope, req.block_hashes))
        now = self.clock.now()
        self.inflight.refresh(scope, now)
        # (P/D: the policy adds the prefill pool itself, so it is told what to leave out of that too)
        choose_excluding = getattr(self.policy, "choose_excluding", None) if exclude else None
        decision = self.policy.choose(req, candidates, now) if choose_excluding is None \
            else choose_excluding(req, candidates, now, exclude)
        if tracker is not None:
            await tracker.on_routed(req, decision, now)
        if self.metrics is not None:
            _, seconds, routed, routed_tokens, cached_tokens = self._decision_metrics(req.model)
            seconds.observe(time.perf_counter() - started)
            routed.inc()
            routed_tokens.inc(req.prompt_tokens)
            if decision.predicted_cached_tokens:
                cached_tokens.inc(decision.predicted_cached_tokens)
        if decision.worker.state is not WorkerState.HEALTHY:
            self._last_resort(req.model, decision.worker, now)
        self.recent_decisions.append({
            "time": now,
            "request_id": req.request_id,
            "model": req.model,
            "worker": decision.worker.id,
            "prefill_worker": decision.prefill_worker.id if decision.prefill_worker else None,
            "policy": decision.policy,
            "reason": decision.reason,
            "prompt_tokens": req.prompt_tokens,
            "session_key": req.session_key,
            "predicted_cached_tokens": decision.predicted_cached_tokens,
        })
        return decision

    def _last_resort(self, model: str, worker: Worker, now: float) -> None:
        """A try sent to a worker out of rotation (``candidates``' last resort): counted, and logged at most
        once a minute per model."""
        if self.metrics is not None:
            self.metrics.routing_decisions.labels(self.policy.name, "last_resort").inc()
        last = self._last_resort_logged.get(model)
        if last is None or now - last >= LAST_RESORT_LOG_S:
            self._last_resort_logged[model] = now
            log.warning("model %s: no worker is healthy; routing to %s, out of rotation only because its health "
                        "probes time out (%s) (health.last_resort)", model, worker.id,
                        worker.last_error or "no answer in time")

    def _decision_metrics(self, model: str) -> tuple[Any, ...]:
        """A decision's metric children for this policy and model, looked up once (the model is a configured
        one: bounded)."""
        key = (self.policy.name, model)
        found = self._metric_children.get(key)
        m = self.metrics
        if found is None or found[0] is not m:
            assert m is not None
            found = self._metric_children[key] = (
                m, child(m.routing_decision_seconds, key[0]), child(m.routing_decisions, key[0], "routed"),
                child(m.routed_prompt_tokens, model), child(m.predicted_cached_tokens, model))
        return found

    # --- accounting ----------------------------------------------------------------------------

    def _prefill_worker(self, decision: RouteDecision) -> Worker:
        return decision.prefill_worker or decision.worker

    def begin(self, decision: RouteDecision, req: RouteRequest) -> None:
        """The request was dispatched: count it in flight, charge its uncached prompt tokens."""
        decision.worker.inflight += 1
        pw = self._prefill_worker(decision)
        tokens = req.prompt_tokens - decision.predicted_cached_tokens
        self.inflight.charge((id(req), pw.id), pw, tokens, req.block_hashes, self.clock.now())

    def first_token(self, decision: RouteDecision, req: RouteRequest, prefilled: bool = True) -> None:
        """Prefill is over: release the prompt tokens charged in ``begin`` (idempotent).
        ``prefilled=False``: the request ended without a first token (nothing to learn from)."""
        pw = self._prefill_worker(decision)
        if self.inflight.release((id(req), pw.id), self.clock.now(), prefilled) is None:
            return
        self._tell_tracker("on_first_token", req, decision)  # e.g. shrink a shared reservation

    def finish(self, decision: RouteDecision, req: RouteRequest, ok: bool) -> None:
        """The request left the worker (success, error or cancellation)."""
        self.first_token(decision, req, prefilled=ok)
        decision.worker.inflight = max(0, decision.worker.inflight - 1)
        if ok:
            decision.worker.last_served_at = self.clock.now()
        self._tell_tracker("on_finished", req, decision, ok)

    def _tell_tracker(self, hook: str, *args: Any) -> None:
        """Call the tracker's optional ``hook(*args, now)``; an async one runs without holding the response."""
        tracker = self.prefix_tracker
        fn = getattr(tracker, hook, None) if tracker is not None else None
        if fn is None:
            return
        result = fn(*args, self.clock.now())
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._background.add(task)
            task.add_done_callback(self._background.discard)
