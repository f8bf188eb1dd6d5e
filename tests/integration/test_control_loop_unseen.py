"""Faults of the live control loop that no earlier test tried (session 20, helper-46): the Kubernetes
actuator against an API server that fails some calls, a workload deleted or scaled by someone else while
a drain is under way; the local actuator's engines started through a wrapper; discovery's reasons for the
pods it does not use; the planner's inputs from a Prometheus answering shapes a real one rarely or never
gives. Each test failed before its fix.

The API server is ``FakeKubeApiServer`` (a FAKE written for the tests: no kube-apiserver can run here),
with its ``fail``/``scale``/``delete_workload`` hooks; the actuator and discovery run for real against it."""

from __future__ import annotations

import asyncio
import time

import pytest

from adapters.base import Role
from orchestrator.fleet.kube_api import KubeApi, KubeApiError
from orchestrator.planner.actuators import KubernetesActuator
from orchestrator.planner.core import PlanDecision
from tests.fakes.kube_apiserver import FakeKubeApiServer
from tests.fixtures.prometheus import prometheus_server  # noqa: F401

pytestmark = [pytest.mark.timeout(90)]

SEL = {"app": "eng", "dyad.dev/pool": "decode"}
PSEL = {"app": "eng", "dyad.dev/pool": "prefill"}


@pytest.fixture
def fake():
    f = FakeKubeApiServer(bookmark_interval_s=0.2)
    yield f
    f.close()


