"""IdleTimer (failover.py): the stream relay's idle deadline, one timer per idle period."""

import asyncio

import pytest

from orchestrator.gateway.failover import IdleTimer


def test_a_shorter_idle_wait_after_the_first_chunk_expires_on_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:
                timer = IdleTimer(loop, deadline.reschedule, 60.0)  # the first wait: long
                timer.pause()
                timer.resume(0.05)  # a chunk came: from now on 0.05 s of silence ends it
                await asyncio.sleep(30)
        return loop.time() - t0

    assert asyncio.run(main()) < 10


def test_paused_it_never_expires_and_each_chunk_moves_the_deadline() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        seen = []
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:
                timer = IdleTimer(loop, deadline.reschedule, 0.05)
                timer.pause()  # relaying to a slow client for longer than the idle wait
                await asyncio.sleep(0.3)
                seen.append("paused: not expired")
                timer.resume(1.5)
                for _ in range(4):  # 2.4 s in all, past one 1.5 s wait: each chunk restarts it
                    await asyncio.sleep(0.6)
                    timer.pause()
                    timer.resume(1.5)
                seen.append("chunks: not expired")
                await asyncio.sleep(30)
        return seen

    assert asyncio.run(main()) == ["paused: not expired", "chunks: not expired"]


def test_cancelled_it_never_fires() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as deadline:
            timer = IdleTimer(loop, deadline.reschedule, 0.01)
            timer.cancel()
            await asyncio.sleep(0.6)

    asyncio.run(main())


def test_armed_for_the_shorter_idle_wait_the_first_wait_still_holds() -> None:
    """Given the idle wait up front (shorter than the first), the timer fires early, re-arms, and the
    first wait still runs its full length; after the first chunk the idle wait applies with no re-arm."""
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:
                IdleTimer(loop, deadline.reschedule, 0.4, idle=0.1)  # no chunk ever comes
                await asyncio.sleep(30)
        first = loop.time() - t0
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:
                timer = IdleTimer(loop, deadline.reschedule, 30.0, idle=0.1)
                await asyncio.sleep(0.05)
                timer.pause()
                timer.resume(0.1)  # the first chunk: from now on 0.1 s of silence ends it
                await asyncio.sleep(30)
        return first, loop.time() - t0

    first, idle = asyncio.run(main())
    assert 0.38 < first < 2 and 0.13 < idle < 2
