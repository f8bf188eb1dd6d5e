"""The simulated engine's pure core: continuous batching over a block-granular prefix cache.

No asyncio, no sockets, no wall clock: the caller passes ``now`` everywhere. The HTTP server drives
one ``EngineModel`` in real time; the virtual-time fleet simulator drives many directly.

Scheduling follows vLLM v1 in spirit: each step serves the running sequences first (one token per
decoding sequence, a chunk per prefilling one) and then admits waiting requests FCFS, all within
``max_num_batched_tokens`` and ``max_num_seqs``. A request is admitted only when blocks for its
whole prompt are available (evicting unreferenced cached blocks LRU-first); a decoding sequence
that cannot grow preempts the most recently admitted one (recompute). Step time comes from the
profile's cost model.

Speed: when a step would contain only decoding sequences and nothing is waiting to be admitted,
the core plans a *run* of identical-composition steps in one go (until the first sequence finishes
or the next request becomes ready), so an hour of traffic costs per-run, not per-token, Python work.

Prefix cache: blocks are keyed by a chained hash over token ids (``chain_block_hashes``), computed
here; KV events (BlockStored / BlockRemoved / AllBlocksCleared) are recorded exactly in vLLM's
shape (docs/engines.md §3): only full blocks, none for hits. vLLM sends one BlockRemoved per evicted
block; the sim sends one per eviction burst listing all its blocks (same shape, same meaning).

Host tier (``profile.host_kv_tokens > 0``, vLLM's native CPU offloading): a block evicted from GPU is
demoted into a host LRU of that capacity instead of being lost (BlockStored ``medium: "CPU"`` in the
placeholder shape vLLM's OffloadingConnector sends by default: the engine hash only, no tokens; then
BlockRemoved ``GPU``); the host LRU's own evictions are BlockRemoved ``CPU``. A prompt whose cached
prefix continues in the host tier reloads those blocks into GPU memory (BlockStored ``GPU``, then
BlockRemoved ``CPU``: the tiers are exclusive), paying ``profile.host_reload_seconds`` on the step
that starts its prefill instead of recomputing them. Reloaded tokens count as cached for the
request (``num_cached_tokens``) and as ``external_kv_transfer`` / ``host_cache_hits`` in the stats,
not as GPU prefix-cache hits (vLLM counts connector hits apart too).

Generation: the sim never emits EOS while ``max_tokens`` is set (it generates exactly
``max_tokens``, finish reason ``length``); without ``max_tokens`` it stops ("stop") after a
deterministic length between 16 and 128 tokens. Token ids come from ``tokenizer.output_token_ids``.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.sim.profiles import EngineProfile
from orchestrator.sim.tokenizer import DEFAULT_VOCAB_SIZE, output_token_ids

_MASK64 = (1 << 64) - 1

# Histogram buckets exactly as vLLM 0.32 exports them (tests/unit/data/vllm-0.32-metrics.txt).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to max_model_len, for prompt/generation length histograms."""
    out: list[float] = []
    m = 1
    while True:
        for f in (1, 2, 5):
            v = m * f
            if v > max_model_len:
                return tuple(out)
            out.append(float(v))
        m *= 10


def chain_block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None,
                       start_block: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``h_i = hash((h_{i-1}, tokens of block i))`` over a tuple of ints — deterministic across
    processes (int and tuple hashing is not salted), masked to an unsigned 64-bit value.
    """
    n_full = len(token_ids) // block_size
    out = []
    h = parent if parent is not None else 0x5D1A_D5EE_D000_0001
    for i in range(start_block, n_full):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size]))) & _MASK64
        out.append(h)
    return out


class Hist:
    """A cumulative-on-render histogram: per-bucket counts, sum, count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += n
        self.sum += v * n
        self.count += n

    def cumulative(self) -> list[tuple[float, int]]:
        out, acc = [], 0
        for b, c in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += c
            out.append((b, acc))
        return out


class EngineStats:
    """Counters and histograms with vLLM's meaning (rendered by the server under vLLM's names)."""

    def __init__(self, max_model_len: int) -> None:
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_cache_hits = 0  # prompt tokens reloaded from the host tier instead of recomputed
        self.host_cache_queries = 0  # prompt tokens looked up in the host tier (past the GPU hit)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prompt_tokens_by_source = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self.request_success = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.num_preemptions = 0
        self.ttft = Hist(TTFT_BUCKETS)
        self.itl = Hist(ITL_BUCKETS)
        self.e2e = Hist(LATENCY_BUCKETS)
        self.queue_time = Hist(LATENCY_BUCKETS)
        self.prefill_time = Hist(LATENCY_BUCKETS)
        self.decode_time = Hist(LATENCY_BUCKETS)
        tb = token_buckets(max_model_len)
        self.prompt_len = Hist(tb)
        self.generation_len = Hist(tb)


