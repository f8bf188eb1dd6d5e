"""Faults of the live control loop's inputs and of fleet membership that earlier probes did not cover
(issue 14): dependencies that answer too slowly to ever trip a per-read timeout, engines the local
actuator starts that never become ready or are removed behind its back, a workers file caught
half-written, malformed KV events. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from adapters.base import EngineKind, Role
from adapters.vllm import VllmAdapter
from orchestrator.clock import VirtualClock
from orchestrator.config import HealthConfig, ScrapeConfig
from orchestrator.fleet.health import HealthChecker
from orchestrator.fleet.kube_api import KubeApi
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.scrape import MetricsScraper
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.metrics_source import DirectSource, PrometheusSource

pytestmark = [pytest.mark.timeout(60)]


@contextlib.asynccontextmanager
async def trickling_server() -> AsyncIterator[str]:
    """An HTTP server that answers 200 with a long body and sends one byte of it every 0.2 s: each
    read completes well within any per-read timeout, the answer never does."""
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            while True:
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for w in writers:
            w.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1)


async def _within(coro, bound_s: float):
    """Run ``coro``; fail the test (instead of hanging) when it takes longer than ``bound_s``."""
    t = time.monotonic()
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=bound_s)
    if not done:
        task.cancel()
        raise AssertionError(f"still running after {bound_s:g} s")
    return task.result(), time.monotonic() - t


# ---------------------------------------------------------------- deadlines, not per-read timeouts

async def test_a_trickling_prometheus_costs_the_planner_its_timeout_not_forever():
    async with trickling_server() as url:
        src = PrometheusSource(url, timeout_s=0.5)
        with pytest.raises(TimeoutError, match="within 1 s"):
            await _within(src.observe(0.0), 5.0)


async def test_a_trickling_gateway_metrics_endpoint_is_bounded_too():
    async with trickling_server() as url:
        src = DirectSource(metrics_url=f"{url}/metrics", timeout_s=0.5)
        with pytest.raises(TimeoutError, match="within 0.5 s"):
            await _within(src.observe(0.0), 5.0)


async def test_one_trickling_engine_does_not_stall_the_health_or_scrape_loop():
    async with trickling_server() as url, httpx.AsyncClient() as http:
        fleet = FleetRegistry([Worker("slow", url, engine=EngineKind.VLLM, models=["m"])])
        adapter = VllmAdapter()
        checker = HealthChecker(fleet, http, HealthConfig(timeout_s=0.3), VirtualClock(), lambda _: adapter)
        _, took = await _within(checker.check_all(), 5.0)
        w = fleet.get("slow")
        assert w.state is WorkerState.UNHEALTHY and "0.3" in (w.last_error or ""), w.last_error
        w.state = WorkerState.HEALTHY  # the scrape loop only reads workers in rotation
        scraper = MetricsScraper(fleet, http, ScrapeConfig(timeout_s=0.3), VirtualClock(), lambda _: adapter)
        await _within(scraper.scrape_all(), 5.0)


async def test_a_trickling_kubernetes_api_answer_is_bounded():
    async with trickling_server() as url:
        api = KubeApi(url, timeout_s=0.5)
        try:
            with pytest.raises(TimeoutError):
                await _within(api.get("/api/v1/namespaces/x/pods"), 5.0)
            with pytest.raises(TimeoutError):
                await _within(api.merge_patch("/api/v1/namespaces/x/pods/p", {}), 5.0)
        finally:
            await api.aclose()



def _planner(**settings):
    from orchestrator.planner.core import Planner, PlannerSettings
    from orchestrator.planner.install import DEFAULT_PROFILE
    from orchestrator.planner.perf_model import PerfModel
    from orchestrator.planner.solver import Limits, Targets

    return Planner(PerfModel.load(DEFAULT_PROFILE), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=8),
                                                                    **settings))


async def test_a_source_without_its_own_deadline_makes_the_planner_hold_and_say_why():
    from orchestrator.planner.actuators import RecommendOnly
    from orchestrator.planner.service import PlannerService

    class Hung:
        async def observe(self, now: float):
            await asyncio.Event().wait()

    service = PlannerService(_planner(interval_s=30.0), Hung(), RecommendOnly(), fleet=lambda: [],
                             clock=VirtualClock(), observe_timeout_s=0.3)
    decision, _ = await _within(service.run_once(), 5.0)
    assert decision.actions == [] and service.held is not None
    assert service.held["reason"] == "source_unavailable" and "0.3 s" in service.held["detail"], service.held


async def test_kubernetes_scale_in_sees_a_pod_whose_engine_is_gone_as_idle_at_once():
    """The drain check reads a victim's engine; an engine that refuses connections has nothing to
    finish. It used to read as "cannot tell" (the adapter wraps the connect error), so the scale-in
    waited out ``kubernetes_drain_timeout_s`` (10 minutes by default) for a dead pod."""
    from types import SimpleNamespace

    from orchestrator.config import load_config
    from orchestrator.planner.install import kubernetes_actuator
    from orchestrator.ports import free_port

    cfg = load_config({"models": [{"name": "m"}], "planner": {
        "enabled": True, "actuator": "kubernetes", "kubernetes_api": "http://127.0.0.1:9",
        "kubernetes_workloads": {"decode": "statefulsets/d"}}}, environ={})
    cfg.discovery.kubernetes.port = free_port()  # nothing listens there
    async with httpx.AsyncClient() as http:
        runtime = SimpleNamespace(config=cfg, fleet=FleetRegistry(), http=http, clock=VirtualClock(),
                                  adapter_for=lambda _: VllmAdapter())
        actuator = kubernetes_actuator(cfg.planner, runtime)
        try:
            pod = {"metadata": {"name": "d-1"}, "status": {"podIP": "127.0.0.1"}}
            assert await actuator.is_idle(pod) is True
        finally:
            await actuator.close()


# ---------------------------------------------------------------- engines the local actuator starts

def _local_fleet(command: str, start_timeout_s: float = 5.0):
    """A local actuator starting real processes (``command``, which never serves HTTP) into a registry."""
    from types import SimpleNamespace

    from orchestrator.planner.actuators import LocalProcessActuator
    from orchestrator.planner.install import _DrainingLocal

    fleet = FleetRegistry()
    clock = VirtualClock(100.0)
    local = LocalProcessActuator({Role.PREFILL: command}, clock=clock, stop_timeout_s=2.0,
                                 on_started=lambda p: fleet.add(Worker(p.worker_id, p.url, role=p.role, models=["m"],
                                                                               state=WorkerState.UNHEALTHY)),
                                 on_stopped=lambda p: fleet.get(p.worker_id) and fleet.remove(p.worker_id))
    return fleet, clock, local, _DrainingLocal(local, SimpleNamespace(fleet=fleet), min_serve_s=30.0,
                                               start_timeout_s=start_timeout_s)


def _decision(*actions):
    from orchestrator.planner.core import PlanDecision

    return PlanDecision(at=0.0, observation=None, forecast=None, sizing=None, desired={}, current={},
                        actions=list(actions), correction={}, predictors={}, reasons=[])


async def test_an_engine_that_never_becomes_ready_stops_counting_and_is_reaped():
    """A started engine whose process lives but never answers its health probe counted as capacity on
    its way for good (the planner never started a replacement) and held its host's resources."""
    from orchestrator.planner.core import Action
    from orchestrator.planner.install import starting_by
    from orchestrator.planner.service import views_from_workers

    fleet, clock, local, actuator = _local_fleet("sleep 60", start_timeout_s=5.0)
    try:
        await actuator.apply(_decision(Action("start", Role.PREFILL)))
        (wid, p), = local.processes.items()
        starting = starting_by(actuator)
        assert views_from_workers(fleet.workers(), starting=starting)[0].state == "starting"
        clock.advance(4.0)
        assert views_from_workers(fleet.workers(), starting=starting)[0].state == "starting"
        clock.advance(2.0)  # past the start timeout, still not ready: not capacity any more
        assert views_from_workers(fleet.workers(), starting=starting)[0].state == "unhealthy"
        done = await actuator.apply(_decision())
        assert any(line.startswith(f"reaped {wid}") and "not ready" in line for line in done), done
        assert wid not in local.processes and fleet.get(wid) is None
        assert p.proc.poll() is not None  # the process is gone too
    finally:
        await actuator.close()