async def until(pred, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def decision(prefill: int | None, decode: int | None, current: dict[str, int] | None = None) -> PlanDecision:
    desired = {k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None}
    return PlanDecision(at=0.0, observation=None, forecast=None, sizing=None, desired=desired,
                        current=current or {}, actions=[], correction={}, predictors={}, reasons=[])


def actuator(fake: FakeKubeApiServer, idle=None, **kw) -> KubernetesActuator:
    async def is_idle(pod):
        return True if idle is None else idle(pod)

    return KubernetesActuator(KubeApi(fake.url, token="fake-token"), "dyad",
                              {Role.PREFILL: "statefulsets/p", Role.DECODE: "statefulsets/d"}, is_idle=is_idle,
                              settle_s=0.3, poll_s=0.05, **kw)


def marked(fake: FakeKubeApiServer, name: str) -> bool:
    pod = fake.pod(name)
    return pod is not None and (pod["metadata"].get("annotations") or {}).get("dyad.dev/draining") == "true"


# ------------------------------------------------------------------ Kubernetes actuator


async def test_an_outside_scale_up_during_a_drain_deletes_no_pod_that_was_not_drained(fake):
    """kubectl scale (or an HPA) raises the replicas while a scale-in waits for its victim to drain: the
    finisher used to lower the replicas to its old target anyway, and Kubernetes deleted the new pods,
    never marked nor drained, with whatever they were serving. Now the scale-in planned against the old
    replicas is given up (its marks removed: the pod serves again) and the next decision re-plans."""
    fake.add_statefulset("d", 3, SEL)
    await until(lambda: len(fake.pod_names()) == 3, what="the controller's pods")
    busy = {"d-2": True}
    act = actuator(fake, idle=lambda pod: not busy.get(pod["metadata"]["name"], False))
    try:
        assert await act.apply(decision(None, 2)) == ["marked d-2 draining"]
        fake.scale("d", 5)  # an operator, meanwhile
        await until(lambda: len(fake.pod_names()) == 5, what="the operator's two new pods")
        busy["d-2"] = False
        await until(lambda: act.events, what="the finisher's verdict")
        await asyncio.sleep(0.5)
        assert fake.replicas("d") == 5, act.events
        assert fake.pod_names() == ["d-0", "d-1", "d-2", "d-3", "d-4"]
        assert not marked(fake, "d-2")  # back in rotation: the drain it was in is over
        assert "changed outside the planner" in act.events[0], act.events
        assert not act.pending
    finally:
        await act.close()


async def test_a_failed_final_scale_patch_is_retried_not_left_with_pods_drained_for_good(fake):
    """The API server answers 500 to the patch that lowers the replicas after the drain: the scale-in was
    forgotten at once (popped before the call), so its victims stayed marked draining, out of rotation,
    and the replicas stayed up; the planner, counting only serving pods, then holds and never asks again.
    Now the finisher keeps the scale-in until the patch goes through."""
    fake.add_statefulset("d", 2, SEL)
    await until(lambda: len(fake.pod_names()) == 2, what="the controller's pods")
    act = actuator(fake)
    try:
        fake.fail("patch", "statefulsets/scale", 500, times=2)
        assert await act.apply(decision(None, 1)) == ["marked d-1 draining"]
        await until(lambda: fake.replicas("d") == 1, what="the scale-in, once the API server answers again")
        await until(lambda: fake.pod_names() == ["d-0"], what="d-1 deleted")
        await until(lambda: not act.pending, what="the scale-in forgotten once done")
    finally:
        await act.close()


async def test_one_workload_the_api_refuses_does_not_stop_the_other_roles_scaling(fake):
    """The prefill StatefulSet is deleted under the actuator (or its scale answers 403, 500, ...): every
    decision raised at the prefill role and the decode role, whatever it needed, was never scaled. Now
    each role is carried out on its own; the failed one is a line in what was applied (and logged)."""
    fake.add_statefulset("p", 1, PSEL)
    fake.add_statefulset("d", 1, SEL)
    await until(lambda: len(fake.pod_names()) == 2, what="the controller's pods")
    act = actuator(fake)
    try:
        fake.delete_workload("p")
        done = await act.apply(decision(2, 3))
        assert "scaled statefulsets/d to 3" in done
        assert any(line.startswith("statefulsets/p: failed") and "404" in line for line in done), done
        assert fake.replicas("d") == 3
        with pytest.raises(KubeApiError, match="500"):  # nothing could be carried out: the interval fails
            fake.fail("get", "statefulsets/scale", 500, times=2)
            await act.apply(decision(2, 4))
        fake.add_statefulset("p", 1, PSEL)  # back; now the API answers each status once to decode's patch
        for status in (403, 409, 422, 500):
            fake.fail("patch", "statefulsets/scale", status)
            done = await act.apply(decision(1, 4, current={"prefill": 1, "decode": 3}))
            assert done == [f"statefulsets/d: failed: KubeApiError: kubernetes API {status}: injected fault: "
                            f"patch statefulsets/scale answers {status}"], done
        assert fake.replicas("d") == 3
        assert await act.apply(decision(1, 4, current={"prefill": 1, "decode": 3})) == ["scaled statefulsets/d to 4"]
    finally:
        await act.close()


async def test_replicas_changed_by_someone_else_are_named_once_in_what_was_applied(fake):
    """kubectl scale (or an HPA) and the planner both own the replicas: the planner keeps sizing (it is
    the owner), but the fight was invisible. Now the first decision after an outside change says so."""
    fake.add_statefulset("d", 1, SEL)
    await until(lambda: len(fake.pod_names()) == 1, what="the controller's pod")
    act = actuator(fake)
    try:
        assert await act.apply(decision(None, 3, current={"decode": 1})) == ["scaled statefulsets/d to 3"]
        fake.scale("d", 6)
        done = await act.apply(decision(None, 7, current={"decode": 3}))
        assert done[0].startswith("statefulsets/d: replicas are 6, not the 3 the planner set (changed outside"), done
        assert done[1:] == ["scaled statefulsets/d to 7"]
        assert await act.apply(decision(None, 7, current={"decode": 7})) == []  # told once
    finally:
        await act.close()


# ------------------------------------------------------------------ local actuator


async def _answers(url: str) -> bool:
    import httpx

    async with httpx.AsyncClient() as c:
        try:
            await c.get(url + "/", timeout=1.0)
            return True
        except httpx.TransportError:
            return False


async def _wait_answers(url: str, want: bool, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await _answers(url) == want:
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.mark.parametrize("child_ignores_sigterm", [False, True])
async def test_an_engine_started_through_a_wrapper_is_stopped_with_its_wrapper(child_ignores_sigterm, tmp_path):
    """A command template that runs the engine under a wrapper (``sh -c '...; ...'``, a launch script, a
    launcher that forks its workers): stopping signalled the wrapper's pid only, the wrapper died and the
    engine ran on, orphaned, holding its port and (on a GPU host) its memory, out of every view. Now the
    whole process group the engine was started in is signalled, and what outlives the stop timeout is
    killed."""
    import os
    import signal
    import sys

    from orchestrator.planner.actuators import LocalProcessActuator
    from orchestrator.planner.core import Action

    engine = tmp_path / "engine.py"  # an HTTP server standing in for an engine
    engine.write_text("import http.server, signal, sys\n"
                      + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if child_ignores_sigterm else "")
                      + "http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), "
                        "http.server.SimpleHTTPRequestHandler).serve_forever()\n")
    cmd = f"sh -c '{sys.executable} {engine} {{port}}; echo the engine exited'"
    act = LocalProcessActuator({Role.DECODE: cmd}, stop_timeout_s=2.0)
    pgids = []
    try:
        p = await act.start(Role.DECODE)
        pgids.append(p.proc.pid)
        assert await _wait_answers(p.url, True), "the engine never answered"
        assert await act.apply(PlanDecision(at=0.0, observation=None, forecast=None, sizing=None, desired={},
                                            current={}, actions=[Action("stop", Role.DECODE, p.worker_id)],
                                            correction={}, predictors={}, reasons=[])) == [f"stopped {p.worker_id}"]
        assert p.proc.poll() is not None
        assert await _wait_answers(p.url, False), "the engine outlived its stop"
    finally:
        await act.close()
        for pgid in pgids:  # whatever the test left running
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------------ discovery


async def test_discovery_says_why_each_matched_pod_is_not_a_worker_and_counts_them(fake, caplog):
    """A pod whose role label is not a role (``decoder``) was used silently in the selector's role; a pod
    not Ready, without an IP or without the named port, and a pod whose engine is already another worker,
    were simply absent: nothing said why. Now such a pod is not used (an unknown role is not guessed),
    /admin/discovery names each and why, ``dyad_discovery_unused_pods{reason}`` counts them, and the
    unknown role is logged."""
    from orchestrator.config import load_config
    from orchestrator.fleet.discovery import build_discovery
    from orchestrator.fleet.registry import FleetRegistry
    from orchestrator.telemetry.metrics import DyadMetrics

    labels = {"app": "eng", "dyad.dev/pool": "decode"}
    fake.add_pod("good", labels, 9001)
    fake.add_pod("starting", labels, 9002, ready=False)
    fake.add_pod("typo", {**labels, "dyad.dev/role": "decoder"}, 9003)
    fake.add_pod("no-ip", labels, 9004, ip="")
    fake.add_pod("twin", labels, 9001)  # the same engine address as "good"
    bare = fake.add_pod("no-port", labels, 9005)
    fake.patch_pod("no-port", {"spec": {"containers": [{"name": "engine", "ports": [{"name": "metrics",
                                                                                       "containerPort": 9}]}]}})
    assert bare["metadata"]["name"] == "no-port"
    cfg = load_config({"discovery": {"source": "kubernetes", "kubernetes": {
        "api": {"api_url": fake.url, "token": "fake-token", "namespace": "dyad"},
        "selectors": {"decode": "app=eng,dyad.dev/pool=decode"}, "watch_timeout_s": 30}}}, environ={})
    fleet, metrics = FleetRegistry(), DyadMetrics()
    d = build_discovery(cfg.discovery, fleet, metrics=metrics)
    await d.start()
    try:
        await until(lambda: d.source.unused and fleet.workers(), what="the first report")
        assert [w.id for w in fleet.workers()] == ["good"]
        status = d.status()
        pods = status["unused"]["pods"]
        assert pods["starting"] == "not_ready: not Ready"
        assert pods["no-ip"] == "no_ip: no status.podIP yet"
        assert pods["no-port"].startswith("no_port: no container port named 'http'")
        assert pods["typo"].startswith("unknown_role: label dyad.dev/role='decoder' is not a role"), pods
        assert status["unused"]["count"] == 4
        assert status["conflicts"] == {"twin": "the engine at http://127.0.0.1:9001 is already worker 'good'"}
        value = metrics.registry.get_sample_value
        assert {r: value("dyad_discovery_unused_pods", {"reason": r}) for r in ("not_ready", "no_ip", "no_port",
                                                                                "unknown_role")} == dict.fromkeys(
            ("not_ready", "no_ip", "no_port", "unknown_role"), 1.0)
        assert any("typo is not used" in r.getMessage() for r in caplog.records)
        # the pod gets Ready: it joins and leaves the list of pods not used
        fake.set_ready("starting", True)
        await until(lambda: fleet.get("starting") is not None, what="the pod that turned Ready")
        await until(lambda: "starting" not in d.status()["unused"]["pods"], what="the list of pods not used")
        assert value("dyad_discovery_unused_pods", {"reason": "not_ready"}) == 0.0
    finally:
        await d.stop()


# ------------------------------------------------------------------ Prometheus answers of odd shapes
# httpx.MockTransport stands in for Prometheus here (a HAND-WRITTEN DOUBLE: a real Prometheus never
# answers these shapes to these queries; a proxy, a federating layer or a buggy one might).


def _planner(**settings):
    from orchestrator.planner.core import Planner, PlannerSettings
    from orchestrator.planner.install import DEFAULT_PROFILE
    from orchestrator.planner.perf_model import PerfModel
    from orchestrator.planner.solver import Limits, Targets

    return Planner(PerfModel.load(DEFAULT_PROFILE), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=8),
                                                                    **settings))


