"""The Helm chart (deploy/helm/dyad), rendered offline by the real Helm SDK (helm-python-sdk: Helm v4's
Go library behind a C ABI, from PyPI) with several value sets, then checked the way a cluster would:
every built-in object against the Kubernetes 1.30 and 1.37 schemas (kubernetes-validate, strict),
the prometheus-operator objects against models generated from its CRD schemas (cloudcoil), references between objects, the rendered gateway config through ``dyad check-config`` with each
container's environment, the PrometheusRule through promtool, and the dashboards against
dashboards/*.json. No cluster runs here: nothing is applied."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dyad"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
K8S_VERSIONS = ("1.30.0", "1.37.0")
NAMESPACE = "llm"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
MONITORING = {"monitoring": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}

VALUE_SETS: dict[str, dict[str, Any]] = {
    # the defaults (vLLM P/D, 2 prefill + 2 decode, in-chart Redis) with the planner
    "pd-vllm": {"planner": {"enabled": True, "prometheusUrl": "http://prometheus-operated.monitoring.svc:9090"},
                **MONITORING},
    "aggregated": {**yaml.safe_load((CHART / "values-aggregated.yaml").read_text()), **MONITORING},
    "external-redis": {"redis": {"enabled": False, "url": "rediss://redis.example.internal:6380/0",
                                 "tlsSecret": "redis-tls", "tlsClientCert": True},
                       "gateway": {"replicas": 3, "adminTokenSecret": "dyad-admin",
                                   "config": {"limits": {"default_rpm": 600}}}},
    "redis-url-in-secret": {"redis": {"enabled": False, "urlSecret": {"name": "dyad-redis-url", "key": "url"}}},
    "pd-sglang": {"engine": {"type": "sglang", "sglang": {"bootstrapPort": 9001}},
                  "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 3}}, **MONITORING},
    "no-redis-single-gateway": {"redis": {"enabled": False}, "gateway": {"replicas": 1},
                                "monitoring": {"dashboards": {"enabled": False}}},
}
# What a Secret referenced by the chart would hold, for running check-config with the container env.
SECRET_VALUES = {("dyad-redis-url", "url"): "rediss://from-secret.example:6380/0", ("dyad-admin", "token"): "t0ken"}


def render(values: dict[str, Any], release: str = "dyad") -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=release, namespace=NAMESPACE)
    docs = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    return request.param, VALUE_SETS[request.param], render(VALUE_SETS[request.param])


def find(docs, kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def env_of(container: dict) -> dict[str, str]:
    """The container's DYAD_* environment as the process would see it (Secrets from SECRET_VALUES)."""
    out = {}
    for e in container.get("env", []):
        if not e["name"].startswith("DYAD_"):
            continue
        if "value" in e:
            out[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = SECRET_VALUES[(ref["name"], ref["key"])]
    return out


def check_config(config_text: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "dyad.yaml"
    path.write_text(config_text)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DYAD_")}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "check-config", str(path)],
                          capture_output=True, text=True, env={**clean, **env}, timeout=60, cwd=ROOT)


def test_helm_lint_is_clean():
    report = helm.lint(str(CHART), strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["total_charts_linted"] == 1
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], (problems, report["errors"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(rendered, version):
    name, _, docs = rendered
    errors, checked = [], 0
    for d in docs:
        if (d["apiVersion"], d["kind"]) in CRDS:
            continue  # kubernetes-validate ships no prometheus-operator schemas: see the next test
        try:
            kubernetes_validate.validate(d, version, strict=True)
            checked += 1
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, f"{name}:\n" + "\n".join(errors)
    assert checked >= 7  # config, gateway Deployment + Service, 2 pools x (StatefulSet + Service) at least


def test_prometheus_operator_objects_match_their_crd_schemas(rendered):
    """ServiceMonitor and PrometheusRule against prometheus-operator's CRD schemas (as pydantic models,
    cloudcoil-models-prometheus-operator): types checked on validation, and a field the schema does
    not know (which pydantic would drop) shows as a difference on the way back."""
    name, _, docs = rendered
    for d in docs:
        if (d["apiVersion"], d["kind"]) not in CRDS:
            continue
        model = getattr(prometheus_operator, d["kind"]).model_validate(d)
        assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == d, (name, d["kind"])


def test_names_are_unique_and_selectors_find_pods(rendered):
    name, _, docs = rendered
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), name
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)]
    for w in workloads(docs):
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= w["spec"]["template"]["metadata"]["labels"].items(), w["metadata"]["name"]
    for svc in find(docs, "Service"):
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= labels.items() for labels in pod_labels), f"{name}: {svc['metadata']['name']} selects nothing"
        ports = {p["name"] for w in workloads(docs) if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
                 for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (svc["metadata"]["name"], p)
    for sts in find(docs, "StatefulSet"):
        assert find(docs, "Service", sts["spec"]["serviceName"])[0]["spec"]["clusterIP"] == "None"
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        if "serviceAccountName" in spec:
            assert find(docs, "ServiceAccount", spec["serviceAccountName"]), w["metadata"]["name"]
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert find(docs, "ConfigMap", v["configMap"]["name"]), (w["metadata"]["name"], v)


def test_rendered_config_passes_check_config_in_every_container(rendered, tmp_path):
    name, values, docs = rendered
    (cm,) = [d for d in find(docs, "ConfigMap") if "dyad.yaml" in d["data"]]
    text = cm["data"]["dyad.yaml"]
    dyad_pods = [w for w in find(docs, "Deployment") if w["spec"]["template"]["metadata"]["labels"].get(
        "app.kubernetes.io/component") in ("gateway", "planner")]
    assert dyad_pods
    for w in dyad_pods:
        container = w["spec"]["template"]["spec"]["containers"][0]
        assert container["args"][:3] == ["serve", "--config", "/etc/dyad/dyad.yaml"]
        env = env_of(container)
        r = check_config(text, env, tmp_path)
        assert r.returncode == 0, f"{name} {w['metadata']['name']} env={env}:\n{r.stderr}"
        assert "ok:" in r.stdout

    # the workers are exactly the engine pods, by their stable DNS names, with their roles
    from orchestrator.config import load_config

    clean_env = {k: v for k, v in env_of(dyad_pods[0]["spec"]["template"]["spec"]["containers"][0]).items()}
    cfg = load_config(yaml.safe_load(text), environ=clean_env)
    expected = []
    for sts in find(docs, "StatefulSet"):
        svc, pool = sts["spec"]["serviceName"], sts["metadata"]["labels"]["dyad.dev/pool"]
        expected += [(f"http://{sts['metadata']['name']}-{i}.{svc}.{NAMESPACE}.svc:8000", pool)
                     for i in range(sts["spec"]["replicas"])]
    assert sorted((w.url, w.role.value) for w in cfg.workers) == sorted(expected)
    sglang = values.get("engine", {}).get("type") == "sglang"
    for w in cfg.workers:
        assert w.engine.value == ("sglang" if sglang else "vllm")
        assert (w.kv_events is not None) == (not sglang)  # SGLang publishes no KV events
        if sglang and w.role.value == "prefill":
            assert w.bootstrap_port == values["engine"]["sglang"]["bootstrapPort"]
    # the shared index follows the Redis values
    redis = values.get("redis", {})
    if redis.get("enabled", True):
        assert cfg.index.backend == "redis" and find(docs, "Service", cfg.index.redis_url.split("//")[1].split(".")[0])
    elif redis.get("url"):
        assert cfg.index.backend == "redis"
        assert not [w for w in workloads(docs) if w["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"]
        if redis.get("tlsSecret"):  # the Secret's files, mounted in every Dyad container, named in the URL
            assert cfg.index.redis_url == redis["url"] + (
                "?ssl_ca_certs=/etc/dyad-redis-tls/ca.crt&ssl_certfile=/etc/dyad-redis-tls/tls.crt"
                "&ssl_keyfile=/etc/dyad-redis-tls/tls.key")
            for w in dyad_pods:
                spec = w["spec"]["template"]["spec"]
                assert {"name": "redis-tls", "secret": {"secretName": redis["tlsSecret"]}} in spec["volumes"]
                assert {"name": "redis-tls", "mountPath": "/etc/dyad-redis-tls", "readOnly": True} in \
                    spec["containers"][0]["volumeMounts"]
        else:
            assert cfg.index.redis_url == redis["url"]
    elif redis.get("urlSecret"):
        assert cfg.index.redis_url == SECRET_VALUES[("dyad-redis-url", "url")]
    else:
        assert cfg.index.backend == "memory"
    for key, value in values.get("gateway", {}).get("config", {}).items():  # free-form config merged in
        assert getattr(cfg, key).model_dump(include=set(value)) == value


def test_engine_arguments_per_engine_and_role(rendered):
    name, values, docs = rendered
    sglang = values.get("engine", {}).get("type") == "sglang"
    pd = len(find(docs, "StatefulSet")) == 2
    for sts in find(docs, "StatefulSet"):
        pool = sts["metadata"]["labels"]["dyad.dev/pool"]
        c = sts["spec"]["template"]["spec"]["containers"][0]
        args = dict(a.partition("=")[::2] for a in c["args"])
        if sglang:
            assert c["command"][-1] == "sglang.launch_server" and c["image"].startswith("lmsysorg/sglang")
            assert args["--disaggregation-mode"] == pool and args["--page-size"] == "32"
            if pool == "prefill":
                assert args["--disaggregation-bootstrap-port"] == "9001"
                assert any(p["containerPort"] == 9001 for p in c["ports"])
        else:
            assert c["command"][-1] == "vllm.entrypoints.openai.api_server"
            assert args["--block-size"] == "32" and "--enable-prefix-caching" in args
            assert json.loads(args["--kv-events-config"])["endpoint"] == "tcp://*:5557"
            if pd:
                kv = json.loads(args["--kv-transfer-config"])
                assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[pool]
                assert kv.get("kv_load_failure_policy") == (None if pool == "prefill" else "recompute")
            else:
                assert "--kv-transfer-config" not in args


def test_planner_rbac_is_namespaced_and_scales_only_its_pools(rendered):
    name, values, docs = rendered
    planner = [w for w in find(docs, "Deployment") if w["metadata"]["name"].endswith("-planner")]
    if not values.get("planner", {}).get("enabled", False):
        assert not planner and not find(docs, "Role")
        return
    (role,) = find(docs, "Role")
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    (binding,) = find(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": planner[0]["spec"]["template"]["spec"]["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    scale = [r for r in role["rules"] if "statefulsets/scale" in r["resources"]]
    assert sorted(scale[0]["resourceNames"]) == sorted(s["metadata"]["name"] for s in find(docs, "StatefulSet"))
    assert all("delete" not in r["verbs"] for r in role["rules"])
    env = {e["name"]: e.get("value") for e in planner[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DYAD_PLANNER__ENABLED"] == "true" and env["DYAD_PLANNER__ACTUATOR"] == "kubernetes"
    assert planner[0]["spec"]["replicas"] == 1 and planner[0]["spec"]["strategy"]["type"] == "Recreate"
    (cm,) = [d for d in find(docs, "ConfigMap") if "dyad.yaml" in d["data"]]
    planner_cfg = yaml.safe_load(cm["data"]["dyad.yaml"])["planner"]
    assert planner_cfg["prometheus_url"] == values["planner"]["prometheusUrl"]  # the gateways' load, not its own
    assert planner_cfg["kubernetes_workloads"] == {
        role: f"statefulsets/{s['metadata']['name']}" for s in find(docs, "StatefulSet")
        for role in [s["metadata"]["labels"]["dyad.dev/pool"]]}


def test_prometheus_rule_is_our_tested_rules_and_passes_promtool(rendered, tmp_path):
    name, values, docs = rendered
    rules = find(docs, "PrometheusRule")
    if "monitoring" not in values or not values["monitoring"].get("prometheusRule", {}).get("enabled"):
        assert not rules
        return
    (rule,) = rules
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    exe = shutil.which("promtool")
    assert exe, "promtool not found: run scripts/setup_test_deps.sh"
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule["spec"]))
    r = subprocess.run([exe, "check", "rules", "rules.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_service_monitor_selects_gateway_planner_and_engine_services(rendered):
    name, values, docs = rendered
    monitors = find(docs, "ServiceMonitor")
    if "monitoring" not in values or not values["monitoring"].get("serviceMonitor", {}).get("enabled"):
        assert not monitors
        return
    (sm,) = monitors
    sel = sm["spec"]["selector"]["matchLabels"]
    selected = [s for s in find(docs, "Service") if sel.items() <= s["metadata"]["labels"].items()]
    components = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected}
    assert {"gateway", "engine"} <= components and "redis" not in components
    assert len([s for s in selected if s["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]) == \
        len(find(docs, "StatefulSet"))
    for s in selected:
        assert any(p["name"] == sm["spec"]["endpoints"][0]["port"] for p in s["spec"]["ports"])
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]


def test_dashboards_are_configmaps_of_the_committed_json(rendered):
    name, values, docs = rendered
    maps = [d for d in find(docs, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    if values.get("monitoring", {}).get("dashboards", {}).get("enabled", True) is False:
        assert not maps
        return
    committed = {p.name: json.loads(p.read_text()) for p in (ROOT / "dashboards").glob("*.json")}
    got = {k: json.loads(v) for m in maps for k, v in m["data"].items()}
    assert got == committed  # every dashboard, unchanged (the chart links dashboards/*.json)


def test_bad_values_fail_the_render_naming_the_value():
    cases = {
        "planner.enabled": {"pools": {"prefill": {"enabled": False}, "decode": {"enabled": False},
                                      "both": {"enabled": True}},
                            "planner": {"enabled": True, "prometheusUrl": "http://prom:9090"}},
        "planner.prometheusUrl": {"planner": {"enabled": True}},
        "redis: set redis.enabled=false": {"redis": {"url": "redis://elsewhere:6379/0"}},
        "pools.prefill": {"pools": {"decode": {"enabled": False}}, "planner": {"enabled": False}},
        "pools: enable at least one": {"pools": {"prefill": {"enabled": False}, "decode": {"enabled": False}},
                                       "planner": {"enabled": False}},
    }
    for message, values in cases.items():
        with pytest.raises(helm.HelmRenderError, match=message):
            render(values)


def test_values_schema_names_a_misspelt_or_mistyped_value():
    """values.schema.json: Helm refuses values that do not fit, naming where (typos included)."""
    cases = {
        "at '/gateway/replicas': got string, want integer": {"gateway": {"replicas": "two"}},
        "additional properties 'gatway' not allowed": {"gatway": {"replicas": 2}},
        "at '/gateway': additional properties 'replicaz' not allowed": {"gateway": {"replicaz": 2}},
        "at '/redis/url'": {"redis": {"enabled": False, "url": "http://not-redis:6379"}},
        "at '/engine/type'": {"engine": {"type": "trtllm"}},
        "at '/pools/decode/replicas'": {"pools": {"decode": {"replicas": -1}}},
        "at '/gateway/policy'": {"gateway": {"policy": "cache_aware"}},
    }
    for message, values in cases.items():
        with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
            render(values)


def test_chart_files_are_links_to_the_tested_sources():
    """The chart ships deploy/prometheus/rules.yml and dashboards/*.json through symlinks (Helm follows
    them when it loads or packages a chart), so it can never carry stale copies."""
    files = CHART / "files"
    assert (files / "rules.yml").resolve() == RULES.resolve()
    links = sorted(p.name for p in (files / "dashboards").iterdir())
    assert links == sorted(p.name for p in (ROOT / "dashboards").glob("*.json")), \
        "a dashboard without a link in deploy/helm/dyad/files/dashboards"
    for p in (files / "dashboards").iterdir():
        assert p.resolve() == (ROOT / "dashboards" / p.name).resolve()