async def test_an_engine_that_exits_at_once_is_not_counted_as_starting():
    from orchestrator.planner.core import Action
    from orchestrator.planner.install import starting_by
    from orchestrator.planner.service import views_from_workers

    fleet, clock, local, actuator = _local_fleet("true")
    try:
        await actuator.apply(_decision(Action("start", Role.PREFILL)))
        (wid, p), = local.processes.items()
        await asyncio.to_thread(p.proc.wait, 5)
        assert views_from_workers(fleet.workers(), starting=starting_by(actuator))[0].state == "unhealthy"
        done = await actuator.apply(_decision())
        assert any(line.startswith(f"reaped {wid}") for line in done) and fleet.get(wid) is None
    finally:
        await actuator.close()


async def test_an_engine_an_operator_removed_from_the_registry_is_stopped_not_orphaned():
    """``DELETE /admin/workers/{id}`` on an engine the planner started: the process ran on, unseen by
    the planner (not in its fleet) and never stopped until the gateway exited."""
    from orchestrator.planner.core import Action

    fleet, clock, local, actuator = _local_fleet("sleep 60")
    try:
        await actuator.apply(_decision(Action("start", Role.PREFILL)))
        (wid, p), = local.processes.items()
        fleet.remove(wid)  # what the admin route does
        done = await actuator.apply(_decision())
        assert any(line.startswith(f"stopped {wid}") and "registry" in line for line in done), done
        assert wid not in local.processes and p.proc.poll() is not None
    finally:
        await actuator.close()