GOOD = {"request_rate": "5", "mean_isl": "500", "mean_osl": "50", "ttft_mean": "0.2", "ttft_p90": "0.3",
        "itl_mean": "0.02", "itl_p90": "0.03"}


def _prometheus(answers: dict[str, object]):
    """A Prometheus double: each Observation field's query answers ``answers[field]`` (a value string: one
    series; a list of them: that many series; a dict: the whole body), GOOD otherwise, or an empty vector."""
    import httpx

    from orchestrator.planner.metrics_source import prometheus_queries

    by_query = {q: f for f, q in prometheus_queries("30s").items()}

    def handle(request: httpx.Request) -> httpx.Response:
        field = by_query.get(request.url.params["query"])
        answer = answers.get(field, GOOD.get(field)) if field else None
        if isinstance(answer, dict):
            return httpx.Response(200, json=answer)
        values = [] if answer is None else answer if isinstance(answer, list) else [answer]
        rows = [{"metric": {"replica": str(i)}, "value": [1.7e9, v]} for i, v in enumerate(values)]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": rows}})

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


@pytest.mark.parametrize("answers, reason, says", [
    # several series where one is expected: the first was taken, whichever it was
    ({"request_rate": ["5", "500"]}, "source_unavailable", "2 series"),
    ({"ttft_p90": ["0.3", "9"]}, "source_unavailable", "2 series"),
    # NaN arrivals: read as 'no samples' (a Prometheus that lost its data), which it is not
    ({"request_rate": "NaN"}, "source_unavailable", "NaN"),
    # an infinite value was read as 'not measured' and the interval planned on without it
    ({"ttft_mean": "+Inf"}, "invalid_input", "ttft_mean = inf"),
    ({"mean_isl": "-Inf"}, "invalid_input", "mean_isl = -inf"),
])
async def test_a_prometheus_answer_of_an_unexpected_shape_holds_and_says_what_it_was(answers, reason, says):
    from orchestrator.clock import VirtualClock
    from orchestrator.planner.actuators import RecommendOnly
    from orchestrator.planner.core import WorkerView
    from orchestrator.planner.metrics_source import PrometheusSource
    from orchestrator.planner.service import PlannerService

    fleet = [WorkerView("p1", Role.PREFILL, "healthy", 0, 0), WorkerView("d1", Role.DECODE, "healthy", 0, 0)]
    good, odd = _prometheus({}), _prometheus(answers)
    clock = VirtualClock(1000.0)
    try:
        source = PrometheusSource("http://prom:9090", window_s=30.0, client=good)
        service = PlannerService(_planner(interval_s=30.0), source, RecommendOnly(), fleet=lambda: fleet, clock=clock)
        await service.run_once()
        assert service.held is None  # the good answers plan
        source._client = odd
        clock.advance(30.0)
        decision = await service.run_once()
        assert decision.actions == [] and service.held is not None, service.held
        assert service.held["reason"] == reason and says in service.held["detail"], service.held
    finally:
        await good.aclose()
        await odd.aclose()


