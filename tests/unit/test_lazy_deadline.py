"""LazyDeadline: one deadline on one timer, moved only when the deadline comes earlier (pure asyncio,
no sockets)."""

from __future__ import annotations

import asyncio

from orchestrator.gateway.lazy_deadline import LazyDeadline


async def test_fires_once_at_the_deadline_and_not_after_clear():
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    d = LazyDeadline(loop, lambda: fired.append(loop.time()))
    start = loop.time()
    d.set(0.02)
    await asyncio.sleep(0.06)
    assert len(fired) == 1 and fired[0] - start >= 0.02 and d.when is None
    d.set(0.02)
    d.clear()
    await asyncio.sleep(0.05)
    assert len(fired) == 1  # cleared before it was due


async def test_a_later_deadline_keeps_the_timer_and_fires_at_the_new_time():
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    d = LazyDeadline(loop, lambda: fired.append(loop.time()))
    start = loop.time()
    d.set(0.02)
    timer = d._timer
    d.set(0.08)  # later: the same timer stays armed and re-arms for the rest when it fires early
    assert d._timer is timer
    await asyncio.sleep(0.04)
    assert not fired  # the early firing only re-armed
    await asyncio.sleep(0.08)
    assert len(fired) == 1 and fired[0] - start >= 0.08


async def test_an_earlier_deadline_moves_the_timer_and_cancel_leaves_nothing_armed():
    loop = asyncio.get_running_loop()
    fired: list[int] = []
    d = LazyDeadline(loop, lambda: fired.append(1))
    d.set(10.0)
    far = d._timer
    d.set(0.01)  # earlier: the timer moves
    assert d._timer is not far and far is not None and far.cancelled()
    await asyncio.sleep(0.04)
    assert fired == [1]
    d.set(0.01)
    d.cancel()
    assert d._timer is None and d.when is None
    await asyncio.sleep(0.03)
    assert fired == [1]
