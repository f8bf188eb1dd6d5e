"""KV cache events from engines → prefix index updates.

Two parts:

* ``KvEventMapper`` (pure, one per worker): turns vLLM-shaped events into index operations. A
  ``BlockStored`` is re-hashed from its ``token_ids`` with our own hasher (so engine seeds, hash
  algorithms and versions do not matter) and the engine hash → our hash pairs are remembered, because
  ``BlockRemoved`` carries only engine hashes. ``medium`` gives the tier.
* ``KvEventSubscriber`` (I/O, one per worker): a ZMQ SUB socket on the engine's publisher.
  Multipart ``[topic, seq (8-byte big-endian), msgpack [ts, [event...], dp_rank]]``. A jump in
  ``seq`` is a gap: the missed batches are fetched from the engine's replay endpoint (DEALER, send
  ``[b"", start_seq]``, receive ``[b"", topic, seq, payload]`` until seq = -1). A live ``seq`` that
  goes back (below the previous live one) means the engine restarted: its old entries are cleared
  first. A subscriber that joins late (first seq > 0) replays from 0 to learn what the engine
  already holds.

What an engine sends is not trusted: a message with the wrong frames, a ``seq`` that is not an 8-byte
non-negative counter, an undecodable payload or an event with fields of the wrong shape is skipped and
counted (``malformed``; ``dyad_kv_events_total{type="malformed"}``), logged at a bounded rate, and the
stream goes on. A batch is decoded and applied ``EVENTS_PER_CHUNK`` events at a time, yielding to the
event loop in between, so one huge batch cannot stall it. (No ZMQ ``MAXMSGSIZE``: libzmq 4.3 ends a
connecting socket's session for good on an oversized message, without reconnecting.) The engine hash →
our hash map keeps at most ``max_mapped`` blocks per worker (oldest dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.index import GROUP_BLOCKS, Tier

log = logging.getLogger("dyad.kv.events")

END_SEQ = -1
EVENTS_PER_CHUNK = 1024  # events decoded and applied between two yields to the event loop
MAX_MAPPED_BLOCKS = 1_000_000  # engine hash → our hash entries kept per worker (index.max_blocks by default)
KNOWN_EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class _BoundedLog:
    """A warning at most once per ``interval_s`` (with how many were not logged since)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._quiet = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._quiet += 1
            return
        if self._quiet:
            msg += " (%d more like it not logged)"
            args = (*args, self._quiet)
        self._quiet = 0
        self._next = now + self.interval_s
        log.warning(msg, *args)


@dataclass
class IndexOp:
    """One change to the index for one worker: ``store`` / ``remove`` hashes in a tier, or ``clear``."""

    kind: str
    hashes: list[int] = field(default_factory=list)
    tier: Tier | None = None
    block_size: int | None = None
    namespace: str | None = None
    anchors: list[int] | None = None  # each hash's group anchor (index.chain_anchors)


def _as_int(h: Any) -> int:
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(h[-8:], "big")
    return int(h) & 0xFFFFFFFFFFFFFFFF


