"""The admin API over real HTTP: auth (distinct from client keys), add/list/drain/undrain/remove."""

from __future__ import annotations

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from tests.integration.test_gateway import CHAT, Engine, error_of, wait_until

ADMIN = "admin-secret"
KEY = "client-key"


@pytest.fixture(scope="module")
def engine():
    e = Engine("E").start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def gateway():
    cfg = load_config({"gateway": {"admin_token": ADMIN, "api_keys": [KEY]}, "health": {"interval_s": 0.2}})
    with GatewayThread(cfg) as g:
        yield g


@pytest.fixture
def admin(gateway):
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10) as c:
        yield c


def test_admin_auth(gateway):
    with httpx.Client(base_url=gateway.url) as c:
        r = c.get("/admin/workers")
        assert r.status_code == 401 and error_of(r)["code"] == "missing_admin_token"
        r = c.get("/admin/workers", headers={"authorization": "Bearer nope"})
        assert r.status_code == 403 and error_of(r)["code"] == "invalid_admin_token"
        r = c.get("/admin/workers", headers={"authorization": f"Bearer {KEY}"})  # client key is not admin
        assert r.status_code == 403
        r = c.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 401  # and the admin token is not a client key


def test_admin_disabled_without_token():
    with GatewayThread(load_config({})) as g, httpx.Client(base_url=g.url) as c:
        r = c.get("/admin/workers", headers={"authorization": "Bearer anything"})
        assert r.status_code == 404
        err = error_of(r)
        assert err["code"] == "admin_disabled" and "gateway.admin_token" in err["message"]


def test_add_route_drain_undrain_remove(admin, gateway, engine):
    client = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 404  # nobody serves "m" yet

    r = admin.post("/admin/workers", json={"id": "e1", "url": engine.url, "labels": {"zone": "x"}})
    assert r.status_code == 201, r.text
    view = r.json()
    assert view["state"] == "healthy" and view["models"] == ["m"]  # probed and discovered at once
    assert [w["id"] for w in admin.get("/admin/workers").json()["workers"]] == ["e1"]
    assert client.post("/v1/chat/completions", json=CHAT).json()["engine"] == "E"

    assert admin.post("/admin/workers/e1/drain").json()["state"] == "draining"
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and "draining" in error_of(r)["message"]
    assert admin.post("/admin/workers/e1/undrain").json()["state"] == "healthy"
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200

    r = admin.delete("/admin/workers/e1")
    assert r.status_code == 200 and r.json()["removed"] == "e1"
    assert admin.get("/admin/workers").json()["workers"] == []
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 404
    client.close()


def test_add_unreachable_worker_is_unhealthy_and_health_loop_keeps_it_out(admin, gateway):
    r = admin.post("/admin/workers", json={"id": "gone", "url": "http://127.0.0.1:1", "models": ["z"]})
    assert r.status_code == 201 and r.json()["state"] == "unhealthy" and r.json()["last_error"]
    assert wait_until(lambda: gateway.runtime.fleet.get("gone").consecutive_failures >= 2)
    assert admin.delete("/admin/workers/gone").status_code == 200


def test_admin_errors(admin):
    r = admin.post("/admin/workers", json={"url": "ftp://x"})
    assert r.status_code == 400 and error_of(r)["param"] == "url"
    r = admin.post("/admin/workers", json={"url": "http://127.0.0.1:1", "role": "chef"})
    assert r.status_code == 400 and error_of(r)["param"] == "role"
    r = admin.post("/admin/workers", content=b"{oops")
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    assert admin.post("/admin/workers", json={"id": "dup", "url": "http://127.0.0.1:1"}).status_code == 201
    r = admin.post("/admin/workers", json={"id": "dup", "url": "http://127.0.0.1:2"})
    assert r.status_code == 409 and error_of(r)["code"] == "worker_exists"
    admin.delete("/admin/workers/dup")
    for method, path in [("DELETE", "/admin/workers/nope"), ("POST", "/admin/workers/nope/drain"),
                         ("POST", "/admin/workers/nope/undrain")]:
        r = admin.request(method, path)
        assert r.status_code == 404 and error_of(r)["code"] == "worker_not_found"
