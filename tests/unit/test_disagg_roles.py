"""Role changes: drain the old role's work, then switch; pools and metrics follow."""

from __future__ import annotations

import asyncio

import pytest

from adapters.base import Role
from orchestrator.clock import VirtualClock
from orchestrator.disagg.roles import RoleConflict, RoleManager
from orchestrator.errors import NotFound
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.router.pd_selection import PdSelectionSettings, select_pair
from orchestrator.router.types import RouteRequest
from orchestrator.telemetry.metrics import DyadMetrics


def fleet(*specs: tuple[str, Role]) -> FleetRegistry:
    return FleetRegistry([Worker(id=i, url=f"http://{i}", role=r, models=["m"], state=WorkerState.HEALTHY)
                          for i, r in specs])


def counter(m: DyadMetrics, frm: str, to: str) -> float:
    return m.registry.get_sample_value("dyad_role_changes_total", {"from_role": frm, "to_role": to}) or 0.0


async def test_role_change_waits_for_in_flight_work_and_takes_no_new_work_meanwhile():
    f = fleet(("a", Role.DECODE), ("b", Role.DECODE), ("p", Role.PREFILL))
    m = DyadMetrics()
    roles = RoleManager(f, VirtualClock(), m)
    b = f.get("b")
    b.inflight = 2  # two requests still decoding on b
    task = roles.request("b", "prefill")
    await asyncio.sleep(0.12)
    assert not task.done()
    assert b.role is Role.DECODE and b.target_role is Role.PREFILL
    assert roles.pools() == {"prefill": ["p"], "decode": ["a"], "both": [], "moving": ["b"]}
    # While it drains, pair selection leaves it alone in both pools.
    for _ in range(5):
        d = select_pair(RouteRequest("r", "m", 4000), f.workers(), 0.0, PdSelectionSettings(min_prefill_tokens=0))
        assert d.worker.id == "a" and d.prefill_worker.id == "p"
    b.inflight = 0
    change = await asyncio.wait_for(task, 2)
    assert change.drained and change.from_role is Role.DECODE and change.to_role is Role.PREFILL
    assert b.role is Role.PREFILL and b.target_role is None
    assert roles.pools() == {"prefill": ["b", "p"], "decode": ["a"], "both": [], "moving": []}
    assert counter(m, "decode", "prefill") == 1


async def test_set_role_is_the_awaitable_planner_interface_and_same_role_is_a_no_op():
    f = fleet(("a", Role.DECODE), ("b", Role.PREFILL))
    m = DyadMetrics()
    roles = RoleManager(f, VirtualClock(), m)
    change = await roles.set_role("b", Role.DECODE)
    assert f.get("b").role is Role.DECODE and change.drained
    again = await roles.set_role("b", "decode")
    assert again.from_role is again.to_role is Role.DECODE
    assert counter(m, "prefill", "decode") == 1
    assert counter(m, "decode", "decode") == 0


async def test_drain_timeout_applies_the_role_anyway_and_says_so():
    f = fleet(("a", Role.DECODE), ("b", Role.DECODE))
    roles = RoleManager(f, VirtualClock(), drain_timeout_s=0.1)
    f.get("b").inflight = 1  # a request that never finishes
    change = await asyncio.wait_for(roles.set_role("b", "prefill"), 2)
    assert not change.drained and f.get("b").role is Role.PREFILL


async def test_refusals_are_clear():
    f = fleet(("a", Role.DECODE), ("p", Role.PREFILL))
    roles = RoleManager(f, VirtualClock())
    with pytest.raises(RoleConflict) as e:
        roles.request("a", "prefill")  # the last decoder of model m
    assert e.value.status == 409 and e.value.code == "last_decoder" and "model 'm'" in str(e.value)
    with pytest.raises(NotFound):
        roles.request("nope", "decode")
    with pytest.raises(RoleConflict) as e:
        roles.request("p", "sideways")
    assert e.value.code == "invalid_role"
    f.get("p").inflight = 1
    roles.request("p", "decode")
    with pytest.raises(RoleConflict) as e:
        roles.request("p", "both")
    assert e.value.code == "role_change_pending"
    await roles.close()
    assert f.get("p").target_role is None and f.get("p").role is Role.PREFILL


async def test_a_moving_decoder_still_counts_when_another_moves_towards_decode():
    f = fleet(("a", Role.DECODE), ("p", Role.PREFILL))
    roles = RoleManager(f, VirtualClock())
    f.get("p").inflight = 1
    roles.request("p", "decode")  # p will be a decoder: a may leave
    roles.request("a", "prefill")
    f.get("p").inflight = 0
    await asyncio.sleep(0.15)
    assert f.get("a").role is Role.PREFILL and f.get("p").role is Role.DECODE
