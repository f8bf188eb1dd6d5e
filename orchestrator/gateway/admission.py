"""Intake: what happens to a request between authentication and routing.

In order, each step refusing early with an OpenAI-shaped error:

0. **how many at once** — ``limits.max_concurrent_per_client`` requests per client (its key; its
   address when the gateway is open) in the gateway at once, queued or served (429 naming the limit);
1. **who** — the key (``auth.KeyRing``) and its model allow-list (403 naming the model);
2. **how often** — the key's token buckets (``limits.RateLimiter``, 429 + ``Retry-After``);
3. **will it make it** — admission control: the time to first token is predicted on every
   candidate worker (``TtftPredictor``); when it exceeds ``limits.ttft_slo_s`` everywhere, the
   request is refused now (503/429 + ``Retry-After``) instead of queuing work that will miss;
4. **when** — the dispatch gate (``AdmissionGate``): with ``limits.max_inflight_per_worker`` set,
   at most that many requests per healthy worker are dispatched; the rest wait in one bounded
   queue served by priority class (high, normal, low; FIFO within a class). A full queue refuses
   the newcomer, unless it outranks someone waiting, who is then shed instead. A client that hangs
   up while queued gives its place back at once; when a SIGTERM drain runs out of grace, whoever
   is still queued gets 503 + ``Retry-After`` (``AdmissionGate.close``), never a cut connection.

The composition root (``compose.py``) builds the per-gateway ``Intake`` (``runtime.intake``); the
OpenAI routes call ``intake.admit`` once per request (on the annotated request: its real prompt
length, the prefix each worker holds, other replicas' load) and wrap the proxy response so the dispatch slot is given
back when the response ends, however it ends.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adapters.base import Histogram
from orchestrator.config import PRIORITIES, LimitsConfig
from orchestrator.errors import ApiError, RateLimited
from orchestrator.fleet.worker import Worker
from orchestrator.gateway.auth import ClientIdentity, KeyRing
from orchestrator.gateway.limits import RateLimiter
from orchestrator.telemetry.logging import request_context

if TYPE_CHECKING:
    from orchestrator.gateway.runtime import GatewayRuntime
    from orchestrator.router.types import RouteRequest
    from orchestrator.telemetry.access_log import AccessRecord
    from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.gateway.admission")

LEARN_ALPHA = 0.3  # weight of the newest throughput sample in the per-worker average
MIN_SAMPLE_REQUESTS = 1.0


class ClientGone(ApiError):
    """The client hung up while its request waited for a dispatch slot (nobody reads this answer)."""

    status = 499  # nginx's "client closed request"
    type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("The client closed the connection while the request was queued.",
                         code="client_closed_request")


class Overloaded(ApiError):
    """Refused because the fleet is too busy (status from ``limits.reject_status``)."""

    type = "overloaded_error"

    def __init__(self, message: str, *, status: int, code: str, retry_after: int) -> None:
        super().__init__(message, status=status, code=code, headers={"Retry-After": str(max(1, retry_after))})


# --- 3. admission control: predicted time to first token ----------------------------------------

@dataclass
class _Learned:
    ttft: Histogram | None = None
    queue: Histogram | None = None
    prompt: Histogram | None = None
    scraped_at: float = -1.0
    tokens_per_s: float | None = None


class TtftPredictor:
    """Predicts a request's time to first token on a worker from plain data (no I/O, no clock).

    TTFT ≈ (prefill tokens queued ahead + this prompt) / prefill throughput. Tokens queued ahead
    are the larger of the gateway's own count (dispatched, no first token yet, including other
    replicas' shared reservations) and the engine's waiting requests times its mean prompt. The
    throughput is ``limits.prefill_tokens_per_s`` when configured, else learned per worker from
    successive scrapes: prompt tokens of finished requests over the time they spent in prefill
    (TTFT minus queue time when the engine reports queue time). No throughput known = no
    prediction, and the request is admitted.
    """

    def __init__(self, tokens_per_s: float | None = None) -> None:
        self.configured = tokens_per_s
        self._learned: dict[str, _Learned] = {}

    def throughput(self, worker: Worker) -> float | None:
        if self.configured is not None:
            return self.configured
        load = worker.load
        state = self._learned.setdefault(worker.id, _Learned())
        if load.scraped_at != state.scraped_at and load.ttft is not None and load.prompt_len is not None:
            if state.ttft is not None and state.prompt is not None:
                self._learn(state, load.ttft.minus(state.ttft), load.prompt_len.minus(state.prompt),
                            load.queue_time.minus(state.queue) if load.queue_time and state.queue else None)
            state.ttft, state.prompt, state.queue = load.ttft, load.prompt_len, load.queue_time
            state.scraped_at = load.scraped_at
        return state.tokens_per_s

    @staticmethod
    def _learn(state: _Learned, ttft: Histogram, prompt: Histogram, queue: Histogram | None) -> None:
        if ttft.count < MIN_SAMPLE_REQUESTS or prompt.count < MIN_SAMPLE_REQUESTS:
            return
        busy = ttft.sum - (queue.sum if queue is not None and queue.count == ttft.count else 0.0)
        if busy <= 0 or prompt.sum <= 0:
            return
        sample = prompt.sum / busy
        prev = state.tokens_per_s
        state.tokens_per_s = sample if prev is None else prev + LEARN_ALPHA * (sample - prev)

    def queued_tokens(self, worker: Worker, peer_prefill_tokens: int = 0) -> float:
        own = worker.inflight_prefill_tokens + peer_prefill_tokens
        load = worker.load
        mean_prompt = load.prompt_len.mean() if load.prompt_len is not None else None
        engine = load.waiting * mean_prompt if mean_prompt else 0.0
        return max(float(own), engine)

    def predict(self, worker: Worker, prompt_tokens: int, peer_prefill_tokens: int = 0) -> float | None:
        tps = self.throughput(worker)
        if not tps:
            return None
        return (self.queued_tokens(worker, peer_prefill_tokens) + prompt_tokens) / tps


# --- 4. the dispatch gate: bounded priority queue ------------------------------------------------

@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    model: str = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    since: float = field(compare=False, default=0.0)


class AdmissionGate:
    """Dispatch slots per model (``capacity(model)``), with one bounded priority queue in front."""

    def __init__(self, capacity: Any, queue_size: int, timeout_s: float, reject_status: int,
                 retry_after_s: int, metrics: DyadMetrics | None = None) -> None:
        self.capacity = capacity  # model -> slots (0 = let the router decide, no queueing)
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.reject_status = reject_status
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.active: dict[str, int] = {}
        self._queues: dict[str, list[_Waiter]] = {}
        self._queued = 0
        self._seq = itertools.count()
        self._closed: Callable[[], ApiError] | None = None  # set by close(): the refusal for any waiter

    @property
    def queued(self) -> int:
        return self._queued

    def _depth(self, rank: int, delta: int) -> None:
        self._queued += delta
        if self.metrics is not None:
            self.metrics.queue_depth.labels(PRIORITIES[rank]).inc(delta)

    async def acquire(self, model: str, rank: int, gone: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Return once a slot for ``model`` is held (give it back with ``release``), or raise ``Overloaded``.

        ``gone``: awaitable that returns when the client disconnects (the ASGI ``receive`` once the
        body is read); while queued, a disconnect raises ``ClientGone`` and frees the place.
        """
        cap = self.capacity(model)
        active = self.active.get(model, 0)
        queue = self._queues.setdefault(model, [])
        if cap <= 0 or (active < cap and not queue):
            self.active[model] = active + 1
            return
        if self._closed is not None:
            raise self._closed()
        if self._queued >= self.queue_size and not self._shed_for(rank):
            raise Overloaded(f"The gateway's queue is full ({self.queue_size} requests waiting, "
                             "limits.queue_size). Retry later.", status=self.reject_status, code="queue_full",
                             retry_after=self.retry_after_s)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(rank, next(self._seq), model, loop.create_future(), time.perf_counter())
        heapq.heappush(queue, waiter)
        self._depth(rank, +1)
        try:
            await self._wait(waiter, gone)
        except BaseException:
            if waiter in queue:
                queue.remove(waiter)
                heapq.heapify(queue)
                self._depth(rank, -1)
            elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(model)  # a slot was handed over as we gave up: pass it on
            raise
        if self.metrics is not None:
            self.metrics.queue_wait.labels(PRIORITIES[rank]).observe(time.perf_counter() - waiter.since)

    async def _wait(self, waiter: _Waiter, gone: Callable[[], Awaitable[Any]] | None) -> None:
        deadline = time.monotonic() + self.timeout_s
        watcher = asyncio.ensure_future(gone()) if gone is not None else None
        waits: list[asyncio.Future[Any]] = [waiter.future] if watcher is None else [waiter.future, watcher]
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Overloaded(f"No dispatch slot freed within {self.timeout_s:g} s "
                                     "(limits.queue_timeout_s). Retry later.", status=self.reject_status,
                                     code="queue_timeout", retry_after=self.retry_after_s)
                # Wake up now and then: capacity grows when workers come back, without any release.
                await asyncio.wait(waits, timeout=min(left, 0.25), return_when=asyncio.FIRST_COMPLETED)
                if not waiter.future.done():
                    if watcher is not None and watcher.done():
                        raise ClientGone()
                    self._dispatch(waiter.model)
                if waiter.future.done():
                    waiter.future.result()
                    return
        finally:
            if watcher is not None:
                watcher.cancel()

    def _shed_for(self, rank: int) -> bool:
        """Make room for a request of ``rank`` by refusing the lowest-priority, newest waiter below it."""
        worst: _Waiter | None = None
        for q in self._queues.values():
            for w in q:
                if w.rank > rank and (worst is None or (w.rank, w.seq) > (worst.rank, worst.seq)):
                    worst = w
        if worst is None:
            return False
        q = self._queues[worst.model]
        q.remove(worst)
        heapq.heapify(q)
        self._depth(worst.rank, -1)
        worst.future.set_exception(Overloaded(
            "Shed from the gateway's queue to make room for higher-priority work. Retry later.",
            status=self.reject_status, code="shed_for_priority", retry_after=self.retry_after_s))
        return True

    def close(self, refusal: Callable[[], ApiError]) -> int:
        """Refuse every waiter with ``refusal()`` and any later request that would have to queue
        (the gateway is going away: a clean refusal beats a connection cut at exit). Returns how
        many waiters were refused."""
        self._closed = refusal
        refused = 0
        for queue in self._queues.values():
            while queue:
                w = heapq.heappop(queue)
                self._depth(w.rank, -1)
                if not w.future.done():
                    w.future.set_exception(refusal())
                    refused += 1
        return refused

    def release(self, model: str) -> None:
        self.active[model] = max(0, self.active.get(model, 0) - 1)
        self._dispatch(model)

    def _dispatch(self, model: str) -> None:
        queue = self._queues.get(model)
        cap = self.capacity(model)
        while queue and (cap <= 0 or self.active.get(model, 0) < cap):
            w = heapq.heappop(queue)
            self._depth(w.rank, -1)
            if w.future.done():
                continue
            self.active[model] = self.active.get(model, 0) + 1
            w.future.set_result(None)


