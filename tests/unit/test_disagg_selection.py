"""Pair selection for prefill/decode disaggregation (pure: plain workers in, decision out)."""

from __future__ import annotations

import dataclasses

import pytest

from adapters.base import LoadSnapshot, Role
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.router.pd_selection import (
    PdPairSelector,
    PdSelectionSettings,
    derive_min_prefill_tokens,
    pd_pools,
    select_pair,
)
from orchestrator.router.types import Overlap, RouteRequest

S = PdSelectionSettings(min_prefill_tokens=256)


def w(id_: str, role: Role, **kw) -> Worker:
    load = kw.pop("load", LoadSnapshot())
    return Worker(id=id_, url=f"http://{id_}", role=role, models=["m"], load=load, **kw)


def req(prompt: int, overlaps: dict[str, int] | None = None) -> RouteRequest:
    return RouteRequest(request_id="r", model="m", prompt_tokens=prompt, block_size=32,
                        overlaps={k: Overlap(blocks=v, weighted_blocks=float(v)) for k, v in (overlaps or {}).items()})


def test_long_prompt_is_split_between_pools():
    fleet = [w("p0", Role.PREFILL), w("d0", Role.DECODE), w("both", Role.BOTH)]
    d = select_pair(req(2000), fleet, 0.0, S)
    assert d is not None
    assert d.prefill_worker is not None and d.prefill_worker.id == "p0"
    assert d.worker.id == "d0"
    assert d.reason.startswith("disaggregated")


def test_no_decode_pool_means_no_pd_decision():
    assert select_pair(req(2000), [w("p0", Role.PREFILL), w("a", Role.BOTH)], 0.0, S) is None
    assert not PdPairSelector(S).applies([w("a", Role.BOTH)])
    with pytest.raises(LookupError):
        PdPairSelector(S).choose(req(10), [w("a", Role.BOTH)], 0.0)


def test_prefill_worker_by_overlap_then_queued_work():
    fleet = [w("p0", Role.PREFILL), w("p1", Role.PREFILL), w("d0", Role.DECODE)]
    # p1 holds 40 of the 64 blocks: 1280 fewer tokens to prefill.
    d = select_pair(req(2048, {"p1": 40}), fleet, 0.0, S)
    assert d.prefill_worker.id == "p1"
    assert d.predicted_cached_tokens == 1280
    # ...unless p1 already has more queued prefill work than the overlap saves.
    fleet[1].inflight_prefill_tokens = 5000
    d = select_pair(req(2048, {"p1": 40}), fleet, 0.0, S)
    assert d.prefill_worker.id == "p0"
    assert d.scores["prefill:p1"] == 5000 + 2048 - 1280


def test_a_prefix_still_prefilling_on_a_prefill_worker_counts_as_cached_there():
    fleet = [w("p0", Role.PREFILL), w("p1", Role.PREFILL), w("d0", Role.DECODE)]
    fleet[1].inflight_prefill_tokens = 2048  # the prompt that computes the shared prefix
    r = req(2048, {"p1": 10})
    r = r.with_inflight({"p1": 48})  # longer than what the index knows yet
    d = select_pair(r, fleet, 0.0, S)
    assert d.prefill_worker.id == "p0"  # 2048 queued + 512 uncached > 0 + 2048
    fleet[1].inflight_prefill_tokens = 1000
    d = select_pair(r, fleet, 0.0, S)
    assert d.prefill_worker.id == "p1" and d.predicted_cached_tokens == 48 * 32


def test_decode_worker_by_kv_usage_and_running_load():
    fleet = [w("p0", Role.PREFILL),
             w("d0", Role.DECODE, load=LoadSnapshot(running=2, kv_usage=0.9)),
             w("d1", Role.DECODE, load=LoadSnapshot(running=4, kv_usage=0.1))]
    # d0: 2 + 8*0.9 = 9.2 ; d1: 4 + 0.8 = 4.8
    assert select_pair(req(2000), fleet, 0.0, S).worker.id == "d1"
    # The gateway's own in-flight count is fresher than the last scrape.
    fleet[2].inflight = 10
    assert select_pair(req(2000), fleet, 0.0, S).worker.id == "d0"


def test_transfer_locality_label_breaks_near_ties():
    settings = PdSelectionSettings(min_prefill_tokens=0, locality_label="rack", locality_bonus=1.5)
    fleet = [w("p0", Role.PREFILL, labels={"rack": "b"}),
             w("d0", Role.DECODE, labels={"rack": "a"}),
             w("d1", Role.DECODE, labels={"rack": "b"}, inflight=1)]
    assert select_pair(req(1000), fleet, 0.0, settings).worker.id == "d1"
    # Without the label the less-loaded d0 wins.
    assert select_pair(req(1000), fleet, 0.0, S).worker.id == "d0"


