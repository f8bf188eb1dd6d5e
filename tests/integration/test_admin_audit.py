"""Every admin action leaves one audit line (who, what, result), refused ones included, over real HTTP
against a gateway in front of simulated engines (the simulator stands in for vLLM: two engines and a
third one for the added worker would not fit beside each other on this machine as real vLLM)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from orchestrator.telemetry.logging import configure_logging

ADMIN = "audit-admin-token-do-not-log"
FINGERPRINT = "admin-token:" + hashlib.sha256(ADMIN.encode()).hexdigest()[:8]


@pytest.fixture
def log_lines():
    buf = io.StringIO()
    root = logging.getLogger()
    old_level, old_handlers = root.level, list(root.handlers)
    handler = configure_logging(json=True, level="WARNING", stream=buf)  # `dyad serve`'s default level
    yield buf
    root.removeHandler(handler)
    root.setLevel(old_level)
    assert root.handlers == old_handlers


def audit_lines(buf: io.StringIO) -> list[dict]:
    return [line for line in map(json.loads, buf.getvalue().splitlines()) if line.get("audit")]


@pytest.fixture(scope="module")
def fleet():
    engines = [SimEngineThread(model="m", profile="cpu-tiny", kv_events=False, seed=i).start() for i in range(3)]
    config = load_config({
        "workers": [{"id": "a", "url": engines[0].url, "role": "decode", "models": ["m"]},
                    {"id": "b", "url": engines[1].url, "role": "decode", "models": ["m"]}],
        "gateway": {"admin_token": ADMIN}, "health": {"interval_s": 0.2},
    }, environ={})
    with GatewayThread(config) as gw:
        yield gw, engines
    for e in engines:
        e.stop()


def test_each_admin_action_is_one_audit_line_with_who_what_result(fleet, log_lines):
    gw, engines = fleet
    admin = httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    anon = httpx.Client(base_url=gw.url, timeout=10)

    assert anon.post("/admin/workers/a/drain").status_code == 401
    assert anon.post("/admin/workers/a/drain", headers={"authorization": "Bearer guess"}).status_code == 403
    assert admin.get("/admin/workers").status_code == 200  # reading is not an action: no line
    assert admin.post("/admin/workers", json={"id": "c", "url": engines[2].url, "models": ["m2"]}).status_code == 201
    r = admin.post("/admin/workers", json={"id": "c", "url": engines[2].url}, headers={"x-forwarded-for": "203.0.113.9"})
    assert r.status_code == 409
    assert admin.post("/admin/workers/c/drain").status_code == 200
    assert admin.post("/admin/workers/c/undrain").status_code == 200
    assert admin.post("/admin/workers/a/role", json={"role": "prefill"}).status_code in (200, 202)
    assert admin.post("/admin/workers/b/role", json={"role": "prefill"}).status_code == 409  # no decoder left
    assert admin.delete("/admin/workers/c").status_code == 200
    assert admin.delete("/admin/workers/nope").status_code == 404

    deadline = time.monotonic() + 10  # the role change drains, then a second line says it was applied
    while not any(line["action"] == "worker.role_change.applied" for line in audit_lines(log_lines)):
        assert time.monotonic() < deadline, audit_lines(log_lines)
        time.sleep(0.05)
    lines = audit_lines(log_lines)
    applied = [line for line in lines if line["action"] == "worker.role_change.applied"]
    lines = [line for line in lines if line["action"] != "worker.role_change.applied"]
    summary = [(line["action"], line.get("target"), line["result"], line.get("status"), line["actor"])
               for line in lines]
    assert summary == [
        ("worker.drain", "a", "denied", 401, "no-token"),
        ("worker.drain", "a", "denied", 403, "invalid-token"),
        ("worker.add", "c", "ok", 201, FINGERPRINT),
        ("worker.add", "c", "error", 409, FINGERPRINT),
        ("worker.drain", "c", "ok", 200, FINGERPRINT),
        ("worker.undrain", "c", "ok", 200, FINGERPRINT),
        ("worker.role_change", "a", lines[6]["result"], lines[6]["status"], FINGERPRINT),
        ("worker.role_change", "b", "error", 409, FINGERPRINT),
        ("worker.remove", "c", "ok", 200, FINGERPRINT),
        ("worker.remove", "nope", "error", 404, FINGERPRINT),
    ]
    assert lines[6]["result"] in ("ok", "accepted") and lines[6]["status"] in (200, 202)
    by = {(line["action"], line["target"], line["result"]): line for line in lines}
    assert by[("worker.add", "c", "ok")]["url"] == engines[2].url
    assert by[("worker.add", "c", "error")]["code"] == "worker_exists"
    # from a trusted proxy (uvicorn trusts loopback by default) the forwarded address is the client
    assert by[("worker.add", "c", "error")]["forwarded_for"] == "203.0.113.9"
    assert by[("worker.add", "c", "error")]["client"] == "203.0.113.9"
    assert by[("worker.drain", "c", "ok")]["state"] == "draining"
    assert by[("worker.role_change", "b", "error")]["role_to"] == "prefill"
    assert [(a["target"], a["result"], a["role_from"], a["role_to"], a["actor"]) for a in applied] == [
        ("a", "ok", "decode", "prefill", FINGERPRINT)]
    lines += applied
    assert by[("worker.remove", "nope", "error")]["code"] == "worker_not_found"
    for line in lines:
        assert line["logger"] == "dyad.audit" and line["level"] == "info"
        assert line["client"] == "127.0.0.1" or line.get("forwarded_for") == line["client"]
    assert ADMIN not in log_lines.getvalue() and "guess" not in log_lines.getvalue()  # never the token


def test_a_worker_id_cannot_forge_a_text_log_line(fleet):
    gw, _ = fleet
    buf = io.StringIO()
    root = logging.getLogger()
    old_level, old_handlers = root.level, list(root.handlers)
    handler = configure_logging(json=False, level="INFO", stream=buf)
    try:
        r = httpx.post(f"{gw.url}/admin/workers/x%0A2026-01-01%20forged%20line/drain",
                       headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
        assert r.status_code == 404
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert root.handlers == old_handlers
    audit = [line for line in buf.getvalue().splitlines() if "dyad.audit" in line]
    assert len(audit) == 1 and "x\\n2026-01-01 forged line" in audit[0], buf.getvalue()
    assert not any(line.startswith("2026-01-01 forged") for line in buf.getvalue().splitlines())
