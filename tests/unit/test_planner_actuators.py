"""Actuators and metric sources: a fake Kubernetes API server (written here, named as such), real
child processes for the local actuator, the gateway-metrics arithmetic of the direct source."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from adapters.base import Role
from orchestrator.planner.actuators import (
    KubernetesActuator,
    LocalProcessActuator,
    RecommendOnly,
    RoleChangeActuator,
)
from orchestrator.planner.core import Action, PlanDecision
from orchestrator.planner.metrics_source import observation_from_scrapes, parse_gateway_metrics
from orchestrator.planner.predictors import LoadForecast
from orchestrator.telemetry.metrics import DyadMetrics


def decision(actions=(), desired=None) -> PlanDecision:
    return PlanDecision(at=0.0, observation=None, forecast=LoadForecast(3.0, 1000, 100), sizing=None,
                        desired=desired or {"prefill": 2, "decode": 3}, current={"prefill": 1, "decode": 1},
                        actions=list(actions), correction={}, predictors={}, reasons=[])


class FakeKubeApi:
    """A FAKE Kubernetes API server for this test: just the apps/v1 scale subresource, with auth."""

    def __init__(self, token: str) -> None:
        self.replicas = {("deployments", "llm-prefill"): 1, ("statefulsets", "llm-decode"): 1}
        self.requests: list[tuple[str, str, str, dict | None]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _target(self):
                parts = self.path.strip("/").split("/")
                # apis/apps/v1/namespaces/{ns}/{kind}/{name}/scale
                if len(parts) != 8 or parts[:4] != ["apis", "apps", "v1", "namespaces"] or parts[7] != "scale":
                    return None
                return parts[4], (parts[5], parts[6])

            def _reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method):
                body = None
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    body = json.loads(self.rfile.read(n))
                api.requests.append((method, self.path, self.headers.get("Content-Type", ""), body))
                if self.headers.get("Authorization") != f"Bearer {token}":
                    return self._reply(401, {"kind": "Status", "code": 401})
                t = self._target()
                if t is None or t[1] not in api.replicas:
                    return self._reply(404, {"kind": "Status", "code": 404})
                if method == "PATCH":
                    if self.headers.get("Content-Type") != "application/merge-patch+json":
                        return self._reply(415, {"kind": "Status", "code": 415})
                    api.replicas[t[1]] = int(body["spec"]["replicas"])
                return self._reply(200, {"kind": "Scale", "metadata": {"name": t[1][1], "namespace": t[0]},
                                         "spec": {"replicas": api.replicas[t[1]]}})

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kube():
    api = FakeKubeApi("s3cret")
    yield api
    api.close()


async def test_kubernetes_actuator_scales_each_role_through_the_scale_subresource(kube):
    act = KubernetesActuator(kube.url, "serving", {Role.PREFILL: "deployments/llm-prefill",
                                                   Role.DECODE: "statefulsets/llm-decode"}, token="s3cret")
    done = await act.apply(decision(desired={"prefill": 2, "decode": 5}))
    assert kube.replicas == {("deployments", "llm-prefill"): 2, ("statefulsets", "llm-decode"): 5}
    assert done == ["scaled deployments/llm-prefill to 2", "scaled statefulsets/llm-decode to 5"]
    assert await act.replicas(Role.DECODE) == 5
    patches = [r for r in kube.requests if r[0] == "PATCH"]
    assert patches[0][1] == "/apis/apps/v1/namespaces/serving/deployments/llm-prefill/scale"


async def test_kubernetes_actuator_surfaces_auth_errors(kube):
    act = KubernetesActuator(kube.url, "serving", {Role.PREFILL: "deployments/llm-prefill"}, token="wrong")
    with pytest.raises(httpx.HTTPStatusError):
        await act.apply(decision())
    assert kube.replicas[("deployments", "llm-prefill")] == 1


async def test_local_process_actuator_starts_and_stops_real_processes():
    # a real child process per worker (a Python HTTP server standing in for an engine command line)
    cmd = f"{sys.executable} -m http.server {{port}} --bind 127.0.0.1"
    started = []
    act = LocalProcessActuator({Role.PREFILL: cmd, Role.DECODE: cmd}, on_started=lambda p: started.append(p))
    try:
        done = await act.apply(decision([Action("start", Role.PREFILL), Action("start", Role.DECODE)]))
        assert len(done) == 2 and len(act.processes) == 2
        p = started[0]
        async with httpx.AsyncClient() as c:
            for _ in range(100):
                try:
                    r = await c.get(p.url + "/")
                    break
                except httpx.TransportError:
                    import asyncio
                    await asyncio.sleep(0.05)
            assert r.status_code == 200
        await act.apply(decision([Action("stop", Role.PREFILL, p.worker_id)]))
        assert p.proc.poll() is not None and p.worker_id not in act.processes
    finally:
        await act.close()
    assert not act.processes


async def test_role_change_actuator_calls_set_role_once_per_move():
    calls = []
    fallback = RecommendOnly()
    act = RoleChangeActuator(set_role=lambda wid, role: calls.append((wid, role)), fallback=fallback)
    # the planner drains w1 towards decode; later, once idle, it emits set_role for it
    await act.apply(decision([Action("drain", Role.PREFILL, "w1", then="decode"), Action("start", Role.DECODE)]))
    assert calls == [("w1", Role.DECODE)]
    assert [a.kind for a in fallback.last.actions] == ["start"]
    await act.apply(decision([Action("set_role", Role.DECODE, "w1")]))
    assert calls == [("w1", Role.DECODE)]  # not twice
    await act.apply(decision([Action("set_role", Role.PREFILL, "w2")]))
    assert calls[-1] == ("w2", Role.PREFILL)


async def test_recommend_only_exports_planner_metrics():
    m = DyadMetrics()
    await RecommendOnly(m).apply(decision([Action("start", Role.DECODE)]))
    text = m.render().decode()
    assert 'dyad_planner_desired_workers{role="decode"} 3.0' in text
    assert 'dyad_planner_predicted{quantity="request_rate"} 3.0' in text
    assert 'dyad_planner_decisions_total{action="start"} 1.0' in text


def test_direct_source_differences_two_gateway_scrapes():
    m = DyadMetrics()
    before = parse_gateway_metrics(m.render().decode(), at=100.0)
    for isl, out, ttft in ((1000, 10, 0.2), (3000, 30, 0.4)):
        m.prompt_tokens.labels("m").observe(isl)
        m.generation_tokens.labels("m").observe(out)
        m.ttft.labels("m").observe(ttft)
        m.e2e.labels("m", "chat").observe(1.0)
    m.routed_prompt_tokens.labels("m").inc(4000)
    m.predicted_cached_tokens.labels("m").inc(1000)
    m.worker_waiting.labels("w0").set(3)
    m.worker_waiting.labels("w1").set(2)
    after = parse_gateway_metrics(m.render().decode(), at=110.0)
    obs = observation_from_scrapes(before, after)
    assert obs.window_s == 10
    assert obs.request_rate == pytest.approx(0.2)
    assert obs.mean_isl == pytest.approx(2000)
    assert obs.mean_osl == pytest.approx(20)
    assert obs.ttft_mean == pytest.approx(0.3)
    assert obs.queue_len == 5
    assert obs.prefix_hit_ratio == pytest.approx(0.25)
