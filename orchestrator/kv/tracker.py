"""PrefixTracker: what the Router calls around the kv_aware policy.

``annotate`` tokenizes the request (locally when possible), hashes its blocks and looks up every
candidate's cached prefix in the index (plus other replicas' in-flight load when the index is
shared); ``on_routed`` records the decision (approximate mode for workers without KV events,
a recency touch otherwise, and a shared load reservation); ``on_first_token`` drops the
reservation's prefill tokens; ``on_finished`` releases it.
``start``/``stop`` run one KV event subscriber per worker that publishes events, and follow the
fleet: a worker that goes unhealthy or is removed has its entries cleared.

Built by ``build_prefix_tracker(config, fleet, metrics, clock)`` when ``router.policy == kv_aware``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from adapters.base import EngineAdapter, EngineKind
from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.config import DyadConfig
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.kv.approximate import ApproximateRecorder
from orchestrator.kv.events import KNOWN_EVENT_TYPES, IndexOp, KvEventMapper, KvEventSubscriber
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.index import PrefixIndex, Tier
from orchestrator.kv.ingest_shards import IngestShards
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.kv.tier_cost import effective_tier_weights
from orchestrator.kv.tokenization import RequestTokenizer
from orchestrator.loop_thread import on_loop_thread
from orchestrator.router.types import RouteDecision, RouteRequest
from orchestrator.telemetry.children import child
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.kv.tracker")

TOUCH_INTERVAL_S = 1.0  # a matched prefix's recency is refreshed at most this often
MAX_TOUCHED = 100_000
# A request decided on its prompt's head records the head's blocks at once. After the send its whole prompt is
# tokenized (one at a time, on a thread) and recorded whole when a worker it went to has no KV events (the
# index learns the whole prompt only from the gateway then), and checked against the head; for workers with
# events (they report every block) only the first such request and then one in HEAD_VERIFY_EVERY is, for the
# check. At most HEAD_WHOLE_WAITING wait for the tokenizer: beyond that a request keeps its head's record
# (counted in ``head_whole_dropped``): under a flood of new long prompts learning degrades, routing does not.
HEAD_VERIFY_EVERY = 64
HEAD_WHOLE_WAITING = 8
MAX_TOKENIZE_LATER = 1_024  # requests decided on their prompt's head, waiting to be routed ...
MAX_TOKENIZE_LATER_TOKENS = 8_000_000  # ... and the (extrapolated) prompt tokens they hold at most


class PrefixTracker:
    def __init__(self, config: DyadConfig, fleet: FleetRegistry, index: PrefixIndex,
                 tokenizer: RequestTokenizer, metrics: DyadMetrics | None = None,
                 clock: Clock = SYSTEM_CLOCK, shared_load: Any = None) -> None:
        self.config = config
        self.fleet = fleet
        self.index = index
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.clock = clock
        self.shared_load = shared_load
        # an index or shared load elsewhere (Redis): annotation does network I/O (loop_thread.on_loop_thread)
        self.remote = shared_load is not None or config.index.backend != "memory"
        self.tier_weights = effective_tier_weights(config.router.kv_aware)
        # False: this replica reads a shared index that others fill from the engines' events
        self.ingest_events = config.index.ingest_events
        self.shards: IngestShards | None = None  # set: replicas split the engines' event streams
        self._shard_task: asyncio.Task[None] | None = None
        self.approx = ApproximateRecorder(index, config.index.approximate_ttl_s, config.index.max_blocks)
        self.mappers: dict[str, KvEventMapper] = {}
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._block_size: dict[str, int] = {}  # namespace → block size learnt from engine events
        self._hashers: dict[tuple[str, int, str | None], BlockHasher] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._touched: dict[tuple[str, int], float] = {}  # (worker, last matched block) → last touch
        # request id → what ``_record_whole`` needs, for requests decided on their prompt's head
        self._tokenize_later: dict[str, tuple[Any, ...]] = {}
        self._head_decisions = 0
        self._whole_gate = asyncio.Semaphore(1)  # one whole-prompt tokenization at a time
        self._whole_waiting = 0
        self.head_whole_dropped = 0
        self._later_tokens = 0  # the prompt tokens those entries hold (extrapolated from the heads)
        self.annotate_failures = 0
        self._started = False
        fleet.subscribe(self._on_fleet)

    # --- names and hashers -----------------------------------------------------------------------
    def namespace(self, model: str) -> str:
        mc = self.config.model(model)
        return mc.name if mc is not None else model

    def block_size_for(self, namespace: str) -> int:
        learnt = self._block_size.get(namespace)
        if learnt is not None:
            return learnt
        mc = self.config.model(namespace)
        return mc.block_size if mc is not None else 32

    def hasher(self, namespace: str, block_size: int, salt: str | None) -> BlockHasher:
        key = (namespace, block_size, salt)
        h = self._hashers.get(key)
        if h is None:
            if len(self._hashers) > 10_000:
                self._hashers.clear()
            h = self._hashers[key] = BlockHasher(namespace, block_size, salt)
        return h

    # --- the Router's calls ----------------------------------------------------------------------
    async def annotate(self, req: RouteRequest, body: dict[str, Any], endpoint: str,
                       candidates: Sequence[Worker]) -> RouteRequest:
        """``req`` with token ids, block hashes, overlaps (and peer load). Never raises: a request this
        cannot handle (odd content, a tokenizer error) is routed on load alone (``req`` comes back)."""
        if self.remote:
            await on_loop_thread()  # (network I/O: on the loop's thread, never the native plane's)
        session_key = req.session_key
        if session_key is None:
            user = body.get("user")
            if isinstance(user, str) and user:
                session_key = f"user:{user}"
        try:
            return await self._annotate(req, body, endpoint, candidates, session_key)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - routing degrades to load, the request goes on
            self.annotate_failures += 1
            log.warning("prefix lookup failed for request %s (%s: %s); routing it on load alone",
                        req.request_id, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            return _keyed(req, session_key)

    async def _annotate(self, req: RouteRequest, body: dict[str, Any], endpoint: str,
                        candidates: Sequence[Worker], session_key: str | None) -> RouteRequest:
        ns = self.namespace(req.model)
        bs = self.block_size_for(ns)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if len(self.approx) or self.approx.shared:
            await self.approx.expire(self.clock.now())
        ids_of = [w.id for w in candidates]
        probe = self.tokenizer.head_probe(req.model, endpoint, body, candidates, bs)
        if probe is not None:
            new = await self._new_everywhere(req, probe, bs, self.hasher(ns, bs, salt), ids_of, session_key)
            if new is not None:
                self._head_decisions += 1
                verify = self._head_decisions % HEAD_VERIFY_EVERY == 1  # (the first, then one in HEAD_VERIFY_EVERY)
                self._later_put(req.request_id, (endpoint, body, candidates, new.block_hashes, probe[0], verify),
                                new.prompt_tokens)
                return new
        tok = await self.tokenizer.tokenize(req.model, endpoint, body, candidates)
        if tok is None:
            return _keyed(req, session_key)
        block_hashes = tok.block_hashes(self.hasher(ns, bs, salt))
        peers = req.peer_load
        started = time.perf_counter()
        if self.shared_load is not None:
            overlaps, peers = await asyncio.gather(
                self.index.overlaps(block_hashes, self.tier_weights, ids_of),
                self.shared_load.peer_loads(ids_of))  # (read by KvAwarePolicy)
        else:
            overlaps = await self.index.overlaps(block_hashes, self.tier_weights, ids_of)
        if self.metrics is not None:
            child(self.metrics.index_lookup_seconds, self.index.backend).observe(time.perf_counter() - started)
        # token ids are shared with the token cache: read-only
        return req.annotated(token_ids=tok.ids, prompt_tokens=len(tok.ids), block_size=bs, block_hashes=block_hashes,
                             overlaps=overlaps, peer_load=peers, session_key=session_key)

    async def _new_everywhere(self, req: RouteRequest, probe: tuple[Sequence[int], int], bs: int,
                              hasher: BlockHasher, ids_of: list[str], session_key: str | None) -> RouteRequest | None:
        """``req`` annotated from the head of its prompt alone when no candidate's cache holds even the
        head's first block (every overlap is 0, whatever the rest of the prompt is), else None (the whole
        prompt is needed to measure the overlap). Its block hashes are the head's but its last block (a
        word cut at the head's end may tokenize differently); no token ids; its length is the head's
        tokens per character times the prompt's characters (``head_probe``).

        What is recorded for it (approximate mode) is the head's blocks at once, and every block once
        its whole prompt is tokenized after the send (``_record_whole``). Workers with KV events report
        every block themselves."""
        head, prompt_tokens = probe
        safe = len(head) // bs - 1
        if safe < 1:
            return None
        head_hashes = hasher.hash_blocks(head[: safe * bs])
        started = time.perf_counter()
        overlaps = await self.index.overlaps(head_hashes[:1], self.tier_weights, ids_of)
        if self.metrics is not None:
            child(self.metrics.index_lookup_seconds, self.index.backend).observe(time.perf_counter() - started)
        if any(o.blocks for o in overlaps.values()):
            return None
        peers = await self.shared_load.peer_loads(ids_of) if self.shared_load is not None else req.peer_load
        return req.annotated(token_ids=None, prompt_tokens=prompt_tokens, block_size=bs,
                             block_hashes=head_hashes, overlaps={}, peer_load=peers, session_key=session_key)

    def _later_put(self, request_id: str, later: tuple[Any, ...], size: int) -> None:
        """Keep what ``_record_whole`` needs until the request is routed. Bounded (by entries and by the
        prompts' tokens): a request refused after annotation never comes back for its entry."""
        self._tokenize_later[request_id] = (*later, size)
        self._later_tokens += size
        while len(self._tokenize_later) > MAX_TOKENIZE_LATER or self._later_tokens > MAX_TOKENIZE_LATER_TOKENS:
            self._later_tokens -= self._tokenize_later.pop(next(iter(self._tokenize_later)))[-1]

    async def _record_whole(self, req: RouteRequest, later: tuple[Any, ...], worker_ids: list[str]) -> None:
        """After the send of a request decided on its head: tokenize the whole prompt (on a thread, one
        at a time), check the head against it (``verify_head``), and record all its blocks for
        ``worker_ids`` (the workers it went to that have no KV events)."""
        endpoint, body, candidates, head_hashes, head, _, _ = later
        self._whole_waiting += 1
        try:
            async with self._whole_gate:
                tok = await self.tokenizer.tokenize(req.model, endpoint, body, candidates, off_loop=True)
        finally:
            self._whole_waiting -= 1
        if tok is None:
            return
        self.tokenizer.verify_head(req.model, head[: len(head_hashes) * req.block_size], tok.ids)
        ns = self.namespace(req.model)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        whole = tok.block_hashes(self.hasher(ns, req.block_size, salt))
        if whole[: len(head_hashes)] != list(head_hashes):
            return  # (verify_head has turned head-first off: nothing recorded from a wrong head)
        for wid in worker_ids:
            await self.approx.record(wid, whole, self.clock.now())

    async def on_routed(self, req: RouteRequest, decision: RouteDecision, now: float) -> None:
        holders = [decision.worker] + ([decision.prefill_worker] if decision.prefill_worker else [])
        later = self._tokenize_later.pop(req.request_id, None) if self._tokenize_later else None
        if later is not None:  # decided on its prompt's head: the whole prompt after the send, off the path
            self._later_tokens -= later[-1]
            approximate = [w.id for w in holders if not self._gets_events(w)]
            outcome = "head"
            if approximate or later[-2]:  # (recorded whole, or checked)
                if self._whole_waiting < HEAD_WHOLE_WAITING:
                    self._spawn(self._record_whole(req, later, approximate))
                    outcome = "whole"
                else:
                    self.head_whole_dropped += 1
                    outcome = "dropped"
            if self.metrics is not None:
                child(self.metrics.head_first, outcome).inc()
        if req.block_hashes:
            for w in holders:
                if self._gets_events(w):
                    # Engines publish nothing on a cache hit: refresh the matched prefix's recency
                    # (at most once per TOUCH_INTERVAL_S per worker and prefix: a hot system prompt
                    # would otherwise be re-stored on every request).
                    ov = req.overlaps.get(w.id)
                    if ov is not None and ov.blocks and self._touch_due(w.id, req.block_hashes[ov.blocks - 1], now):
                        self._spawn(self.index.store(w.id, req.block_hashes[: ov.blocks], Tier.DEVICE))
                else:
                    await self.approx.record(w.id, req.block_hashes, now)
        if self.shared_load is not None:
            uncached = max(0, req.prompt_tokens - decision.predicted_cached_tokens)
            self.shared_load.reserve_soon(req.request_id, decision.worker.id, uncached)

    def _gets_events(self, w: Worker) -> bool:
        """Does this gateway see ``w``'s cache through its KV events (else: approximate records)?"""
        return w.id in self.subscribers or (w.kv_events is not None
                                            and (not self.ingest_events or self.shards is not None))

    def _touch_due(self, worker_id: str, last_hash: int, now: float) -> bool:
        key = (worker_id, last_hash)
        last = self._touched.get(key)
        if last is not None and now - last < TOUCH_INTERVAL_S:
            return False
        if len(self._touched) >= MAX_TOUCHED:
            self._touched = {k: t for k, t in self._touched.items() if now - t < TOUCH_INTERVAL_S}
            if len(self._touched) >= MAX_TOUCHED:
                self._touched.clear()
        self._touched[key] = now
        return True

    # The two hooks below return a coroutine (run in the background by the Router) only when
    # there is shared load to update; alone, a gateway pays nothing for them.
    def on_first_token(self, req: RouteRequest, decision: RouteDecision, now: float) -> Awaitable[None] | None:
        """Prefill is over: other replicas stop counting this request's prompt as queued work."""
        if self.shared_load is None:
            return None
        return self.shared_load.first_token(req.request_id)

    def on_finished(self, req: RouteRequest, decision: RouteDecision, ok: bool, now: float) -> Awaitable[None] | None:
        if self.shared_load is None:
            return None
        return self.shared_load.release(req.request_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- KV events ---------------------------------------------------------------------------------
    async def apply_events(self, worker_id: str, ts: float, events: list[dict[str, Any]]) -> None:
        mapper = self.mappers.get(worker_id)
        w = self.fleet.get(worker_id)
        if mapper is None or (w is not None and w.state is WorkerState.UNHEALTHY):
            return  # an unhealthy worker's entries stay cleared; re-learnt by replay when it is back
        if self.metrics is not None and ts > 0:
            self.metrics.kv_event_lag.labels(worker_id).set(max(0.0, time.time() - ts))
        if self.metrics is not None:
            counts: dict[str, int] = {}
            for ev in events:
                kind = ev.get("type")
                # (a known type or "unknown": an engine cannot mint label values, one child each)
                kind = kind if isinstance(kind, str) and kind in KNOWN_EVENT_TYPES else "unknown"
                counts[kind] = counts.get(kind, 0) + 1
            for kind, n in counts.items():
                self.metrics.kv_events.labels(worker_id, kind).inc(n)
        malformed = mapper.malformed
        try:
            await self._apply_mapped(worker_id, mapper, events)
        finally:
            if self.metrics is not None and mapper.malformed > malformed:
                self.metrics.kv_events.labels(worker_id, "malformed").inc(mapper.malformed - malformed)

    async def _apply_mapped(self, worker_id: str, mapper: KvEventMapper, events: list[dict[str, Any]]) -> None:
        # Consecutive operations of the same kind and tier are merged, so a batch of N events
        # costs one index write (one Redis round trip) per run instead of N; order is kept.
        pending: IndexOp | None = None
        for ev in events:
            op = mapper.apply(ev)
            if op is None:
                continue
            if pending is not None and _mergeable(pending, op):
                pending.hashes.extend(op.hashes)
                if pending.anchors is not None and op.anchors is not None:
                    pending.anchors.extend(op.anchors)
                else:
                    pending.anchors = None
                continue
            if pending is not None and not await self._apply_following(worker_id, mapper, pending):
                return
            pending = IndexOp(op.kind, list(op.hashes), op.tier, op.block_size, op.namespace,
                              list(op.anchors) if op.anchors is not None else None)
        if pending is not None:
            await self._apply_following(worker_id, mapper, pending)

    def _following(self, worker_id: str, mapper: KvEventMapper) -> bool:
        """Are ``worker_id``'s events (through ``mapper``) still to be applied: not removed (or re-added,
        with a new mapper) nor down (its entries cleared) since its batch started?"""
        if self.mappers.get(worker_id) is not mapper:
            return False
        w = self.fleet.get(worker_id)
        return w is None or w.state is not WorkerState.UNHEALTHY

    async def _apply_following(self, worker_id: str, mapper: KvEventMapper, op: IndexOp) -> bool:
        """``apply_op`` unless the worker was removed or went down meanwhile (False: stop the batch). A write
        in flight when that happened may land after the fleet listener's clear: cleared again then."""
        if not self._following(worker_id, mapper):
            return False
        await self.apply_op(worker_id, op)
        if not self._following(worker_id, mapper):
            await self.index.clear_worker(worker_id)
            return False
        return True

    async def apply_op(self, worker_id: str, op: IndexOp) -> None:
        if op.kind == "store":
            if op.namespace is not None and op.block_size is not None:
                known = self._block_size.get(op.namespace)
                if known != op.block_size:
                    if known is None and op.block_size != self.block_size_for(op.namespace):
                        log.warning("model %s: engine %s uses block size %d, not the configured %d; "
                                    "hashing requests with %d", op.namespace, worker_id, op.block_size,
                                    self.block_size_for(op.namespace), op.block_size)
                    self._block_size[op.namespace] = op.block_size
            if op.anchors is not None and getattr(self.index, "uses_anchors", False):
                await self.index.store(worker_id, op.hashes, op.tier or Tier.DEVICE, anchors=op.anchors)
            else:
                await self.index.store(worker_id, op.hashes, op.tier or Tier.DEVICE)
        elif op.kind == "remove":
            await self.index.remove(worker_id, op.hashes, op.tier)
        elif op.kind == "clear":
            await self.index.clear_worker(worker_id)

    async def _on_reset(self, worker_id: str, why: str) -> None:
        mapper = self.mappers.get(worker_id)
        if mapper is not None:
            mapper.reset()
        await self.index.clear_worker(worker_id)

    def _worker_namespace(self, worker_id: str) -> Callable[[], str | None]:
        def resolve() -> str | None:
            w = self.fleet.get(worker_id)
            if w is None or not w.models:
                return None
            return self.namespace(w.models[0])
        return resolve

    def _subscribe(self, w: Worker) -> None:
        if w.kv_events is None or w.id in self.subscribers or not self.ingest_events:
            return
        if self.shards is not None and not self.shards.owns(w.id):
            return  # another replica writes this engine's events
        self.mappers[w.id] = KvEventMapper(w.id, self._worker_namespace(w.id), self.config.index.max_blocks)
        gaps = self.metrics.kv_event_gaps if self.metrics is not None else None
        counted = self.metrics.kv_events if self.metrics is not None else None
        sub = KvEventSubscriber(
            w.id, w.kv_events.endpoint, self.apply_events, self._on_reset,
            replay_endpoint=w.kv_events.replay_endpoint, topic=w.kv_events.topic,
            host=urlsplit(w.url).hostname or "127.0.0.1",
            on_gap=(lambda wid, n: gaps.labels(wid).inc()) if gaps is not None else None,
            on_malformed=(lambda wid, _what: counted.labels(wid, "malformed").inc()) if counted is not None else None)
        self.subscribers[w.id] = sub
        if self._started:
            sub.start()

    def _on_fleet(self, event: str, w: Worker) -> None:
        """Fleet listener (sync): keep subscribers and index entries in step with the fleet."""
        if event == "added":
            self._subscribe(w)
        elif event == "removed":
            sub = self.subscribers.pop(w.id, None)
            self.mappers.pop(w.id, None)
            if sub is not None:
                self._spawn_if_running(sub.stop())
            self.approx.forget_worker(w.id)
            self._spawn_if_running(self.index.clear_worker(w.id))
        elif event == "state" and w.state is WorkerState.UNHEALTHY:
            log.info("worker %s unhealthy: clearing its prefix index entries", w.id)
            mapper = self.mappers.get(w.id)
            if mapper is not None:
                mapper.reset()
            self.approx.forget_worker(w.id)
            self._spawn_if_running(self.index.clear_worker(w.id))
        elif event == "state" and w.state is WorkerState.HEALTHY:
            sub = self.subscribers.get(w.id)
            if sub is not None:
                sub.request_full_replay()  # back: re-learn what it still holds

    def _spawn_if_running(self, coro: Any) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            coro.close()
            return
        self._spawn(coro)

    # --- lifecycle -----------------------------------------------------------------------------
    async def rebalance(self) -> None:
        """Ingest sharding: renew this replica's registration, then follow exactly the engines it
        owns now (a gained engine starts with a full replay of its buffer)."""
        if self.shards is None:
            return
        await self.shards.members()
        for w in self.fleet.workers():
            if w.kv_events is None:
                continue
            sub = self.subscribers.get(w.id)
            if self.shards.owns(w.id):
                if sub is None and w.state is not WorkerState.UNHEALTHY:
                    self._subscribe(w)
                    new = self.subscribers.get(w.id)
                    if new is not None and self._started and new._task is None:
                        new.start()
            elif sub is not None:
                del self.subscribers[w.id]
                self.mappers.pop(w.id, None)
                await sub.stop()

    async def _shard_loop(self) -> None:
        assert self.shards is not None
        while True:
            await asyncio.sleep(self.shards.interval_s)
            try:
                await self.rebalance()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep following; the next round retries
                log.exception("ingest sharding: rebalance failed")

    async def start(self) -> None:
        self._started = True
        if self.shards is not None:
            await self.shards.members()
            self._shard_task = asyncio.get_running_loop().create_task(self._shard_loop(), name="dyad-ingest-shards")
        for w in self.fleet.workers():
            self._subscribe(w)
        for sub in self.subscribers.values():
            if sub._task is None:
                sub.start()
        if self.shared_load is not None:
            self.shared_load.start()

    async def stop(self) -> None:
        self._started = False
        if self._shard_task is not None:
            self._shard_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._shard_task
            self._shard_task = None
        if self.shards is not None:
            await self.shards.leave()
        for sub in list(self.subscribers.values()):
            await sub.stop()
        if self.shared_load is not None:
            await self.shared_load.stop()
        background = list(self._background)
        if self.approx._pass is not None:
            background.append(self.approx._pass)  # type: ignore[arg-type]
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.index.close()


def _mergeable(a: IndexOp, b: IndexOp) -> bool:
    return (a.kind == b.kind and a.kind in ("store", "remove") and a.tier == b.tier
            and a.block_size == b.block_size and a.namespace == b.namespace)


def build_index(config: DyadConfig, metrics: DyadMetrics | None = None, clock: Clock = SYSTEM_CLOCK) -> PrefixIndex:
    ic = config.index
    if ic.backend == "redis_cluster":
        from orchestrator.kv.redis_cluster_index import RedisClusterPrefixIndex
        return RedisClusterPrefixIndex(ic.redis_url, ic.key_prefix, ic.max_blocks, metrics, clock=clock)
    if ic.backend == "redis":
        from orchestrator.kv.redis_index import RedisPrefixIndex
        return RedisPrefixIndex(ic.redis_url, ic.key_prefix, ic.max_blocks, metrics, clock=clock)
    return MemoryPrefixIndex(ic.max_blocks, metrics)


def build_prefix_tracker(config: DyadConfig, fleet: FleetRegistry, metrics: DyadMetrics | None = None,
                         clock: Clock = SYSTEM_CLOCK, *, http: httpx.AsyncClient | None = None,
                         adapter_for: Callable[[EngineKind], EngineAdapter] | None = None) -> PrefixTracker:
    """The tracker the gateway plugs into its Router when ``router.policy == "kv_aware"``.

    ``http`` / ``adapter_for`` enable the engine /tokenize fallback for models without local
    tokenizer files. With ``index.backend: redis`` replicas also share in-flight load.
    """
    index = build_index(config, metrics, clock)
    shared = None
    if config.index.backend == "redis_cluster":
        from orchestrator.kv.redis_cluster_index import CLUSTER_DOWN_ERRORS, RedisClusterPrefixIndex
        from orchestrator.kv.shared_load import SharedLoad
        assert isinstance(index, RedisClusterPrefixIndex)
        p = config.index.key_prefix
        tagged = f"{p}:{{{p}:load}}"  # one hash tag: the load scripts touch several workers' keys
        shared = SharedLoad(index.client, tagged, route_key=f"{tagged}:route", down_errors=CLUSTER_DOWN_ERRORS,
                            call_timeout_s=0.5)
    if config.index.backend == "redis":
        from orchestrator.kv.redis_index import RedisPrefixIndex
        from orchestrator.kv.shared_load import SharedLoad
        assert isinstance(index, RedisPrefixIndex)
        shared = SharedLoad(index.client, config.index.key_prefix)
    tokenizer = RequestTokenizer(config, http, adapter_for)
    tracker = PrefixTracker(config, fleet, index, tokenizer, metrics, clock, shared)
    if config.index.ingest_shard and shared is not None and config.index.ingest_events:
        from orchestrator.kv.redis_cluster_index import CLUSTER_DOWN_ERRORS
        tracker.shards = IngestShards(index.client, config.index.key_prefix,  # type: ignore[attr-defined]
                                      shared.replica_id, down_errors=CLUSTER_DOWN_ERRORS)
    return tracker


def _keyed(req: RouteRequest, session_key: str | None) -> RouteRequest:
    """``req`` with ``session_key`` (and nothing else found)."""
    if req.session_key == session_key:
        return req
    return req.annotated(token_ids=req.token_ids, prompt_tokens=req.prompt_tokens, block_size=req.block_size,
                         block_hashes=req.block_hashes, overlaps=req.overlaps, peer_load=req.peer_load,
                         session_key=session_key)
