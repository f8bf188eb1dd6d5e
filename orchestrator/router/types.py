"""What flows through the router: the request as routing sees it, and the decision.

Policies implement ``RoutingPolicy.choose`` over plain data: they never do network I/O and never
read the wall clock (``now`` is passed in), so they run unchanged in the virtual-time simulator.
Anything that needs I/O (tokenization, prefix-index lookups) happens before ``choose`` and arrives
in ``RouteRequest``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.fleet.worker import Worker


@dataclass
class Overlap:
    """How much of a request's prompt a worker already holds, in consecutive blocks from the start."""

    blocks: int = 0  # consecutive matched blocks
    weighted_blocks: float = 0.0  # blocks credited by tier (device 1.0, host 0.75, disk 0.25)


def prefix_credit(overlap: Overlap | None, inflight_blocks: int = 0) -> tuple[int, float]:
    """A worker's (matched, credited) leading blocks of a prompt: its cached prefix (credited by
    tier) or, when longer, the prefix a prefill sent there is still computing (``inflight_overlaps``),
    credited in full: the engine finds it cached when this request starts."""
    matched, credit = (overlap.blocks, overlap.weighted_blocks) if overlap is not None else (0, 0.0)
    if inflight_blocks > matched:
        matched = inflight_blocks
    if inflight_blocks > credit:
        credit = float(inflight_blocks)
    return matched, credit


@dataclass(frozen=True)
class PeerLoad:
    """Load other gateway replicas have placed on a worker (from shared reservations in Redis)."""

    inflight: int = 0
    prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request as routing and admission see it: built once per request (``gateway/annotate.py``),
    never changed afterwards. What one try adds (prefixes in flight on each worker) goes into that
    try's copy (``with_inflight``); what annotation adds, into a new value (``annotated``). Copies are
    made field by field (``dataclasses.replace`` costs twice as much)."""

    request_id: str
    model: str
    prompt_tokens: int  # known or estimated prompt length in tokens
    max_tokens: int | None = None  # the most tokens it may generate in all (per-choice limit x n); None: unset
    token_ids: Sequence[int] | None = None  # when tokenized (read-only: shared with the token cache)
    block_hashes: list[int] = field(default_factory=list)  # our chained block hashes
    block_size: int = 32
    overlaps: dict[str, Overlap] = field(default_factory=dict)  # worker id → overlap (from the index)
    # worker id → leading blocks a prefill this gateway sent there is still computing (router.inflight)
    inflight_overlaps: dict[str, int] = field(default_factory=dict)
    peer_load: dict[str, PeerLoad] = field(default_factory=dict)  # worker id → other replicas' load
    session_key: str | None = None
    priority: int = 0
    # False: prefill on the decode worker, never on a separate prefill worker (a request the P/D hand-off
    # does not cover: /v1/responses, a batch of prompts)
    split_allowed: bool = True
    # True: prefill on the decode worker whenever it can (a request the engine forks into several sequences,
    # ``n``/``best_of`` > 1: vLLM's children would share one hand-off; one asking for prompt logprobs, whose
    # prompt vLLM computes again whatever was handed off); split only where it cannot (SGLang)
    prefer_local: bool = False

    def annotated(self, *, token_ids: Sequence[int] | None, prompt_tokens: int, block_size: int,
                  block_hashes: list[int], overlaps: dict[str, Overlap], peer_load: dict[str, PeerLoad],
                  session_key: str | None) -> RouteRequest:
        """This request with what the prefix tracker found (tokens, block hashes, overlaps, peer load)."""
        return RouteRequest(self.request_id, self.model, prompt_tokens, self.max_tokens, token_ids, block_hashes,
                            block_size, overlaps, self.inflight_overlaps, peer_load, session_key, self.priority,
                            self.split_allowed, self.prefer_local)

    def with_inflight(self, inflight_overlaps: dict[str, int]) -> RouteRequest:
        """This request for one try: with the leading blocks each worker is still prefilling for others."""
        return RouteRequest(self.request_id, self.model, self.prompt_tokens, self.max_tokens, self.token_ids,
                            self.block_hashes, self.block_size, self.overlaps, inflight_overlaps, self.peer_load,
                            self.session_key, self.priority, self.split_allowed, self.prefer_local)


@dataclass
class RouteDecision:
    worker: Worker
    policy: str
    reason: str = ""
    predicted_cached_tokens: int = 0
    prefill_worker: Worker | None = None  # set when prefill runs elsewhere (P/D)
    scores: dict[str, float] = field(default_factory=dict)  # worker id → cost/score, for debugging
    # P/D progress for the stall watchdog (gateway/attempt.py), kept by the P/D executor
    # (disagg/executor.py): prefill legs running now, and when the last one ended (clock time)
    prefill_legs: int = 0
    prefill_ended_at: float | None = None
    # prefill workers whose leg failed on this try (the P/D executor notes them; the proxy leaves them out of
    # the request's later tries: router.decide's ``exclude``)
    failed_prefill: list[str] = field(default_factory=list)


class RoutingPolicy(Protocol):
    name: str

    def choose(self, req: RouteRequest, candidates: Sequence[Worker], now: float) -> RouteDecision:
        """Pick one of ``candidates`` (non-empty, all healthy and serving ``req.model``)."""
        ...
