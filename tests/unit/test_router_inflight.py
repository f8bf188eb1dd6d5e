"""router.inflight: the books of dispatched prefill (tokens per worker, prefixes in flight)."""

from __future__ import annotations

from orchestrator.fleet.worker import Worker
from orchestrator.router.inflight import InflightLedger


def test_covered_counts_leading_blocks_in_flight_on_that_worker_only():
    a, b = Worker("a", "http://a"), Worker("b", "http://b")
    led = InflightLedger()
    led.charge("r1", a, 300, [1, 2, 3, 4])
    led.charge("r2", a, 100, [1, 2, 9])
    assert led.covered_by_worker([a, b], [1, 2, 3, 7]) == {"a": 3}
    assert led.covered_by_worker([a, b], [1, 2, 9, 8]) == {"a": 3}
    assert led.covered_by_worker([a, b], [5, 1, 2]) == {}  # a run starts at the first block
    assert led.covered_by_worker([b], [1, 2, 3]) == {}  # b has nothing in flight
    assert led.covered_by_worker([a, b], [1, 2, 3]) == {"a": 3}
    assert a.inflight_prefill_tokens == 400
    assert led.release("r1") == 300
    assert led.release("r1") is None  # idempotent
    assert led.covered_by_worker([a], [1, 2, 3]) == {"a": 2}  # r2 still computes blocks 1-2
    assert a.inflight_prefill_tokens == 100
    led.release("r2")
    assert led.covered_by_worker([a, b], [1, 2]) == {} and a.inflight_prefill_tokens == 0 and len(led) == 0


def test_recharging_a_key_replaces_it_and_the_per_worker_cap_forgets_the_oldest():
    a = Worker("a", "http://a")
    led = InflightLedger(max_per_worker=3)
    led.charge("r", a, 50, [1])
    led.charge("r", a, 70, [2])  # a retry on the same key: not counted twice
    assert a.inflight_prefill_tokens == 70
    assert led.covered_by_worker([a], [1]) == {} and led.covered_by_worker([a], [2]) == {"a": 1}
    for i in range(5):
        led.charge(f"x{i}", a, 10, [100 + i])
    assert len(led) == 3  # a lost release must not grow the books forever
    assert a.inflight_prefill_tokens == 30
    assert led.covered_by_worker([a], [104]) == {"a": 1} and led.covered_by_worker([a], [2]) == {}


def test_the_fleet_walk_matches_a_linear_walk_per_worker_on_chained_prompts():
    import random

    from orchestrator.kv.hashing import BlockHasher

    rng = random.Random(3)
    hasher = BlockHasher("m", 4)
    workers = [Worker(f"w{i}", f"http://w{i}") for i in range(3)]
    led = InflightLedger()
    base = [rng.randrange(20) for _ in range(40)]
    prompts = []
    for k in range(30):  # prompts sharing prefixes of random lengths with a common base
        cut = rng.randrange(len(base) + 1)
        p = base[:cut] + [rng.randrange(20) for _ in range(rng.randrange(0, 30))]
        prompts.append(hasher.hash_blocks(p))
        if k % 2 == 0:
            led.charge(k, rng.choice(workers), 1, prompts[-1])
    def check() -> None:
        for hashes in prompts:
            expected = {}
            for w in workers:
                refs = led._refs.get(w.id, {})
                linear = 0
                for h in hashes:
                    if h not in refs:
                        break
                    linear += 1
                if linear:
                    expected[w.id] = linear
            assert led.covered_by_worker(workers, hashes) == expected  # the one-walk version agrees

    check()
    for k in range(0, 30, 4):  # releases free blocks (and slots, reused by later charges)
        led.release(k)
    check()
    for k in range(1, 30, 6):
        led.charge(k, rng.choice(workers), 1, prompts[k])
    check()


def test_backlog_drains_at_the_rate_learned_from_first_tokens():
    w = Worker("a", "http://a")
    led = InflightLedger()
    led.charge("r1", w, 1200, now=0.0)
    assert w.queued_prefill_tokens == 1200 and led.rate("a") is None
    led.refresh([w], 0.9)
    assert w.queued_prefill_tokens == 1200  # no rate yet: the whole charge
    led.release("r1", now=1.0)
    assert led.rate("a") == 1200.0 and w.queued_prefill_tokens == 0
    led.charge("r2", w, 2400, now=2.0)
    led.refresh([w], 3.0)
    assert w.queued_prefill_tokens == 1200.0  # half done, by the learned rate
    assert w.inflight_prefill_tokens == 2400  # the charge itself stays until the first token
    led.refresh([w], 9.0)
    assert w.queued_prefill_tokens == 0.0  # never below zero
    led.release("r2", now=9.0)
    # r2 could start at 2.0 (dispatch; the previous first token was at 1.0): 2400 tokens in 7 s
    assert led.rate("a") == (0.9 * 1200 + 2400) / (0.9 * 1.0 + 7.0)


def test_service_starts_at_the_previous_first_token_and_failures_teach_nothing():
    w = Worker("a", "http://a")
    led = InflightLedger()
    led.charge("a", w, 1000, now=0.0)
    led.charge("b", w, 1000, now=0.5)  # queued behind a
    led.release("a", now=1.0)
    led.release("b", now=2.0)  # served from 1.0 (a's first token), not from its dispatch
    assert led.rate("a") == (0.9 * 1000 + 1000) / (0.9 * 1.0 + 1.0)
    before = led.rate("a")
    led.charge("c", w, 5000, now=3.0)
    led.release("c", now=3.1, prefilled=False)  # an error or a cancellation: not a prefill
    assert led.rate("a") == before
    assert w.queued_prefill_tokens == 0 and w.inflight_prefill_tokens == 0
    led.charge("d", w, 300, now=10.0)
    led.refresh([w], 10.0)
    assert w.queued_prefill_tokens == 300  # capped by what is still charged, whatever was drained before


def test_covered_matches_a_brute_force_model_on_random_charges_and_releases():
    """Fast paths (a prompt new to the worker, or in flight nowhere) and the general path agree with
    the definition: the leading blocks each in some prompt in flight on that worker."""
    import random

    rng = random.Random(11)
    workers = [Worker(n, f"http://{n}") for n in ("a", "b", "c")]
    led = InflightLedger()
    live: dict[str, tuple[Worker, list[int]]] = {}
    for step in range(3000):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            led.release(key)
            del live[key]
        else:
            w = rng.choice(workers)
            start = rng.randrange(0, 30)
            blocks = list(range(start, start + rng.randrange(0, 10)))
            if blocks and rng.random() < 0.1:
                blocks.append(blocks[0])  # a repeated block must not break the counts
            key = f"r{step}"
            led.charge(key, w, 10, blocks)
            live[key] = (w, blocks)
        query = list(range(rng.randrange(0, 30), 40))
        expect = {}
        for w in workers:
            held = {h for (ww, bl) in live.values() if ww is w for h in bl}
            n = 0
            while n < len(query) and query[n] in held:
                n += 1
            if n:
                expect[w.id] = n
        assert led.covered_by_worker(workers, query) == expect
    for key in list(live):
        led.release(key)
    assert led._holders == {} and led._refs == {}