def _nothing() -> None:
    return None


# --- the pipeline --------------------------------------------------------------------------------

class _Admitted:
    """The proxy response, run with the request's log context; at its end the dispatch slot is given
    back and the shutdown tracker hears that the request is over."""

    __slots__ = ("inner", "release", "finished", "rid", "model", "client_done", "settle")

    def __init__(self, inner: Any, release: Any, finished: Any, rid: str, model: str,
                 client_done: Any = None, settle: Callable[[], Awaitable[None]] | None = None) -> None:
        self.inner = inner
        self.release = release
        self.finished = finished
        self.rid = rid
        self.model = model
        self.client_done = client_done
        self.settle = settle

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            with request_context(self.rid, model=self.model):
                await self.inner(scope, receive, send)
        finally:
            self.give_back()
            if self.settle is not None:
                await self.settle()

    def give_back(self) -> None:
        """The request's places given back: the dispatch slot, the shutdown tracker's count, the client's
        concurrency count (also called by the native lane, which runs the request without ``__call__``)."""
        self.release()
        self.finished()
        if self.client_done is not None:
            self.client_done()


class Intake:
    def __init__(self, runtime: GatewayRuntime) -> None:
        cfg = runtime.config
        lim: LimitsConfig = cfg.limits
        self.runtime = runtime
        self.config = lim
        self.keys = KeyRing(cfg.auth, lim, cfg.gateway.api_keys)
        redis_url = (lim.redis_url or cfg.index.redis_url) if lim.backend == "redis" else None
        self.limiter = RateLimiter(runtime.clock, runtime.metrics, redis_url=redis_url, key_prefix=lim.key_prefix)
        self.predictor = TtftPredictor(lim.prefill_tokens_per_s)
        self.gate = AdmissionGate(self._capacity, lim.queue_size, lim.queue_timeout_s, lim.reject_status,
                                  cfg.gateway.retry_after_s, runtime.metrics) \
            if lim.max_inflight_per_worker else None
        self.concurrent: dict[str, int] = {}  # client → requests in the gateway (entries only while > 0)

    def _capacity(self, model: str) -> int:
        per = self.config.max_inflight_per_worker or 0
        return per * len(self.runtime.router.candidates(model))

    def authenticate(self, request: Any) -> ClientIdentity:
        return self.keys.authenticate(request)

    def client_key(self, identity: ClientIdentity, request: Any) -> str | None:
        """Who ``limits.max_concurrent_per_client`` counts: the key, or the address of an anonymous client."""
        if self.config.max_concurrent_per_client is None:
            return None
        if identity.name != "anonymous":
            return "key:" + identity.name
        client = getattr(request, "client", None)
        return "addr:" + (client.host if client is not None else "?")

    def enter(self, key: str | None) -> None:
        """Count a request of ``key`` in (``leave`` when it ends); 429 past the per-client limit."""
        if key is None:
            return
        limit = self.config.max_concurrent_per_client
        n = self.concurrent.get(key, 0)
        if limit is not None and n >= limit:
            raise RateLimited(f"Too many concurrent requests from this client ({n} in progress; limit "
                              f"{limit}, limits.max_concurrent_per_client). Retry when one has finished.",
                              code="too_many_concurrent_requests",
                              headers={"Retry-After": str(max(1, self.runtime.config.gateway.retry_after_s))})
        self.concurrent[key] = n + 1

    def leave(self, key: str | None) -> None:
        if key is None:
            return
        n = self.concurrent.get(key, 0) - 1
        if n > 0:
            self.concurrent[key] = n
        else:
            self.concurrent.pop(key, None)

    def rank(self, identity: ClientIdentity, headers: Any) -> int:
        name = self.config.priority_header
        return identity.priority_from(headers.get(name), name)

    async def admit(self, identity: ClientIdentity, req: RouteRequest, headers: Any,
                    gone: Callable[[], Awaitable[Any]] | None = None) -> tuple[bool, list[tuple[bytes, bytes]]]:
        """Rate limits, admission control, then a dispatch slot. Returns (a slot is held — ``wrap`` the
        response so it is released —, the ``x-ratelimit-*`` headers for the answer). ``gone`` returns when
        the client disconnects (``AdmissionGate.acquire``)."""
        rank = self.rank(identity, headers)
        limit_headers = await self.limiter.check(identity, self.charge_of(req, identity))
        if self.config.ttft_slo_s is not None:
            self.check_ttft(req)
        if self.gate is None:
            return False, limit_headers
        await self.gate.acquire(req.model, rank, gone)
        return True, limit_headers

    @staticmethod
    def charge_of(req: RouteRequest, identity: ClientIdentity) -> int:
        """What a request is charged to its key's tokens-per-minute bucket before it runs: the prompt
        estimate plus its output budget (``annotate.output_budget``; 0 when it names none), at most the
        whole bucket. The budget is what the client allows, not what it will use (``max_tokens`` x ``n``
        may be absurd: the engine refuses it, or stops early); what the answer really uses beyond the
        charge is taken once it is over (``settler``), so a costlier request still pays its share then."""
        cost = req.prompt_tokens + (req.max_tokens if isinstance(req.max_tokens, int) else 0)
        return min(cost, identity.tpm) if identity.tpm else cost

    def settler(self, identity: ClientIdentity, req: RouteRequest,
                record: AccessRecord) -> Callable[[], Awaitable[None]] | None:
        """For a key with a tokens-per-minute limit: what charges the bucket, once the answer is over,
        for the tokens it used beyond ``charge_of`` (``record`` holds the counts then: the engine's
        usage, else the estimate and what was relayed). ``None`` for a key without one."""
        if not identity.tpm:
            return None
        charged = self.charge_of(req, identity)
        limiter = self.limiter

        async def settle() -> None:
            used = (record.prompt_tokens or 0) + (record.generated_tokens or 0)
            if used > charged:
                try:
                    await limiter.debit(identity, used - charged)
                except Exception:  # noqa: BLE001 - the answer is out: never turn accounting into an error
                    log.exception("rate limits: charging %d tokens after the answer failed", used - charged)

        return settle

    def check_ttft(self, req: RouteRequest) -> None:
        slo = self.config.ttft_slo_s
        assert slo is not None
        best: float | None = None
        for w in self.runtime.router.candidates(req.model):
            peer = req.peer_load.get(w.id)
            overlap = req.overlaps.get(w.id)  # the prefix this worker holds is not prefilled again
            uncached = req.prompt_tokens - (min(overlap.blocks * req.block_size, req.prompt_tokens) if overlap else 0)
            ttft = self.predictor.predict(w, uncached, peer.prefill_tokens if peer else 0)
            if ttft is None:
                return  # no basis for a prediction on this worker: let it try
            best = ttft if best is None else min(best, ttft)
            if ttft <= slo:
                break
        if best is None:
            return  # no candidate: the router answers 503
        self.runtime.metrics.predicted_ttft.observe(best)
        if best > slo:
            log.info("admission: refused, predicted TTFT %.2f s > SLO %.2f s on every worker", best, slo)
            raise Overloaded(f"Every worker for model '{req.model}' is predicted to take {best:.1f} s or more "
                             f"to the first token, over the {slo:g} s target (limits.ttft_slo_s). Retry later.",
                             status=self.config.reject_status, code="ttft_slo",
                             retry_after=math.ceil(best - slo))

    def wrap(self, response: Any, model: str, rid: str, slot: bool, client_key: str | None = None,
             settle: Callable[[], Awaitable[None]] | None = None) -> _Admitted:
        """``response`` run in the request's log context; at its end gives the dispatch slot back (when
        ``slot``), ends the request's ``ShutdownState.started`` (the OpenAI routes start it) and its
        per-client count (``enter``), then charges what the answer used beyond its charge (``settler``)."""
        gate = self.gate
        release = (lambda: gate.release(model)) if slot and gate is not None else _nothing
        done = (lambda: self.leave(client_key)) if client_key is not None else None
        return _Admitted(response, release, self.runtime.shutdown.finished, rid, model, done, settle)

    async def run(self) -> None:
        """Lives as a runtime task so that stopping the gateway closes the limiter's Redis connection."""
        try:
            await asyncio.Event().wait()
        finally:
            await self.limiter.close()
