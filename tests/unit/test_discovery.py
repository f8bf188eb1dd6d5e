"""Discovery's pure parts (no sockets): desired-vs-known diffing, the reconciler on a registry, the
pod → worker mapping, watch-event application, the workers-file parser, and the k8s actuator's
scale-in decisions (which pods go, when the drain is over)."""

from __future__ import annotations

import pytest

from adapters.base import Role
from orchestrator.config import KubernetesDiscoveryConfig, WorkerConfig
from orchestrator.fleet.discovery.file import WorkersFileError, parse_workers_file
from orchestrator.fleet.discovery.kubernetes import (
    Unused,
    apply_event,
    desired_from_pods,
    pod_mapping,
    pod_to_spec,
)
from orchestrator.fleet.discovery.reconcile import Owned, Reconciler, WorkerSpec, plan_changes
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.actuators import DrainingScaleIn, drain_finished, replica_change, scale_in_victims


def spec(wid: str, url: str | None = None, role: str = "both", draining: bool = False, **kw) -> WorkerSpec:
    # one engine address per id (it was one per id *length*: "a" and "b" were the same engine)
    return WorkerSpec(WorkerConfig(id=wid, url=url or f"http://engine-{wid}.test:8000", role=role, **kw), draining)


def kinds(changes) -> list[tuple[str, str]]:
    return [(c.kind, c.worker_id) for c in changes]


# ------------------------------------------------------------------ plan_changes


def test_two_new_workers_with_one_engine_address_in_one_report_add_one():
    """Two pods given one IP and port, both in the first list: each was checked only against the
    registry (where neither was yet), and both were added: one engine as two workers."""
    desired = {"a": spec("a", "http://10.0.0.9:8000"), "b": spec("b", "http://10.0.0.9:8000/")}
    changes = plan_changes(desired, {}, {}, set(), 0.0, 30.0)
    assert kinds(changes) == [("add", "a"), ("conflict", "b")]
    assert changes[1].reason == "the engine at http://10.0.0.9:8000 is already worker 'a'"


def test_new_workers_are_added_but_never_a_draining_one():
    desired = {"a": spec("a"), "b": spec("b", draining=True)}
    assert kinds(plan_changes(desired, {}, {}, set(), 0.0, 30)) == [("add", "a")]


def test_identity_change_replaces_role_change_is_in_place():
    old = Owned(spec("a", url="http://10.0.0.1:8000").config)
    assert kinds(plan_changes({"a": spec("a", url="http://10.0.0.2:8000")}, {"a": old}, {}, set(), 0, 30)) == [
        ("replace", "a")]
    old = Owned(spec("a", url="http://10.0.0.1:8000", role="prefill").config)
    changes = plan_changes({"a": spec("a", url="http://10.0.0.1:8000", role="decode")}, {"a": old}, {}, set(), 0, 30)
    assert kinds(changes) == [("set_role", "a")] and changes[0].reason == "prefill -> decode"


def test_departed_worker_is_withdrawn_then_removed_when_idle_or_after_grace():
    cfg = spec("a").config
    assert kinds(plan_changes({}, {"a": Owned(cfg)}, {"a": 3}, set(), 10.0, 30)) == [("withdraw", "a")]
    withdrawn = {"a": Owned(cfg, withdrawn_at=10.0)}
    assert plan_changes({}, withdrawn, {"a": 3}, set(), 20.0, 30) == []  # busy, within grace
    assert kinds(plan_changes({}, withdrawn, {"a": 0}, set(), 20.0, 30)) == [("remove", "a")]
    late = plan_changes({}, withdrawn, {"a": 3}, set(), 40.0, 30)
    assert kinds(late) == [("remove", "a")] and "still busy" in late[0].reason


def test_marks_drain_and_undrain_and_a_returning_worker_is_restored():
    cfg = spec("a").config
    assert kinds(plan_changes({"a": spec("a", draining=True)}, {"a": Owned(cfg)}, {}, set(), 0, 30)) == [
        ("drain", "a")]
    assert kinds(plan_changes({"a": spec("a")}, {"a": Owned(cfg, marked=True)}, {}, set(), 0, 30)) == [
        ("undrain", "a")]
    assert kinds(plan_changes({"a": spec("a")}, {"a": Owned(cfg, withdrawn_at=1.0)}, {"a": 1}, set(), 2, 30)) == [
        ("restore", "a")]
    assert plan_changes({"a": spec("a")}, {"a": Owned(cfg)}, {}, set(), 0, 30) == []  # steady state: nothing