async def test_an_api_call_that_times_out_is_named_in_what_was_applied(fake):
    """A scale read the API server never answers: the role failed with 'ReadTimeout: ' and nothing else
    (httpx's and asyncio's timeouts have no message), on /admin/planner and in the log. Now the call is
    named."""
    fake.add_statefulset("p", 1, PSEL)
    fake.add_statefulset("d", 1, SEL)
    await until(lambda: len(fake.pod_names()) == 2, what="the controller's pods")
    act = KubernetesActuator(KubeApi(fake.url, token="fake-token", timeout_s=0.2), "dyad",
                             {Role.PREFILL: "statefulsets/p", Role.DECODE: "statefulsets/d"}, settle_s=0.3, poll_s=0.05)
    try:
        fake.fail("get", "statefulsets/scale", 0, hang_s=2.0)  # silence, longer than the call's deadline
        done = await act.apply(decision(2, 2))
        assert done[0].startswith("statefulsets/p: failed: TimeoutError: kubernetes API GET /apis/apps/v1/namespaces/"
                                  "dyad/statefulsets/p/scale did not answer within"), done
        assert done[1:] == ["scaled statefulsets/d to 2"]
    finally:
        await act.close()


def test_a_workers_path_that_is_not_a_regular_file_is_refused_not_waited_on(tmp_path):
    """The workers path a FIFO (a named pipe, ``--workers-file <(generate)`` after its one read) or a
    device: opening it waited for a writer for good, in the poll's thread, so the file source never
    polled again (a regular file put back later was never seen) and the gateway's exit waited on that
    thread. Now a path that is not a regular file is an error like an unreadable one, at once."""
    import os
    import threading

    from orchestrator.config import FileDiscoveryConfig
    from orchestrator.fleet.discovery.file import FileSource

    path = tmp_path / "workers.yaml"
    path.write_text("- url: http://127.0.0.1:9001\n")
    src = FileSource(FileDiscoveryConfig(path=str(path), interval_s=1))
    assert sorted(src.poll() or []) == ["http://127.0.0.1:9001"]
    path.unlink()
    os.mkfifo(path)
    results: list[object] = []
    t = threading.Thread(target=lambda: results.append(src.poll()), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the thread (a writer opens the FIFO) before failing
        with open(path, "w"):
            pass
        t.join(5)
        pytest.fail("polling a FIFO blocked")
    assert results == [None] and src.last_error is not None and "not a regular file" in src.last_error
    path.unlink()
    path.write_text("- url: http://127.0.0.1:9001\n- url: http://127.0.0.1:9002\n")
    assert src.poll() is None  # changed: applied once it reads the same at the next poll
    assert sorted(src.poll() or []) == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


async def test_an_idleness_check_that_raises_is_bounded_by_the_drain_timeout(fake):
    """The check of a victim's engine raising (a pod of an odd shape, a bug) failed the whole finisher
    round before the drain timeout was looked at: the scale-in never finished and its victims stayed out of
    rotation for good. Now a check that raises reads 'cannot tell', which the drain timeout bounds."""
    fake.add_statefulset("d", 2, SEL)
    await until(lambda: len(fake.pod_names()) == 2, what="the controller's pods")

    def broken(pod):
        raise ValueError("invalid literal for int() with base 10: 'http'")

    act = actuator(fake, idle=broken, drain_timeout_s=1.0)
    try:
        assert await act.apply(decision(None, 1)) == ["marked d-1 draining"]
        await until(lambda: act.events, what="the scale-in after the drain timeout")
        assert act.events == ["drain timeout for d-1: scaled statefulsets/d to 1"] and fake.replicas("d") == 1
    finally:
        await act.close()


async def test_a_standby_action_on_a_pod_that_is_gone_does_not_stop_the_scaling(fake):
    """``activate`` of a pod deleted meanwhile (404 on its patch) raised out of the whole apply: no role was
    scaled that interval. Now it is a line in what was applied and the rest is carried out."""
    from orchestrator.planner.core import Action

    fake.add_statefulset("d", 1, SEL)
    await until(lambda: len(fake.pod_names()) == 1, what="the controller's pod")
    act = actuator(fake)
    try:
        d = decision(None, 3, current={"decode": 1})
        d.actions.append(Action("activate", Role.DECODE, "d-9"))
        done = await act.apply(d)
        assert done[0].startswith("activate d-9 failed: KubeApiError: kubernetes API 404"), done
        assert done[1:] == ["scaled statefulsets/d to 3"]
    finally:
        await act.close()


# ------------------------------------------------------------------ engine load an engine cannot have


@pytest.mark.parametrize("sample, says", [
    ('vllm:num_requests_waiting{model_name="m"} +Inf', "waiting = inf"),
    ('vllm:num_requests_running{model_name="m"} -1000', "running = -1000"),
    ('vllm:gpu_cache_usage_perc{model_name="m"} -Inf', "kv_usage = -inf"),
])
async def test_an_engine_reporting_an_impossible_load_is_a_failed_scrape_not_the_fleets_load(sample, says, caplog):
    """One engine exporting ``num_requests_waiting +Inf`` (a bug, a proxy's arithmetic) made every planner
    interval fail (``int(inf)`` in the planner's view of the fleet: OverflowError, nothing planned, no drain
    completed) for as long as it did; a negative running count made that worker look emptier than empty to
    the router. Such a scrape is now refused: counted as a scrape error (logged once), the last good load
    kept. The planner's view of a load is also bounded on its own. httpx.MockTransport stands in for the
    engine's /metrics (a HAND-WRITTEN DOUBLE: no real engine exports these)."""
    import httpx

    from adapters.base import EngineKind
    from adapters.vllm import VllmAdapter
    from orchestrator.clock import VirtualClock
    from orchestrator.config import ScrapeConfig
    from orchestrator.fleet.registry import FleetRegistry
    from orchestrator.fleet.scrape import MetricsScraper
    from orchestrator.fleet.worker import Worker, WorkerState
    from orchestrator.planner.service import views_from_workers
    from orchestrator.telemetry.metrics import DyadMetrics

    good = ('vllm:num_requests_waiting{model_name="m"} 2\nvllm:num_requests_running{model_name="m"} 3\n'
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n')
    body = {"text": good}
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200, text=body["text"])))
    fleet = FleetRegistry([Worker("w", "http://engine:8000", engine=EngineKind.VLLM, models=["m"],
                                  state=WorkerState.HEALTHY)])
    metrics = DyadMetrics()
    scraper = MetricsScraper(fleet, http, ScrapeConfig(timeout_s=1.0), VirtualClock(), lambda _: VllmAdapter(),
                             metrics=metrics)
    try:
        assert await scraper.scrape_worker(fleet.get("w"))
        name = sample.split("{")[0]
        body["text"] = "".join(line + "\n" for line in good.splitlines() if not line.startswith(name)) + sample + "\n"
        for _ in range(3):
            assert not await scraper.scrape_worker(fleet.get("w"))
        w = fleet.get("w")
        assert (w.load.running, w.load.waiting, w.load.kv_usage) == (3.0, 2.0, 0.5)  # the last good one
        assert metrics.registry.get_sample_value("dyad_worker_scrape_errors_total", {"worker": "w"}) == 3.0
        assert sum(says in r.getMessage() for r in caplog.records) == 1, [r.getMessage() for r in caplog.records]
        # whatever a load holds, the planner's view of it does not fail the interval
        from adapters.base import LoadSnapshot
        w.load = LoadSnapshot(running=float("inf"), waiting=float("nan"))
        assert views_from_workers([w])[0].waiting == 0
    finally:
        await http.aclose()


