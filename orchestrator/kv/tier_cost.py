"""What a cached block is worth by tier, from modelled bandwidth (no fitted weights).

A prompt block the engine holds in GPU memory costs nothing to reuse. One it holds in an offload tier
(host memory, disk) must be copied back first; the copy replaces computing the block, so the saving,
in units of "one block computed", is

    credit = 1 - reload_seconds_per_token / prefill_seconds_per_token
           = 1 - prefill_tokens_per_s * kv_bytes_per_token / reload_bytes_per_s

clamped to [0, 1]. E.g. an 8B-class model (128 KiB of KV per token) prefilling 12k tokens/s with a
25 GB/s host link: 1 - 12000 × 131072 / 25e9 ≈ 0.94. The same model reading from a 2 GB/s disk:
0.21. ``kv_aware`` multiplies each matched block by its best tier's credit (``index.best_tier_weight``).
Pure functions; the configuration is ``router.kv_aware.tier_cost``.
"""

from __future__ import annotations

from orchestrator.config import KvAwareConfig, TierCostConfig


def reload_credit(kv_bytes_per_token: float, reload_bytes_per_s: float, prefill_tokens_per_s: float) -> float:
    """Share of a block's prefill time saved by reloading it over ``reload_bytes_per_s``."""
    if reload_bytes_per_s <= 0 or prefill_tokens_per_s <= 0:
        return 0.0
    reload_s = kv_bytes_per_token / reload_bytes_per_s
    compute_s = 1.0 / prefill_tokens_per_s
    return min(1.0, max(0.0, 1.0 - reload_s / compute_s))


def derived_tier_weights(cost: TierCostConfig) -> dict[str, float]:
    """The tiers ``cost`` models, each with its reload credit."""
    out: dict[str, float] = {}
    if cost.host_reload_bytes_per_s is not None:
        out["host"] = reload_credit(cost.kv_bytes_per_token, cost.host_reload_bytes_per_s, cost.prefill_tokens_per_s)
    if cost.disk_read_bytes_per_s is not None:
        out["disk"] = reload_credit(cost.kv_bytes_per_token, cost.disk_read_bytes_per_s, cost.prefill_tokens_per_s)
    return out


def effective_tier_weights(cfg: KvAwareConfig) -> dict[str, float]:
    """``tier_weights`` with the tiers of ``tier_cost`` (when set) replaced by their derived credit."""
    weights = dict(cfg.tier_weights)
    if cfg.tier_cost is not None:
        weights.update(derived_tier_weights(cfg.tier_cost))
    return weights
