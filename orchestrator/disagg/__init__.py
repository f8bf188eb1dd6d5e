"""Prefill/decode disaggregation: pair selection in the router, the P/D executor, role changes.

``build(...)`` returns the parts the gateway's composition root (``orchestrator/gateway/compose.py``)
wires in: the router's policy wrapped so that fleets with a decode pool get P/D pair selection
(``orchestrator.router.pd_selection``), the ``PdExecutor`` that runs split requests (vLLM's
NIXL/Example connectors, SGLang's dual dispatch), and the ``RoleManager`` that moves ``kv_both``
workers between pools. The admin routes (``admin_routes.router``) are mounted by the app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.base import Role
from orchestrator.router.pd_selection import (
    PdRoutingPolicy,
    PdSelectionSettings,
    select_pair,
    threshold_from_profile,
)
from orchestrator.router.types import RouteDecision, RouteRequest

# ``threshold_from_profile`` of the simulator's GPU-like engine profile (an 8B-class model on one
# H100-class GPU), written out so the gateway does not import the simulator (a leaf);
# tests/unit/test_disagg_flows.py checks it still equals the derivation.
GPU_LIKE_MIN_PREFILL_TOKENS = 141


def resolve_min_prefill_tokens(configured: int | None, profile: Any | None = None) -> int:
    """``disagg.min_prefill_tokens`` when set; else derived from the engine profile (default: the
    GPU-like profile, what production fleets run)."""
    if configured is not None:
        return configured
    if profile is None:
        return GPU_LIKE_MIN_PREFILL_TOKENS
    return threshold_from_profile(profile)


@dataclass
class DisaggParts:
    roles: Any  # RoleManager (always: role changes work without disaggregation too)
    policy: Any | None = None  # the P/D-wrapped routing policy (None: disagg.enabled is false)
    executor: Any | None = None  # PdExecutor


def build(config: Any, fleet: Any, policy: Any, http: Any, metrics: Any, clock: Any, adapter_for: Any,
          profile: Any | None = None, breakers: Any | None = None) -> DisaggParts:
    """The P/D parts for a gateway (see the module docstring); no-op parts when ``disagg.enabled`` is false.
    ``breakers`` (the gateway's ``CircuitBreakers``): prefill workers' legs count in their breakers, and an SGLang
    pair retried after a failed prefill skips prefill workers whose breaker is open."""
    from orchestrator.disagg.executor import MODE_LOCAL, PdExecutor
    from orchestrator.disagg.roles import RoleManager

    cfg = config.disagg
    parts = DisaggParts(roles=RoleManager(fleet, clock, metrics))
    if not cfg.enabled or isinstance(policy, PdRoutingPolicy):
        return parts
    settings = PdSelectionSettings(min_prefill_tokens=resolve_min_prefill_tokens(cfg.min_prefill_tokens, profile))

    def prefill_pool(model: str) -> list[Any]:
        return [w for w in fleet.candidates(model, Role.PREFILL) if w.role == Role.PREFILL]

    def count_local(decision: RouteDecision) -> None:
        if decision.prefill_worker is None:
            metrics.pd_requests.labels(MODE_LOCAL).inc()

    def choose_prefill(model: str, exclude: set[str]) -> Any:
        blocked = breakers.blocked(clock.now()) if breakers is not None else frozenset()
        pool = [w for w in prefill_pool(model) if w.id not in exclude and w.id not in blocked]
        if not pool:
            return None
        probe = RouteRequest(request_id="", model=model, prompt_tokens=0)
        decoders = [w for w in fleet.candidates(model, Role.DECODE) if w.role == Role.DECODE]
        decision = select_pair(probe, [*pool, *decoders], clock.now(), PdSelectionSettings(min_prefill_tokens=0))
        return decision.prefill_worker if decision is not None else pool[0]

    parts.policy = PdRoutingPolicy(policy, settings, prefill_pool, count_local)
    parts.executor = PdExecutor(http, fleet, cfg, metrics, clock, adapter_for, choose_prefill,
                                stall=config.resilience, breakers=breakers)
    return parts