async def test_a_role_whose_engines_never_come_up_is_started_again_only_after_a_growing_pause():
    """A broken command template (a missing GPU, a bad flag) exits at once every time; the planner asked
    for a start every interval and the actuator started one every interval, for good. Now each start that
    did not come up doubles the pause before the next one of that role; one that comes up resets it."""
    from orchestrator.planner.core import Action

    fleet, clock, local, actuator = _local_fleet("false")
    actuator.start_backoff_s = 10.0
    start = _decision(Action("start", Role.PREFILL))
    try:
        pauses = []
        for _ in range(3):
            done = await actuator.apply(start)
            assert any(line.startswith("started") for line in done), done
            (wid, p), = local.processes.items()
            await asyncio.to_thread(p.proc.wait, 5)
            done = await actuator.apply(start)  # reaps it; the new start is held back
            assert any(line.startswith(f"reaped {wid}") for line in done), done
            held = [line for line in done if "held back" in line]
            assert held and not local.processes, done
            pauses.append(float(held[0].split("held back ")[1].split(" s")[0]))
            clock.advance(pauses[-1] + 0.1)
        assert pauses == [10.0, 20.0, 40.0]
        # a start that comes up resets the pause
        local.commands[Role.PREFILL] = "sleep 60"
        await actuator.apply(start)
        (wid, _), = local.processes.items()
        fleet.record_health(fleet.get(wid), True, clock.now())
        await actuator.apply(_decision())
        assert actuator.failed_starts.get(Role.PREFILL, 0) == 0
    finally:
        await actuator.close()



