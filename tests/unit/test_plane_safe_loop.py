"""``PlaneSafeLoop`` (orchestrator/gateway/native/loop.py): loop work started on another thread (the native data
plane's) is queued on the loop's own thread and wakes it. Each test runs a real loop (uvloop's class when
installed, as the gateway does) that has nothing else to do: the other thread acts while the loop sleeps in
its poll, so a call that did not wake it would leave the awaiting side asleep until the test's own timeout."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from orchestrator.gateway.native.loop import PlaneSafeLoop

WAIT_S = 3.0  # how long the loop waits for what the other thread does (it takes ~0.1 s when the loop is woken)


def meanwhile(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any], delay_s: float = 0.1) -> dict[str, Any]:
    """Run ``fn`` on a new thread after ``delay_s`` (the loop asleep by then), with ``loop`` as that thread's
    running loop (as the native lane does); its result or error lands in the returned dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        time.sleep(delay_s)
        asyncio.events._set_running_loop(loop)
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - checked by the test
            out["error"] = e
        finally:
            asyncio.events._set_running_loop(None)

    threading.Thread(target=run, daemon=True).start()
    return out


def run_adopted(main: Callable[[PlaneSafeLoop], Any]) -> Any:
    loop = PlaneSafeLoop()
    try:
        async def adopted() -> Any:
            loop.adopt()
            return await main(loop)
        return loop.run_until_complete(adopted())
    finally:
        loop.close()


async def woken_within(aw: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    value = await asyncio.wait_for(aw, WAIT_S)
    return value, time.monotonic() - t0


def test_a_future_resolved_from_another_thread_wakes_the_loop():
    async def main(loop: PlaneSafeLoop) -> Any:
        fut = loop.create_future()
        meanwhile(loop, lambda: fut.set_result("woken"))
        return await woken_within(fut)

    value, waited = run_adopted(main)
    assert value == "woken" and waited < WAIT_S / 2


def test_an_event_set_from_another_thread_wakes_its_waiter():
    async def main(loop: PlaneSafeLoop) -> Any:
        event = asyncio.Event()
        meanwhile(loop, event.set)
        return await woken_within(event.wait())

    value, waited = run_adopted(main)
    assert value is True and waited < WAIT_S / 2


def test_a_task_started_from_another_thread_runs_on_the_loop_thread():
    async def main(loop: PlaneSafeLoop) -> Any:
        done = loop.create_future()

        async def work() -> None:
            done.set_result(threading.get_ident())

        meanwhile(loop, lambda: asyncio.ensure_future(work()))
        ran_on, waited = await woken_within(done)
        return ran_on == threading.get_ident(), waited

    same_thread, waited = run_adopted(main)
    assert same_thread and waited < WAIT_S / 2


def test_a_task_cancelled_from_another_thread_is_cancelled_promptly():
    async def main(loop: PlaneSafeLoop) -> Any:
        sleeper = asyncio.ensure_future(asyncio.sleep(60))
        meanwhile(loop, sleeper.cancel)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(sleeper, WAIT_S)
        except asyncio.CancelledError:
            return "cancelled", time.monotonic() - t0
        return "finished", time.monotonic() - t0

    outcome, waited = run_adopted(main)
    assert outcome == "cancelled" and waited < WAIT_S / 2


def test_timers_from_another_thread_fire_on_the_loop_and_can_be_cancelled():
    async def main(loop: PlaneSafeLoop) -> Any:
        fired: list[str] = []
        fut = loop.create_future()

        def schedule() -> Any:
            loop.call_later(0.05, lambda: fired.append("later"))
            dropped = loop.call_at(loop.time() + 0.1, lambda: fired.append("cancelled"))
            loop.call_at(loop.time() + 0.2, lambda: fut.set_result(threading.get_ident()))
            dropped.cancel()
            return dropped

        out = meanwhile(loop, schedule)
        ran_on, waited = await woken_within(fut)
        return fired, out["value"].cancelled(), ran_on == threading.get_ident(), waited

    fired, cancelled, on_loop_thread, waited = run_adopted(main)
    assert fired == ["later"] and cancelled and on_loop_thread and waited < WAIT_S / 2


def test_before_adopt_and_on_its_own_thread_it_is_the_plain_loop():
    loop = PlaneSafeLoop()
    try:
        assert loop.on_own_thread()  # not adopted: no thread is told apart
        handle = loop.call_later(10, lambda: None)
        assert type(handle).__name__ != "_ForeignTimer"  # the loop's own timer
        handle.cancel()

        async def adopted() -> Any:
            loop.adopt()
            other = meanwhile(loop, loop.on_own_thread, 0.0)
            await asyncio.sleep(0.2)
            return loop.on_own_thread(), other.get("value")

        assert loop.run_until_complete(adopted()) == (True, False)
    finally:
        loop.close()