def test_foreign_workers_are_never_touched():
    assert kinds(plan_changes({"w0": spec("w0")}, {}, {}, {"w0"}, 0, 30)) == [("conflict", "w0")]
    assert plan_changes({}, {}, {}, {"w0"}, 0, 30) == []


# ------------------------------------------------------------------ the reconciler on a registry


def test_reconciler_lifecycle_on_a_registry():
    static = Worker(id="w0", url="http://static:8000", state=WorkerState.HEALTHY)
    fleet = FleetRegistry([static])
    events: list[tuple[str, str]] = []
    fleet.subscribe(lambda e, w: events.append((e, w.id)))
    r = Reconciler(fleet, "test", grace_s=30)
    r.update({"a": spec("a", role="decode"), "b": spec("b")}, now=0.0)
    a = fleet.get("a")
    assert a is not None and a.state is WorkerState.UNHEALTHY  # the health loop brings it in
    fleet.record_health(a, True, now=0.5)
    r.update({"a": spec("a", role="prefill"), "b": spec("b")}, now=1.0)
    assert a.role is Role.PREFILL and ("role", "a") in events
    # marked draining: stays, takes nothing new; unmarked: back
    r.update({"a": spec("a", role="prefill", draining=True), "b": spec("b")}, now=2.0)
    assert a.state is WorkerState.DRAINING and fleet.candidates("m") == []
    r.update({"a": spec("a", role="prefill"), "b": spec("b")}, now=3.0)
    assert a.state is WorkerState.HEALTHY
    # a leaves while busy: drained, kept until idle
    a.inflight = 2
    r.update({"b": spec("b")}, now=4.0)
    assert a.state is WorkerState.DRAINING and fleet.get("a") is a
    r.sweep(now=5.0)
    assert fleet.get("a") is a
    a.inflight = 0
    r.sweep(now=6.0)
    assert fleet.get("a") is None and ("removed", "a") in events
    assert fleet.get("w0") is static and static.state is WorkerState.HEALTHY  # never touched
    # an operator's drain is not undone by the source
    fleet.drain("b")
    r.update({"b": spec("b")}, now=7.0)
    assert fleet.get("b").state is WorkerState.DRAINING


# ------------------------------------------------------------------ pods


