"""Client keys: hashed storage, constant-time lookup, allow-lists, priority header, `dyad hash-key`."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from starlette.requests import Request

from orchestrator.config import ConfigError, load_config
from orchestrator.errors import Forbidden, InvalidRequest, Unauthorized
from orchestrator.gateway.auth import KeyRing, hash_key


def _request(token: str | None = None) -> Request:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})


def _ring(**limits) -> KeyRing:
    cfg = load_config({"auth": {"keys": [
        {"name": "team-a", "sha256": hash_key("key-a"), "models": ["m1"], "rpm": 5, "priority": "high"},
        {"name": "team-b", "sha256": hash_key("key-b").upper()},  # hex is case-insensitive
    ]}, "gateway": {"api_keys": ["plain-key"]}, "limits": limits}, environ={})
    return KeyRing(cfg.auth, cfg.limits, cfg.gateway.api_keys)


def test_keys_resolve_to_their_identity_and_limits():
    ring = _ring(default_rpm=100, default_tpm=1000)
    a = ring.authenticate(_request("key-a"))
    assert (a.name, a.models, a.rpm, a.tpm, a.priority) == ("team-a", frozenset({"m1"}), 5, 1000, "high")
    b = ring.authenticate(_request("key-b"))
    assert (b.name, b.models, b.rpm) == ("team-b", None, 100)
    assert ring.authenticate(_request("plain-key")).name == "api_keys[0]"


@pytest.mark.parametrize("token, code", [(None, "missing_api_key"), ("key-c", "invalid_api_key"),
                                         ("key-", "invalid_api_key"), (hash_key("key-a"), "invalid_api_key")])
def test_missing_or_wrong_keys_are_refused(token, code):
    with pytest.raises(Unauthorized) as e:
        _ring().authenticate(_request(token))
    assert e.value.code == code and e.value.status == 401


def test_open_gateway_is_anonymous_with_default_limits():
    cfg = load_config({"limits": {"default_rpm": 7}}, environ={})
    ring = KeyRing(cfg.auth, cfg.limits, [])
    who = ring.authenticate(_request())
    assert ring.open and who.name == "anonymous" and who.rpm == 7


def test_model_allow_list_names_the_model():
    a = _ring().identify("key-a")
    a.check_model("m1")
    a.check_model("alias", ("m1",))  # an alias of an allowed model
    with pytest.raises(Forbidden) as e:
        a.check_model("m2")
    assert e.value.status == 403 and e.value.param == "model" and "'m2'" in e.value.message


def test_priority_header_may_lower_but_not_raise():
    ring = _ring()
    high, normal = ring.identify("key-a"), ring.identify("key-b")
    assert high.priority_from(None, "x-dyad-priority") == 0
    assert high.priority_from("low", "x-dyad-priority") == 2
    assert normal.priority_from("HIGH", "x-dyad-priority") == 1  # capped at the key's class
    with pytest.raises(InvalidRequest) as e:
        normal.priority_from("urgent", "x-dyad-priority")
    assert e.value.param == "x-dyad-priority"


def test_config_rejects_bad_digests_and_duplicates():
    with pytest.raises(ConfigError) as e:
        load_config({"auth": {"keys": [{"name": "x", "sha256": "secret-in-clear"}]}}, environ={})
    assert "auth.keys.0.sha256" in str(e.value) and "dyad hash-key" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config({"auth": {"keys": [{"name": "x", "sha256": hash_key("1")},
                                       {"name": "x", "sha256": hash_key("2")}]}}, environ={})
    assert "duplicate key name" in str(e.value)


def test_hash_key_command():
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "hash-key", "--name", "t"], input="s3cret\n",
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hashlib.sha256(b"s3cret").hexdigest()
    assert "sha256: " + out.stdout.strip() in out.stderr  # a config entry to paste
    gen = subprocess.run([sys.executable, "-m", "orchestrator.cli", "hash-key", "--generate"],
                         capture_output=True, text=True, check=True)
    key, digest = gen.stdout.split()
    assert key.startswith("dyad-") and len(key) > 40 and hash_key(key) == digest
    empty = subprocess.run([sys.executable, "-m", "orchestrator.cli", "hash-key"], input="",
                           capture_output=True, text=True)
    assert empty.returncode == 2
