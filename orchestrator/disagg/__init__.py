"""Prefill/decode disaggregation: pair selection in the router, the P/D executor, role changes.

``install(runtime)`` turns it on for a gateway (one call, idempotent): the router's policy is
wrapped so that fleets with a decode pool get P/D pair selection (``orchestrator.router.pd_selection``),
``runtime.pd_executor`` runs the split requests (``executor.PdExecutor``: vLLM's NIXL/Example
connectors, SGLang's dual dispatch), and ``runtime.roles`` moves ``kv_both`` workers between pools
(``roles.RoleManager``). The admin routes (``admin_routes.router``) are mounted by the app.
"""

from __future__ import annotations

from typing import Any

from adapters.base import Role
from orchestrator.router.pd_selection import (
    PdRoutingPolicy,
    PdSelectionSettings,
    select_pair,
    threshold_from_profile,
)
from orchestrator.router.types import RouteDecision, RouteRequest


def resolve_min_prefill_tokens(configured: int | None, profile: Any | None = None) -> int:
    """``disagg.min_prefill_tokens`` when set; else derived from the engine profile (default: the
    GPU-like profile, what production fleets run)."""
    if configured is not None:
        return configured
    if profile is None:
        from orchestrator.sim.profiles import GPU_LIKE
        profile = GPU_LIKE
    return threshold_from_profile(profile)


def install(runtime: Any, profile: Any | None = None) -> None:
    """Enable disaggregation on a ``GatewayRuntime`` (no-op when ``disagg.enabled`` is false)."""
    from orchestrator.disagg.executor import MODE_LOCAL, PdExecutor
    from orchestrator.disagg.roles import RoleManager

    cfg = runtime.config.disagg
    if getattr(runtime, "roles", None) is None:
        runtime.roles = RoleManager(runtime.fleet, runtime.clock, runtime.metrics)
    if not cfg.enabled or isinstance(runtime.router.policy, PdRoutingPolicy):
        return
    settings = PdSelectionSettings(min_prefill_tokens=resolve_min_prefill_tokens(cfg.min_prefill_tokens, profile))
    fleet = runtime.fleet

    def prefill_pool(model: str) -> list[Any]:
        return [w for w in fleet.candidates(model, Role.PREFILL) if w.role == Role.PREFILL]

    def count_local(decision: RouteDecision) -> None:
        if decision.prefill_worker is None:
            runtime.metrics.pd_requests.labels(MODE_LOCAL).inc()

    def choose_prefill(model: str, exclude: set[str]) -> Any:
        pool = [w for w in prefill_pool(model) if w.id not in exclude]
        if not pool:
            return None
        probe = RouteRequest(request_id="", model=model, prompt_tokens=0)
        decoders = [w for w in fleet.candidates(model, Role.DECODE) if w.role == Role.DECODE]
        decision = select_pair(probe, [*pool, *decoders], runtime.clock.now(),
                               PdSelectionSettings(min_prefill_tokens=0))
        return decision.prefill_worker if decision is not None else pool[0]

    runtime.router.policy = PdRoutingPolicy(runtime.router.policy, settings, prefill_pool, count_local)
    runtime.pd_executor = PdExecutor(runtime.http, fleet, cfg, runtime.metrics, runtime.clock,
                                     runtime.adapter_for, choose_prefill)