async def test_a_command_that_cannot_be_run_is_a_failed_start_not_a_failed_interval():
    """A template naming a program that is not installed raised FileNotFoundError out of the actuator:
    the whole interval failed (other actions in it were not carried out) and it did so every interval."""
    from orchestrator.planner.core import Action

    fleet, clock, local, actuator = _local_fleet("/nonexistent/engine --port {port}")
    actuator.start_backoff_s = 10.0
    local.commands[Role.DECODE] = "sleep 60"
    try:
        done = await actuator.apply(_decision(Action("start", Role.PREFILL), Action("start", Role.DECODE)))
        assert any("start of prefill failed" in line and "nonexistent" in line for line in done), done
        assert any(line.startswith("started local-decode") for line in done), done  # the rest was carried out
        done = await actuator.apply(_decision(Action("start", Role.PREFILL)))
        assert any("held back" in line for line in done), done
    finally:
        await actuator.close()



async def test_engines_slow_to_exit_are_stopped_together_not_one_after_another():
    """``stop`` waits up to ``stop_timeout_s`` for an engine to exit after SIGTERM (a big model takes a
    while to free its memory; a wedged one never does) and then kills it. Stops ran one after another:
    a scale-in of N such engines held the planner loop N × that long, and the gateway's shutdown too."""
    import sys

    from orchestrator.planner.core import Action

    deaf = f"{sys.executable} -c 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'"
    fleet, clock, local, actuator = _local_fleet(deaf)
    local.stop_timeout_s = 1.0
    try:
        await actuator.apply(_decision(*[Action("start", Role.PREFILL)] * 3))
        ids = sorted(local.processes)
        procs = [local.processes[w].proc for w in ids]
        await asyncio.sleep(0.5)  # the interpreters are up and ignore SIGTERM
        for w in ids:  # they served their minimum time
            fleet.record_health(fleet.get(w), True, clock.now())
        clock.advance(60.0)
        _, took = await _within(actuator.apply(_decision(*[Action("stop", Role.PREFILL, w) for w in ids])), 10.0)
        assert all(p.poll() is not None for p in procs) and not local.processes
        assert took < 2.0, f"3 stops took {took:.1f} s"
        await actuator.apply(_decision(*[Action("start", Role.PREFILL)] * 3))
        procs = [p.proc for p in local.processes.values()]
        await asyncio.sleep(0.5)
        _, took = await _within(actuator.close(), 10.0)
        assert all(p.poll() is not None for p in procs) and took < 2.0, f"close took {took:.1f} s"
    finally:
        await actuator.close()


# ---------------------------------------------------------------- a workers file caught mid-write

def test_a_workers_file_caught_half_written_never_withdraws_workers(tmp_path):
    """Tools that write in place (``open(path, "w")``) truncate first: a poll between the truncation
    and the write saw an empty list, or the first entries of a YAML list, and withdrew (drained,
    then removed) every worker missing from it."""
    from orchestrator.config import FileDiscoveryConfig
    from orchestrator.fleet.discovery.file import FileSource

    path = tmp_path / "workers.yaml"
    full = "- id: a\n  url: http://10.0.0.1:8000\n- id: b\n  url: http://10.0.0.2:8000\n"
    path.write_text(full)
    src = FileSource(FileDiscoveryConfig(path=str(path), interval_s=0.1))
    assert sorted(src.poll()) == ["a", "b"]  # the first load applies at once
    for caught in ("", full[: full.index("- id: b")]):  # truncated; the first entry only
        path.write_text(caught)
        assert src.poll() is None, f"applied a file caught mid-write: {caught!r}"
        path.write_text(full)  # the writer finishes
        assert src.poll() is None and src.poll() is None
    # a writer that stops after truncating leaves an empty file: refused, the list stays
    path.write_text("")
    assert src.poll() is None and src.poll() is None and "empty" in (src.last_error or "")
    # deliberate changes apply one poll later: removing every worker is written as []
    path.write_text("- id: a\n  url: http://10.0.0.1:8000\n")
    assert src.poll() is None and list(src.poll()) == ["a"]
    path.write_text("[]\n")
    assert src.poll() is None and src.poll() == {}


# ---------------------------------------------------------------- KV events an engine gets wrong