@pytest.mark.parametrize("status, body, says", [
    # what Prometheus 2.42 answered with --query.timeout=1ms (seen from the real binary; which query times
    # out varies from run to run, so the answer is replayed by a double here)
    (503, {"status": "error", "errorType": "timeout", "error": "query timed out in expression evaluation"},
     "HTTP 503 (timeout: query timed out in expression evaluation)"),
    (422, {"status": "error", "errorType": "execution", "error": "query processing would load too many samples"},
     "HTTP 422 (execution: query processing would load too many samples)"),
    (200, {"status": "error", "errorType": "internal", "error": "boom"}, "an error (internal: boom)"),
])
async def test_a_prometheus_refusing_a_query_is_named_with_its_own_words(status, body, says):
    """Prometheus refusing a query (its query timeout, too many samples) answers a 4xx/5xx whose JSON says
    why: the planner's hold said only httpx's "Server error '503 Service Unavailable' for url '...<the query,
    URL-encoded>' For more information check: https://developer.mozilla.org/...". Now it says what
    Prometheus said, and about which query."""
    import httpx

    from orchestrator.planner.metrics_source import PrometheusSource

    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(status, json=body)))
    try:
        with pytest.raises(Exception) as e:  # noqa: PT011 - what the planner's hold shows is checked below
            await PrometheusSource("http://prom:9090", window_s=30.0, client=client).observe(0.0)
        said = f"{type(e.value).__name__}: {e.value}"
    finally:
        await client.aclose()
    assert said.startswith("PrometheusAnswerError: Prometheus at http://prom:9090 answered " + says), said
    assert "to 'sum(rate(" in said and "developer.mozilla.org" not in said, said


