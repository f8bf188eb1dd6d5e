"""The simulated engine's armed crash (``die_after_tokens``, a fault the failover tests inject) happens at its
token count however late the engine's loop runs: a late loop advances the engine model by many steps at once,
and the tokens generated after the crash point must not reach the client (they did: on a loaded machine a
request could finish whole on the engine that was to die, and a failover test saw no failover)."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator.sim.engine_model import EngineModel, SimRequest
from orchestrator.sim.profiles import load_profile
from orchestrator.sim.server import _DIED, _Driver


def delivered_then_crash(crash_at: int | None, late_s: float, requests: int = 1) -> list[list[Any]]:
    """Submit ``requests`` 12-token requests, let the loop be ``late_s`` late, pump once; what each queue got."""

    async def run() -> list[list[Any]]:
        model = EngineModel(load_profile("cpu-tiny"), seed=1, record_kv_events=False)
        crashed: list[int] = []
        driver = _Driver(model, None, lambda n: crashed.append(n) if crash_at is not None and n >= crash_at
                         and not crashed else None)
        driver.crash_at = lambda: None if crashed else crash_at
        queues = [driver.submit(SimRequest(f"r{i}", list(range(8)), max_tokens=12)) for i in range(requests)]
        driver.pump(driver.loop.time() + late_s)  # the loop comes back late_s late: many steps at once
        if crashed:
            driver.fail_all()  # (what the server's crash does: every open stream ends)
        got = []
        for q in queues:
            items = []
            while not q.empty():
                items.append(q.get_nowait())
            got.append(items)
        return got

    return asyncio.run(run())


def tokens(items: list[Any]) -> int:
    return sum(len(o.times) for o in items if o is not _DIED)


def test_a_late_loop_delivers_the_tokens_up_to_the_crash_and_then_the_crash():
    (got,) = delivered_then_crash(crash_at=5, late_s=10.0)
    assert tokens(got) == 5 and got[-1] is _DIED
    assert not any(o.finished for o in got if o is not _DIED)


def test_several_streams_lose_the_tokens_generated_after_the_crash_point():
    got = delivered_then_crash(crash_at=7, late_s=10.0, requests=3)
    assert sum(tokens(g) for g in got) == 7
    assert all(g[-1] is _DIED for g in got)


def test_without_a_crash_a_late_loop_delivers_everything():
    (got,) = delivered_then_crash(crash_at=None, late_s=10.0)
    assert tokens(got) == 12 and got[-1].finished