def pod(name="e-0", ip="10.1.2.3", ready=True, labels=None, annotations=None, deleting=False, ports=None) -> dict:
    meta = {"name": name, "labels": labels or {}, "annotations": annotations or {}, "resourceVersion": "7"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta,
            "spec": {"nodeName": "n1", "containers": [{"ports": ports or [
                {"name": "http", "containerPort": 8000}, {"name": "kv-events", "containerPort": 5557},
                {"name": "kv-replay", "containerPort": 5558}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


K8S = KubernetesDiscoveryConfig(selectors={Role.PREFILL: "a=b"}, kv_events_port="kv-events",
                                kv_replay_port="kv-replay", models=["m"], engine="sim")


def test_pod_to_worker_mapping():
    s = pod_to_spec(pod(labels={"dyad.dev/role": "decode"}), Role.PREFILL, K8S)
    assert s is not None and not s.draining
    c = s.config
    assert (c.id, c.url, c.role, c.engine.value, c.models) == ("e-0", "http://10.1.2.3:8000", Role.DECODE, "sim", ["m"])
    assert c.kv_events.endpoint == "tcp://10.1.2.3:5557" and c.kv_events.replay_endpoint == "tcp://10.1.2.3:5558"
    assert c.labels == {"pod": "e-0", "node": "n1"}
    # role from the selector when the label is missing; a value that is not a role is not guessed (the pod
    # is not used, and pod_mapping says why: it used to take the selector's role silently)
    assert pod_to_spec(pod(labels={}), Role.PREFILL, K8S).config.role is Role.PREFILL
    assert pod_to_spec(pod(labels={"dyad.dev/role": "chef"}), Role.PREFILL, K8S) is None
    assert pod_mapping(pod(labels={"dyad.dev/role": "chef"}), Role.PREFILL, K8S) == Unused(
        "unknown_role", "label dyad.dev/role='chef' is not a role (prefill, decode, both) (discovery.kubernetes.role_label)")
    # not routable: not Ready, no IP, no such port; each with its reason
    assert pod_to_spec(pod(ready=False), Role.PREFILL, K8S) is None
    assert pod_to_spec(pod(ip=None), Role.PREFILL, K8S) is None
    assert pod_to_spec(pod(ports=[{"name": "metrics", "containerPort": 9}]), Role.PREFILL, K8S) is None
    assert [pod_mapping(p, Role.PREFILL, K8S).reason for p in (  # type: ignore[union-attr]
        pod(ready=False), pod(ip=None), pod(ports=[{"name": "metrics", "containerPort": 9}]))] == [
        "not_ready", "no_ip", "no_port"]
    # marked or being deleted: a worker that takes nothing new
    assert pod_to_spec(pod(annotations={"dyad.dev/draining": "true"}), Role.PREFILL, K8S).draining
    assert pod_to_spec(pod(deleting=True), Role.PREFILL, K8S).draining
    # a numbered port and IPv6
    v6 = KubernetesDiscoveryConfig(selectors={Role.DECODE: "a"}, port=9000)
    assert pod_to_spec(pod(ip="fd00::5"), Role.DECODE, v6).config.url == "http://[fd00::5]:9000"


def test_sglang_prefill_pods_carry_their_named_bootstrap_port():
    cfg = KubernetesDiscoveryConfig(selectors={Role.PREFILL: "a", Role.DECODE: "b"}, engine="sglang",
                                    bootstrap_port="bootstrap")
    ports = [{"name": "http", "containerPort": 8000}, {"name": "bootstrap", "containerPort": 9001}]
    assert pod_to_spec(pod(ports=ports), Role.PREFILL, cfg).config.bootstrap_port == 9001
    # a decode pod has no bootstrap server; without the setting the engine default (None) stays
    assert pod_to_spec(pod(ports=ports), Role.DECODE, cfg).config.bootstrap_port is None
    assert pod_to_spec(pod(ports=ports), Role.PREFILL, K8S).config.bootstrap_port is None
    numbered = KubernetesDiscoveryConfig(selectors={Role.PREFILL: "a"}, bootstrap_port="9100")
    assert pod_to_spec(pod(), Role.PREFILL, numbered).config.bootstrap_port == 9100


def test_a_pod_two_selectors_match_counts_once():
    caches = [(Role.PREFILL, {"e-0": pod()}), (Role.DECODE, {"e-0": pod(), "e-1": pod("e-1")})]
    out = desired_from_pods(caches, K8S)
    assert sorted(out) == ["e-0", "e-1"] and out["e-0"].config.role is Role.PREFILL


def test_watch_events_update_the_cache_and_the_resume_point():
    cache: dict = {}
    assert apply_event(cache, {"type": "ADDED", "object": pod()}) == "7"
    assert "e-0" in cache
    assert apply_event(cache, {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "42"}}}) == "42"
    assert "e-0" in cache  # a bookmark changes nothing but the version
    gone = pod()
    gone["metadata"]["resourceVersion"] = "43"
    assert apply_event(cache, {"type": "DELETED", "object": gone}) == "43" and cache == {}
    assert apply_event(cache, {"type": "SOMETHING", "object": pod()}) is None and cache == {}


# ------------------------------------------------------------------ the workers file


def test_workers_file_parses_lists_and_mappings_and_names_bad_fields():
    text = "workers:\n  - {url: 'http://a:1', role: prefill}\n  - {url: 'http://b:1', id: bee, draining: true}\n"
    out = parse_workers_file(text)
    assert sorted(out) == ["bee", "http://a:1"] and out["bee"].draining and out["http://a:1"].config.role is Role.PREFILL
    assert list(parse_workers_file('[{"url": "http://c:2"}]')) == ["http://c:2"]  # JSON
    assert parse_workers_file("") == {}
    with pytest.raises(WorkersFileError, match=r"workers\.1\.url"):
        parse_workers_file("- {url: 'http://a:1'}\n- {url: 'ftp://x'}\n")
    with pytest.raises(WorkersFileError, match="duplicate"):
        parse_workers_file("- {url: 'http://a:1'}\n- {url: 'http://a:1'}\n")
    with pytest.raises(WorkersFileError, match="not valid"):
        parse_workers_file("- [unclosed")


# ------------------------------------------------------------------ the actuator's scale-in decisions


def sts_pods(*names, marked=(), unready=()):
    return [pod(n, annotations={"dyad.dev/draining": "true"} if n in marked else {}, ready=n not in unready)
            for n in names]


def test_statefulset_scale_in_removes_the_highest_ordinals():
    pods = sts_pods("d-0", "d-1", "d-2", "d-10")
    assert scale_in_victims("statefulsets", pods, 2, "dyad.dev/draining") == ["d-2", "d-10"]
    assert scale_in_victims("statefulsets", pods, 4, "dyad.dev/draining") == ["d-10"]


def test_deployment_scale_in_prefers_marked_then_unready_pods():
    pods = sts_pods("x-a", "x-b", "x-c", marked=("x-a",), unready=("x-b",))
    assert scale_in_victims("deployments", pods, 1, "dyad.dev/draining") == ["x-a", "x-b"]
    assert scale_in_victims("deployments", pods, 3, "dyad.dev/draining") == []


def test_drain_is_over_after_settling_and_two_idle_reads_or_the_timeout():
    s = DrainingScaleIn(target=1, marked_at={"d-1": 0.0})
    assert drain_finished(s, {"d-1": True}, 0.5, settle_s=1.0, timeout_s=60) == (False, "d-1 settling")
    assert drain_finished(s, {"d-1": True}, 1.5, 1.0, 60)[0] is False  # one idle read is not enough
    assert drain_finished(s, {"d-1": False}, 2.0, 1.0, 60) == (False, "d-1 busy")  # resets the count
    assert drain_finished(s, {"d-1": True}, 2.5, 1.0, 60)[0] is False
    assert drain_finished(s, {"d-1": True}, 3.0, 1.0, 60) == (True, "drained")
    stuck = DrainingScaleIn(target=1, marked_at={"d-1": 0.0})
    assert drain_finished(stuck, {"d-1": None}, 30.0, 1.0, 60) == (False, "d-1 not yet idle")
    assert drain_finished(stuck, {"d-1": False}, 61.0, 1.0, 60) == (True, "drain timeout for d-1")


def test_planner_counts_are_compared_not_used_as_replica_counts():
    assert replica_change(2, None) == "set"  # no count: desired is the replica count
    assert replica_change(0, 0) == "hold"  # nothing serving yet (pods starting): never scale to 0
    assert replica_change(1, 1) == "hold"  # a starting pod is not counted: holding must not remove it
    assert replica_change(3, 2) == "grow" and replica_change(1, 2) == "shrink"


# ------------------------------------------------------------------ reaching the API server


def test_in_cluster_address_and_the_rotating_token(tmp_path, monkeypatch):
    from orchestrator.fleet import kube_api

    assert kube_api.in_cluster_url({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}) \
        == "https://10.96.0.1:443"
    assert kube_api.in_cluster_url({"KUBERNETES_SERVICE_HOST": "fd00::1"}) == "https://[fd00::1]:443"
    assert kube_api.in_cluster_url({}) == "https://kubernetes.default.svc"
    assert kube_api.pod_namespace("serving") == "serving"
    token = tmp_path / "token"
    token.write_text("first\n")
    api = kube_api.KubeApi("https://api.example:6443/", token_file=str(token), ca_file=str(tmp_path / "missing"))
    assert api.base_url == "https://api.example:6443"
    assert api._headers()["Authorization"] == "Bearer first"
    token.write_text("second")
    assert api._headers()["Authorization"] == "Bearer first"  # re-read on a period, not per call
    monkeypatch.setattr(kube_api, "TOKEN_REREAD_S", 0.0)
    assert api._headers()["Authorization"] == "Bearer second"
    assert api._headers("application/merge-patch+json")["Content-Type"] == "application/merge-patch+json"
    fixed = kube_api.KubeApi("http://127.0.0.1:1", token="t", token_file=str(token))
    assert fixed._headers()["Authorization"] == "Bearer t"  # an explicit token wins over the file


def test_check_config_checks_the_workers_file_too(tmp_path, capsys):
    from orchestrator.cli import main as dyad

    workers = tmp_path / "workers.yaml"
    workers.write_text("- {url: 'http://a:1', role: prefill}\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"discovery:\n  source: file\n  file: {{path: '{workers}'}}\n")
    assert dyad(["check-config", str(cfg)]) == 0
    assert f"+ 1 from {workers}" in capsys.readouterr().out
    workers.write_text("- {url: 'ftp://a:1'}\n")
    assert dyad(["check-config", str(cfg)]) == 2
    assert "workers.0.url" in capsys.readouterr().err
    missing = tmp_path / "k.yaml"
    missing.write_text("discovery: {source: kubernetes}\n")
    assert dyad(["check-config", str(missing)]) == 2
    assert "kubernetes.selectors" in capsys.readouterr().err


# ------------------------------------------------------------------ warm standby marks


def test_standby_mark_parks_and_its_removal_activates():
    s = pod_to_spec(pod(annotations={"dyad.dev/standby": "true"}), Role.PREFILL, K8S)
    assert s.standby and not s.draining
    cfg = spec("a").config
    sb = WorkerSpec(cfg, standby=True)
    assert kinds(plan_changes({"a": sb}, {"a": Owned(cfg)}, {}, set(), 0, 30)) == [("park", "a")]
    assert kinds(plan_changes({"a": WorkerSpec(cfg)}, {"a": Owned(cfg, parked=True)}, {}, set(), 0, 30)) == [
        ("activate", "a")]
    # a drained pod marked standby (the actuator parks it after its drain): park, not undrain
    assert kinds(plan_changes({"a": sb}, {"a": Owned(cfg, marked=True)}, {}, set(), 0, 30)) == [("park", "a")]
    # draining wins over standby
    both = WorkerSpec(cfg, draining=True, standby=True)
    assert kinds(plan_changes({"a": both}, {"a": Owned(cfg, parked=True)}, {}, set(), 0, 30)) == [("drain", "a")]


def test_reconciler_adds_a_standby_pod_out_of_rotation_and_activates_it():
    fleet = FleetRegistry()
    rec = Reconciler(fleet, "kubernetes", grace_s=30)
    cfg = spec("a", models=["m"]).config
    rec.update({"a": WorkerSpec(cfg, standby=True)}, 0.0)
    w = fleet.get("a")
    fleet.record_health(w, True, 1.0)
    assert w.state is WorkerState.STANDBY and fleet.candidates("m") == []
    rec.update({"a": WorkerSpec(cfg)}, 2.0)
    assert w.state is WorkerState.HEALTHY and fleet.candidates("m") == [w]


def test_reconciler_follows_every_mark_in_the_registry_and_in_what_it_owns():
    """drain, park, activate, drain, undrain in turn: the worker's state and the reconciler's own record of
    the marks (which decide the next plan) after each."""
    fleet = FleetRegistry()
    rec = Reconciler(fleet, "kubernetes", grace_s=30)
    cfg = spec("a", models=["m"]).config
    rec.update({"a": WorkerSpec(cfg)}, 0.0)
    w = fleet.get("a")
    fleet.record_health(w, True, 1.0)
    steps = [(WorkerSpec(cfg, draining=True), "drain", WorkerState.DRAINING, (True, False)),
             (WorkerSpec(cfg, standby=True), "park", WorkerState.STANDBY, (False, True)),
             (WorkerSpec(cfg), "activate", WorkerState.HEALTHY, (False, False)),
             (WorkerSpec(cfg, draining=True), "drain", WorkerState.DRAINING, (True, False)),
             (WorkerSpec(cfg), "undrain", WorkerState.HEALTHY, (False, False))]
    for i, (desired, kind, state, marks) in enumerate(steps):
        assert kinds(rec.update({"a": desired}, 2.0 + i)) == [(kind, "a")]
        assert w.state is state and (rec.owned["a"].marked, rec.owned["a"].parked) == marks, kind
        assert rec.update({"a": desired}, 2.5 + i) == []  # followed: nothing more to do


def test_deployment_scale_in_keeps_the_standby_pool():
    pods = sts_pods("x-a", "x-b", "x-c")
    pods[2]["metadata"].setdefault("annotations", {})["dyad.dev/standby"] = "true"
    assert scale_in_victims("deployments", pods, 2, "dyad.dev/draining", "dyad.dev/standby") == ["x-b"]
