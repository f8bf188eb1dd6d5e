"""Engine profiles: the cost model and cache geometry of a simulated engine.

One engine step (one forward pass of continuous batching) costs

    step_fixed_s
    + per_prefill_token_s  × prefill tokens scheduled in the step
    + per_running_seq_s    × sequences in the step (decode or prefill chunk)
    + per_context_token_s  × context tokens of the decoding sequences (attention reads their KV)

so TTFT and ITL follow from load and prefix-cache hits, never from random draws. A request also
waits ``request_overhead_s`` before the scheduler sees it (API server: parsing, tokenization) —
that time delays it but does not occupy the engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from orchestrator.config import TierCostConfig


@dataclass(frozen=True)
class EngineProfile:
    name: str
    step_fixed_s: float
    per_prefill_token_s: float
    per_running_seq_s: float
    per_context_token_s: float = 0.0
    request_overhead_s: float = 0.0
    max_num_batched_tokens: int = 8192  # per-step token budget (chunked prefill)
    max_num_seqs: int = 256
    block_size: int = 16
    num_gpu_blocks: int = 65536  # prefix-cache / KV capacity in blocks
    max_model_len: int = 32768
    kv_bytes_per_token: int = 131072
    transfer_bandwidth_bytes_s: float = 25e9  # P/D KV transfer
    transfer_fixed_s: float = 0.0  # per-transfer setup latency
    kv_lease_s: float = 30.0  # how long a prefill engine keeps blocks for a remote decode
    # Host-memory KV tier (vLLM ``--kv-offloading-size``): blocks evicted from GPU are demoted here
    # (LRU) and reloaded over ``host_reload_bandwidth_bytes_s`` when a prompt hits them. 0 = none.
    host_kv_tokens: int = 0
    host_reload_bandwidth_bytes_s: float = 25e9  # host→GPU copy; PCIe Gen4 x16 in practice

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"EngineProfile.{f.name} must be >= 0 (got {v})")
        for f in ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_gpu_blocks", "max_model_len"):
            if getattr(self, f) < 1:
                raise ValueError(f"EngineProfile.{f} must be >= 1")

    @property
    def cache_tokens(self) -> int:
        return self.block_size * self.num_gpu_blocks

    def prefill_seconds(self, tokens: int) -> float:
        """Compute time of a lone prefill of ``tokens`` tokens (chunked by the step budget)."""
        if tokens <= 0:
            return 0.0
        steps = -(-tokens // self.max_num_batched_tokens)
        return steps * (self.step_fixed_s + self.per_running_seq_s) + tokens * self.per_prefill_token_s

    def decode_step_seconds(self, batch: int, context_tokens: int = 0) -> float:
        return self.step_fixed_s + batch * self.per_running_seq_s + context_tokens * self.per_context_token_s

    def transfer_seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        bw = self.transfer_bandwidth_bytes_s
        return self.transfer_fixed_s + (tokens * self.kv_bytes_per_token / bw if bw > 0 else 0.0)

    def host_reload_seconds(self, tokens: int) -> float:
        """Time to copy ``tokens`` tokens of KV from the host tier back into GPU memory."""
        bw = self.host_reload_bandwidth_bytes_s
        if tokens <= 0 or bw <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / bw

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CPU_TINY = EngineProfile(
    # Calibrated to the real CPU vLLM used in the tests (docs/engines.md §1: the 512/4/2048/8/2 Llama,
    # eager, one core, --block-size 32, --kv-cache-memory-bytes 256 MiB): 2,000-token prompt →
    # cold TTFT ≈ 548 ms, prefix-hit TTFT ≈ 33 ms, ≈ 259 ms of prefill per 1k tokens, ≈ 11.7 ms per
    # decode token. Here: cold TTFT = 20 + 9.7 + 2 + 2000×0.259 ≈ 550 ms; a hit on 62 of 63 blocks
    # recomputes 16 tokens ≈ 36 ms; a lone decode step 11.7 ms. How a step splits into fixed vs
    # per-sequence cost was not measured: 2 ms per sequence is an estimate (batch 32 ≈ 74 ms).
    name="cpu-tiny",
    step_fixed_s=0.0097,
    per_prefill_token_s=0.000259,
    per_running_seq_s=0.002,
    per_context_token_s=0.0,
    request_overhead_s=0.020,
    max_num_batched_tokens=4096,
    max_num_seqs=256,
    block_size=32,
    num_gpu_blocks=4096,  # 256 MiB / (2,048 B per token × 32 tokens per block)
    max_model_len=4096,
    kv_bytes_per_token=2048,  # 2 (K,V) × 4 layers × 2 kv heads × 64 dims × 2 bytes (bf16)
    transfer_bandwidth_bytes_s=1e9,  # NIXL/UCX over loopback on CPU, order of magnitude
    transfer_fixed_s=0.005,
)

GPU_LIKE = EngineProfile(
    # Assumptions: a Llama-3-8B-class model (32 layers, 8 KV heads × 128 dims, bf16) on one
    # H100-class GPU (80 GB, ~3.3 TB/s HBM), vLLM-style chunked prefill.
    # - prefill ≈ 12k tokens/s (83 µs per token);
    # - a decode step at batch 1 ≈ 7 ms (reading 16 GB of weights) and grows with batch (60 µs per
    #   sequence) and with context (attention reads 128 KiB of KV per context token at ~3.3 TB/s
    #   ≈ 40 ns per token): batch 32 with 2k-token contexts ≈ 12 ms, with 15k-token contexts ≈ 28 ms;
    # - KV cache ≈ 55 GB / 128 KiB per token ≈ 430k tokens = 26,880 blocks of 16. The Mooncake
    #   synthetic trace has ≈ 22.5M distinct prefix tokens, so 8 such workers (≈ 3.4M tokens) cannot
    #   hold it all: eviction and placement matter;
    # - P/D transfer over a 200 Gb/s RDMA NIC ≈ 25 GB/s (a 15k-token prompt ≈ 80 ms).
    name="gpu-like",
    step_fixed_s=0.007,
    per_prefill_token_s=1.0 / 12000.0,
    per_running_seq_s=0.00006,
    per_context_token_s=4e-8,
    request_overhead_s=0.002,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    block_size=16,
    num_gpu_blocks=26880,
    max_model_len=131072,
    kv_bytes_per_token=131072,
    transfer_bandwidth_bytes_s=25e9,
    transfer_fixed_s=0.002,
)

ZERO = EngineProfile(
    # No compute cost at all: every step takes 0 s. For gateway-overhead benchmarks, where the
    # engine must not be the bottleneck.
    name="zero",
    step_fixed_s=0.0,
    per_prefill_token_s=0.0,
    per_running_seq_s=0.0,
    per_context_token_s=0.0,
    request_overhead_s=0.0,
    max_num_batched_tokens=1 << 20,
    max_num_seqs=4096,
    block_size=16,
    num_gpu_blocks=1 << 20,
    max_model_len=1 << 20,
    kv_bytes_per_token=0,
    transfer_bandwidth_bytes_s=0.0,
    transfer_fixed_s=0.0,
)

def tier_cost_of(profile: EngineProfile) -> TierCostConfig | None:
    """The gateway's ``router.kv_aware.tier_cost`` for engines like ``profile`` (its KV size per
    token, prefill rate and host reload bandwidth), so the router credits a host hit at the reload
    cost the engines pay. None when the profile has no host tier or no timing."""
    if not profile.host_kv_tokens or profile.per_prefill_token_s <= 0 or profile.kv_bytes_per_token <= 0:
        return None
    return TierCostConfig(kv_bytes_per_token=profile.kv_bytes_per_token,
                          prefill_tokens_per_s=1.0 / profile.per_prefill_token_s,
                          host_reload_bytes_per_s=profile.host_reload_bandwidth_bytes_s or None)


PROFILES: dict[str, EngineProfile] = {p.name: p for p in (CPU_TINY, GPU_LIKE, ZERO)}


def load_profile(name_or_path: str | EngineProfile | dict[str, Any], **overrides: Any) -> EngineProfile:
    """A named profile (``cpu-tiny``, ``gpu-like``, ``zero``), a JSON file, or a dict.

    A JSON file / dict may set ``"base": "<profile name>"`` and override only some fields.
    Keyword overrides replace fields last.
    """
    if isinstance(name_or_path, EngineProfile):
        prof = name_or_path
    elif isinstance(name_or_path, dict):
        prof = _from_dict(name_or_path, source="dict")
    elif name_or_path in PROFILES:
        prof = PROFILES[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"unknown engine profile {name_or_path!r}: not one of {sorted(PROFILES)} and not a file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"engine profile {path}: invalid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"engine profile {path}: expected a JSON object")
        prof = _from_dict(data, source=str(path))
    return replace(prof, **overrides) if overrides else prof


def _from_dict(data: dict[str, Any], source: str) -> EngineProfile:
    data = dict(data)
    base_name = data.pop("base", None)
    known = {f.name for f in fields(EngineProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"engine profile {source}: unknown field(s) {', '.join(unknown)}")
    if base_name is not None:
        if base_name not in PROFILES:
            raise ValueError(f"engine profile {source}: unknown base {base_name!r}")
        data.setdefault("name", f"{base_name}+custom")
        return replace(PROFILES[base_name], **data)
    missing = [n for n in ("name", "step_fixed_s", "per_prefill_token_s", "per_running_seq_s") if n not in data]
    if missing:
        raise ValueError(f"engine profile {source}: missing field(s) {', '.join(missing)} (or give a 'base')")
    return EngineProfile(**data)