def test_a_model_name_with_a_quote_is_escaped_in_the_queries(prometheus_server):  # noqa: F811
    """``planner.model`` was pasted into each PromQL selector as it is: a name with a double quote or a
    backslash broke every query (a real Prometheus answers 400 bad_data), and the planner held for good.
    Now it is a PromQL string: every query of the planner parses (the real Prometheus answers 200)."""
    import httpx

    from orchestrator.planner.metrics_source import prometheus_queries

    for model in ('org/model "v2" \\ test', "modèle-ü", "a\nb"):
        queries = prometheus_queries("30s", model)
        for name, q in queries.items():
            r = httpx.get(f"{prometheus_server.url}/api/v1/query", params={"query": q}, timeout=10)
            assert r.status_code == 200, (model, name, r.text[:200])
    assert queries["request_rate"] == 'sum(rate(dyad_request_arrivals_total{model="a\\nb"}[30s]))'


async def test_a_command_template_with_json_braces_starts_its_engine_with_them_as_written(tmp_path):
    """vLLM's P/D engines take ``--kv-transfer-config '{"kv_connector":"NixlConnector",...}'``: the template
    went through str.format, which read the JSON braces as fields: KeyError out of the actuator, every
    interval failed (the start was not even counted as a failed one). Now only {port}, {role} and
    {worker_id} are filled in and the rest passes as written."""
    import json
    import sys

    from orchestrator.planner.actuators import LocalProcessActuator

    out = tmp_path / "argv.json"
    probe = tmp_path / "engine.py"
    probe.write_text(f"import json, sys\nopen({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    kv = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    cmd = f"{sys.executable} {probe} --port {{port}} --role {{role}} --id {{worker_id}} --kv-transfer-config '{kv}'"
    act = LocalProcessActuator({Role.DECODE: cmd})
    try:
        p = await act.start(Role.DECODE)
        await asyncio.to_thread(p.proc.wait, 30)
        assert json.loads(out.read_text()) == ["--port", str(p.port), "--role", "decode", "--id", p.worker_id,
                                               "--kv-transfer-config", kv]
    finally:
        await act.close()


def test_a_command_template_without_its_port_is_refused_at_load():
    """A template without {port} starts an engine on its own default port while the gateway probes the port
    the actuator picked: never ready, reaped, started again with a growing pause, for good. Refused at load,
    naming the entry."""
    from orchestrator.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"planner: local_commands.decode: has no \{port\}"):
        load_config({"planner": {"actuator": "local", "local_commands": {
            "prefill": "vllm serve m --port {port}", "decode": "vllm serve m --port 8000"}}}, environ={})


@pytest.mark.parametrize("le", [None, "fast"])
async def test_engine_histogram_rows_without_a_usable_bucket_bound_are_named(le):
    """The engines' latency from Prometheus (a window with no streamed request): a bucket row without an
    ``le`` label, or with one that is not a number, ended the observation with "KeyError: 'le'" or
    "ValueError: could not convert string to float: 'fast'". Now the hold names the answer."""
    import httpx

    from orchestrator.planner.metrics_source import PrometheusSource

    labels = {"instance": "engine:8000"} if le is None else {"instance": "engine:8000", "le": le}

    def handle(request: httpx.Request) -> httpx.Response:
        q = request.url.params["query"]
        if "_bucket" in q and ("time_to_first_token" in q or "dyad_pd_prefill" in q):
            rows = [{"metric": labels, "value": [1.7e9, "5"]}]
        elif q.startswith("sum(rate(dyad_request_arrivals_total{}"):
            rows = [{"metric": {}, "value": [1.7e9, "5"]}]
        else:
            rows = []
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": rows}})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    try:
        src = PrometheusSource("http://prom:9090", window_s=30.0, client=client,
                               engines=lambda: [(Role.BOTH, "http://engine:8000")])
        with pytest.raises(Exception) as e:  # noqa: PT011 - the message is what is checked
            await src.observe(0.0)
        said = f"{type(e.value).__name__}: {e.value}"
    finally:
        await client.aclose()
    assert said.startswith("PrometheusAnswerError: Prometheus at http://prom:9090 answered a histogram bucket"), said
    assert "le" in said


