"""The virtual-time fleet-routing benchmark: engine-side counters, and routing that matters."""

from __future__ import annotations

import pytest

from orchestrator.bench.fleet_virtual import run_virtual_routing
from orchestrator.bench.traces import TraceRequest
from orchestrator.sim.profiles import GPU_LIKE


def _trace() -> list[TraceRequest]:
    # Two 4-block prompts, each sent twice in a row (A A B B A A B B), one per second: an idle fleet.
    a, b = (1, 2, 3, 4), (11, 12, 13, 14)
    order = [a, a, b, b, a, a, b, b]
    return [TraceRequest(index=i, arrival_s=float(i), input_len=2048, output_len=4, hash_ids=h)
            for i, h in enumerate(order)]


def test_kv_aware_reuses_what_round_robin_recomputes() -> None:
    rr = run_virtual_routing(_trace(), GPU_LIKE, workers=2, policy="round_robin")
    kv = run_virtual_routing(_trace(), GPU_LIKE, workers=2, policy="kv_aware")
    assert rr["finished"] == kv["finished"] == 8
    # kv_aware: only the first A and the first B are cold (6 of 8 requests hit all but the last token)
    assert kv["hit_ratio"] == pytest.approx(6 * 2047 / (8 * 2048))
    assert rr["hit_ratio"] < kv["hit_ratio"]
    assert kv["ttft_s"]["p50"] < rr["ttft_s"]["p50"]


def test_prefill_load_is_the_engines_uncached_prompt_tokens() -> None:
    s = run_virtual_routing(_trace(), GPU_LIKE, workers=2, policy="round_robin")
    loads = s["prefill_load"]["per_engine"]
    assert len(loads) == 2
    assert sum(loads) == pytest.approx(8 * 2048 * (1 - s["hit_ratio"]))
    assert s["prefill_load"]["max_over_mean"] == pytest.approx(max(loads) / (sum(loads) / 2))