MALFORMED = [
    {"type": "BlockStored", "block_hashes": ["zz"], "token_ids": list(range(4)), "block_size": 4},
    {"type": "BlockStored", "block_hashes": [1], "token_ids": list(range(4)), "block_size": "four"},
    {"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"] * 4, "block_size": 4},
    {"type": "BlockStored", "block_hashes": [1], "token_ids": list(range(4)), "block_size": 4, "extra_keys": 3},
    {"type": "BlockStored", "block_hashes": [2], "token_ids": list(range(4)), "block_size": 4, "parent_block_hash": [1]},
    {"type": "BlockRemoved", "block_hashes": 5},
]


def test_each_malformed_kv_event_is_skipped_and_counted():
    """Any of these raised out of the mapper, and with it out of the engine's subscriber, which then
    stopped for good: the worker's index entries froze (stale hits, no new ones) until it was removed."""
    from orchestrator.kv.events import KvEventMapper

    m = KvEventMapper("w", lambda: "m")
    for ev in MALFORMED:
        assert m.apply(ev) is None, ev
    assert m.malformed == len(MALFORMED)
    ok = m.apply({"type": "BlockStored", "block_hashes": [7], "token_ids": list(range(4)), "block_size": 4})
    assert ok is not None and ok.kind == "store"


async def test_the_subscriber_outlives_a_batch_it_cannot_apply():
    import zmq.asyncio

    from orchestrator.kv.events import KvEventMapper, KvEventSubscriber
    from tests.integration.test_kv_events import TOKENS, Publisher, stored, until

    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    mapper = KvEventMapper("w", lambda: "m")
    stores: list[list[int]] = []
    fail = [True]

    async def on_batch(wid, ts, events):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("a bug while applying this batch")
        for ev in events:
            op = mapper.apply(ev)
            if op is not None and op.kind == "store":
                stores.append(op.hashes)

    async def on_reset(wid, why):
        mapper.reset()

    sub = KvEventSubscriber("w", f"tcp://127.0.0.1:{pub.port}", on_batch, on_reset, context=ctx)
    sub.start()
    try:
        await asyncio.sleep(0.3)  # SUB connects
        await pub.publish([stored([1], TOKENS[:4])])  # on_batch fails on this one
        await pub.publish([MALFORMED[0], stored([2], TOKENS[:4])])
        await until(lambda: len(stores) == 1)
        await pub.publish([stored([3], TOKENS[4:8], parent=2)])
        await until(lambda: len(stores) == 2)
        assert not sub._task.done() and sub.failed == 1 and mapper.malformed == 1
    finally:
        await sub.stop()
        pub.close()
        ctx.term()


# ---------------------------------------------------------------- values no fleet can produce

@pytest.mark.parametrize("garbage", [
    {"request_rate": -5.0},  # read as a measured zero load: the planner scaled in
    {"mean_isl": -100.0, "mean_osl": -5.0},
    {"request_rate": 1e300, "mean_isl": 1e300, "mean_osl": 1e300, "ttft_mean": 1e300, "itl_mean": 1e300},
    {"peak_rate": 1e300},
])
async def test_a_source_reporting_garbage_makes_the_planner_hold_not_act_or_crash(garbage):
    from orchestrator.planner.actuators import RecommendOnly
    from orchestrator.planner.core import WorkerView
    from orchestrator.planner.metrics_source import Observation
    from orchestrator.planner.service import PlannerService

    class Garbage:
        async def observe(self, now: float):
            base = {"request_rate": 5.0, "mean_isl": 500.0, "mean_osl": 50.0, "ttft_mean": 0.2, "itl_mean": 0.02}
            return Observation(at=now, window_s=30.0, **{**base, **garbage})

    fleet = [WorkerView("p1", Role.PREFILL, "healthy", 0, 0), WorkerView("d1", Role.DECODE, "healthy", 0, 0),
             WorkerView("d2", Role.DECODE, "healthy", 0, 0)]
    clock = VirtualClock(1000.0)
    service = PlannerService(_planner(interval_s=30.0, scale_in_intervals=1), Garbage(), RecommendOnly(),
                             fleet=lambda: fleet, clock=clock)
    for _ in range(3):
        clock.advance(30.0)
        decision = await service.run_once()
        assert decision.actions == [], decision.actions
    assert service.held is not None and service.held["reason"] == "invalid_input", service.held
    assert next(iter(garbage)) in service.held["detail"]


