"""Client keys and the admin token with non-ASCII characters, over real HTTP on both data planes.

Found by probing: ``dyad hash-key`` (and the config's plain keys, and ``gateway.admin_token``) hash or compare a
key as UTF-8, but header values arrive decoded as Latin-1 — so a key such as ``clé-secrète``, sent as its UTF-8
bytes, never matched: 401 for its owner, 403 for the admin. Now a bearer token that is valid UTF-8 is read as
UTF-8 (``auth.bearer_token``); bytes that are not UTF-8 are still just a wrong key (401, never a 500).
"""

from __future__ import annotations

import logging

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.auth import hash_key
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from tests.integration.test_gateway import error_of

KEY = "clé-secrète-🔑"
ADMIN = "jeton-d’admin"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def gw():
    engine = SimEngineThread(model="tiny", profile="cpu-tiny", seed=0, kv_events=False).start()
    cfg = load_config({"models": [{"name": "tiny"}],
                       "workers": [{"id": "w0", "url": engine.url, "engine": "sim", "models": ["tiny"]}],
                       "gateway": {"admin_token": ADMIN, "api_keys": ["plain-ключ"]},
                       "auth": {"keys": [{"name": "k1", "sha256": hash_key(KEY)}]},
                       "health": {"interval_s": 30}}, environ={})
    try:
        with GatewayThread(cfg) as g:
            yield g
    finally:
        engine.stop()


def _auth(token: bytes) -> dict[str, bytes]:
    return {"authorization": b"Bearer " + token}


@pytest.mark.parametrize("key", [KEY, "plain-ключ"])
def test_a_non_ascii_client_key_authenticates_on_every_route(gw, key):
    headers = _auth(key.encode())
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.get(f"{gw.url}/v1/models", headers=headers, timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"], r.text


@pytest.mark.parametrize("token", [b"cl\xe9-secr\xe8te", b"\xff\xfe\xfd", KEY.encode()[:-1]])
def test_other_bytes_are_a_wrong_key_not_a_failure(gw, token):
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=_auth(token), timeout=30)
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", r.text


def test_a_non_ascii_admin_token_opens_the_admin_api_and_is_audited_as_itself(gw, caplog):
    with caplog.at_level(logging.INFO, logger="dyad.audit"):
        r = httpx.get(f"{gw.url}/admin/workers", headers=_auth(ADMIN.encode()), timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{gw.url}/admin/workers/w0/drain", headers=_auth(ADMIN.encode()), timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{gw.url}/admin/workers/w0/undrain", headers=_auth(ADMIN.encode()), timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.get(f"{gw.url}/admin/workers", headers=_auth(b"\xff"), timeout=30)
    assert r.status_code == 403 and error_of(r)["code"] == "invalid_admin_token", r.text
    actors = {getattr(rec, "actor", None) for rec in caplog.records if getattr(rec, "audit", False)}
    assert actors == {"admin-token:" + hash_key(ADMIN)[:8]}, actors
