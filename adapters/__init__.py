"""Engine adapters: one per wire dialect, chosen by the worker's engine kind.

``get_adapter(kind)`` returns one shared adapter per kind, so all workers of a kind share its
tokenize cache. The simulator speaks vLLM's dialect; a simulator started in SGLang's dialect is
configured as engine ``sglang``.
"""

from __future__ import annotations

from adapters.base import (
    AdapterError,
    EngineAdapter,
    EngineKind,
    Histogram,
    LoadSnapshot,
    Role,
    UnsupportedByEngine,
)
from adapters.sglang import SglangAdapter
from adapters.vllm import VllmAdapter

__all__ = [
    "AdapterError",
    "EngineAdapter",
    "EngineKind",
    "Histogram",
    "LoadSnapshot",
    "Role",
    "SglangAdapter",
    "UnsupportedByEngine",
    "VllmAdapter",
    "get_adapter",
    "internal_field_carriers",
    "internal_fields",
    "scheduling_fields",
]

_shared: dict[EngineKind, EngineAdapter] = {}


def get_adapter(kind: EngineKind | str) -> EngineAdapter:
    """The shared adapter for an engine kind (``sim`` → the vLLM adapter)."""
    kind = EngineKind(kind)
    adapter = _shared.get(kind)
    if adapter is None:
        if kind is EngineKind.SGLANG:
            adapter = SglangAdapter()
        else:
            adapter = _shared.get(EngineKind.VLLM) or VllmAdapter()
            _shared[EngineKind.VLLM] = adapter
        _shared[kind] = adapter
    return adapter


def internal_fields() -> frozenset[str]:
    """Every body field some adapter declares as Dyad's own (``EngineAdapter.internal_fields``)."""
    return VllmAdapter.internal_fields | SglangAdapter.internal_fields


def scheduling_fields() -> frozenset[str]:
    """Every body field some adapter's engine orders its requests by (``EngineAdapter.scheduling_fields``)."""
    return VllmAdapter.scheduling_fields | SglangAdapter.scheduling_fields


def internal_field_carriers() -> frozenset[str]:
    """Every body field some adapter's engine merges into where it keeps its internal fields
    (``EngineAdapter.internal_field_carriers``): an internal field inside one is refused too."""
    return VllmAdapter.internal_field_carriers | SglangAdapter.internal_field_carriers
