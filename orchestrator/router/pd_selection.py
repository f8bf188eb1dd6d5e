"""Prefill/decode pair selection: which worker prefills a request, which decodes it, or neither split.

Pure decision code (plain data in, a ``RouteDecision`` out; no I/O, no wall clock), used live by the
gateway and unchanged by the virtual-time simulator.

* The **prefill** worker is the one with the least prefill work after this request: tokens it still
  has queued for prefill plus this request's tokens it does not already hold (prefix overlap credit).
* The **decode** worker is the one with the least decode pressure: requests it is running (the
  gateway's own in-flight count or the engine's report, whichever is larger) plus its KV usage
  expressed in request equivalents, with an optional bonus when it shares a transfer-locality label
  (e.g. ``rack``) with the chosen prefill worker.
* **Conditional disaggregation**: when the tokens the decode worker would have to prefill itself are
  fewer than ``min_prefill_tokens``, it prefills locally — a split costs a round trip and a KV
  transfer that a short prefill does not repay.
* **Aggregated workers in a P/D fleet**: ``both``-role workers compete with the decode pool on the
  same decode pressure (a dedicated decode worker wins ties) and, when chosen, serve the whole
  request themselves, so a mixed fleet uses every engine.

Workers with a pending role change (``target_role`` set) take no new work: they are draining.
Any number of prefill and decode workers (XpYd) are supported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from adapters.base import EngineKind, Role
from orchestrator.errors import NoHealthyWorker
from orchestrator.fleet.worker import Worker
from orchestrator.router.types import RouteDecision, RouteRequest, prefix_credit

POLICY_NAME = "pd"

# Used when no engine profile is known: roughly where a GPU prefill of the uncached tokens costs as
# much as the extra hop and the KV transfer of a disaggregated request (see ``derive_min_prefill_tokens``).
FALLBACK_MIN_PREFILL_TOKENS = 256


@dataclass(frozen=True)
class PdSelectionSettings:
    """Knobs of pair selection. Defaults suit a fleet of identical engines."""

    min_prefill_tokens: int = FALLBACK_MIN_PREFILL_TOKENS
    kv_usage_weight: float = 8.0  # a full KV cache counts as this many running requests
    locality_label: str | None = None  # worker label that marks a fast transfer path (same value = local)
    locality_bonus: float = 1.0  # request equivalents subtracted for a same-locality decode worker
    max_prefill_queue_tokens: int | None = None  # prefill pool this backed up → decode prefills locally


def derive_min_prefill_tokens(
    prefill_tokens_per_s: float,
    handoff_overhead_s: float,
    kv_bytes_per_token: float = 0.0,
    transfer_bytes_per_s: float = math.inf,
) -> int:
    """The uncached prompt length at which splitting starts to pay, from an engine profile.

    Prefilling ``n`` tokens locally costs ``n / prefill_tokens_per_s`` of the decode worker's time
    (stalling every sequence it is decoding). Splitting costs a fixed hand-off (one more HTTP round
    trip, scheduling on two engines) plus moving the KV: ``n * kv_bytes_per_token / bandwidth``.
    The split pays once ``n / rate >= overhead + n * bytes / bandwidth``.
    """
    if prefill_tokens_per_s <= 0:
        raise ValueError("prefill_tokens_per_s must be positive")
    per_token_saved = 1.0 / prefill_tokens_per_s
    per_token_moved = kv_bytes_per_token / transfer_bytes_per_s if transfer_bytes_per_s > 0 else math.inf
    margin = per_token_saved - per_token_moved
    if margin <= 0:
        # Moving a token costs more than computing it: never split.
        return 2**31 - 1
    return max(0, math.ceil(handoff_overhead_s / margin))


def pd_pools(candidates: Sequence[Worker]) -> tuple[list[Worker], list[Worker]]:
    """(prefill pool, decode pool) among workers that may take new work now."""
    prefill: list[Worker] = []
    decode: list[Worker] = []
    for w in candidates:
        if not w.accepting or w.target_role is not None:
            continue
        if w.role == Role.PREFILL:
            prefill.append(w)
        elif w.role == Role.DECODE:
            decode.append(w)
    return prefill, decode


def aggregated_pool(candidates: Sequence[Worker]) -> list[Worker]:
    """``both``-role workers that may take new work now (they serve a request end to end)."""
    return [w for w in candidates if w.role == Role.BOTH and w.accepting and w.target_role is None]


def cached_tokens(req: RouteRequest, worker: Worker) -> int:
    """Prompt tokens ``worker`` is credited with holding (tier-weighted, or the prefix a prefill sent
    there is still computing when that is longer: ``router.inflight``), never more than the prompt."""
    _, credit = prefix_credit(req.overlaps.get(worker.id), req.inflight_overlaps.get(worker.id, 0))
    return min(req.prompt_tokens, int(credit * req.block_size))


def can_prefill_locally(worker: Worker) -> bool:
    """SGLang decode servers only decode what a prefill server ships them; vLLM consumers (and the
    simulator in vLLM dialect) prefill by themselves when no transfer parameters come along; any
    ``both``-role worker serves whole requests."""
    return worker.role == Role.BOTH or worker.engine != EngineKind.SGLANG


def prefill_cost(req: RouteRequest, worker: Worker) -> float:
    """Tokens this worker would have to prefill before this request's first token is ready."""
    uncached = req.prompt_tokens - cached_tokens(req, worker)
    return float(worker.queued_prefill_tokens + max(uncached, 0))


