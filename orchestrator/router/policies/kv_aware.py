"""kv_aware: send a request where its prompt is cached, unless that worker is the bottleneck.

Per candidate the policy estimates, in KV blocks, the work the request would wait behind and add:

    uncached = request_blocks - credit
    cost     = prefill_load_weight * (queued_prefill_blocks + recompute_weight * uncached)
             + decode_load_weight * (active_blocks + request_blocks)

``credit`` is the worker's consecutive cached prefix, each block credited by its tier (device 1.0;
a host or disk block at ``1 - reload time / prefill time`` from ``kv_aware.tier_cost`` — the share of
computing it that reloading saves, ``orchestrator/kv/tier_cost.py`` — or, without it, the configured
``tier_weights``, host 0.75 and disk 0.25 by default), or, when longer, the prefix a prefill this gateway already sent
there is still computing (``RouteRequest.inflight_overlaps``, from ``router.inflight``): the engine
admits in order and finds those blocks cached when it starts this one, so the request is charged
only for the rest. ``queued_prefill_blocks`` is the uncached prompt work already dispatched to the
worker and not yet prefilled: this gateway's own (``Worker.queued_prefill_tokens``: what it
charged, drained at the worker's learned prefill rate, ``router.inflight``) plus other
replicas' (shared through Redis), or the engine's waiting requests × this request's uncached size
there when that is larger. ``active_blocks`` is the KV the worker's running requests read every
decode step: ``kv_usage × num_blocks`` from its scrape or, when larger, requests in flight × this
request's size (fresher than a scrape during a burst).

Why the weights (measured in docs/benchmarks.md): waiting behind a queue costs only this request,
but computing a prefix again that another worker holds costs the fleet prefill time every later
request waits for, so own uncached blocks weigh ``recompute_weight`` = 2 times a queued block. A
decode step reads a block of KV far faster than a prefill computes one (on an H100-class GPU,
~40 ns vs ~83 µs per token per step), so running work weighs ``decode_load_weight`` = 0.1: enough
to spread long decodes, not enough to push a request off its prefix.

Why this does not pile onto one worker when every prompt shares a system prompt: the prefix only
saves ``credit`` blocks, and each request sent to the holder adds its uncached blocks to the
holder's queue and its whole context to the holder's decode load, so once those exceed the saving a
cold worker is cheaper; it then caches the prefix too and the fleet shares the load
(tests/unit/test_kv_policy.py replays it).

Ties go to a seeded random choice among equals (never "the first worker"). With
``temperature > 0`` the choice is a seeded softmax over ``-cost / max_cost / temperature``.
Session affinity (``req.session_key``: the configured header or the body's ``user``) keeps a
conversation on the worker that served its last turn while that worker costs at most
``AFFINITY_SLACK`` times the best one, for ``session_ttl_s``.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.config import KvAwareConfig
from orchestrator.fleet.worker import Worker
from orchestrator.router.types import Overlap, PeerLoad, RouteDecision, RouteRequest, prefix_credit

log = logging.getLogger("dyad.router.kv_aware")

POLICY_NAME = "kv_aware"
AFFINITY_SLACK = 1.5  # a session stays put while its worker costs ≤ this × the cheapest
MAX_SESSIONS = 100_000


@dataclass
class WorkerCost:
    worker: Worker
    cost: float
    overlap_blocks: int
    credit: float
    prefill_blocks: float
    active_blocks: float


def peer_load_of(req: RouteRequest) -> Mapping[str, PeerLoad]:
    """Other replicas' load, attached to the request by the prefix tracker (empty when alone)."""
    return req.peer_load


