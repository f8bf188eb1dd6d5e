"""Admission: TTFT prediction from plain worker data, and the bounded priority queue in front of dispatch."""

from __future__ import annotations

import asyncio

import pytest

from adapters.base import Histogram, LoadSnapshot
from orchestrator.fleet.worker import Worker
from orchestrator.gateway.admission import AdmissionGate, ClientGone, Overloaded, TtftPredictor
from orchestrator.gateway.shutdown import ShuttingDown
from orchestrator.telemetry.metrics import DyadMetrics


def _hist(count: float, total: float) -> Histogram:
    return Histogram(buckets=[(float("inf"), count)], sum=total, count=count)


def test_configured_throughput_and_queued_tokens():
    p = TtftPredictor(tokens_per_s=1000)
    w = Worker("w", "http://x", inflight_prefill_tokens=3000)
    assert p.predict(w, 1000) == pytest.approx(4.0)
    assert p.predict(w, 1000, peer_prefill_tokens=1000) == pytest.approx(5.0)  # other replicas' work counts
    # the engine's own queue (waiting x mean prompt) wins when it is larger than what this gateway sent
    w.load = LoadSnapshot(waiting=10, prompt_len=_hist(4, 2000))
    assert p.predict(w, 1000) == pytest.approx(6.0)


def test_throughput_is_learned_from_prefill_time_between_scrapes():
    p = TtftPredictor()
    w = Worker("w", "http://x")
    assert p.predict(w, 100) is None  # nothing known: no prediction (the request is admitted)
    w.load = LoadSnapshot(ttft=_hist(10, 5.0), queue_time=_hist(10, 1.0), prompt_len=_hist(10, 8000),
                          scraped_at=1.0)
    assert p.predict(w, 100) is None  # one scrape: no difference yet
    # 20 more requests, 40k prompt tokens, 12 s TTFT of which 2 s queued: 4k tokens/s of prefill
    w.load = LoadSnapshot(ttft=_hist(30, 17.0), queue_time=_hist(30, 3.0), prompt_len=_hist(30, 48000),
                          scraped_at=2.0)
    assert p.throughput(w) == pytest.approx(4000)
    assert p.predict(w, 4000) == pytest.approx(1.0)
    # a slower window moves the estimate part of the way (EWMA), never a single sample's jump
    w.load = LoadSnapshot(ttft=_hist(40, 27.0), queue_time=_hist(40, 3.0), prompt_len=_hist(40, 58000),
                          scraped_at=3.0)
    assert p.throughput(w) == pytest.approx(4000 + 0.3 * (1000 - 4000))


def _gate(cap: int, queue: int, timeout: float = 5.0) -> AdmissionGate:
    return AdmissionGate(lambda model: cap, queue, timeout, 503, 2, DyadMetrics())


async def test_queue_serves_higher_priority_first_and_fifo_within_a_class():
    gate = _gate(cap=1, queue=10)
    await gate.acquire("m", 1)
    order: list[str] = []

    async def client(name: str, rank: int) -> None:
        await gate.acquire("m", rank)
        order.append(name)
        await asyncio.sleep(0)
        gate.release("m")

    tasks = []
    for name, rank in [("low1", 2), ("normal1", 1), ("low2", 2), ("high", 0), ("normal2", 1)]:
        tasks.append(asyncio.create_task(client(name, rank)))
        await asyncio.sleep(0)
    assert gate.queued == 5
    gate.release("m")
    await asyncio.gather(*tasks)
    assert order == ["high", "normal1", "normal2", "low1", "low2"]
    assert gate.active["m"] == 0 and gate.queued == 0


async def test_full_queue_refuses_or_sheds_the_lowest_priority():
    gate = _gate(cap=1, queue=2)
    await gate.acquire("m", 1)
    waiting = [asyncio.create_task(gate.acquire("m", r)) for r in (2, 1)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as e:  # outranks no waiter: the newcomer is refused
        await gate.acquire("m", 2)
    assert e.value.status == 503 and e.value.code == "queue_full" and e.value.headers["Retry-After"] == "2"
    high = asyncio.create_task(gate.acquire("m", 0))  # outranks the low waiter, who is shed
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as e:
        await waiting[0]
    assert e.value.code == "shed_for_priority"
    gate.release("m")
    await high
    assert not waiting[1].done()
    gate.release("m")
    await waiting[1]


async def test_timeout_and_cancellation_leave_the_queue_clean():
    gate = _gate(cap=1, queue=5, timeout=0.3)
    await gate.acquire("m", 1)
    with pytest.raises(Overloaded) as e:
        await gate.acquire("m", 1)
    assert e.value.code == "queue_timeout" and gate.queued == 0
    t = asyncio.create_task(gate.acquire("m", 1))
    await asyncio.sleep(0.01)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert gate.queued == 0
    gate.release("m")
    assert gate.active["m"] == 0


async def test_capacity_growth_wakes_waiters_without_a_release():
    cap = {"n": 1}
    gate = AdmissionGate(lambda model: cap["n"], 5, 5.0, 503, 1)
    await gate.acquire("m", 1)
    t = asyncio.create_task(gate.acquire("m", 1))
    await asyncio.sleep(0.05)
    assert not t.done()
    cap["n"] = 2  # a worker became healthy
    await asyncio.wait_for(t, 2.0)
    assert gate.active["m"] == 2


async def test_no_capacity_means_no_queueing():
    gate = _gate(cap=0, queue=0)  # no healthy worker: the router answers, not the queue
    await gate.acquire("m", 2)
    await gate.acquire("m", 2)


async def test_a_waiter_whose_client_hangs_up_leaves_the_queue_at_once():
    gate = _gate(cap=1, queue=1, timeout=30)
    await gate.acquire("m", 1)
    hung_up = asyncio.Event()
    t = asyncio.create_task(gate.acquire("m", 1, gone=hung_up.wait))
    await asyncio.sleep(0.01)
    assert gate.queued == 1
    hung_up.set()
    with pytest.raises(ClientGone) as e:
        await asyncio.wait_for(t, 0.2)  # well before the 0.25 s poll: the disconnect itself wakes it
    assert e.value.status == 499 and gate.queued == 0
    assert gate.active["m"] == 1  # the slot holder is untouched
    # the freed place is usable: the queue (size 1) takes a newcomer instead of refusing it
    t2 = asyncio.create_task(gate.acquire("m", 1, gone=asyncio.Event().wait))
    await asyncio.sleep(0.01)
    assert gate.queued == 1
    gate.release("m")
    await asyncio.wait_for(t2, 1.0)
    assert gate.active["m"] == 1 and gate.queued == 0


async def test_close_refuses_every_waiter_and_later_queueing_but_not_free_slots():
    gate = _gate(cap=1, queue=5, timeout=30)
    await gate.acquire("m", 1)
    waiting = [asyncio.create_task(gate.acquire("m", r)) for r in (0, 2)]
    await asyncio.sleep(0.01)
    assert gate.close(lambda: ShuttingDown(4)) == 2
    for t in waiting:
        with pytest.raises(ShuttingDown) as e:
            await t
        assert e.value.status == 503 and e.value.headers["Retry-After"] == "4"
    assert gate.queued == 0
    with pytest.raises(ShuttingDown):
        await gate.acquire("m", 0)  # would have to queue: refused at once
    gate.release("m")
    await gate.acquire("m", 1)  # a free slot is still handed out (it will finish within the grace)
    assert gate.active["m"] == 1