def decode_cost(worker: Worker, settings: PdSelectionSettings, prefill: Worker | None = None) -> float:
    """Decode pressure in request equivalents (lower is better)."""
    active = max(float(worker.inflight), worker.load.running + worker.load.waiting)
    cost = active + settings.kv_usage_weight * worker.load.kv_usage
    if settings.locality_label and prefill is not None:
        mine = worker.labels.get(settings.locality_label)
        if mine is not None and mine == prefill.labels.get(settings.locality_label):
            cost -= settings.locality_bonus
    return cost


def select_pair(
    req: RouteRequest,
    candidates: Sequence[Worker],
    now: float,
    settings: PdSelectionSettings,
    exclude: Collection[str] = (),
) -> RouteDecision | None:
    """Choose (prefill, decode) for ``req``, or ``None`` when the candidates have no decode pool.

    ``exclude`` names workers that must not be chosen (e.g. a decode worker that already failed this
    request). The decision's ``worker`` is the decode worker; ``prefill_worker`` is ``None`` when the
    decode worker prefills locally (``reason`` says why). Ties break by worker id, so the choice is
    deterministic for the same state.
    """
    del now  # selection depends only on the state passed in; kept for the RoutingPolicy signature
    allowed = [w for w in candidates if w.id not in exclude]
    prefill_pool, decode_pool = pd_pools(allowed)
    if not decode_pool:
        return None
    serving = decode_pool + aggregated_pool(allowed)
    scores: dict[str, float] = {}

    best_prefill: Worker | None = None
    if prefill_pool:
        for w in prefill_pool:
            scores[f"prefill:{w.id}"] = prefill_cost(req, w)
        best_prefill = min(prefill_pool, key=lambda w: (prefill_cost(req, w), w.inflight, w.id))

    for w in serving:
        scores[f"decode:{w.id}"] = decode_cost(w, settings, best_prefill)
    decode = min(serving, key=lambda w: (decode_cost(w, settings, best_prefill), w.role == Role.BOTH, w.id))

    local_uncached = req.prompt_tokens - cached_tokens(req, decode)
    if decode.role == Role.BOTH:
        reason, prefill = f"aggregated: {decode.id} serves both roles and has the least decode pressure", None
    elif best_prefill is None:
        reason, prefill = "no prefill worker available", None
    elif not can_prefill_locally(decode):
        reason, prefill = f"disaggregated: {decode.engine.value} decode workers cannot prefill", best_prefill
    elif req.prefer_local:
        reason, prefill = "local prefill: one hand-off does not serve this request (several sequences: " \
                          "n/best_of; or prompt logprobs, for which the engine recomputes the prompt)", None
    elif local_uncached < settings.min_prefill_tokens:
        reason, prefill = (f"local prefill: {local_uncached} uncached tokens < "
                           f"min_prefill_tokens {settings.min_prefill_tokens}"), None
    elif (settings.max_prefill_queue_tokens is not None
          and best_prefill.inflight_prefill_tokens > settings.max_prefill_queue_tokens):
        reason, prefill = (f"local prefill: prefill queue {best_prefill.inflight_prefill_tokens} tokens > "
                           f"{settings.max_prefill_queue_tokens}"), None
    else:
        reason, prefill = f"disaggregated: {local_uncached} uncached tokens", best_prefill

    predicted = cached_tokens(req, prefill if prefill is not None else decode)
    return RouteDecision(worker=decode, policy=POLICY_NAME, reason=reason, predicted_cached_tokens=predicted,
                         prefill_worker=prefill, scores=scores)