def test_conditional_disaggregation_uses_the_decode_workers_own_cache():
    fleet = [w("p0", Role.PREFILL), w("d0", Role.DECODE)]
    short = select_pair(req(200), fleet, 0.0, S)
    assert short.prefill_worker is None and short.worker.id == "d0"
    assert "local prefill" in short.reason
    # Long prompt, but the decode worker already holds all but 100 tokens of it → local.
    cached = select_pair(req(3200, {"d0": 97}), fleet, 0.0, S)
    assert cached.prefill_worker is None
    assert cached.predicted_cached_tokens == 97 * 32
    # Exactly at the threshold → split.
    assert select_pair(req(256), fleet, 0.0, S).prefill_worker is not None


def test_backed_up_prefill_pool_falls_back_to_local_prefill():
    settings = PdSelectionSettings(min_prefill_tokens=0, max_prefill_queue_tokens=4000)
    fleet = [w("p0", Role.PREFILL, inflight_prefill_tokens=8000), w("d0", Role.DECODE)]
    d = select_pair(req(1000), fleet, 0.0, settings)
    assert d.prefill_worker is None and "prefill queue" in d.reason


def test_both_role_workers_in_a_pd_fleet_take_whole_requests_when_least_loaded():
    fleet = [w("p0", Role.PREFILL), w("d0", Role.DECODE, inflight=2), w("b0", Role.BOTH),
             w("b1", Role.BOTH, state=WorkerState.DRAINING)]
    d = select_pair(req(2000), fleet, 0.0, S)
    assert d.worker.id == "b0" and d.prefill_worker is None and d.reason.startswith("aggregated")
    assert "decode:b0" in d.scores and "decode:b1" not in d.scores
    fleet[2].inflight = 3  # now the decode worker has less pressure: split as usual
    d = select_pair(req(2000), fleet, 0.0, S)
    assert d.worker.id == "d0" and d.prefill_worker.id == "p0"
    fleet[2].inflight = 2  # a tie goes to the dedicated decode worker
    assert select_pair(req(2000), fleet, 0.0, S).worker.id == "d0"
    # Served by requests in flight, the both-role worker takes its share of a burst.
    fleet[1].inflight = fleet[2].inflight = 0
    served = []
    for _ in range(8):
        d = select_pair(req(2000), fleet, 0.0, S)
        d.worker.inflight += 1
        served.append(d.worker.id)
    assert served.count("b0") == 4 and served.count("d0") == 4


def test_draining_unhealthy_and_excluded_workers_take_no_new_work():
    fleet = [w("p0", Role.PREFILL, state=WorkerState.UNHEALTHY),
             w("p1", Role.PREFILL, target_role=Role.DECODE),
             w("p2", Role.PREFILL, state=WorkerState.DRAINING),
             w("d0", Role.DECODE), w("d1", Role.DECODE, inflight=3)]
    prefill, decode = pd_pools(fleet)
    assert prefill == [] and [x.id for x in decode] == ["d0", "d1"]
    d = select_pair(req(2000), fleet, 0.0, S, exclude={"d0"})
    assert d.worker.id == "d1" and d.prefill_worker is None
    assert d.reason == "no prefill worker available"
    assert select_pair(req(2000), fleet, 0.0, S, exclude={"d0", "d1"}) is None


def test_xpyd_spreads_over_many_workers_as_load_accumulates():
    fleet = [w(f"p{i}", Role.PREFILL) for i in range(3)] + [w(f"d{i}", Role.DECODE) for i in range(5)]
    used_p, used_d = set(), set()
    for _ in range(15):
        d = select_pair(req(1024), fleet, 0.0, S)
        used_p.add(d.prefill_worker.id)
        used_d.add(d.worker.id)
        d.prefill_worker.inflight_prefill_tokens += 1024  # what the gateway records on dispatch
        d.worker.inflight += 1
    assert used_p == {"p0", "p1", "p2"}
    assert used_d == {f"d{i}" for i in range(5)}
    assert sorted(x.inflight for x in fleet[3:]) == [3, 3, 3, 3, 3]


def test_threshold_derived_from_engine_profile():
    # GPU-like: 10k prefill tok/s, 20 ms hand-off, 128 KiB/token over 25 GB/s.
    n = derive_min_prefill_tokens(10_000, 0.020, 131072, 25e9)
    assert 200 < n < 230
    # Slower prefill → splitting pays sooner.
    assert derive_min_prefill_tokens(2_000, 0.020, 131072, 25e9) < n
    # Transfer slower than compute → never split.
    assert derive_min_prefill_tokens(10_000, 0.020, 131072, 1e8) >= 2**31 - 1
    with pytest.raises(ValueError):
        derive_min_prefill_tokens(0, 0.02)


