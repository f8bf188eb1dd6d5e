"""Dependency outages through a running gateway: nothing crashes, decisions hold, service resumes.

- Prometheus (real, ``tests/fixtures/prometheus.py``) killed while the SLO planner reads from it:
  the planner keeps its last decision (no new one is taken on missing data, the error shows on
  ``/admin/planner``), the gateway keeps serving, and once Prometheus is back the planner plans
  again, never on the empty answers a just-restarted Prometheus gives for its rate window.
- Redis (real, ``tests/fixtures/redis.py``) killed under rate-limited traffic: the limiter decides
  on local buckets (limits still enforced, no error, no hang), and uses Redis again once it is back.

The engines are Dyad's simulated engines: what is under test is the gateway's handling of its own
dependencies, not engine behaviour.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from orchestrator.config import load_config
from orchestrator.gateway.auth import hash_key
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from tests.fixtures.prometheus import prometheus_server  # noqa: F401
from tests.fixtures.redis import redis_server, unique_prefix  # noqa: F401

MODEL = "m"
ADMIN = {"authorization": "Bearer outage-admin"}


@pytest.fixture(scope="module")
def engines():
    es = [SimEngineThread(model=MODEL, profile="zero", seed=i, kv_events=False).start() for i in range(2)]
    yield es
    for e in es:
        e.stop()


def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Traffic:
    """Steady background requests (``rate`` per second) until stopped; counts statuses and errors."""

    def __init__(self, url: str, rate: float) -> None:
        self.url, self.rate = url, rate
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while not self._stop.wait(1 / self.rate):
                try:
                    r = c.post("/v1/completions", json={"model": MODEL, "prompt": "steady", "max_tokens": 4})
                    self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


@pytest.mark.prometheus
@pytest.mark.timeout(120)
def test_planner_holds_its_last_decision_while_prometheus_is_down_and_resumes_after(engines, prometheus_server):  # noqa: F811
    config = load_config({
        "models": [{"name": MODEL}],
        "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "models": [MODEL]} for i, e in enumerate(engines)],
        "gateway": {"admin_token": ADMIN["authorization"].split()[1]},
        "health": {"interval_s": 5},
        "planner": {"enabled": True, "interval_s": 0.5, "prometheus_url": prometheus_server.url,
                    "prometheus_window_s": 3, "actuator": "recommend",
                    # this traffic is not streamed, so no TTFT is measured at the gateway: without this the
                    # planner holds on "latency_missing" (tested in tests/unit/test_planner_inputs.py)
                    "correct_from_latency": False},
    }, environ={})
    gw = GatewayThread(config).start()
    prom_up = True
    try:
        prometheus_server.set_targets([f"{gw.url}/metrics"])

        def status() -> dict:
            return httpx.get(f"{gw.url}/admin/planner", headers=ADMIN, timeout=5).json()

        def planned(entry: dict) -> bool:  # a plan on measured traffic (not a hold)
            return (entry["observation"] or {}).get("request_rate", 0) > 0 and \
                not any(r.startswith("held") for r in entry.get("reasons") or ())

        with Traffic(gw.url, rate=8) as traffic:
            _until(lambda: sum(planned(h) for h in status()["history"]) >= 3 and status()["held"] is None,
                   30, "the planner to plan on Prometheus data")

            prometheus_server.kill()
            prom_up = False
            time.sleep(0.6)  # an interval in flight when it died ends now
            before = status()
            time.sleep(5)  # ten intervals, longer than the rate window: no pre-outage sample is left in it
            during = status()
            # the planner holds the current sizes and says why (issue 14: inputs or no action)
            assert during["held"] and during["held"]["reason"] == "source_unavailable", during["held"]
            assert "Connect" in during["held"]["detail"], during["held"]
            last_planned = [h for h in before["history"] if planned(h)][-1]
            outage = during["history"][len(before["history"]):]
            assert len(outage) >= 5  # it kept looking every interval...
            for h in outage:  # ...and each look held: no plan, the sizes it had, no action
                assert not planned(h) and h["actions"] == [] and h["desired"] == last_planned["current"], h
            held = len(during["history"])

            prometheus_server.revive()
            prom_up = True
            _until(lambda: sum(planned(h) for h in status()["history"][held:]) >= 3 and status()["held"] is None,
                   30, "the planner to plan again")
            after = status()["history"][held:]
            # a just-restarted Prometheus answers its rate window empty: the planner holds until it has data,
            # it never plans on it as zero load (every entry is a plan on real traffic, or a hold)
            assert all(planned(h) or h["observation"] is None or h["actions"] == [] for h in after), \
                [h["observation"] for h in after]
            assert not [h for h in after if h["observation"] and h["observation"].get("request_rate") == 0]
        assert traffic.errors == [] and set(traffic.statuses) == {200}, (traffic.statuses, traffic.errors[:3])
        assert sum(traffic.statuses.values()) > 40
    finally:
        if not prom_up:
            prometheus_server.revive()  # the session's server is shared
        gw.stop()


@pytest.mark.redis
def test_rate_limits_fall_back_to_local_buckets_while_redis_is_down(engines, redis_server):  # noqa: F811
    prefix = unique_prefix("rl-outage")
    config = load_config({
        "models": [{"name": MODEL}],
        "workers": [{"id": "w0", "url": engines[0].url, "engine": "sim", "models": [MODEL]}],
        "auth": {"keys": [{"name": "team", "sha256": hash_key("team-key"), "rpm": 4}]},
        "limits": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": prefix},
        "health": {"interval_s": 5},
    }, environ={})
    store = redis.Redis.from_url(redis_server.url)

    def ask() -> httpx.Response:
        return httpx.post(f"{gw.url}/v1/completions", headers={"authorization": "Bearer team-key"}, timeout=5,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2})

    def fallbacks() -> float:
        for line in gw.runtime.metrics.render().decode().splitlines():
            if line.startswith("dyad_rate_limit_local_fallbacks_total "):
                return float(line.split()[1])
        return 0.0

    gw = GatewayThread(config).start()
    try:
        assert [ask().status_code for _ in range(2)] == [200, 200]
        assert store.keys(f"{prefix}:rl:*")  # the bucket is shared through Redis
        with redis_server.stopped():
            # Redis is gone: every request is still answered at once (timeout=5 would catch a hang), from
            # this process's own bucket — full at first (4 per minute), so the limit holds on its own
            answers = [ask() for _ in range(5)]
            assert [r.status_code for r in answers] == [200, 200, 200, 200, 429], [r.text for r in answers]
            assert answers[-1].json()["error"]["code"] == "rpm_exceeded" and answers[-1].headers["retry-after"]
            assert fallbacks() == 5
        # Redis is back (empty): once the limiter has a connection open again (opened in the background, off any
        # request's path: a request meanwhile decides locally, here from the spent local bucket: 429), decisions
        # are shared again (an empty shared bucket: 200)
        deadline = time.monotonic() + 10
        while True:
            r = ask()
            if r.status_code == 200:
                break
            assert r.status_code == 429 and time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert store.keys(f"{prefix}:rl:*"), r.text
        settled = fallbacks()
        assert [ask().status_code for _ in range(3)] == [200, 200, 200]
        assert fallbacks() == settled  # every decision since through Redis
    finally:
        gw.stop()
        store.close()
