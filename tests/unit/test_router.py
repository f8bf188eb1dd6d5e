"""Router: candidate filtering, the prefix-tracker seam, accounting, recent decisions (no network)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from adapters.base import Role
from orchestrator.clock import VirtualClock
from orchestrator.errors import NoHealthyWorker
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.router.policies.round_robin import RoundRobinPolicy
from orchestrator.router.router import Router
from orchestrator.router.types import Overlap, RouteDecision, RouteRequest
from orchestrator.telemetry.metrics import DyadMetrics


def make_router(*workers: Worker, tracker=None) -> tuple[Router, DyadMetrics]:
    metrics = DyadMetrics()
    reg = FleetRegistry(workers, configured_models=["m", "ghost"])
    return Router(RoundRobinPolicy(), reg, VirtualClock(5.0), metrics, tracker, retry_after_s=7), metrics


def req(rid: str = "r1", prompt_tokens: int = 100) -> RouteRequest:
    return RouteRequest(request_id=rid, model="m", prompt_tokens=prompt_tokens)


async def test_route_skips_unhealthy_draining_prefill_only_and_excluded():
    ok = Worker("ok", "http://ok", models=["m"])
    ok2 = Worker("ok2", "http://ok2", models=["m"])
    sick = Worker("sick", "http://s", models=["m"], state=WorkerState.UNHEALTHY)
    drain = Worker("drain", "http://d", models=["m"], state=WorkerState.DRAINING)
    pre = Worker("pre", "http://p", models=["m"], role=Role.PREFILL)
    router, _ = make_router(sick, drain, pre, ok, ok2)
    chosen = {(await router.route(req(), {}, "/v1/completions")).worker.id for _ in range(4)}
    assert chosen == {"ok", "ok2"}
    for _ in range(3):
        assert (await router.route(req(), {}, "/v1/completions", exclude={"ok"})).worker.id == "ok2"


async def test_no_candidate_is_503_with_retry_after_and_a_reason():
    router, metrics = make_router(Worker("a", "http://a", models=["m"], state=WorkerState.UNHEALTHY))
    with pytest.raises(NoHealthyWorker) as e:
        await router.route(req(), {}, "/v1/completions")
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "7"
    assert "unhealthy" in e.value.message
    with pytest.raises(NoHealthyWorker, match="no worker serves it"):
        await router.route(RouteRequest("r", "ghost", 1), {}, "/v1/completions")
    assert metrics.routing_decisions.labels("round_robin", "no_candidate")._value.get() == 2


class Tracker:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.finished: list[bool] = []

    async def annotate(self, r, body, endpoint, candidates):
        self.calls.append(f"annotate:{endpoint}:{','.join(w.id for w in candidates)}:{body['prompt']}")
        return replace(r, overlaps={"a": Overlap(blocks=2, weighted_blocks=2.0)})

    async def on_routed(self, r, decision, now):
        decision.predicted_cached_tokens = 64
        self.calls.append(f"routed:{decision.worker.id}:{now}")

    async def on_finished(self, r, decision, ok, now):
        self.finished.append(ok)


async def test_tracker_seam_is_called_around_the_policy():
    t = Tracker()
    router, metrics = make_router(Worker("a", "http://a", models=["m"]), tracker=t)
    r = await router.annotate(req(), {"prompt": "hello"}, "/v1/completions")  # a new value: requests are immutable
    d = await router.decide(r)
    assert t.calls == ["annotate:/v1/completions:a:hello", "routed:a:5.0"]
    assert r.overlaps["a"].blocks == 2
    assert router.recent_decisions[-1]["predicted_cached_tokens"] == 64
    assert metrics.predicted_cached_tokens.labels("m")._value.get() == 64
    router.begin(d, r)
    router.finish(d, r, ok=True)
    await asyncio.sleep(0)  # the async on_finished runs in the background
    await asyncio.sleep(0)
    assert t.finished == [True]


async def test_accounting_charges_uncached_prompt_tokens_until_first_token():
    a = Worker("a", "http://a", models=["m"])
    router, _ = make_router(a)
    r1, r2 = req("r1", 100), req("r2", 50)
    d1 = await router.route(r1, {}, "/v1/completions")
    d1.predicted_cached_tokens = 30
    router.begin(d1, r1)
    d2 = await router.route(r2, {}, "/v1/completions")
    router.begin(d2, r2)
    assert (a.inflight, a.inflight_prefill_tokens) == (2, 70 + 50)
    router.first_token(d1, r1)
    router.first_token(d1, r1)  # idempotent
    assert (a.inflight, a.inflight_prefill_tokens) == (2, 50)
    router.finish(d1, r1, ok=True)
    router.finish(d2, r2, ok=False)  # finish without first token releases the charge too
    assert (a.inflight, a.inflight_prefill_tokens) == (0, 0)


async def test_prefill_tokens_charged_to_prefill_worker_in_pd_decisions():
    p = Worker("p", "http://p", models=["m"], role=Role.PREFILL)
    d = Worker("d", "http://d", models=["m"], role=Role.DECODE)
    router, _ = make_router(p, d)
    r = req()
    decision = RouteDecision(worker=d, policy="x", prefill_worker=p)
    router.begin(decision, r)
    assert (d.inflight, d.inflight_prefill_tokens, p.inflight_prefill_tokens) == (1, 0, 100)
    router.finish(decision, r, ok=True)
    assert (d.inflight, p.inflight_prefill_tokens) == (0, 0)


async def test_recent_decisions_are_bounded():
    router, _ = make_router(Worker("a", "http://a", models=["m"]))
    for i in range(250):
        await router.route(req(f"r{i}"), {}, "/v1/completions")
    assert len(router.recent_decisions) == 200
    last = router.recent_decisions[-1]
    assert last["request_id"] == "r249" and last["worker"] == "a" and last["policy"] == "round_robin"
    assert set(last) >= {"time", "model", "reason", "predicted_cached_tokens"}


class HashingTracker:
    """Gives each prompt word one block hash (chained by position, as the real hasher); no index."""

    async def annotate(self, r, body, endpoint, candidates):
        words = body["prompt"].split()
        return replace(r, block_hashes=[hash(tuple(words[: i + 1])) for i in range(len(words))],
                       prompt_tokens=len(words) * r.block_size)

    async def on_routed(self, r, decision, now):
        pass


async def test_prefixes_in_flight_are_credited_and_charged_once():
    """A copy of a prompt sent while the first is still prefilling on a worker finds those blocks
    cached when it starts (engines admit in order): kv_aware credits them, the copy is charged only
    for its own tail, and once the first token is out the ledger forgets the prefix."""
    from orchestrator.router.policies.kv_aware import KvAwarePolicy

    a, b = Worker("a", "http://a", models=["m"]), Worker("b", "http://b", models=["m"])
    router = Router(KvAwarePolicy(seed=0), FleetRegistry([a, b], configured_models=["m"]), VirtualClock(0.0),
                    None, HashingTracker())
    shared = " ".join(f"s{i}" for i in range(40))
    r1 = await router.annotate(RouteRequest("r1", "m", 1, block_size=32), {"prompt": shared + " x1 x2"},
                               "/v1/completions")
    d1 = await router.decide(r1)
    router.begin(d1, r1)
    holder, other = d1.worker, (b if d1.worker is a else a)
    assert holder.inflight_prefill_tokens == 42 * 32
    r2 = await router.annotate(RouteRequest("r2", "m", 1, block_size=32), {"prompt": shared + " y1 y2"},
                               "/v1/completions")
    assert r2.inflight_overlaps == {}  # the annotated request stays as it is; each try sees its own copy
    d2 = await router.decide(r2)
    assert d2.worker is holder and d2.predicted_cached_tokens == 40 * 32
    router.begin(d2, r2)
    assert holder.inflight_prefill_tokens == 42 * 32 + 2 * 32  # the copy pays for its tail only
    assert other.inflight_prefill_tokens == 0
    router.first_token(d1, r1)
    router.first_token(d2, r2)
    d3 = await router.route(RouteRequest("r3", "m", 1, block_size=32), {"prompt": shared + " z"}, "/v1/completions")
    assert d3.predicted_cached_tokens == 0  # from now on the KV-event index speaks for those blocks
    assert (a.inflight_prefill_tokens, b.inflight_prefill_tokens) == (0, 0)
    assert len(router.inflight) == 0


def _slow(wid: str) -> Worker:
    """A worker out of rotation only because its probes timed out (``FleetRegistry.last_resort``)."""
    return Worker(wid, f"http://{wid}", models=["m"], state=WorkerState.UNHEALTHY, out_by_timeouts=True,
                  ready_at=1.0)


async def test_with_no_healthy_worker_the_router_turns_to_the_last_resort_and_counts_it():
    """Every worker out, two of them only for slow probes: tries go to those two (counted as ``last_resort``
    decisions, besides ``routed``), never to the one out for another reason; ``exclude`` still applies (a retry
    goes to the other slow worker, then there is none)."""
    dead = Worker("dead", "http://dead", models=["m"], state=WorkerState.UNHEALTHY, ready_at=1.0)
    router, metrics = make_router(dead, _slow("s1"), _slow("s2"))
    chosen = {(await router.route(req(), {}, "/v1/completions")).worker.id for _ in range(4)}
    assert chosen == {"s1", "s2"}
    assert metrics.routing_decisions.labels("round_robin", "last_resort")._value.get() == 4
    assert (await router.route(req(), {}, "/v1/completions", exclude={"s1"})).worker.id == "s2"
    with pytest.raises(NoHealthyWorker):
        await router.route(req(), {}, "/v1/completions", exclude={"s1", "s2"})


async def test_a_healthy_worker_keeps_the_last_resort_out_even_for_a_retry():
    """One healthy worker: every try goes there, and a retry that excludes it is a 503 rather than a turn to a
    worker whose probes time out; with ``health.last_resort`` off, no healthy worker is a 503 as before."""
    ok = Worker("ok", "http://ok", models=["m"])
    router, metrics = make_router(ok, _slow("s1"))
    assert {(await router.route(req(), {}, "/v1/completions")).worker.id for _ in range(3)} == {"ok"}
    with pytest.raises(NoHealthyWorker):
        await router.route(req(), {}, "/v1/completions", exclude={"ok"})
    assert metrics.routing_decisions.labels("round_robin", "last_resort")._value.get() == 0
    off, _ = make_router(_slow("s1"))
    off.fleet.health.last_resort = False
    with pytest.raises(NoHealthyWorker):
        await off.route(req(), {}, "/v1/completions")