class KvEventMapper:
    """Per-worker translation of engine events into our block hashes (pure; no I/O)."""

    def __init__(self, worker_id: str, namespace: Callable[[], str | None],
                 max_mapped: int = MAX_MAPPED_BLOCKS) -> None:
        self.worker_id = worker_id
        self._namespace = namespace  # the worker's canonical model name (resolved lazily)
        # Bounded: an engine that never reports removals (or whose BlockRemoved were lost) must not grow
        # it forever. The oldest stored are dropped first (a later BlockRemoved of one is then ignored,
        # a child stored under it is counted ``unmapped``; the index's own cap ages their entries out).
        self.max_mapped = max(1, max_mapped)
        self.forgotten = 0  # entries dropped by that cap
        # engine hash → (our hash, tier mask, position in its chain, group anchor)
        self.engine_to_ours: dict[int, tuple[int, int, int, int]] = {}
        self.unmapped = 0  # stored blocks whose parent we never saw (cannot be chained)
        self.skipped = 0  # blocks we do not index (multimodal keys, non-primary KV groups)
        self.malformed = 0  # events whose fields have the wrong shape (skipped; see ``apply``)

    def reset(self) -> None:
        self.engine_to_ours.clear()

    def apply(self, event: dict[str, Any]) -> IndexOp | None:
        """One event → its index operation (None: nothing to do). An event whose fields have the wrong
        shape (another engine version, a bug) is skipped and counted in ``malformed``: the index is a
        routing hint, and one bad event must not stop the engine's whole stream."""
        try:
            return self._apply(event)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
            self.malformed += 1
            if self.malformed == 1 or self.malformed % 1000 == 0:
                log.warning("kv events for %s: skipped a malformed %s event (%d so far)", self.worker_id,
                            str(event.get("type"))[:40], self.malformed)
            return None

    def _apply(self, event: dict[str, Any]) -> IndexOp | None:
        kind = event.get("type")
        if kind == "BlockStored":
            return self._stored(event)
        if kind == "BlockRemoved":
            return self._removed(event)
        if kind == "AllBlocksCleared":
            self.reset()
            return IndexOp("clear")
        return None

    def _stored(self, ev: dict[str, Any]) -> IndexOp | None:
        if ev.get("group_idx") not in (None, 0):
            self.skipped += len(ev.get("block_hashes") or ())
            return None
        engine_hashes = [_as_int(h) for h in ev.get("block_hashes") or ()]
        tokens = ev.get("token_ids") or []
        block_size = ev.get("block_size") or 0
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise TypeError(f"block_size {type(block_size).__name__}")
        if engine_hashes and not tokens:
            return self._stored_known(engine_hashes, Tier.from_medium(ev.get("medium")))
        if not engine_hashes or block_size <= 0 or len(tokens) < block_size * len(engine_hashes):
            return None
        extra = ev.get("extra_keys") or []
        lora = ev.get("lora_name")
        if lora is not None and not isinstance(lora, str):
            raise TypeError(f"lora_name {type(lora).__name__}")  # (a namespace: a name, or nothing)
        salt: str | None = None
        for keys in extra:
            for k in keys or ():
                if isinstance(k, str):
                    if k != lora:
                        salt = k  # cache_salt (first block only, by vLLM's construction)
                else:
                    self.skipped += len(engine_hashes)
                    return None  # multimodal identifiers: text-only requests never match these blocks
        namespace = lora or self._namespace()
        if namespace is None:
            return None
        parent = ev.get("parent_block_hash")
        parent_ours: int | None = None
        pos, anchor = 0, 0
        if parent is not None:
            known = self.engine_to_ours.get(_as_int(parent))
            if known is None:
                self.unmapped += len(engine_hashes)
                return None
            parent_ours, pos, anchor = known[0], known[2] + 1, known[3]
        hasher = BlockHasher(namespace, block_size, None if parent is not None else salt)
        ours = hasher.hash_blocks(tokens[: block_size * len(engine_hashes)], parent=parent_ours)
        tier = Tier.from_medium(ev.get("medium"))
        anchors: list[int] = []
        for eh, oh in zip(engine_hashes, ours, strict=True):
            if pos % GROUP_BLOCKS == 0:
                anchor = oh
            anchors.append(anchor)
            prev = self.engine_to_ours.pop(eh, None)  # (re-inserted: the newest again)
            self.engine_to_ours[eh] = (oh, (prev[1] if prev else 0) | int(tier), pos, anchor)
            pos += 1
        self._cap()
        return IndexOp("store", ours, tier, block_size=block_size, namespace=namespace, anchors=anchors)

    def _cap(self) -> None:
        known = self.engine_to_ours
        over = len(known) - self.max_mapped
        if over > 0:
            for eh in list(itertools.islice(known, over)):
                del known[eh]
            self.forgotten += over

    def _stored_known(self, engine_hashes: list[int], tier: Tier) -> IndexOp | None:
        """A block moved to another tier, announced by engine hash only (vLLM's OffloadingConnector
        sends offloads as BlockStored ``medium: "CPU"`` with no tokens unless its
        ``self_describing_kv_events`` is on): blocks we already know gain the tier; unknown ones
        cannot be re-hashed and are skipped."""
        ours: list[int] = []
        anchors: list[int] = []
        known_map = self.engine_to_ours
        for eh in engine_hashes:
            known = known_map.get(eh)
            if known is None:
                self.unmapped += 1
                continue
            known_map[eh] = (known[0], known[1] | int(tier), known[2], known[3])
            ours.append(known[0])
            anchors.append(known[3])
        return IndexOp("store", ours, tier, anchors=anchors) if ours else None

    def _removed(self, ev: dict[str, Any]) -> IndexOp | None:
        if ev.get("group_idx") not in (None, 0):
            return None
        tier = Tier.from_medium(ev.get("medium"))
        ours: list[int] = []
        for h in ev.get("block_hashes") or ():
            eh = _as_int(h)
            known = self.engine_to_ours.get(eh)
            if known is None:
                continue
            ours.append(known[0])
            left = known[1] & ~int(tier)
            if left:
                self.engine_to_ours[eh] = (known[0], left, known[2], known[3])
            else:
                del self.engine_to_ours[eh]
        return IndexOp("remove", ours, tier) if ours else None