def test_virtual_fleet_driver_uses_pair_selection_and_conditional_prefill():
    """The virtual P/D fleet places arrivals with the live Router's pair selection (small run, virtual time)."""
    from orchestrator.sim.profiles import GPU_LIKE
    from orchestrator.sim.virtual_time import FleetSpec, SimRequest, VirtualFleet

    reqs = [SimRequest(id=i, arrival=i * 0.05, isl=100 if i % 2 else 3000, osl=20) for i in range(40)]
    fleet = VirtualFleet(GPU_LIKE, FleetSpec(prefill=2, decode=3), pd_settings=PdSelectionSettings(min_prefill_tokens=141),
                         prefix_index=True)
    result = fleet.run(reqs)
    assert all(r.finish is not None for r in result.requests)
    assert sum(1 for _, _, pw, _ in fleet.route_log if pw is None) == 20
    assert sum(1 for _, _, pw, _ in fleet.route_log if pw is not None) == 20
    short = [r for r in result.requests if r.isl == 100]
    long_ = [r for r in result.requests if r.isl == 3000]
    assert all(r.prefill_worker == r.decode_worker and r.decode_worker.startswith("d") for r in short)
    assert all(r.prefill_worker.startswith("p") and r.decode_worker.startswith("d") for r in long_)
    assert {r.prefill_worker for r in long_} == {"p0", "p1"}
    assert len({r.decode_worker for r in result.requests}) == 3
    assert all(w.worker.inflight == 0 and w.worker.inflight_prefill_tokens == 0 for w in fleet.workers.values())


def test_a_request_that_may_not_be_split_prefills_on_its_decode_worker():
    from orchestrator.router.pd_selection import PdRoutingPolicy
    from orchestrator.router.policies.round_robin import RoundRobinPolicy

    prefill = [w("p0", Role.PREFILL)]
    policy = PdRoutingPolicy(RoundRobinPolicy(), S, lambda model: prefill)
    long = req(4000)
    assert policy.choose(long, [w("d0", Role.DECODE)], 0.0).prefill_worker is not None
    long = dataclasses.replace(long, split_allowed=False)  # e.g. /v1/responses: the P/D hand-off does not cover it
    d = policy.choose(long, [w("d0", Role.DECODE)], 0.0)
    assert d.prefill_worker is None and d.worker.id == "d0"


def test_a_request_forked_into_several_sequences_is_prefilled_where_it_is_decoded_if_it_can_be():
    """``n``/``best_of`` > 1 (``prefer_local``): vLLM's children would share one hand-off, so a vLLM decode
    worker prefills it itself; an SGLang decode server cannot, so there it is still split."""
    from adapters.base import EngineKind
    forked = dataclasses.replace(req(2000), prefer_local=True)
    fleet = [w("p0", Role.PREFILL), w("d0", Role.DECODE)]
    d = select_pair(forked, fleet, 0.0, S)
    assert d.worker.id == "d0" and d.prefill_worker is None and "several sequences" in d.reason
    assert select_pair(req(2000), fleet, 0.0, S).prefill_worker is not None  # one sequence: split as before
    sglang = [w("p0", Role.PREFILL, engine=EngineKind.SGLANG), w("d0", Role.DECODE, engine=EngineKind.SGLANG)]
    d = select_pair(forked, sglang, 0.0, S)
    assert d.prefill_worker is not None and d.prefill_worker.id == "p0"
    # and it survives the per-try copies the router makes
    assert forked.with_inflight({}).prefer_local and forked.annotated(
        token_ids=None, prompt_tokens=2000, block_size=32, block_hashes=[], overlaps={}, peer_load={},
        session_key=None).prefer_local


def test_the_router_policy_leaves_out_the_prefill_workers_a_request_failed_on():
    """The router filters only its (decode) candidates by a try's ``exclude``; the P/D policy adds the prefill
    pool itself, so it must leave the excluded prefill workers out of it too (a retry after a failed prefill
    leg asked the same prefill worker again)."""
    from orchestrator.router.pd_selection import PdRoutingPolicy
    from orchestrator.router.policies.round_robin import RoundRobinPolicy

    prefill = [w("p0", Role.PREFILL), w("p1", Role.PREFILL, inflight=3)]
    policy = PdRoutingPolicy(RoundRobinPolicy(), S, lambda model: prefill)
    decode = [w("d0", Role.DECODE)]
    assert policy.choose(req(4000), decode, 0.0).prefill_worker.id == "p0"
    assert policy.choose_excluding(req(4000), decode, 0.0, {"p0"}).prefill_worker.id == "p1"
    d = policy.choose_excluding(req(4000), decode, 0.0, {"p0", "p1"})
    assert d.prefill_worker is None and d.worker.id == "d0"  # a vLLM decode worker prefills locally
