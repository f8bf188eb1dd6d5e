"""Deployment files, validated offline: Kubernetes schemas (kubernetes-validate, strict), the
references between objects, the gateway config they ship, the NIXL settings, Prometheus configs
(promtool), and the single-machine recipe."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from orchestrator.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
LOCAL = ROOT / "deploy" / "local"
PROM = ROOT / "deploy" / "prometheus"
K8S_VERSIONS = ("1.30.0", "1.37.0")


def _manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("[0-9]*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


DOCS = _manifests()


def _find(kind: str, name: str) -> dict | None:
    for _, d in DOCS:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    return None


def _workloads() -> list[dict]:
    return [d for _, d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]


def _container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _args(workload: dict) -> dict[str, str]:
    out = {}
    for a in _container(workload).get("args", []):
        key, _, value = a.partition("=")
        out[key] = value
    return out


def _env(workload: dict) -> dict[str, dict]:
    return {e["name"]: e for e in _container(workload).get("env", [])}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_strictly(version):
    assert len(DOCS) >= 15
    errors = []
    for fname, doc in DOCS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{fname} {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, "\n".join(errors)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("[0-9]*.yaml"))


def test_names_are_unique_and_namespaced():
    seen = set()
    for _, d in DOCS:
        key = (d["kind"], d["metadata"]["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "dyad", key


def test_selectors_match_pod_templates_and_services_find_pods():
    templates = []
    for w in _workloads():
        labels = w["spec"]["template"]["metadata"]["labels"]
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= labels.items(), f"{w['metadata']['name']}: selector does not match its pods"
        templates.append((w, labels))
    for _, svc in [(f, d) for f, d in DOCS if d["kind"] == "Service"]:
        matched = [w for w, labels in templates if svc["spec"]["selector"].items() <= labels.items()]
        assert matched, f"Service {svc['metadata']['name']} selects no pods"
        for w in matched:
            port_names = {p["name"] for p in _container(w)["ports"]}
            for p in svc["spec"]["ports"]:
                assert p["targetPort"] in port_names, f"{svc['metadata']['name']}: {p['targetPort']} not exposed"
    # The client-facing gateway Service must not send traffic to the planner replica.
    gw_svc = _find("Service", "dyad-gateway")
    planner_labels = _find("Deployment", "dyad-planner")["spec"]["template"]["metadata"]["labels"]
    assert not gw_svc["spec"]["selector"].items() <= planner_labels.items()
    for _, pdb in [(f, d) for f, d in DOCS if d["kind"] == "PodDisruptionBudget"]:
        assert any(pdb["spec"]["selector"]["matchLabels"].items() <= labels.items() for _, labels in templates)


def test_referenced_objects_exist_and_probes_use_declared_ports():
    for w in _workloads():
        spec = w["spec"]["template"]["spec"]
        name = w["metadata"]["name"]
        if "serviceAccountName" in spec:
            assert _find("ServiceAccount", spec["serviceAccountName"]), name
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                assert _find("ConfigMap", vol["configMap"]["name"]), f"{name}: {vol}"
            if "persistentVolumeClaim" in vol:
                assert _find("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]), f"{name}: {vol}"
        for c in spec["containers"]:
            ports = {p["name"] for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}, name
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe, {})
                port = (p.get("httpGet") or p.get("tcpSocket") or {}).get("port")
                if port is not None:
                    assert port in ports, f"{name}.{probe}: port {port} not declared"
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:  # no Secret ships with the manifests: every reference must be optional
                    assert ref.get("optional") is True, f"{name}: secret {ref['name']} must be optional"
    if (sts := _find("StatefulSet", "vllm-prefill")) is not None:
        assert _find("Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def _selector_terms(selector: str) -> dict[str, str]:
    terms = dict(t.split("=", 1) for t in selector.split(","))
    assert all("!" not in k for k in terms), selector
    return terms


def test_gateway_config_is_valid_and_discovers_every_engine_pod():
    cm = _find("ConfigMap", "dyad-gateway-config")
    config = load_config(yaml.safe_load(cm["data"]["dyad.yaml"]), environ={})
    assert config.index.backend == "redis" and "dyad-redis" in config.index.redis_url
    # Engines are discovered (list + watch of pods), not listed: each role's selector finds exactly
    # the pods of that role's StatefulSet, whose named ports the worker URL and KV events use.
    disc = config.discovery
    assert disc.source == "kubernetes" and not config.workers
    k8s = disc.kubernetes
    engines = [w for w in _workloads() if w["kind"] == "StatefulSet"]
    for role, selector in k8s.selectors.items():
        terms = _selector_terms(selector)
        found = [w for w in engines if terms.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(found) == 1, (role, selector)
        sts = found[0]
        assert sts["spec"]["template"]["metadata"]["labels"][k8s.role_label] == role.value
        ports = {p["name"] for p in _container(sts)["ports"]}
        assert {k8s.port, k8s.kv_events_port, k8s.kv_replay_port} <= ports
        assert config.planner.kubernetes_workloads[role] == f"statefulsets/{sts['metadata']['name']}"
    assert set(k8s.models) <= {m.name for m in config.models}
    for sts in engines:  # every engine pod is someone's
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert any(_selector_terms(sel).items() <= labels.items() for sel in k8s.selectors.values())
    # the drain mark the planner writes is the one the gateways watch (same config, same default)
    assert k8s.draining_annotation == "dyad.dev/draining"
    served = {m.name for m in config.models}
    for sts in [w for w in _workloads() if w["kind"] == "StatefulSet"]:
        assert _args(sts)["--served-model-name"] in served
        assert int(_args(sts)["--block-size"]) == config.models[0].block_size
    # Env overrides in the Deployments are valid config too (a typo would crash-loop the pod).
    for name in ("dyad-gateway", "dyad-planner"):
        env = {k: v["value"] for k, v in _env(_find("Deployment", name)).items()
               if k.startswith("DYAD_") and "value" in v}
        load_config(yaml.safe_load(cm["data"]["dyad.yaml"]), environ=env)
    # The planner scales workloads that exist, in the namespace they live in, through the
    # subresource its Role allows.
    planner = load_config(yaml.safe_load(cm["data"]["dyad.yaml"]),
                          environ={"DYAD_PLANNER__ACTUATOR": "kubernetes"}).planner
    assert planner.kubernetes_namespace == "dyad"
    for role, workload in planner.kubernetes_workloads.items():
        kind, _, name = workload.partition("/")
        sts = _find({"statefulsets": "StatefulSet", "deployments": "Deployment"}[kind], name)
        assert sts is not None, workload
        assert sts["spec"]["template"]["metadata"]["labels"]["dyad.dev/role"] == role.value
    assert _env(_find("Deployment", "dyad-gateway"))["DYAD_PLANNER__ENABLED"]["value"] == "false"
    assert _env(_find("Deployment", "dyad-planner"))["DYAD_PLANNER__ENABLED"]["value"] == "true"
    assert _find("Deployment", "dyad-planner")["spec"]["replicas"] == 1
    assert _find("Deployment", "dyad-gateway")["spec"]["replicas"] >= 2


@pytest.mark.parametrize(("sts", "role"), [("vllm-prefill", "kv_producer"), ("vllm-decode", "kv_consumer")])
def test_engines_carry_the_nixl_and_kv_event_settings(sts, role):
    w = _find("StatefulSet", sts)
    args, env = _args(w), _env(w)
    kvt = json.loads(args["--kv-transfer-config"])
    assert kvt["kv_connector"] == "NixlConnector" and kvt["kv_role"] == role
    if role == "kv_consumer":
        assert kvt["kv_load_failure_policy"] == "recompute"
    side_port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in _container(w)["ports"]}
    assert ports["nixl"] == side_port
    events = json.loads(args["--kv-events-config"])
    assert events["enable_kv_cache_events"] and events["endpoint"].startswith("tcp://*:")  # PUB binds on *
    assert int(events["endpoint"].rsplit(":", 1)[1]) == ports["kv-events"]
    assert int(events["replay_endpoint"].rsplit(":", 1)[1]) == ports["kv-replay"]
    assert "--enable-prefix-caching" in args


def test_scrape_annotations_point_at_metrics_ports():
    annotated = []
    for w in _workloads():
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") == "true":
            ports = {p["containerPort"] for p in _container(w)["ports"]}
            assert int(ann["prometheus.io/port"]) in ports
            annotated.append(w["metadata"]["name"])
    assert {"dyad-gateway", "dyad-planner", "vllm-prefill", "vllm-decode"} <= set(annotated)


def _grants(role_name: str) -> set[tuple[str, str]]:
    role = _find("Role", role_name)
    return {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}


def test_rbac_grants_exactly_what_the_code_uses_and_nothing_cluster_wide():
    # Exactly the calls Dyad makes (tests/integration/test_kubernetes_loop.py holds the calls a real
    # gateway and planner make against these Roles): the planner reads and patches */scale, lists the
    # pods a scale-in removes, watches pods (its own discovery) and patches the drain annotation;
    # a gateway only lists and watches pods.
    assert _grants("dyad-planner") == {("statefulsets/scale", "get"), ("statefulsets/scale", "patch"),
                                       ("deployments/scale", "get"), ("deployments/scale", "patch"),
                                       ("pods", "list"), ("pods", "watch"), ("pods", "patch")}
    assert _grants("dyad-gateway") == {("pods", "list"), ("pods", "watch")}
    for name in ("dyad-planner", "dyad-gateway"):
        binding = _find("RoleBinding", name)
        assert binding["roleRef"]["name"] == name
        assert binding["subjects"][0]["name"] == _find("Deployment", name)["spec"]["template"]["spec"][
            "serviceAccountName"]
    assert not [d for _, d in DOCS if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool not found; run scripts/setup_test_deps.sh"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_prometheus_configmap_is_rendered_from_the_tested_rules():
    spec = importlib.util.spec_from_file_location("render_prometheus", K8S / "render_prometheus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (K8S / "70-prometheus-config.yaml").read_text() == mod.render(), \
        "stale ConfigMap: run python deploy/kubernetes/render_prometheus.py"
    cm = _find("ConfigMap", "dyad-prometheus-config")
    assert cm["data"]["rules.yml"] == (PROM / "rules.yml").read_text()


def test_kubernetes_prometheus_config_passes_promtool(tmp_path):
    # Debian's prometheus build has no Kubernetes service discovery, so promtool would reject
    # kubernetes_sd_configs as an unknown field; swap it for file_sd and check everything else
    # (relabel regexes, rule files, global settings) for real.
    cfg = yaml.safe_load((PROM / "prometheus-kubernetes.yml").read_text())
    for job in cfg["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs")[0]["role"] == "pod"
        job["file_sd_configs"] = [{"files": ["targets.json"]}]
    cfg["rule_files"] = ["rules.yml"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "targets.json").write_text("[]")
    shutil.copy(PROM / "rules.yml", tmp_path / "rules.yml")
    r = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_local_recipe_configs_are_valid():
    r = _promtool("check", "config", "prometheus.yml", cwd=LOCAL)
    assert r.returncode == 0, r.stdout + r.stderr
    prom = yaml.safe_load((LOCAL / "prometheus.yml").read_text())
    scraped = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for mode in ("agg", "pd"):
        config = load_config(LOCAL / f"dyad-{mode}.yaml", environ={})
        assert f"{config.gateway.host}:{config.gateway.port}" in scraped
        assert {w.url.removeprefix("http://") for w in config.workers} <= scraped
        assert len(config.workers) == 2
    pd = load_config(LOCAL / "dyad-pd.yaml", environ={})
    assert sorted(w.role.value for w in pd.workers) == ["decode", "prefill"]
    r = subprocess.run(["bash", "-n", str(LOCAL / "run.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    script = (LOCAL / "run.sh").read_text()
    assert '"kv_role":"kv_producer"' in script and '"kv_role":"kv_consumer"' in script