# ---------------------------------------------------------------- worker addresses that cannot work

@pytest.mark.parametrize("url", ["http://", "https:///v1", "http://:8000", "http://a b:8000", "http://host:99999",
                                 "http://host:0", "http://host:port", "http://ho\nst:1"])
def test_a_worker_url_without_a_usable_address_is_refused_where_workers_come_in(url, tmp_path):
    """The config, the admin API and the workers file share ``WorkerConfig``: it checked the scheme only,
    so a half-written file entry (``url: http://``) or a typo became a worker that can never be probed
    (an InvalidURL on every round), registered under an id taken from the broken URL."""
    from pydantic import ValidationError

    from orchestrator.config import WorkerConfig
    from orchestrator.fleet.discovery.file import WorkersFileError, parse_workers_file

    with pytest.raises(ValidationError):
        WorkerConfig(url=url)
    with pytest.raises(WorkersFileError, match=r"workers\.0\.url"):
        parse_workers_file(json.dumps([{"url": url}]))


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "https://engine.ns.svc:443/", "http://[fd00::1]:8000",
                                 "http://localhost:8000/prefix"])
def test_ordinary_worker_urls_still_pass(url):
    from orchestrator.config import WorkerConfig

    assert WorkerConfig(url=url).url == url.rstrip("/")


# ---------------------------------------------------------------- a pod watch that gets odd answers