@dataclass
class SimRequest:
    """What the engine is asked to do. ``max_tokens=None`` → the sim picks a natural stop length."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int | None = 16
    do_remote_decode: bool = False  # P/D prefill side: produce 1 token, keep the KV for a remote decode
    remote_prefill: bool = False  # P/D decode side: KV arrives by transfer, no local prefill compute
    output_seed: int | None = None  # default: derived from the engine seed and the prompt
    block_hashes: Sequence[int] | None = None  # precomputed chain_block_hashes(prompt, block_size)


class SimOutput:
    """New tokens of one request since the last ``advance`` (times are the steps' end times)."""

    __slots__ = ("request_id", "start_index", "times", "finished", "finish_reason", "num_cached_tokens",
                 "output_seed", "lease_block_ids", "prompt_tokens")

    def __init__(self, request_id: str, start_index: int, times: list[float], finished: bool,
                 finish_reason: str | None, num_cached_tokens: int, output_seed: int, prompt_tokens: int,
                 lease_block_ids: list[int] | None = None) -> None:
        self.request_id = request_id
        self.start_index = start_index
        self.times = times
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_cached_tokens = num_cached_tokens
        self.output_seed = output_seed
        self.prompt_tokens = prompt_tokens
        self.lease_block_ids = lease_block_ids

    @property
    def num_tokens(self) -> int:
        return len(self.times)

    def token_ids(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
        return output_token_ids(self.output_seed, self.start_index, len(self.times), vocab_size)

    def __repr__(self) -> str:
        return (f"SimOutput({self.request_id!r}, start={self.start_index}, n={len(self.times)}, "
                f"finished={self.finished}, reason={self.finish_reason})")


class SimRequestError(ValueError):
    """A request the engine refuses (too long for the context or the cache, duplicate id)."""


_PENDING, _WAITING, _TRANSFER, _RUNNING, _LEASED, _DONE = range(6)


class _Req:
    __slots__ = ("req", "rid", "prompt", "prompt_len", "prefill_target", "num_computed", "generated", "target",
                 "natural_stop", "hashes", "held", "private", "state", "arrival", "ready", "scheduled_at",
                 "first_token_at", "last_token_at", "cached_tokens", "seed", "counted", "block_ids", "aborted",
                 "reload_s")

    def __init__(self, req: SimRequest, seed: int, target: int, natural_stop: bool, now: float, ready: float):
        self.req = req
        self.rid = req.request_id
        self.prompt = req.prompt_token_ids
        self.prompt_len = len(req.prompt_token_ids)
        self.prefill_target = self.prompt_len  # grows on preemption (prompt + generated are recomputed)
        self.num_computed = 0
        self.generated = 0
        self.target = target
        self.natural_stop = natural_stop
        self.hashes: list[int] | None = list(req.block_hashes) if req.block_hashes is not None else None
        self.held: list[int] = []  # cached block hashes this request references
        self.private = 0  # blocks it holds that are not (yet) in the prefix cache
        self.state = _PENDING
        self.arrival = now
        self.ready = ready
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.cached_tokens = 0
        self.seed = seed
        self.counted = False
        self.block_ids: list[int] | None = None
        self.aborted = False
        self.reload_s = 0.0  # host-tier reload time charged to the step that starts its prefill

    @property
    def nblocks(self) -> int:
        return len(self.held) + self.private


class _Run:
    """Steps planned in one go. ``chunks`` non-empty ⇒ exactly one (mixed) step."""

    __slots__ = ("decodes", "chunks", "ends", "done")

    def __init__(self, decodes: list[_Req], chunks: list[tuple[_Req, int]], ends: list[float]) -> None:
        self.decodes = decodes
        self.chunks = chunks
        self.ends = ends
        self.done = 0  # steps committed


class EngineModel:
    """One simulated engine. Drive it with ``submit`` / ``abort`` / ``advance(now)``; ask
    ``next_event_time()`` when to call ``advance`` next (None = idle)."""

    def __init__(self, profile: EngineProfile, seed: int = 0, *, engine_id: str = "sim-0",
                 record_kv_events: bool = True, track_histograms: bool = True,
                 vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        self.profile = profile
        self.seed = seed
        self.engine_id = engine_id
        self.vocab_size = vocab_size
        self.record_kv_events = record_kv_events
        self.track_histograms = track_histograms
        self.stats = EngineStats(profile.max_model_len)
        self._bs = profile.block_size
        self._t = 0.0  # when the engine became idle (end of the last step)
        self._reqs: dict[str, _Req] = {}
        self._pending: list[tuple[float, int, _Req]] = []  # heap by ready time: arrivals + transfers
        self._pending_n = 0
        self._waiting: deque[_Req] = deque()
        self._running: dict[str, _Req] = {}
        self._leases: list[tuple[float, str]] = []  # heap of (expiry, request id)
        self._run: _Run | None = None
        self._cache: dict[int, int] = {}  # block hash → reference count
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, eviction order
        self._private_total = 0
        self._host: OrderedDict[int, None] = OrderedDict()  # host-tier blocks, LRU first
        self._host_cap = profile.host_kv_tokens // profile.block_size
        self._next_block_id = 0
        self._events: list[tuple[float, list[dict[str, Any]]]] = []
        self._held_outputs: list[SimOutput] = []

    # ------------------------------------------------------------------ public API
    def submit(self, req: SimRequest, now: float) -> None:
        """Accept a request at ``now``; it becomes schedulable after the profile's request overhead."""
        p = self.profile
        if req.request_id in self._reqs:
            raise SimRequestError(f"request id {req.request_id!r} is already in flight")
        n = len(req.prompt_token_ids)
        if n < 1:
            raise SimRequestError("the prompt must contain at least one token")
        natural = req.max_tokens is None
        seed = req.output_seed if req.output_seed is not None else self._derive_seed(req.prompt_token_ids)
        target = (16 + seed % 113) if natural else int(req.max_tokens)  # type: ignore[arg-type]
        if req.do_remote_decode:
            target = 1
        if target < 1:
            raise SimRequestError("max_tokens must be at least 1")
        if natural:
            target = max(1, min(target, p.max_model_len - n))
        if n + target > p.max_model_len:
            raise SimRequestError(
                f"This model's maximum context length is {p.max_model_len} tokens. However, you requested "
                f"{n + target} tokens ({n} in the messages, {target} in the completion). Please reduce the "
                f"length of the messages or completion.")
        if -(-(n + target) // self._bs) > p.num_gpu_blocks:
            raise SimRequestError(f"the request needs more KV cache blocks than the engine has ({p.num_gpu_blocks})")
        self._advance_into(now, self._held_outputs)
        r = _Req(req, seed, target, natural, now, now + p.request_overhead_s)
        self._reqs[r.rid] = r
        self._push_pending(r)
        self._cut_run(r.ready)

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a request (client went away). True if it was still in flight."""
        self._advance_into(now, self._held_outputs)
        r = self._reqs.get(request_id)
        if r is None or r.state in (_DONE, _LEASED):
            return False
        run = self._run
        if run is not None:
            if r in run.decodes:
                run.decodes.remove(r)
            run.chunks = [(q, k) for q, k in run.chunks if q is not r]
        r.aborted = True
        self._cut_run(now)
        if r.state == _WAITING:
            self._waiting.remove(r)
        elif r.state == _RUNNING:
            del self._running[r.rid]
        # _PENDING / _TRANSFER entries stay in the heap and are skipped when popped.
        self._free_blocks(r)
        r.state = _DONE
        del self._reqs[r.rid]
        self.stats.request_success["abort"] += 1
        return True

    def advance(self, now: float) -> list[SimOutput]:
        """Run every step that ends at or before ``now``; return the tokens they produced."""
        out, self._held_outputs = self._held_outputs, []
        self._advance_into(now, out)
        return out

    def next_event_time(self) -> float | None:
        """When the next step ends (or the next queued request becomes schedulable); None if idle."""
        run = self._run
        if run is not None:
            return run.ends[run.done]
        return self._next_start()

    def run_end_time(self) -> float | None:
        """When the whole planned run of steps ends (``next_event_time`` is its next step); None when
        no run is planned. A driver that needs no per-step tokens can sleep until then: a submit or
        an abort cuts the run anyway."""
        run = self._run
        return None if run is None else run.ends[-1]

    def release_lease(self, request_id: str, now: float) -> bool:
        """The remote decode engine has pulled this prefill's KV: unpin its blocks."""
        r = self._reqs.get(request_id)
        if r is None or r.state != _LEASED:
            return False
        self._finish_lease(r)
        return True

    def lease_info(self, request_id: str) -> tuple[int, list[int]] | None:
        """(prompt tokens, block ids) of a leased prefill, or None."""
        r = self._reqs.get(request_id)
        if r is None or r.state != _LEASED:
            return None
        return r.prompt_len, list(r.block_ids or [])

    def reset_prefix_cache(self, now: float) -> bool:
        """Drop every unreferenced cached block and publish AllBlocksCleared (vLLM refuses while
        blocks are in use; so do we)."""
        self._advance_into(now, self._held_outputs)
        if any(c > 0 for c in self._cache.values()):
            return False
        self._cache.clear()
        self._lru.clear()
        self._host.clear()
        if self.record_kv_events:
            self._emit(now, {"type": "AllBlocksCleared"})
        return True

    def drain_kv_events(self) -> list[tuple[float, list[dict[str, Any]]]]:
        """KV event batches recorded since the last drain, one batch per engine step."""
        ev, self._events = self._events, []
        return ev

    # --- gauges --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine (waiting for admission or for a KV transfer)."""
        return len(self._waiting) + sum(1 for _, _, r in self._pending if r.state == _TRANSFER)

    @property
    def num_in_flight(self) -> int:
        return sum(1 for r in self._reqs.values() if r.state != _LEASED)

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks referenced by requests (unreferenced cached blocks count as free)."""
        used = self.profile.num_gpu_blocks - self._free_count() - len(self._lru)
        return used / self.profile.num_gpu_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    @property
    def waiting_prefill_tokens(self) -> int:
        """Uncomputed prompt tokens of queued and running requests (the engine's prefill backlog)."""
        tot = sum(r.prefill_target - r.num_computed for r in self._waiting)
        tot += sum(r.prefill_target - r.num_computed for r in self._running.values())
        tot += sum(r.prefill_target for _, _, r in self._pending if r.state == _PENDING)
        return tot

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of this prompt are in the prefix cache right now (no side effects)."""
        return self.cached_prefix_blocks(chain_block_hashes(token_ids, self._bs)) * self._bs

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    def cached_prefix_tiers(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """(GPU blocks, host blocks) of the leading cached prefix of this hash chain: the GPU prefix,
        then how far it continues in the host tier (no side effects)."""
        dev = self.cached_prefix_blocks(block_hashes)
        host = self._host
        n = 0
        if host:
            for h in block_hashes[dev:]:
                if h not in host:
                    break
                n += 1
        return dev, n

    def cached_prefix_blocks(self, block_hashes: Iterable[int]) -> int:
        """How many leading blocks of this hash chain are in the prefix cache (no side effects, no
        LRU touch)."""
        cache = self._cache
        n = 0
        for h in block_hashes:
            if h not in cache:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ internals: time
    def _derive_seed(self, prompt: Sequence[int]) -> int:
        return hash((self.seed, len(prompt), tuple(prompt[-64:]))) & 0x7FFFFFFFFFFFFFFF

    def _push_pending(self, r: _Req) -> None:
        self._pending_n += 1
        heapq.heappush(self._pending, (r.ready, self._pending_n, r))

    def _next_start(self) -> float | None:
        cands = []
        if self._running or (self._waiting and self._can_admit(self._waiting[0])):
            cands.append(self._t)
        while self._pending and self._pending[0][2].aborted:
            heapq.heappop(self._pending)
        if self._pending:
            cands.append(self._pending[0][0])
        if self._leases and self._waiting:
            cands.append(self._leases[0][0])
        if not cands:
            return None
        return max(self._t, min(cands))

    def _advance_into(self, now: float, out: list[SimOutput]) -> None:
        while True:
            if self._run is not None:
                self._commit(now, out)
                if self._run is not None:
                    return
                continue
            start = self._next_start()
            if start is None or start > now:
                self._expire_leases(now)
                return
            self._t = start
            self._expire_leases(start)
            self._release_pending(start)
            if not self._schedule(start) and self._next_start() == start:
                return  # nothing schedulable at this instant (defensive: never spin)

    def _release_pending(self, t: float) -> None:
        pend = self._pending
        while pend and pend[0][0] <= t:
            _, _, r = heapq.heappop(pend)
            if r.aborted:
                continue
            if r.state == _PENDING:
                r.state = _WAITING
                self._waiting.append(r)
            elif r.state == _TRANSFER:  # KV arrived: recompute the last prompt token, then decode
                r.state = _RUNNING
                r.num_computed = r.prefill_target - 1
                self._store_computed_blocks(r, t)
                self._running[r.rid] = r

    def _cut_run(self, t: float) -> None:
        """Make the current run end at the first step ending at or after ``t`` (new work arrives)."""
        run = self._run
        if run is None or run.chunks or len(run.ends) <= run.done + 1:
            return
        i = bisect.bisect_left(run.ends, t, lo=run.done)
        if i < len(run.ends) - 1:
            del run.ends[i + 1:]

    # ------------------------------------------------------------------ internals: blocks
    def _free_count(self) -> int:
        return self.profile.num_gpu_blocks - self._private_total - len(self._cache)

    def _allocate(self, r: _Req, n: int, t: float) -> bool:
        if n <= 0:
            return True
        free = self._free_count()
        if free + len(self._lru) < n:
            return False
        if free < n:
            pop, cache = self._lru.popitem, self._cache
            removed = [pop(False)[0] for _ in range(n - free)]
            for h in removed:
                del cache[h]
            if self._host_cap:
                self._demote(removed, t)
            if self.record_kv_events:  # one event for the blocks evicted together (same shape as vLLM's)
                self._emit(t, {"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU", "group_idx": 0})
        r.private += n
        self._private_total += n
        return True

    def _demote(self, hashes: list[int], t: float) -> None:
        """GPU-evicted blocks enter the host tier (most recent last); the host LRU overflows."""
        host = self._host
        for h in hashes:
            host[h] = None
            host.move_to_end(h)
        dropped = [host.popitem(last=False)[0] for _ in range(len(host) - self._host_cap)]
        if self.record_kv_events:
            kept = [h for h in hashes if h in host]
            if kept:  # vLLM's default (non self-describing) offload event: engine hashes only
                self._emit(t, {"type": "BlockStored", "block_hashes": kept, "parent_block_hash": None,
                               "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
                               "lora_name": None, "group_idx": 0})
            if dropped:
                self._emit(t, {"type": "BlockRemoved", "block_hashes": dropped, "medium": "CPU", "group_idx": 0})

    def _host_hit(self, r: _Req, start: int) -> int:
        host = self._host
        if not host:
            return 0
        n = 0
        for h in self._ensure_hashes(r)[start:]:
            if h not in host:
                break
            n += 1
        return n

    def _free_blocks(self, r: _Req) -> None:
        cache, lru = self._cache, self._lru
        for h in reversed(r.held):  # tail blocks become the first to be evicted, as in vLLM
            c = cache.get(h)
            if c is None:
                continue
            c -= 1
            cache[h] = c
            if c == 0:
                lru[h] = None
        r.held = []
        self._private_total -= r.private
        r.private = 0

    def _ensure_hashes(self, r: _Req) -> list[int]:
        if r.hashes is None:
            r.hashes = chain_block_hashes(r.prompt, self._bs)
        return r.hashes

    def _hit_blocks(self, r: _Req) -> int:
        cache = self._cache
        n = 0
        for h in self._ensure_hashes(r):
            if h not in cache:
                break
            n += 1
        return n

    def _can_admit(self, r: _Req) -> bool:
        if len(self._running) >= self.profile.max_num_seqs:
            return False
        hit = self._hit_blocks(r)
        need = -(-r.prefill_target // self._bs) - hit
        lru_hits = sum(1 for h in r.hashes[:hit] if self._cache[h] == 0)  # type: ignore[index]
        return need <= self._free_count() + len(self._lru) - lru_hits

    def _store_computed_blocks(self, r: _Req, t: float, upto_tokens: int | None = None) -> None:
        """Prompt blocks up to ``upto_tokens`` (default: those computed) enter the prefix cache
        (BlockStored for new ones). The scheduler calls it for the tokens a step is about to
        compute, as vLLM does (``allocate_slots`` caches the step's full blocks when it schedules
        them), so a request admitted in the same or a later step hits a prefix still being
        prefilled instead of computing it a second time."""
        hashes = self._ensure_hashes(r)
        upto = min(len(hashes), (r.num_computed if upto_tokens is None else upto_tokens) // self._bs)
        start = len(r.held)  # held = the leading cached blocks so far
        if upto <= start:
            return
        self._cache_blocks(r, hashes, start, upto, r.prompt, t)

    def _cache_blocks(self, r: _Req, hashes: Sequence[int], start: int, upto: int,
                      tokens: Sequence[int], t: float, hold: bool = True) -> None:
        """Move r's private blocks ``start..upto`` into the prefix cache. ``hold``: r keeps a
        reference (prompt blocks while it runs); else they enter the LRU unreferenced. A block
        someone else cached first is shared instead (no event: nothing new was stored)."""
        cache, lru = self._cache, self._lru
        seg = -1
        for i in range(start, upto):
            h = hashes[i]
            c = cache.get(h)
            if c is not None:
                if seg >= 0:
                    self._emit_stored(hashes, seg, i, tokens, t)
                    seg = -1
                if hold:
                    if c == 0:
                        del lru[h]
                    cache[h] = c + 1
                    r.held.append(h)
                    r.private -= 1
                    self._private_total -= 1
                continue
            if hold:
                cache[h] = 1
                r.held.append(h)
            else:
                cache[h] = 0
                lru[h] = None
            r.private -= 1
            self._private_total -= 1
            if seg < 0:
                seg = i
        if seg >= 0:
            self._emit_stored(hashes, seg, upto, tokens, t)

    def _emit_stored(self, hashes: Sequence[int], a: int, b: int, tokens: Sequence[int], t: float) -> None:
        if not self.record_kv_events or b <= a:
            return
        bs = self._bs
        self._emit(t, {
            "type": "BlockStored",
            "block_hashes": list(hashes[a:b]),
            "parent_block_hash": hashes[a - 1] if a > 0 else None,
            "token_ids": list(tokens[a * bs:b * bs]),
            "block_size": bs,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        })

    def _emit(self, t: float, ev: dict[str, Any]) -> None:
        if self._events and self._events[-1][0] == t:
            self._events[-1][1].append(ev)
        else:
            self._events.append((t, [ev]))

    def _expire_leases(self, t: float) -> None:
        leases = self._leases
        while leases and leases[0][0] <= t:
            _, rid = heapq.heappop(leases)
            r = self._reqs.get(rid)
            if r is not None and r.state == _LEASED:
                self._finish_lease(r)

    def _finish_lease(self, r: _Req) -> None:
        self._free_blocks(r)
        r.state = _DONE
        self._reqs.pop(r.rid, None)

    # ------------------------------------------------------------------ internals: scheduling
    def _schedule(self, t: float) -> bool:
        """Plan the next step(s) starting at ``t``. False if there was nothing to run."""
        p = self.profile
        bs = self._bs
        budget = p.max_num_batched_tokens
        decodes: list[_Req] = []
        chunks: list[tuple[_Req, int]] = []
        used = 0
        # 1. running sequences (in admission order)
        for r in list(self._running.values()):
            if r.rid not in self._running:
                continue  # preempted below
            if used >= budget:
                break
            if r.num_computed < r.prefill_target:
                k = min(r.prefill_target - r.num_computed, budget - used)
                chunks.append((r, k))
                used += k
                continue
            need = -(-(r.prefill_target + r.generated + 1) // bs) - r.nblocks
            while need > 0 and not self._allocate(r, need, t):
                victim = self._running[next(reversed(self._running))]
                self._preempt(victim)
                if victim is r:
                    break
                decodes = [d for d in decodes if d is not victim]
                chunks = [(q, k) for q, k in chunks if q is not victim]
            if r.rid not in self._running:
                continue
            decodes.append(r)
            used += 1
        # the blocks this step computes are cached now, when scheduled (vLLM's allocate_slots)
        for r, k in chunks:
            self._store_computed_blocks(r, t, r.num_computed + k)
        # 2. admit waiting requests FCFS
        waiting = self._waiting
        while waiting and used < budget and len(self._running) < p.max_num_seqs:
            r = waiting[0]
            if not self._admit(r, t):
                break
            waiting.popleft()
            if r.state == _TRANSFER:
                continue
            k = min(r.prefill_target - r.num_computed, budget - used)
            chunks.append((r, k))
            self._store_computed_blocks(r, t, r.num_computed + k)
            used += k
        used = sum(k for _, k in chunks) + len(decodes)
        if not decodes and not chunks:
            return False
        if chunks:
            ctx = sum(r.prefill_target + r.generated for r in decodes)
            reload_s = 0.0
            for r, _k in chunks:
                if r.reload_s:
                    reload_s += r.reload_s
                    r.reload_s = 0.0
            dur = (reload_s + p.step_fixed_s + p.per_running_seq_s * (len(decodes) + len(chunks))
                   + p.per_prefill_token_s * sum(k for _, k in chunks) + p.per_context_token_s * ctx)
            self._run = _Run(decodes, chunks, [t + dur])
            return True
        self._run = self._plan_decode_run(decodes, t)
        return True

    def _plan_decode_run(self, decodes: list[_Req], t: float) -> _Run:
        p = self.profile
        bs = self._bs
        k = min(r.target - r.generated for r in decodes)
        if k > 1 and self._waiting and self._can_admit(self._waiting[0]):
            k = 1
        if k > 1:  # blocks for k steps of growth; otherwise go one step at a time
            need = 0
            for r in decodes:
                need += max(0, -(-(r.prefill_target + r.generated + k) // bs) - r.nblocks)
            if need > self._free_count() + len(self._lru):
                k = 1
            else:
                for r in decodes:
                    extra = -(-(r.prefill_target + r.generated + k) // bs) - r.nblocks
                    if extra > 0:
                        self._allocate(r, extra, t)
        b = len(decodes)
        base = p.step_fixed_s + p.per_running_seq_s * b
        ctx0 = sum(r.prefill_target + r.generated for r in decodes)
        per_ctx = p.per_context_token_s
        limit = math.inf
        while self._pending and self._pending[0][2].aborted:
            heapq.heappop(self._pending)
        if self._pending:
            limit = self._pending[0][0]
        if self._leases and self._waiting:
            limit = min(limit, self._leases[0][0])
        ends = []
        e = t
        for i in range(k):
            e += base + per_ctx * (ctx0 + b * i)
            ends.append(e)
            if e >= limit:
                break
        return _Run(decodes, [], ends)

    def _admit(self, r: _Req, t: float) -> bool:
        if not self._can_admit(r):
            return False
        p = self.profile
        hashes = self._ensure_hashes(r)
        hit = self._hit_blocks(r)
        cache, lru = self._cache, self._lru
        for h in hashes[:hit]:
            c = cache[h]
            if c == 0:
                del lru[h]
            cache[h] = c + 1
        r.held = list(hashes[:hit])
        # the prefix continues in the host tier: take those blocks out first (a GPU eviction below
        # must not demote over them), reload them into GPU memory instead of computing them
        reload = 0 if r.req.remote_prefill else self._host_hit(r, hit)
        if reload:
            host = self._host
            for h in hashes[hit:hit + reload]:
                del host[h]
            if self.record_kv_events:
                self._emit(t, {"type": "BlockRemoved", "block_hashes": list(hashes[hit:hit + reload]),
                               "medium": "CPU", "group_idx": 0})
        need = -(-r.prefill_target // self._bs) - hit
        ok = self._allocate(r, need, t)
        assert ok, "admission check and allocation disagree"
        dev_tokens = min(hit * self._bs, r.prefill_target - 1)
        if reload:
            self._cache_blocks(r, hashes, hit, hit + reload, r.prompt, t)
        hit_tokens = min((hit + reload) * self._bs, r.prefill_target - 1)
        host_tokens = hit_tokens - dev_tokens
        if host_tokens > 0:
            r.reload_s += p.host_reload_seconds(host_tokens)
        r.num_computed = hit_tokens
        if r.scheduled_at is None:
            r.scheduled_at = t
            r.cached_tokens = hit_tokens
        if r.block_ids is None:
            r.block_ids = list(range(self._next_block_id, self._next_block_id + r.nblocks))
            self._next_block_id += r.nblocks
        st = self.stats
        if not r.counted:
            r.counted = True
            st.prefix_cache_queries += r.prompt_len
            st.prefix_cache_hits += dev_tokens
            st.host_cache_hits += host_tokens
            if self._host_cap:
                st.host_cache_queries += r.prompt_len - dev_tokens
            st.prompt_tokens += r.prompt_len
            by = st.prompt_tokens_by_source
            by["local_cache_hit"] += dev_tokens
            by["external_kv_transfer"] += host_tokens
            if r.req.remote_prefill:
                by["external_kv_transfer"] += r.prompt_len - hit_tokens
            else:
                by["local_compute"] += r.prompt_len - hit_tokens
            if self.track_histograms:
                st.queue_time.observe(t - r.ready)
                st.prompt_len.observe(r.prompt_len)
        if r.req.remote_prefill and r.generated == 0:
            r.state = _TRANSFER
            r.ready = t + p.transfer_seconds(r.prefill_target - hit_tokens)
            self._push_pending(r)
        else:
            r.state = _RUNNING
            self._running[r.rid] = r
        return True

    def _preempt(self, r: _Req) -> None:
        del self._running[r.rid]
        self._free_blocks(r)
        r.prefill_target = r.prompt_len + r.generated
        r.num_computed = 0
        r.state = _WAITING
        self._waiting.appendleft(r)
        self.stats.num_preemptions += 1

    # ------------------------------------------------------------------ internals: commit
    def _commit(self, now: float, out: list[SimOutput]) -> None:
        run = self._run
        assert run is not None
        ends = run.ends
        j = bisect.bisect_right(ends, now, lo=run.done)
        if j == run.done:
            return
        a = run.done
        run.done = j
        if j == len(ends):
            self._t = ends[-1]
            self._run = None
        times = ends[a:j]
        st = self.stats
        if self.track_histograms and run.decodes:
            prev = ends[a - 1] if a > 0 else None
            for e in times:
                if prev is not None:
                    st.itl.observe(e - prev, len(run.decodes))
                prev = e
        if a == 0 and self.track_histograms and run.decodes:
            # the first step's ITL: from each sequence's previous token
            for r in run.decodes:
                if r.last_token_at is not None:
                    st.itl.observe(ends[0] - r.last_token_at)
        n = j - a
        for r in run.decodes:
            start = r.generated
            r.generated += n
            r.last_token_at = times[-1]
            st.generation_tokens += n
            done = r.generated >= r.target
            if done:
                self._finish(r, times[-1])
            out.append(SimOutput(r.rid, start, times, done, self._reason(r) if done else None,
                                 r.cached_tokens, r.seed, r.prompt_len,
                                 r.block_ids if done and r.req.do_remote_decode else None))
        for r, k in run.chunks:
            e = ends[0]
            r.num_computed += k  # its blocks were cached when the step was scheduled
            if r.num_computed < r.prefill_target:
                continue
            start = r.generated
            r.generated += 1
            st.generation_tokens += 1
            if r.first_token_at is None:
                r.first_token_at = e
                if self.track_histograms:
                    st.ttft.observe(e - r.arrival)
            r.last_token_at = e
            done = r.generated >= r.target
            if done:
                self._finish(r, e)
            out.append(SimOutput(r.rid, start, [e], done, self._reason(r) if done else None,
                                 r.cached_tokens, r.seed, r.prompt_len,
                                 r.block_ids if done and r.req.do_remote_decode else None))

    def _reason(self, r: _Req) -> str:
        return "stop" if r.natural_stop else "length"

    def _finish(self, r: _Req, t: float) -> None:
        del self._running[r.rid]
        st = self.stats
        st.request_success[self._reason(r)] += 1
        if self.track_histograms:
            st.e2e.observe(t - r.arrival)
            st.generation_len.observe(r.generated)
            if r.scheduled_at is not None and r.first_token_at is not None:
                st.prefill_time.observe(r.first_token_at - r.scheduled_at)
                st.decode_time.observe(t - r.first_token_at)
        if r.req.do_remote_decode:
            r.state = _LEASED
            heapq.heappush(self._leases, (t + self.profile.kv_lease_s, r.rid))
            return
        self._cache_generated_blocks(r, t)
        self._free_blocks(r)
        r.state = _DONE
        del self._reqs[r.rid]

    def _cache_generated_blocks(self, r: _Req, t: float) -> None:
        """Full blocks that include generated tokens join the prefix cache (unreferenced), so a
        follow-up chat turn that repeats this answer hits them — as in vLLM."""
        bs = self._bs
        computed = r.prompt_len + r.generated - 1  # the last token's KV is never computed
        n_full = computed // bs
        hashes = self._ensure_hashes(r)
        first = len(hashes)
        if n_full <= first or len(r.held) < first:
            return
        tokens = list(r.prompt) + output_token_ids(r.seed, 0, r.generated, self.vocab_size)
        more = chain_block_hashes(tokens[: n_full * bs], bs, parent=hashes[-1] if hashes else None, start_block=first)
        all_hashes = list(hashes) + more
        avail = min(n_full, first + r.private)
        self._cache_blocks(r, all_hashes, first, avail, tokens, t, hold=False)