class KvAwarePolicy:
    name = POLICY_NAME

    def __init__(self, config: KvAwareConfig | None = None, seed: int | None = None) -> None:
        self.config = config or KvAwareConfig()
        self._rng = random.Random(seed)
        self._sessions: dict[str, tuple[str, float]] = {}  # session → (worker id, expires at)

    # --- the estimate ---------------------------------------------------------------------------
    def cost_of(self, req: RouteRequest, w: Worker, overlap: Overlap | None, peer: PeerLoad | None) -> WorkerCost:
        bs = max(1, req.block_size)
        request_blocks = math.ceil(max(req.prompt_tokens, 0) / bs)
        return self._cost(request_blocks, bs, w, overlap, peer, req.inflight_overlaps.get(w.id, 0))

    def _cost(self, request_blocks: int, bs: int, w: Worker, overlap: Overlap | None,
              peer: PeerLoad | None, inflight_blocks: int = 0) -> WorkerCost:
        matched, credit = prefix_credit(overlap, inflight_blocks)
        if credit > request_blocks:
            credit = float(request_blocks)
        load = w.load
        if peer is None:
            queued_blocks = w.queued_prefill_tokens / bs
            inflight = w.inflight
        else:
            queued_blocks = (w.queued_prefill_tokens + peer.prefill_tokens) / bs
            inflight = w.inflight + peer.inflight
        # Requests waiting on this worker look like this one there (same tenants, same prefixes):
        # each is taken to need about this request's uncached blocks.
        uncached = request_blocks - credit
        per_request = uncached if uncached > 1.0 else 1.0
        # The engine's own queue also counts traffic from outside this gateway; take the larger view.
        engine_waiting_blocks = load.waiting * per_request
        if engine_waiting_blocks > queued_blocks:
            queued_blocks = engine_waiting_blocks
        prefill = queued_blocks + uncached
        running = inflight if inflight > load.running else load.running
        kv_blocks = load.kv_usage * load.num_blocks if load.num_blocks else 0.0
        # Fresher than a scrape: each running request reads about this request's context per step.
        active = running * request_blocks
        if kv_blocks > active:
            active = kv_blocks
        cfg = self.config
        cost = (cfg.prefill_load_weight * (queued_blocks + cfg.recompute_weight * uncached)
                + cfg.decode_load_weight * (active + request_blocks))
        return WorkerCost(w, cost, matched, credit, prefill, active)

    # --- the choice -----------------------------------------------------------------------------
    def choose(self, req: RouteRequest, candidates: Sequence[Worker], now: float) -> RouteDecision:
        peers = peer_load_of(req)
        overlaps = req.overlaps
        bs = max(1, req.block_size)
        request_blocks = math.ceil(max(req.prompt_tokens, 0) / bs)
        cost = self._cost
        inflight = req.inflight_overlaps
        costs = [cost(request_blocks, bs, w, overlaps.get(w.id), peers.get(w.id), inflight.get(w.id, 0))
                 for w in candidates]
        best_cost = min(c.cost for c in costs)
        chosen: WorkerCost | None = None
        why = ""
        if req.session_key:
            chosen = self._affine(req.session_key, costs, best_cost, now)
            if chosen is not None:
                why = "session affinity"
        if chosen is None and self.config.temperature > 0 and len(costs) > 1:
            chosen = self._softmax(costs)
            why = f"softmax T={self.config.temperature:g}"
        if chosen is None:
            ties = [c for c in costs if c.cost <= best_cost + 1e-9]
            chosen = ties[0] if len(ties) == 1 else self._rng.choice(ties)
            why = "lowest cost" if len(ties) == 1 else f"lowest cost (random among {len(ties)} ties)"
        if req.session_key:
            self._remember(req.session_key, chosen.worker.id, now)
        cached_tokens = min(chosen.overlap_blocks * req.block_size, req.prompt_tokens)
        reason = (f"{why}: overlap {chosen.overlap_blocks}/{request_blocks}"
                  f" blocks, uncached+queued prefill {chosen.prefill_blocks:.0f} blocks,"
                  f" active {chosen.active_blocks:.0f} blocks, cost {chosen.cost:.1f} (best {best_cost:.1f})")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kv_aware %s → %s: %s; costs %s", req.request_id, chosen.worker.id, reason,
                      {c.worker.id: round(c.cost, 1) for c in costs})
        return RouteDecision(worker=chosen.worker, policy=self.name, reason=reason,
                             predicted_cached_tokens=cached_tokens,
                             scores={c.worker.id: c.cost for c in costs})

    def _softmax(self, costs: list[WorkerCost]) -> WorkerCost:
        top = max(c.cost for c in costs) or 1.0
        logits = [-(c.cost / top) / self.config.temperature for c in costs]
        m = max(logits)
        weights = [math.exp(x - m) for x in logits]
        return self._rng.choices(costs, weights=weights, k=1)[0]

    def _affine(self, key: str, costs: list[WorkerCost], best_cost: float, now: float) -> WorkerCost | None:
        entry = self._sessions.get(key)
        if entry is None:
            return None
        worker_id, expires = entry
        if now >= expires:
            del self._sessions[key]
            return None
        for c in costs:
            if c.worker.id == worker_id:
                return c if c.cost <= best_cost * AFFINITY_SLACK + 1e-9 else None
        return None  # the worker is gone, unhealthy or draining

    def _remember(self, key: str, worker_id: str, now: float) -> None:
        sessions = self._sessions
        sessions.pop(key, None)
        sessions[key] = (worker_id, now + self.config.session_ttl_s)
        if len(sessions) > MAX_SESSIONS:  # oldest insertion first (dicts keep order)
            for k in list(sessions)[: len(sessions) - MAX_SESSIONS]:
                del sessions[k]
