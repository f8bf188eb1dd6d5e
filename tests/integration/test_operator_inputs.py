"""A live gateway whose workers file goes bad: it keeps serving with the last good list, says why on
``GET /admin/discovery`` (and stops saying it once the file is good again), picks up the next good
version; a worker that leaves takes its series with it from ``/metrics``."""

from __future__ import annotations

import json
import os

import httpx

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from tests.integration.test_file_discovery import until

MODEL = "sim-model"
ADMIN = "admin-secret"


def replace_file(path, text: str) -> None:
    """As an operator should: write a temporary file, then rename it over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_bad_workers_file_is_reported_on_admin_discovery_and_the_last_good_list_serves(tmp_path):
    engines = [SimEngineThread(model=MODEL, profile="gpu-like", seed=i, kv_events=False).start() for i in range(2)]
    path = tmp_path / "workers.json"
    good = [{"id": "f0", "url": engines[0].url, "engine": "sim", "models": [MODEL]}]
    replace_file(path, json.dumps(good))
    gw = None
    try:
        gw = GatewayThread(load_config({
            "models": [{"name": MODEL}],
            "gateway": {"admin_token": ADMIN},
            "discovery": {"source": "file", "file": {"path": str(path), "interval_s": 0.1}},
            "health": {"interval_s": 0.2}, "scrape": {"interval_s": 0.1, "timeout_s": 0.5},
        }, environ={})).start()
        fleet = gw.runtime.fleet
        until(lambda: fleet.get("f0") is not None and fleet.get("f0").state.value == "healthy", what="f0 healthy")
        admin = httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
        chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

        status = admin.get("/admin/discovery")
        assert status.status_code == 200, status.text
        assert status.json()["source"] == "file" and status.json()["last_error"] is None
        assert status.json()["workers"] == ["f0"]
        assert httpx.get(f"{gw.url}/admin/discovery").status_code == 401  # behind the admin token

        # a typo in the top-level key: it read as "no workers" and withdrew f0
        replace_file(path, json.dumps({"worker": good}))
        until(lambda: admin.get("/admin/discovery").json()["last_error"] is not None, what="error reported")
        assert "worker: unknown key" in admin.get("/admin/discovery").json()["last_error"]
        assert fleet.get("f0").state.value == "healthy"
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200

        # the next good version is picked up, and the error is gone
        good.append({"id": "f1", "url": engines[1].url, "engine": "sim", "models": [MODEL]})
        replace_file(path, json.dumps(good))
        until(lambda: fleet.get("f1") is not None and fleet.get("f1").state.value == "healthy", what="f1 healthy")
        assert admin.get("/admin/discovery").json()["last_error"] is None

        # a worker collects per-worker counters (errors, breaker, KV events: here put there directly, as
        # the request path and the scrape loop would); gone from the file, it is removed when idle, and
        # its series leave the scrape with it (they stayed for the life of the process)
        replace_file(path, json.dumps([*good, {"id": "gone", "url": "http://127.0.0.1:9", "engine": "sim",
                                                "models": [MODEL]}]))
        until(lambda: fleet.get("gone") is not None, what="'gone' added")
        m = gw.runtime.metrics
        m.upstream_errors.labels("gone", "connect").inc()
        m.scrape_errors.labels("gone").inc()
        m.breaker_transitions.labels("gone", "open").inc()
        m.kv_event_lag.labels("gone").set(1.0)
        assert 'dyad_upstream_errors_total{kind="connect",worker="gone"}' in httpx.get(f"{gw.url}/metrics").text
        replace_file(path, json.dumps(good))
        until(lambda: fleet.get("gone") is None, what="'gone' removed")
        text = httpx.get(f"{gw.url}/metrics").text
        assert 'worker="gone"' not in text, [line for line in text.splitlines() if 'worker="gone"' in line]
        assert 'worker="f0"' in text  # the others stay
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
