"""Pod discovery's watch semantics against ``FakeKubeApiServer`` (a FAKE API server written for the
tests: no kube-apiserver can run here), and the Kubernetes actuator's calls.

Discovery runs for real (HTTP list + watch) into a real ``FleetRegistry``; no engines are needed
here (the health loop is not running, so added workers stay unhealthy: what is checked is
membership and draining). The full loop with engines and traffic is test_kubernetes_loop.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from adapters.base import Role
from orchestrator.config import load_config
from orchestrator.fleet.discovery import Discovery, build_discovery
from orchestrator.fleet.kube_api import KubeApi, KubeApiError
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import WorkerState
from orchestrator.planner.actuators import KubernetesActuator
from orchestrator.planner.core import PlanDecision
from tests.fakes.kube_apiserver import FakeKubeApiServer

pytestmark = [pytest.mark.timeout(60)]

SEL = {"app": "eng", "dyad.dev/pool": "decode"}


@pytest.fixture
def fake():
    f = FakeKubeApiServer(bookmark_interval_s=0.2)
    yield f
    f.close()


def discovery(fake: FakeKubeApiServer, token: str = "fake-token", **kube) -> tuple[FleetRegistry, Discovery]:
    cfg = load_config({"discovery": {"source": "kubernetes", "remove_grace_s": 30, "kubernetes": {
        "api": {"api_url": fake.url, "token": token, "namespace": "dyad"},
        "selectors": {"decode": "app=eng,dyad.dev/pool=decode"}, "watch_timeout_s": 30, **kube}}}, environ={})
    fleet = FleetRegistry()
    d = build_discovery(cfg.discovery, fleet)
    assert d is not None
    return fleet, d


async def until(pred, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def running(d: Discovery):
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


def watch(d: Discovery):
    return d.source.watches[0][1]


async def test_initial_list_readiness_flip_and_draining_mark(fake):
    fake.add_pod("e-0", SEL, 8001)
    fake.add_pod("e-1", SEL, 8002, ready=False)
    fake.add_pod("other-0", {"app": "other"}, 8003)
    fleet, d = discovery(fake)
    async with running(d):
        assert [w.id for w in fleet.workers()] == ["e-0"]  # present at start; not-Ready and other pods never
        w0 = fleet.get("e-0")
        assert w0.url == "http://127.0.0.1:8001" and w0.role is Role.DECODE and w0.state is WorkerState.UNHEALTHY
        fake.set_ready("e-1", True)
        await until(lambda: fleet.get("e-1") is not None, what="e-1 to join when Ready")
        # Ready → not Ready: out of rotation at once, gone once idle
        fleet.get("e-1").inflight = 1
        fake.set_ready("e-1", False)
        await until(lambda: fleet.get("e-1").state is WorkerState.DRAINING, what="e-1 withdrawn")
        await asyncio.sleep(0.7)
        assert fleet.get("e-1") is not None  # still finishing its request
        fleet.get("e-1").inflight = 0
        await until(lambda: fleet.get("e-1") is None, what="e-1 removed when idle")
        # the planner's mark drains without removing; clearing it brings the worker back
        fleet.record_health(w0, True, now=0.0)
        fake.patch_pod("e-0", {"metadata": {"annotations": {"dyad.dev/draining": "true"}}})
        await until(lambda: w0.state is WorkerState.DRAINING, what="the mark")
        fake.patch_pod("e-0", {"metadata": {"annotations": {"dyad.dev/draining": None}}})
        await until(lambda: w0.state is WorkerState.HEALTHY, what="the mark cleared")
        # a role relabel switches the role in place; leaving the selector withdraws it
        fake.patch_pod("e-0", {"metadata": {"labels": {"dyad.dev/role": "prefill"}}})
        await until(lambda: w0.role is Role.PREFILL, what="the role label")
        fake.patch_pod("e-0", {"metadata": {"labels": {"dyad.dev/pool": "elsewhere"}}})
        await until(lambda: fleet.get("e-0") is None, what="the pod leaving the selector")
        assert watch(d).lists == 1 and watch(d).gone == 0  # all of it over one watch


async def test_bookmarks_keep_the_resume_point_fresh_so_a_resume_after_compaction_needs_no_relist(fake):
    fake.add_pod("e-0", SEL, 8001)
    fleet, d = discovery(fake)
    async with running(d):
        w = watch(d)
        listed_rv = int(w.resource_version)
        for i in range(5):  # changes this watch does not see: only bookmarks tell it the version moved
            fake.add_pod(f"other-{i}", {"app": "other"}, 9000 + i)
        await until(lambda: int(w.resource_version) == fake.rv, what="a bookmark at the current version")
        assert w.bookmarks >= 1 and int(w.resource_version) > listed_rv
        fake.compact(upto=fake.rv)  # history before the bookmark is gone
        await until(lambda: fake.active_watches == 1, what="the watch connected")
        fake.drop_watches()
        await until(lambda: fake.active_watches == 0, what="the watch cut")
        fake.add_pod("e-1", SEL, 8002)
        await until(lambda: fleet.get("e-1") is not None, what="e-1 after the resume")
        assert w.gone == 0 and w.lists == 1 and w.resumes >= 1


async def test_410_gone_relists_and_notices_what_was_missed(fake):
    fake.add_pod("e-0", SEL, 8001)
    fake.add_pod("e-1", SEL, 8002)
    fleet, d = discovery(fake)
    async with running(d):
        w = watch(d)
        assert sorted(x.id for x in fleet.workers()) == ["e-0", "e-1"]
        # while the watch is cut: a pod goes, another comes, and the history is compacted
        fake.bookmark_interval_s = 60  # no bookmark may rescue the resume point
        await asyncio.sleep(0.3)
        await until(lambda: fake.active_watches == 1, what="the watch connected")
        fake.drop_watches()
        await until(lambda: fake.active_watches == 0, what="the watch cut")
        fake.delete_pod("e-0")
        fake.add_pod("e-2", SEL, 8003)
        fake.compact()
        await until(lambda: w.gone >= 1 and w.lists >= 2, what="410 then a re-list")
        await until(lambda: sorted(x.id for x in fleet.workers()) == ["e-1", "e-2"], what="the re-listed fleet")


async def test_a_dropped_watch_resumes_from_its_version_and_replays_the_gap(fake):
    fake.add_pod("e-0", SEL, 8001)
    fleet, d = discovery(fake)
    async with running(d):
        w = watch(d)
        for i in range(3):
            await until(lambda: fake.active_watches == 1, what="the watch connected")
            fake.drop_watches()
            await until(lambda: fake.active_watches == 0, what="the watch cut")
            fake.add_pod(f"e-{i + 1}", SEL, 8002 + i)  # while disconnected: only a resume from the version sees it
        await until(lambda: len(fleet.workers()) == 4, what="the pods added during the gaps")
        assert w.lists == 1 and w.gone == 0 and w.errors == 3 and w.resumes >= 3


async def test_wrong_token_is_an_error_that_retries_not_a_crash(fake):
    fake.add_pod("e-0", SEL, 8001)
    fleet, d = discovery(fake, token="wrong")
    d.start_timeout_s = 0.5
    async with running(d):
        await until(lambda: watch(d).errors >= 2, what="retries")
        assert "401" in watch(d).last_error and len(fleet) == 0


# ------------------------------------------------------------------ the actuator's calls


def decision(prefill: int | None, decode: int) -> PlanDecision:
    desired = {"decode": decode} if prefill is None else {"prefill": prefill, "decode": decode}
    return PlanDecision(at=0.0, observation=None, forecast=None, sizing=None, desired=desired, current={},
                        actions=[], correction={}, predictors={}, reasons=[])


def actuator(fake: FakeKubeApiServer, token: str = "fake-token", idle=None, **kw) -> KubernetesActuator:
    async def is_idle(pod):
        return True if idle is None else idle(pod)

    return KubernetesActuator(KubeApi(fake.url, token=token), "dyad",
                              {Role.PREFILL: "statefulsets/p", Role.DECODE: "statefulsets/d"}, is_idle=is_idle,
                              settle_s=0.3, poll_s=0.05, **kw)


async def test_actuator_scales_out_at_once_and_in_only_after_the_drain(fake):
    fake.add_statefulset("p", 1, {"app": "eng", "dyad.dev/pool": "prefill"})
    fake.add_statefulset("d", 1, SEL)
    await until(lambda: len(fake.pod_names()) == 2, what="the controller's pods")
    busy = {"d-2": True}
    act = actuator(fake, idle=lambda pod: not busy.get(pod["metadata"]["name"], False))
    try:
        assert await act.apply(decision(1, 3)) == ["scaled statefulsets/d to 3"]
        await until(lambda: len(fake.pod_names()) == 4, what="two new pods")
        assert await act.apply(decision(1, 1)) == ["marked d-1 draining", "marked d-2 draining"]
        await asyncio.sleep(0.8)
        assert fake.replicas("d") == 3  # d-2's engine is still busy
        # the planner changes its mind about one pod: its mark is removed, the drain goes on for the other
        assert await act.apply(decision(1, 2)) == ["cancelled the drain of d-1"]
        assert "dyad.dev/draining" not in fake.pod("d-1")["metadata"]["annotations"]
        busy["d-2"] = False
        await until(lambda: act.events, what="the scale-in once d-2 is idle")
        assert fake.replicas("d") == 2
        await until(lambda: fake.pod_names() == ["d-0", "d-1", "p-0"], what="d-2 deleted")
        assert act.events == ["drained: scaled statefulsets/d to 2"]
        assert fake.replicas("p") == 1  # untouched
    finally:
        await act.close()


async def test_a_restarted_actuator_carries_on_with_marked_pods_and_times_out_a_stuck_drain(fake):
    fake.add_statefulset("d", 2, SEL)
    await until(lambda: len(fake.pod_names()) == 2, what="the controller's pods")
    first = actuator(fake, idle=lambda pod: False)
    await first.apply(decision(None, 1))
    await first.close()  # the planner restarts mid-drain
    assert fake.pod("d-1")["metadata"]["annotations"]["dyad.dev/draining"] == "true"
    second = actuator(fake, idle=lambda pod: False, drain_timeout_s=0.6)
    try:
        assert await second.apply(decision(None, 1)) == []  # already marked: nothing new to do
        await until(lambda: second.events, what="the timed-out drain")
        assert fake.replicas("d") == 1
        assert second.events == ["drain timeout for d-1: scaled statefulsets/d to 1"]
    finally:
        await second.close()


async def test_actuator_surfaces_auth_errors(fake):
    fake.add_statefulset("d", 1, SEL)
    act = actuator(fake, token="wrong")
    try:
        with pytest.raises(KubeApiError, match="401"):
            await act.apply(decision(None, 2))
        assert fake.replicas("d") == 1
    finally:
        await act.close()


async def test_deployment_scale_in_steers_the_replicaset_to_the_drained_pods(fake):
    fake.add_deployment("x", 3, SEL)
    await until(lambda: fake.pod_names() == ["x-1", "x-2", "x-3"], what="the Deployment's pods")
    fake.patch_pod("x-1", {"metadata": {"annotations": {"dyad.dev/draining": "true"}}})  # a drain left from before
    act = KubernetesActuator(KubeApi(fake.url, token="fake-token"), "dyad", {Role.DECODE: "deployments/x"},
                             settle_s=0.2, poll_s=0.05)
    try:
        assert await act.apply(decision(None, 1)) == ["marked x-1 draining", "marked x-3 draining"]
        for name in ("x-1", "x-3"):
            assert fake.pod(name)["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "-1000"
        await until(lambda: act.events, what="the scale-in")
        # a ReplicaSet alone would remove the newest pods (x-3, x-2); the deletion cost makes it the drained ones
        await until(lambda: fake.pod_names() == ["x-2"], what="the drained pods deleted")
    finally:
        await act.close()