def iter_batch(payload: bytes, chunk: int = EVENTS_PER_CHUNK) -> Iterator[tuple[float, list[dict[str, Any]]]]:
    """msgpack ``[ts, [event...], dp_rank?]`` (or a map ``{"ts", "events"}``) → ``(ts, events)`` for every
    ``chunk`` events, decoded as they are asked for (a huge batch is never held decoded whole, and its
    reader can yield between chunks). Events that are not maps are dropped. Raises (ValueError,
    TypeError, msgpack's errors) on a payload of another shape, possibly after earlier chunks."""
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(payload), 1))
    u.feed(payload)
    ts = 0.0
    try:
        n = u.read_array_header()
    except ValueError:  # not an array: a map-shaped batch, tolerated
        u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(payload), 1))
        u.feed(payload)
        for _ in range(u.read_map_header()):
            key = u.unpack()
            if key == "ts":
                ts = _ts(u.unpack())
            elif key == "events":
                yield from _events(u, ts, chunk)
            else:
                u.skip()
        return
    if n < 2:
        raise ValueError(f"a batch of {n} fields")
    yield from _events(u, _ts(u.unpack()), chunk)


def _ts(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"timestamp {type(value).__name__}")
    return float(value)


def _events(u: msgpack.Unpacker, ts: float, chunk: int) -> Iterator[tuple[float, list[dict[str, Any]]]]:
    buf: list[dict[str, Any]] = []
    sent = False
    for _ in range(u.read_array_header()):
        ev = u.unpack()
        if isinstance(ev, dict):
            buf.append(ev)
            if len(buf) >= chunk:
                yield ts, buf
                buf, sent = [], True
    if buf or not sent:
        yield ts, buf


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """The whole batch at once (``iter_batch`` in one piece)."""
    ts, events = 0.0, []
    for when, part in iter_batch(payload, chunk=1 << 62):
        ts = when
        events.extend(part)
    return ts, events


BatchHandler = Callable[[str, float, list[dict[str, Any]]], Awaitable[None]]
ResetHandler = Callable[[str, str], Awaitable[None]]