async def test_one_selector_the_api_refuses_does_not_keep_the_other_roles_pods_out(fake):
    """Two selectors (prefill, decode); the API refuses one of them for good (a selector it cannot parse
    answers 400): the source reported nothing until every watch had listed once, so the gateway had no
    discovered worker at all, decode pods included. Now a watch whose first list failed does not hold back
    the others' pods; its own pods join once its list goes through."""
    from orchestrator.config import load_config
    from orchestrator.fleet.discovery import build_discovery
    from orchestrator.fleet.registry import FleetRegistry

    fake.add_pod("d-0", {"app": "eng", "pool": "decode"}, 9001)
    fake.add_pod("p-0", {"app": "eng", "pool": "prefill"}, 9002)
    fake.fail("list", "pods", 400, times=4, selector="app=eng,pool=prefill")
    cfg = load_config({"discovery": {"source": "kubernetes", "kubernetes": {
        "api": {"api_url": fake.url, "token": "fake-token", "namespace": "dyad"},
        "selectors": {"prefill": "app=eng,pool=prefill", "decode": "app=eng,pool=decode"},
        "watch_timeout_s": 30}}}, environ={})
    fleet = FleetRegistry()
    d = build_discovery(cfg.discovery, fleet)
    d.start_timeout_s = 0.5
    await d.start()
    try:
        await until(lambda: fleet.get("d-0") is not None, what="the decode pod, while prefill's list fails")
        assert fleet.get("p-0") is None and "400" in (d.status()["watches"]["prefill"]["last_error"] or "")
        await until(lambda: fleet.get("p-0") is not None, what="the prefill pod once its list goes through")
        assert fleet.get("p-0").role is Role.PREFILL and fleet.get("d-0").role is Role.DECODE
    finally:
        await d.stop()