async def test_a_pod_watch_survives_answers_of_the_wrong_shape():
    """A watch line that is JSON but not an event object (a proxy's answer, a truncated rewrite), or a
    list item without metadata, raised AttributeError/KeyError/TypeError, which the watch loop did not
    catch: the loop ended for good and the gateway's fleet froze at its last report."""
    from orchestrator.fleet.discovery.kubernetes import PodListWatch

    pod = {"metadata": {"name": "p-0", "resourceVersion": "5"},
           "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
    calls = {"list": 0, "watch": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("watch") == "true":
            calls["watch"] += 1
            if calls["watch"] == 1:  # not an event object
                return httpx.Response(200, content=b'["not", "an", "event"]\n')
            if calls["watch"] == 2:  # an event whose object is not an object
                return httpx.Response(200, content=b'{"type": "ADDED", "object": "p-1"}\n')
            return httpx.Response(200, content=b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}\n')
        calls["list"] += 1
        items = [{"kind": "Pod"}, pod] if calls["list"] == 1 else [pod]  # the first list has a pod without metadata
        return httpx.Response(200, json={"metadata": {"resourceVersion": "5"}, "items": items})

    api = KubeApi("http://kube.test", transport=httpx.MockTransport(handler))
    changes: list[int] = []
    watch = PodListWatch(api, "ns", "app=x", lambda: changes.append(1), backoff_max_s=0.05)
    task = asyncio.create_task(watch.run())
    try:
        for _ in range(200):
            if watch.bookmarks >= 1 or task.done():
                break
            await asyncio.sleep(0.02)
        assert not task.done(), task.exception() if task.done() else None
        assert list(watch.pods) == ["p-0"] and watch.errors >= 2 and watch.bookmarks >= 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.aclose()


def test_one_pod_that_cannot_be_mapped_does_not_stop_the_report_of_the_others():
    from orchestrator.config import KubernetesDiscoveryConfig
    from orchestrator.fleet.discovery.kubernetes import desired_from_pods

    def pod(name: str, port) -> dict:
        return {"metadata": {"name": name}, "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]},
                "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}

    out = desired_from_pods([(Role.BOTH, {"good": pod("good", 8000), "bad": pod("bad", "eighty")})],
                            KubernetesDiscoveryConfig())
    assert list(out) == ["good"]


# ---------------------------------------------------------------- one engine registered twice

def test_one_engine_is_never_registered_twice_under_two_ids():
    """A workers-file entry (id defaults to its URL) for an engine that is also a static worker, or two
    entries for one URL, or an admin add of a known URL: the engine became two workers, so the router
    sent it twice its share and the planner counted capacity that does not exist."""
    from orchestrator.config import WorkerConfig
    from orchestrator.fleet.discovery.file import WorkersFileError, parse_workers_file
    from orchestrator.fleet.discovery.reconcile import Reconciler, WorkerSpec
    from orchestrator.fleet.registry import worker_from_config

    with pytest.raises(WorkersFileError, match=r"workers\.1\.url.*workers\.0"):
        parse_workers_file(json.dumps([{"id": "a", "url": "http://10.0.0.1:8000"},
                                       {"id": "b", "url": "http://10.0.0.1:8000/"}]))
    fleet = FleetRegistry([worker_from_config(WorkerConfig(id="static", url="http://10.0.0.1:8000"))])
    changes: list = []
    rec = Reconciler(fleet, "file", grace_s=5.0, on_change=changes.append)
    spec = WorkerSpec(WorkerConfig(id="http://10.0.0.1:8000", url="http://10.0.0.1:8000"))
    other = WorkerSpec(WorkerConfig(id="f2", url="http://10.0.0.2:8000"))
    rec.update({spec.id: spec, other.id: other}, 0.0)
    assert sorted(w.id for w in fleet.workers()) == ["f2", "static"]
    assert [c.kind for c in changes] == ["conflict", "add"] and "static" in changes[0].reason
    rec.sweep(0.5)
    rec.sweep(1.0)
    assert [c.kind for c in changes].count("conflict") == 1  # reported once, not every sweep
    fleet.remove("static")  # the other registration goes: the source's own entry joins
    rec.sweep(1.5)
    assert fleet.get("http://10.0.0.1:8000") is not None


def test_the_admin_api_refuses_a_second_worker_for_a_registered_url():
    from orchestrator.config import load_config
    from orchestrator.gateway.serve import GatewayThread

    cfg = load_config({"gateway": {"admin_token": "adm"}, "models": [{"name": "m"}],
                       "workers": [{"id": "w0", "url": "http://127.0.0.1:9", "models": ["m"]}]}, environ={})
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, headers={"authorization": "Bearer adm"},
                                                timeout=10) as admin:
        r = admin.post("/admin/workers", json={"id": "w1", "url": "http://127.0.0.1:9/", "models": ["m"]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "worker_url_exists", r.text
        assert "w0" in r.json()["error"]["message"]
        assert [w.id for w in gw.runtime.fleet.workers()] == ["w0"]


# ---------------------------------------------------------------- Prometheus answering garbage

@pytest.mark.parametrize(("body", "says"), [
    (b"<html><body>502 Bad Gateway</body></html>", "not JSON (text/html"),
    (b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{}', "not JSON"),
    (b"[]", "not a query result (list)"),
    (b'{"status":"success","data":{"resultType":"scalar","result":[1.0,"5"]}}', "not an instant vector (scalar)"),
    (b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{}}]}}', "not an instant vector"),
])
async def test_a_prometheus_answering_garbage_holds_the_planner_and_names_what_came_back(body, says):
    """Each held before too, but with 'AttributeError: 'list' object has no attribute 'get'' and the
    like on /admin/planner: nothing an SRE could act on."""
    from orchestrator.planner.actuators import RecommendOnly
    from orchestrator.planner.service import PlannerService

    ctype = "text/html" if body.startswith(b"<") else "application/json"
    client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda _: httpx.Response(200, content=body, headers={"content-type": ctype})))
    try:
        service = PlannerService(_planner(interval_s=30.0), PrometheusSource("http://prom:9090", client=client),
                                 RecommendOnly(), fleet=lambda: [], clock=VirtualClock())
        decision = await service.run_once()
        assert decision.actions == [] and service.held["reason"] == "source_unavailable"
        assert "Prometheus at http://prom:9090 answered" in service.held["detail"] and says in service.held["detail"], \
            service.held["detail"]
    finally:
        await client.aclose()