class KvEventSubscriber:
    """Follows one engine's event stream; calls ``on_batch(worker_id, ts, events)`` in order."""

    def __init__(self, worker_id: str, endpoint: str, on_batch: BatchHandler, on_reset: ResetHandler,
                 *, replay_endpoint: str | None = None, topic: str = "kv-events",
                 context: zmq.asyncio.Context | None = None, replay_timeout_s: float = 2.0,
                 on_gap: Callable[[str, int], None] | None = None, host: str = "127.0.0.1",
                 on_malformed: Callable[[str, str], None] | None = None) -> None:
        self.worker_id = worker_id
        self.endpoint = _connectable(endpoint, host)
        self.replay_endpoint = _connectable(replay_endpoint, host) if replay_endpoint else None
        self.topic = topic
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.on_gap = on_gap
        self.on_malformed = on_malformed  # (worker, what): a message or batch skipped as malformed
        self._ctx = context or zmq.asyncio.Context.instance()
        self.replay_timeout_s = replay_timeout_s
        self.next_seq: int | None = None  # the seq we expect next; None = nothing seen yet
        self._last_live: int | None = None  # the last seq the live socket delivered
        self.batches = 0
        self.gaps = 0
        self.replayed = 0
        self.restarts = 0
        self.failed = 0  # batches (chunks of one) ``on_batch`` raised on (skipped; the subscriber goes on)
        self.malformed = 0  # messages skipped: wrong frames, a bad seq, an undecodable payload
        self.errors = 0  # other failures while handling one message (the subscriber goes on)
        self._warn = _BoundedLog()
        self._task: asyncio.Task[None] | None = None
        # On start, learn what the engine already holds (its replay buffer) before following it live.
        self._want_full_replay = self.replay_endpoint is not None

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"dyad-kv-events-{self.worker_id}")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def request_full_replay(self) -> None:
        """Re-learn everything the engine still buffers (after its entries were cleared)."""
        self._want_full_replay = True

    def _malformed(self, what: str, detail: str) -> None:
        self.malformed += 1
        if self.on_malformed is not None:
            self.on_malformed(self.worker_id, what)
        self._warn.warning("kv events for %s: skipped a malformed %s: %s (%d so far)", self.worker_id, what,
                           detail[:200], self.malformed)

    def _seq_of(self, frame: bytes, *, end_ok: bool = False) -> int | None:
        """The 8-byte big-endian counter of a message, None (counted) when it is not one."""
        if len(frame) != 8:
            self._malformed("message", f"a seq of {len(frame)} bytes")
            return None
        seq = int.from_bytes(frame, "big", signed=True)
        if seq < 0 and not (end_ok and seq == END_SEQ):
            self._malformed("message", f"seq {seq}")
            return None
        return seq

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            while True:
                try:
                    await self._step(sub)
                except (asyncio.CancelledError, zmq.ContextTerminated):
                    raise
                except Exception as e:  # noqa: BLE001 - one message must not end the stream; log and go on
                    self.errors += 1
                    self._warn.warning("kv events for %s: a message could not be handled (%s: %s); following on",
                                       self.worker_id, type(e).__name__, e)
                    await asyncio.sleep(0.1)  # (a failure that repeats does not spin)
        except asyncio.CancelledError:
            raise
        except zmq.ContextTerminated:
            log.info("kv events for %s: ZMQ context closed; subscriber stopped", self.worker_id)
        finally:
            sub.close(linger=0)

    async def _step(self, sub: zmq.asyncio.Socket) -> None:
        if self._want_full_replay and self.replay_endpoint:
            self._want_full_replay = False
            self.next_seq = 0
            await self._replay(0, None)
        if not await sub.poll(200):
            return
        frames = await sub.recv_multipart()
        if len(frames) != 3:
            self._malformed("message", f"{len(frames)} frames, not [topic, seq, payload]")
            return
        seq = self._seq_of(frames[1])
        if seq is not None:
            await self._on_live(seq, frames[2])

    async def _on_live(self, seq: int, payload: bytes) -> None:
        expected = self.next_seq
        last, self._last_live = self._last_live, seq
        if last is not None and seq <= last:
            # The live sequence went back: a new publisher, i.e. the engine restarted with an empty cache.
            # (One publisher's live stream only goes forward. Compared with ``next_seq`` instead, the live
            # batches that queued up during a full replay, older than what the replay applied, read as a
            # restart: the entries were cleared and replayed once more.)
            self.restarts += 1
            log.info("kv events for %s: sequence reset (%d after %d): engine restarted", self.worker_id, seq, last)
            expected = None
            self.next_seq = None
            try:
                await self.on_reset(self.worker_id, "restart")
            except Exception as e:  # noqa: BLE001 - (e.g. a shared index refusing writes): follow on regardless
                self.errors += 1
                self._warn.warning("kv events for %s: clearing after the restart failed (%s: %s)", self.worker_id,
                                   type(e).__name__, e)
            if seq > 0:
                await self._replay(0, seq)
        elif expected is None and seq > 0 and self.replay_endpoint:
            await self._replay(0, seq)  # joined late: learn what the engine already holds
        elif expected is not None and seq > expected:
            self.gaps += 1
            if self.on_gap:
                self.on_gap(self.worker_id, seq - expected)
            log.info("kv events for %s: gap %d..%d, replaying", self.worker_id, expected, seq - 1)
            await self._replay(expected, seq)
        if self.next_seq is not None and seq < self.next_seq:
            return  # already applied (came through a replay)
        await self._apply(seq, payload)

    async def _apply(self, seq: int, payload: bytes) -> None:
        """Decode and apply one batch, ``EVENTS_PER_CHUNK`` events at a time with a yield to the loop in
        between. A payload that cannot be decoded is skipped (counted) from where it breaks."""
        self.next_seq = seq + 1
        chunks = iter_batch(payload)
        counted = False
        while True:
            try:
                chunk = next(chunks, None)
            except Exception as e:  # noqa: BLE001 - a corrupt batch is skipped, not fatal
                self._malformed("batch", f"batch {seq}: {type(e).__name__}: {e}")
                return
            if chunk is None:
                return
            if not counted:
                self.batches += 1
                counted = True
            try:
                await self.on_batch(self.worker_id, chunk[0], chunk[1])
            except Exception as e:  # noqa: BLE001 - one batch that cannot be applied must not end the stream
                self.failed += 1
                self._warn.warning("kv events for %s: batch %d not applied: %s: %s", self.worker_id, seq,
                                   type(e).__name__, e)
            if len(chunk[1]) >= EVENTS_PER_CHUNK:
                await asyncio.sleep(0)  # a long batch: let the loop run between its chunks

    async def _replay(self, start: int, stop: int | None) -> None:
        """Fetch and apply batches ``start <= seq < stop`` (or all buffered when stop is None)."""
        if not self.replay_endpoint:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(int(left * 1000)):
                    self._warn.warning("kv events for %s: replay from %d timed out", self.worker_id, start)
                    return
                frames = await dealer.recv_multipart()
                if len(frames) < 4:
                    self._malformed("replay message", f"{len(frames)} frames")
                    continue
                seq = self._seq_of(frames[2], end_ok=True)
                if seq is None:
                    continue
                if seq == END_SEQ:
                    return
                if seq < start or (stop is not None and seq >= stop):
                    continue
                if self.next_seq is not None and seq < self.next_seq:
                    continue
                self.replayed += 1
                await self._apply(seq, frames[3])
        finally:
            dealer.close(linger=0)


def _connectable(endpoint: str, host: str = "127.0.0.1") -> str:
    """vLLM configs bind ``tcp://*:port``; a subscriber connects to the engine's host instead."""
    return endpoint.replace("tcp://*:", f"tcp://{host}:").replace("tcp://0.0.0.0:", f"tcp://{host}:")