def test_a_rate_window_shorter_than_two_scrapes_is_named_not_taken_for_a_prometheus_without_data(tmp_path):
    """``planner.prometheus_window_s`` (default: the interval) shorter than two of Prometheus's scrape
    intervals: rate() over it has fewer than two samples and answers nothing, every interval. The hold said
    'no samples over the last 3s (just restarted, or not scraping the gateway)' while Prometheus scraped
    the gateway fine. Now it says the series are there and the window is too short. A real Prometheus
    (scraping every 5 s) scrapes a static /metrics page standing in for the gateway's."""
    import http.server
    import threading

    from orchestrator.planner.metrics_source import NoPrometheusData, PrometheusSource
    from tests.fixtures.prometheus import PrometheusServer

    class Page(http.server.BaseHTTPRequestHandler):
        n = 0

        def do_GET(self) -> None:  # noqa: N802
            Page.n += 10
            body = (f'# TYPE dyad_request_arrivals_total counter\ndyad_request_arrivals_total{{model="m"}} {Page.n}\n'
                    ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    page = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    try:
        with PrometheusServer([f"127.0.0.1:{page.server_address[1]}"], scrape_interval_s=5.0) as prom:
            prom.wait_for("dyad_request_arrivals_total", timeout_s=30)

            async def observe(window_s: float) -> str:
                try:
                    await PrometheusSource(prom.url, window_s=window_s).observe(0.0)
                except NoPrometheusData as e:
                    return str(e)
                return "planned"

            said = asyncio.run(observe(3.0))
            assert "dyad_request_arrivals_total is there" in said and "prometheus_window_s" in said, said
            assert "not scraping" not in said, said
            prom.wait_until(lambda: prom.query_value("sum(rate(dyad_request_arrivals_total[30s]))"), timeout_s=30,
                            what="two samples")
            assert asyncio.run(observe(30.0)) == "planned"
    finally:
        page.shutdown()
        page.server_close()


@pytest.mark.parametrize("form", ["json", "yaml"])
def test_a_large_workers_file_is_not_read_by_the_pure_python_yaml_scanner(form, monkeypatch):
    """A workers file of 20,000 entries (~1 MB; the cap is 16 MiB, 'a workers file of 100,000 entries is
    ~10 MB') went through PyYAML's pure-Python scanner: 4-10 s of CPU per change with the GIL held, the
    gateway's event loop sharing it meanwhile (a 10-MB file: minutes). JSON now goes through json (with
    duplicate keys still refused), YAML through libyaml's scanner. Counted, not timed: the calls into the
    pure-Python scanner."""
    import json

    import yaml

    from orchestrator.fleet.discovery.file import WorkersFileError, parse_workers_file

    if form == "yaml" and not hasattr(yaml, "CSafeLoader"):
        from tests.fixtures.deps import missing
        missing("PyYAML's libyaml binding (yaml.CSafeLoader)", "make install (pip install -e '.[test]': PyYAML's binary wheel)")
    calls = {"n": 0}
    original = yaml.scanner.Scanner.fetch_more_tokens

    def counted(self):
        calls["n"] += 1
        return original(self)

    monkeypatch.setattr(yaml.scanner.Scanner, "fetch_more_tokens", counted)
    entries = [{"url": f"http://10.{i // 65536}.{(i // 256) % 256}.{i % 256}:8000", "role": "decode"}
               for i in range(20_000)]
    text = json.dumps(entries) if form == "json" else yaml.safe_dump(entries)
    out = parse_workers_file(text)
    assert len(out) == 20_000 and out["http://10.0.0.7:8000"].config.role is Role.DECODE
    assert calls["n"] == 0, f"{calls['n']} calls into the pure-Python YAML scanner"
    bad = '[{"url": "http://a:1", "role": "decode", "role": "prefill"}]' if form == "json" else \
        "- url: http://a:1\n  role: decode\n  role: prefill\n"
    with pytest.raises(WorkersFileError, match="duplicate key 'role'"):
        parse_workers_file(bad)


async def test_a_rotated_token_is_read_again_after_a_401_and_a_missing_token_file_keeps_the_last_one(tmp_path):
    """The service-account token is re-read every 60 s. A token the API server stopped accepting (rotated
    early, revoked) cost up to a minute of 401s on every call (the watch, the actuator) before the file was
    read again; and a token file that could not be read at its re-read (a remount) replaced the token with
    none: a minute of 401s too. Now a 401 makes the next call read the file at once, and a failed read keeps
    the last token."""
    from orchestrator.fleet.kube_api import KubeApi, KubeApiError

    fake = FakeKubeApiServer(tokens={"t1": "tester"})
    token = tmp_path / "token"
    token.write_text("t1\n")
    api = KubeApi(fake.url, token_file=str(token))
    try:
        assert (await api.get("/api/v1/namespaces/dyad/pods"))["kind"] == "PodList"
        fake.tokens = {"t2": "tester"}  # rotated: the old token is refused from now on
        token.write_text("t2\n")
        with pytest.raises(KubeApiError, match="401"):
            await api.get("/api/v1/namespaces/dyad/pods")
        assert (await api.get("/api/v1/namespaces/dyad/pods"))["kind"] == "PodList"  # read again at once
        token.unlink()  # the file is away when it is next read
        api._token_read_at = -1e18  # that re-read is due now
        assert (await api.get("/api/v1/namespaces/dyad/pods"))["kind"] == "PodList"  # the last token kept
    finally:
        await api.aclose()
        fake.close()


async def test_a_workers_file_nested_too_deeply_is_refused_and_the_source_polls_on(tmp_path):
    """A workers file of 100,000 nested brackets: the parser raised RecursionError, which no handler took
    for a bad file: it went out of the poll and ended the file source's loop, so no later change of the
    file was ever applied. Now it is refused like any invalid file, and the loop goes on (whatever a
    poll raises)."""
    from orchestrator.config import FileDiscoveryConfig
    from orchestrator.fleet.discovery.file import FileSource

    path = tmp_path / "workers.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    src = FileSource(FileDiscoveryConfig(path=str(path), interval_s=0.05))
    reports: list[dict] = []
    task = asyncio.create_task(src.run(reports.append))
    try:
        await until(lambda: src.last_error is not None, what="the refusal")
        assert "nested too deeply" in src.last_error, src.last_error
        path.write_text('[{"url": "http://127.0.0.1:9001"}]')
        await until(lambda: reports, what="the good file, applied by the same loop")
        assert sorted(reports[-1]) == ["http://127.0.0.1:9001"] and not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_engines_of_a_scale_in_are_read_together_not_one_after_another(fake):
    """Each finisher round read the victims' engines one after another while holding the actuator's lock:
    a scale-in of N pods whose engines answer slowly (each read bounded by the scrape timeout) held every
    planner decision N × that long. The reads of a round now run together. Counted, not timed: how many
    reads were in progress at once."""
    fake.add_statefulset("d", 5, SEL)
    await until(lambda: len(fake.pod_names()) == 5, what="the controller's pods")
    now = {"in": 0, "most": 0}

    async def slow_idle(pod):
        now["in"] += 1
        now["most"] = max(now["most"], now["in"])
        await asyncio.sleep(0.2)
        now["in"] -= 1
        return True

    act = KubernetesActuator(KubeApi(fake.url, token="fake-token"), "dyad", {Role.DECODE: "statefulsets/d"},
                             is_idle=slow_idle, settle_s=0.1, poll_s=0.05)
    try:
        assert await act.apply(decision(None, 1)) == [f"marked d-{i} draining" for i in range(1, 5)]
        await until(lambda: act.events, what="the scale-in")
        assert now["most"] == 4, now
    finally:
        await act.close()


async def test_a_victim_whose_mark_was_removed_meanwhile_is_marked_again_before_the_scale_in(fake):
    """Someone removes the draining mark of a pod a scale-in waits for (``kubectl annotate pod d-1
    dyad.dev/draining-``): every gateway puts it back in rotation, yet the finisher went on reading its
    engine and lowered the replicas once it read idle, so Kubernetes deleted a pod that was taking new
    requests. Now a victim found without its mark is marked again and settles again first."""
    fake.add_statefulset("d", 2, SEL)
    await until(lambda: len(fake.pod_names()) == 2, what="the controller's pods")
    busy = {"d-1": True}
    act = actuator(fake, idle=lambda pod: not busy["d-1"])
    try:
        assert await act.apply(decision(None, 1)) == ["marked d-1 draining"]
        await asyncio.sleep(0.5)  # settled, read busy
        fake.patch_pod("d-1", {"metadata": {"annotations": {"dyad.dev/draining": None}}})  # the operator
        unmarked_at = time.monotonic()
        busy["d-1"] = False
        await until(lambda: any("scaled statefulsets/d to 1" in line for line in act.events), what="the scale-in")
        scale_at = next(t for t, path, body in fake.patches if path.endswith("/statefulsets/d/scale")
                        and body == {"spec": {"replicas": 1}})
        remarks = [t for t, path, body in fake.patches if path.endswith("/pods/d-1") and t > unmarked_at
                   and (body.get("metadata") or {}).get("annotations", {}).get("dyad.dev/draining") == "true"]
        assert remarks and remarks[0] < scale_at, (remarks, scale_at, act.events)
        assert any("marked d-1 draining again" in line for line in act.events), act.events
    finally:
        await act.close()