async def test_a_full_replay_on_a_busy_engine_is_not_taken_for_a_restart():
    """When a worker turns healthy again the tracker asks for a full replay; the live batches the engine
    published meanwhile wait in the socket and arrive after it, older than what the replay applied.
    Those read as 'the sequence went backwards: the engine restarted', so its index entries were cleared
    and replayed once more, and the restart count lied. A restart is a live sequence that goes back, not
    a replay that got ahead of the live stream."""
    import zmq.asyncio

    from orchestrator.kv.events import KvEventSubscriber
    from tests.integration.test_kv_events import TOKENS, Publisher, stored, until

    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    resets: list[str] = []
    hold = asyncio.Event()
    applied: list[int] = []

    async def on_batch(wid, ts, events):
        applied.append(1)
        if len(applied) == 10:
            await hold.wait()  # busy applying batch 9 while the engine publishes on

    async def on_reset(wid, why):
        resets.append(why)

    sub = KvEventSubscriber("w", f"tcp://127.0.0.1:{pub.port}", on_batch, on_reset,
                            replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}", context=ctx)
    sub.start()
    try:
        await asyncio.sleep(0.3)
        for i in range(10):
            await pub.publish([stored([i + 1], TOKENS[:4])])
        await until(lambda: len(applied) == 10)
        for i in range(10, 30):  # queued in the socket
            await pub.publish([stored([i + 1], TOKENS[:4])])
        await asyncio.sleep(0.1)
        sub.request_full_replay()  # the worker turned healthy again
        hold.set()
        await until(lambda: sub.next_seq == 30 and sub.replayed >= 30)
        await asyncio.sleep(0.2)  # the queued live batches arrive
        assert sub.restarts == 0 and resets == [], (sub.restarts, resets)
        pub.restart()  # a real restart is still seen
        await pub.publish([stored([99], TOKENS[:4])])
        await until(lambda: resets == ["restart"])
    finally:
        await sub.stop()
        pub.close()
        ctx.term()


async def test_a_discovery_report_that_fails_to_apply_does_not_end_the_source(tmp_path):
    """An exception while a report is applied to the registry (here a fleet listener that fails once,
    e.g. a subscriber that cannot be set up) ended the file source's loop for good, and the worker it
    had half-added stayed in the registry as a foreign worker the source never withdrew."""
    from orchestrator.config import load_config
    from orchestrator.fleet.discovery import build_discovery

    path = tmp_path / "workers.json"
    path.write_text(json.dumps([{"id": "a", "url": "http://10.0.0.1:8000"}]))
    cfg = load_config({"discovery": {"source": "file", "remove_grace_s": 30,
                                     "file": {"path": str(path), "interval_s": 0.05}}}, environ={})
    fleet = FleetRegistry()
    failed = []

    def flaky(event, worker):
        if event == "added" and not failed:
            failed.append(worker.id)
            raise RuntimeError("listener failed")

    fleet.subscribe(flaky)
    d = build_discovery(cfg.discovery, fleet)
    await d.start()
    try:
        assert failed == ["a"] and fleet.get("a") is not None
        path.write_text(json.dumps([{"id": "b", "url": "http://10.0.0.2:8000"}]))
        for _ in range(100):
            if fleet.get("b") is not None and fleet.get("a") is None:
                break
            await asyncio.sleep(0.05)
        assert fleet.get("b") is not None, "the source stopped reading its file"
        assert fleet.get("a") is None, "the half-added worker was never withdrawn"
    finally:
        await d.stop()
