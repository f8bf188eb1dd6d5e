"""Who may read the fleet page's data (``/ui/api/state``, ``/ui/api/history``; orchestrator/ui/routes.py).

Found by probing: the data — the last 50 routing decisions with every client's request ids and models, the
workers' internal URLs and engine errors — was served to anyone who could reach the gateway, also on a
gateway whose ``/v1`` routes need a client key and whose admin API needs the admin token. Now with
``gateway.admin_token`` set it needs that token (401/403 as the admin API); with client keys but no admin
token it is refused (404 naming the setting); an open gateway serves it as before. The page itself (no data)
is served to anyone.
"""

from __future__ import annotations

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from tests.integration.test_gateway import error_of

ADMIN = "adm"
KEY = "client-key"


@pytest.mark.parametrize("path", ["/ui/api/state", "/ui/api/history"])
def test_with_an_admin_token_the_fleet_data_needs_it(path):
    with GatewayThread(load_config({"gateway": {"admin_token": ADMIN, "api_keys": [KEY]}}, environ={})) as gw:
        r = httpx.get(f"{gw.url}{path}", timeout=10)
        assert r.status_code == 401 and error_of(r)["code"] == "missing_admin_token", r.text
        for wrong in ("nope", KEY):  # (a client key is not the admin token)
            r = httpx.get(f"{gw.url}{path}", headers={"authorization": f"Bearer {wrong}"}, timeout=10)
            assert r.status_code == 403 and error_of(r)["code"] == "invalid_admin_token", r.text
        r = httpx.get(f"{gw.url}{path}", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
        assert r.status_code == 200 and isinstance(r.json(), dict), r.text
        r = httpx.get(f"{gw.url}/ui", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")


def test_with_client_keys_and_no_admin_token_the_fleet_data_is_refused():
    with GatewayThread(load_config({"gateway": {"api_keys": [KEY]}}, environ={})) as gw:
        for headers in ({}, {"authorization": f"Bearer {KEY}"}):
            r = httpx.get(f"{gw.url}/ui/api/state", headers=headers, timeout=10)
            assert r.status_code == 404, r.text
            err = error_of(r)
            assert err["code"] == "ui_needs_admin_token" and "gateway.admin_token" in err["message"], err


def test_an_open_gateway_serves_the_fleet_data_to_anyone():
    with GatewayThread(load_config({}, environ={})) as gw:
        for path in ("/ui/api/state", "/ui/api/history"):
            assert httpx.get(f"{gw.url}{path}", timeout=10).status_code == 200
