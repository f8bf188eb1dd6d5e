"""Routing policies on plain Worker objects: no network, no clock."""

from __future__ import annotations

from collections import Counter

import pytest

from adapters.base import LoadSnapshot
from orchestrator.config import RouterConfig
from orchestrator.fleet.worker import Worker
from orchestrator.router.policies import UnknownPolicy, make_policy
from orchestrator.router.policies.least_load import LeastLoadPolicy, queue_length
from orchestrator.router.policies.power_of_two import PowerOfTwoPolicy
from orchestrator.router.policies.random import RandomPolicy
from orchestrator.router.policies.round_robin import RoundRobinPolicy
from orchestrator.router.types import RouteRequest

REQ = RouteRequest(request_id="r", model="m", prompt_tokens=10)


def workers(*loads: tuple[float, float, int]) -> list[Worker]:
    """(engine running, engine waiting, gateway inflight) per worker."""
    return [Worker(f"w{i}", f"http://w{i}", models=["m"], load=LoadSnapshot(running=r, waiting=q), inflight=f)
            for i, (r, q, f) in enumerate(loads)]


def test_round_robin_cycles_in_order():
    ws = workers((0, 0, 0), (0, 0, 0), (0, 0, 0))
    p = RoundRobinPolicy()
    assert [p.choose(REQ, ws, 0).worker.id for _ in range(7)] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


def test_queue_length_takes_larger_view():
    assert queue_length(workers((3, 2, 1))[0]) == 5  # engine sees more (other gateways)
    assert queue_length(workers((1, 0, 4))[0]) == 4  # our in-flight is fresher than the scrape


def test_least_load_picks_shortest_queue():
    ws = workers((5, 5, 0), (0, 1, 0), (2, 0, 3))
    d = LeastLoadPolicy().choose(REQ, ws, 0)
    assert d.worker.id == "w1"
    assert d.scores == {"w0": 10, "w1": 1, "w2": 3}


def test_least_load_reacts_to_gateway_inflight_between_scrapes():
    ws = workers((0, 0, 0), (0, 0, 0))
    p = LeastLoadPolicy()
    picks = []
    for _ in range(6):  # simulate dispatch without scrapes: only inflight moves
        w = p.choose(REQ, ws, 0).worker
        w.inflight += 1
        picks.append(w.id)
    assert Counter(picks) == {"w0": 3, "w1": 3}


def test_least_load_spreads_ties():
    ws = workers((1, 0, 0), (1, 0, 0), (1, 0, 0))
    p = LeastLoadPolicy()
    assert {p.choose(REQ, ws, 0).worker.id for _ in range(3)} == {"w0", "w1", "w2"}


def test_power_of_two_never_picks_the_most_loaded_and_is_seeded():
    ws = workers((0, 0, 0), (1, 0, 0), (50, 50, 0))
    picks = [PowerOfTwoPolicy(seed=7).choose(REQ, ws, 0).worker.id for _ in range(1)]
    p = PowerOfTwoPolicy(seed=7)
    seq = [p.choose(REQ, ws, 0).worker.id for _ in range(200)]
    assert "w2" not in seq  # it always loses its comparison
    assert Counter(seq)["w0"] > Counter(seq)["w1"]  # w0 wins whenever sampled
    p2 = PowerOfTwoPolicy(seed=7)
    assert [p2.choose(REQ, ws, 0).worker.id for _ in range(200)] == seq
    assert picks[0] == seq[0]


def test_power_of_two_single_candidate():
    ws = workers((9, 9, 9))
    assert PowerOfTwoPolicy(seed=1).choose(REQ, ws, 0).worker is ws[0]


def test_random_is_seeded_and_uses_everyone():
    ws = workers((0, 0, 0), (0, 0, 0), (0, 0, 0))
    a = [RandomPolicy(seed=3).choose(REQ, ws, 0).worker.id for _ in range(1)]
    p, q = RandomPolicy(seed=3), RandomPolicy(seed=3)
    sa = [p.choose(REQ, ws, 0).worker.id for _ in range(90)]
    assert sa == [q.choose(REQ, ws, 0).worker.id for _ in range(90)]
    assert set(sa) == {"w0", "w1", "w2"} and a[0] == sa[0]


@pytest.mark.parametrize("name, cls", [("round_robin", RoundRobinPolicy), ("least_load", LeastLoadPolicy),
                                       ("power_of_two", PowerOfTwoPolicy), ("random", RandomPolicy)])
def test_make_policy_by_name(name, cls):
    p = make_policy(RouterConfig(policy=name, seed=1))
    assert isinstance(p, cls) and p.name == name


def test_make_policy_kv_aware_missing_module_is_a_clear_error(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_kv(name, *args, **kwargs):
        if name == "orchestrator.router.policies.kv_aware":
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return real_import(name, *args, **kwargs)

    import importlib
    monkeypatch.setattr(importlib, "import_module", lambda name: no_kv(name))
    with pytest.raises(UnknownPolicy, match="kv_aware.*not available"):
        make_policy(RouterConfig(policy="kv_aware"))
