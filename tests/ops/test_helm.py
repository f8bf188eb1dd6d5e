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
    # the fixed worker list instead of discovery (no gateway RBAC; pods beyond replicas never routed to)
    "static-workers": {"gateway": {"discovery": "static"}},
}
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
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

    from orchestrator.config import load_config

    clean_env = {k: v for k, v in env_of(dyad_pods[0]["spec"]["template"]["spec"]["containers"][0]).items()}
    cfg = load_config(yaml.safe_load(text), environ=clean_env)
    if discovers(values):  # the engines are discovered (test_discovery_selects_exactly_the_engine_pods)
        assert cfg.discovery.source == "kubernetes" and cfg.workers == []
        assert cfg.discovery.kubernetes.api.namespace == NAMESPACE
    else:
        check_static_workers(values, docs, cfg)
    check_index(values, docs, dyad_pods, cfg)
    for key, value in values.get("gateway", {}).get("config", {}).items():  # free-form config merged in
        assert getattr(cfg, key).model_dump(include=set(value)) == value


def discovers(values: dict[str, Any]) -> bool:
    return values.get("gateway", {}).get("discovery", "kubernetes") == "kubernetes"


def check_static_workers(values, docs, cfg) -> None:
    """gateway.discovery=static: the workers are exactly the engine pods, by their stable DNS names."""
    assert cfg.discovery.source == "static"
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


def check_index(values, docs, dyad_pods, cfg) -> None:
    """The shared index follows the Redis values."""
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


def selector_labels(selector: str) -> dict[str, str]:
    """An equality-based label selector ("a=b,c=d"), the only kind the chart writes."""
    pairs = [part.split("=") for part in selector.split(",")]
    assert all(len(p) == 2 and p[0] and p[1] for p in pairs), selector
    return dict(pairs)