class PdPairSelector:
    """``RoutingPolicy``-shaped wrapper around ``select_pair`` for the router and the simulator."""

    name = POLICY_NAME

    def __init__(self, settings: PdSelectionSettings | None = None) -> None:
        self.settings = settings or PdSelectionSettings()

    def applies(self, candidates: Sequence[Worker]) -> bool:
        """True when the candidates include a decode pool (P/D routing is in force)."""
        return bool(pd_pools(candidates)[1])

    def choose(self, req: RouteRequest, candidates: Sequence[Worker], now: float,
               exclude: Collection[str] = ()) -> RouteDecision:
        decision = select_pair(req, candidates, now, self.settings, exclude)
        if decision is None:
            raise LookupError("no decode worker among the candidates")
        return decision


class PdRoutingPolicy:
    """The router's policy when disaggregation is on: P/D pair selection whenever the candidates
    include a decode pool, the wrapped ``inner`` policy otherwise (an aggregated fleet).

    The Router hands policies only workers that can decode; ``prefill_pool(model)`` supplies the
    prefill workers for the model (pure: a registry read). ``on_decision`` (optional) is told about
    every P/D decision, e.g. to count local-prefill decisions in metrics.
    """

    def __init__(self, inner: Any, settings: PdSelectionSettings,
                 prefill_pool: Callable[[str], Sequence[Worker]],
                 on_decision: Callable[[RouteDecision], None] | None = None) -> None:
        self.inner = inner
        self.settings = settings
        self.prefill_pool = prefill_pool
        self.on_decision = on_decision

    @property
    def name(self) -> str:
        return self.inner.name

    def choose(self, req: RouteRequest, candidates: Sequence[Worker], now: float) -> RouteDecision:
        return self.choose_excluding(req, candidates, now, ())

    def choose_excluding(self, req: RouteRequest, candidates: Sequence[Worker], now: float,
                         exclude: Collection[str]) -> RouteDecision:
        """``choose``, leaving out the prefill workers named in ``exclude`` too (the router filters the
        candidates, which are decode workers only; the prefill pool is added here)."""
        if not any(w.role == Role.DECODE for w in candidates):
            # An aggregated fleet; still keep new work off workers moving to another role.
            settled = [w for w in candidates if w.target_role is None]
            return self.inner.choose(req, settled or candidates, now)
        known = {w.id for w in candidates}
        extra = [w for w in self.prefill_pool(req.model) if w.id not in known and w.id not in exclude] \
            if req.split_allowed else []
        decision = select_pair(req, [*candidates, *extra], now, self.settings)
        if decision is None:  # every decode worker is draining towards another role
            return self.inner.choose(req, [w for w in candidates if w.target_role is None] or candidates, now)
        if decision.prefill_worker is None and not can_prefill_locally(decision.worker):
            why = "" if req.split_allowed else "; this request is never split: /v1/responses or a batch of prompts"
            raise NoHealthyWorker(req.model, reason="no prefill worker is available for the "
                                  f"{decision.worker.engine.value} decode workers (they cannot prefill{why})")
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision


def threshold_from_profile(profile: Any) -> int:
    """``derive_min_prefill_tokens`` for an engine profile (``orchestrator.sim.profiles.EngineProfile``
    or anything with its fields): the hand-off costs one more API round trip on the prefill engine,
    one engine step for its single token, and the transfer set-up."""
    if profile.per_prefill_token_s <= 0:
        return 2**31 - 1  # prefill is free: a split can never pay
    handoff = profile.request_overhead_s + profile.step_fixed_s + profile.transfer_fixed_s
    return derive_min_prefill_tokens(1.0 / profile.per_prefill_token_s, handoff, profile.kv_bytes_per_token,
                                     profile.transfer_bandwidth_bytes_s or math.inf)
