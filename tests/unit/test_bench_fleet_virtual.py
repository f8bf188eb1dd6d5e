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


def test_virtual_workers_report_what_a_live_scrape_reports() -> None:
    """kv_aware reads ``kv_usage × num_blocks`` live (num_blocks from vllm:cache_config_info); the
    virtual fleet must fill the same fields, or virtual time routes on a different cost than live."""
    from orchestrator.sim.virtual_time import FleetSpec, VirtualFleet, requests_from_trace

    fleet = VirtualFleet(GPU_LIKE, FleetSpec(aggregated=2), policy="kv_aware")
    reqs = requests_from_trace(_trace()[:3])
    for i, r in enumerate(reqs):
        r.arrival = 0.05 * i  # a burst: later ones arrive while the first still holds its KV
    seen = []
    choose = fleet.router.policy.choose  # the live Router's policy

    def spy(rr, cands, now):
        seen.extend((w.load.num_blocks, w.load.kv_usage) for w in cands)
        return choose(rr, cands, now)

    fleet.router.policy.choose = spy
    fleet.run(reqs)
    blocks = GPU_LIKE.cache_tokens // 512
    assert seen and all(nb == blocks for nb, _ in seen)
    assert any(usage > 0 for _, usage in seen)


def test_chat_turns_share_their_history_as_prefix_blocks() -> None:
    from orchestrator.bench.fleet_virtual import chat_requests

    hist = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]
    turn2 = hist + [{"role": "assistant", "content": " ".join(f"a{i}" for i in range(20))},
                    {"role": "user", "content": "more please"}]
    other = [{"role": "user", "content": " ".join(f"x{i}" for i in range(40))}]
    reqs = chat_requests([TraceRequest(index=i, arrival_s=float(i), input_len=0, output_len=8, messages=tuple(m))
                          for i, m in enumerate((hist, turn2, other))], block_tokens=16)
    first, second, third = reqs
    assert (first.isl, len(first.blocks)) == (40, 2) and (second.isl, len(second.blocks)) == (62, 3)
    assert second.blocks[:2] == first.blocks and not set(third.blocks) & set(first.blocks)
    kv = run_virtual_routing(reqs, GPU_LIKE, workers=2, policy="kv_aware")
    assert kv["finished"] == 3 and kv["itl_s"]["mean"] is not None