def test_discovery_selects_exactly_the_engine_pods(rendered):
    """Each role's selector matches the pod template of exactly that pool's StatefulSet (and no gateway,
    planner or Redis pod); a pod made from that template, Ready with an IP, maps (by discovery's own
    pod_to_spec) to the worker the pool stands for: its role, its named HTTP port, its KV-event ports
    (vLLM) or its bootstrap port (SGLang prefill)."""
    from orchestrator.config import load_config
    from orchestrator.fleet.discovery.kubernetes import pod_to_spec

    name, values, docs = rendered
    (cm,) = [d for d in find(docs, "ConfigMap") if "dyad.yaml" in d["data"]]
    cfg = load_config(yaml.safe_load(cm["data"]["dyad.yaml"]), environ={})
    if not discovers(values):
        assert cfg.discovery.source == "static"
        return
    k = cfg.discovery.kubernetes
    engines = {s["metadata"]["labels"]["dyad.dev/pool"]: s for s in find(docs, "StatefulSet")}
    assert sorted(r.value for r in k.selectors) == sorted(engines), name
    sglang = values.get("engine", {}).get("type") == "sglang"
    for role, selector in k.selectors.items():
        sel = selector_labels(selector)
        matched = [w["metadata"]["name"] for w in workloads(docs)
                   if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        sts = engines[role.value]
        assert matched == [sts["metadata"]["name"]], (name, role, matched)
        assert sel == sts["spec"]["selector"]["matchLabels"]  # the pods the StatefulSet owns, no more
        template = sts["spec"]["template"]
        for port in (k.port, k.kv_events_port, k.kv_replay_port, k.bootstrap_port if role.value == "prefill" else None):
            if port is not None:
                assert any(p["name"] == port for c in template["spec"]["containers"] for p in c.get("ports", [])), \
                    (name, role, port)
        pod = {"metadata": {"name": f"{sts['metadata']['name']}-5", "labels": template["metadata"]["labels"]},
               "spec": template["spec"],
               "status": {"podIP": "10.9.8.7", "conditions": [{"type": "Ready", "status": "True"}]}}
        spec = pod_to_spec(pod, role, k)
        assert spec is not None and not spec.draining, (name, role)
        w = spec.config
        assert (w.role, w.url, w.engine.value, w.models) == (
            role, "http://10.9.8.7:8000", "sglang" if sglang else "vllm", [values.get("model", {}).get("name", "llama-3.1-8b")])
        if sglang:
            assert w.kv_events is None
            want = values["engine"]["sglang"]["bootstrapPort"] if role.value == "prefill" and len(engines) == 2 else None
            assert w.bootstrap_port == want
        else:
            assert (w.kv_events.endpoint, w.kv_events.replay_endpoint) == ("tcp://10.9.8.7:5557", "tcp://10.9.8.7:5558")
        # the planner's drain mark takes the pod out of routing
        pod["metadata"]["annotations"] = {k.draining_annotation: "true"}
        assert pod_to_spec(pod, role, k).draining


def grants(docs, namespace: str) -> dict[str, set[tuple]]:
    """ServiceAccount name → what its RoleBindings grant: (apiGroup, resource, verb, resourceNames)."""
    roles = {r["metadata"]["name"]: r for r in docs if r["kind"] == "Role"}
    out: dict[str, set[tuple]] = {}
    for b in (d for d in docs if d["kind"] == "RoleBinding"):
        assert b["roleRef"]["kind"] == "Role"
        for subject in b["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == namespace, b
            for rule in roles[b["roleRef"]["name"]]["rules"]:
                names = tuple(sorted(rule.get("resourceNames", [])))
                out.setdefault(subject["name"], set()).update(
                    (g, r, v, names) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"])
    return out


def unnamed(g: set[tuple]) -> set[tuple]:
    return {t[:3] for t in g}


def kustomize_grants() -> dict[str, set[tuple]]:
    docs = [d for p in sorted(KUSTOMIZE.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]
    return grants(docs, "dyad")


def test_rbac_is_exactly_what_discovery_and_the_planner_use(rendered):
    """Namespaced only. Gateways: pods list + watch, as deploy/kubernetes/61-gateway-rbac.yaml. The
    planner: deploy/kubernetes/60-planner-rbac.yaml's grants, with the scale subresource narrowed by
    resourceNames to this release's prefill and decode StatefulSets (the ones its actuator scales) and
    without deployments/scale (the chart has no engine Deployments). Each Dyad pod runs as the
    ServiceAccount those grants are bound to."""
    name, values, docs = rendered
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    got, ref = grants(docs, NAMESPACE), kustomize_grants()
    deployments = {w["metadata"]["name"]: w for w in find(docs, "Deployment")}
    gateway = deployments["dyad-gateway"]["spec"]["template"]["spec"]
    expected_accounts = set()
    if discovers(values):
        assert gateway["serviceAccountName"] == "dyad-gateway" and find(docs, "ServiceAccount", "dyad-gateway")
        assert got["dyad-gateway"] == {("", "pods", "list", ()), ("", "pods", "watch", ())}
        assert unnamed(got["dyad-gateway"]) == unnamed(ref["dyad-gateway"])
        expected_accounts.add("dyad-gateway")
    else:
        assert "serviceAccountName" not in gateway and not find(docs, "ServiceAccount", "dyad-gateway")
    planner = deployments.get("dyad-planner")
    if values.get("planner", {}).get("enabled", False):
        assert planner["spec"]["template"]["spec"]["serviceAccountName"] == "dyad-planner"
        planner_cfg = yaml.safe_load(find(docs, "ConfigMap", "dyad-config")[0]["data"]["dyad.yaml"])["planner"]
        scaled = sorted(w.split("/")[1] for w in planner_cfg["kubernetes_workloads"].values())
        assert scaled == sorted(s["metadata"]["name"] for s in find(docs, "StatefulSet"))
        assert all(w.startswith("statefulsets/") for w in planner_cfg["kubernetes_workloads"].values())
        assert got["dyad-planner"] == {("apps", "statefulsets/scale", "get", tuple(scaled)),
                                       ("apps", "statefulsets/scale", "patch", tuple(scaled)),
                                       ("", "pods", "list", ()), ("", "pods", "watch", ()), ("", "pods", "patch", ())}
        assert unnamed(got["dyad-planner"]) == {t for t in unnamed(ref["dyad-planner"]) if t[1] != "deployments/scale"}
        assert unnamed(got["dyad-gateway"]) <= unnamed(got["dyad-planner"])  # the planner discovers engines too
        assert (planner_cfg["kubernetes_namespace"], planner_cfg["kubernetes_drain_settle_s"],
                planner_cfg["kubernetes_drain_timeout_s"]) == (NAMESPACE, 5, 600)
        env = {e["name"]: e.get("value") for e in planner["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["DYAD_PLANNER__ENABLED"] == "true" and env["DYAD_PLANNER__ACTUATOR"] == "kubernetes"
        assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"]["type"] == "Recreate"
        assert planner_cfg["prometheus_url"] == values["planner"]["prometheusUrl"]  # the gateways' load, not its own
        expected_accounts.add("dyad-planner")
    else:
        assert planner is None
    assert set(got) == expected_accounts, name
    assert {r["metadata"]["name"] for r in find(docs, "Role")} == expected_accounts
    assert {s["metadata"]["name"] for s in find(docs, "ServiceAccount")} == expected_accounts


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
        "gateway.discovery: the planner": {"gateway": {"discovery": "static"},
                                           "planner": {"enabled": True, "prometheusUrl": "http://prom:9090"}},
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
        "at '/gateway/discovery'": {"gateway": {"discovery": "dns"}},
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
