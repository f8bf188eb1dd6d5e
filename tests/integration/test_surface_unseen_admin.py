"""The admin API with worker ids no other test uses, over real HTTP (both data planes: the native plane hands
``/admin`` to the Python gateway).

Found by probing: ``POST /admin/workers`` took any id — ``a/b`` (a worker no admin route could name again:
``/admin/workers/a/b/drain`` is another path; it could never be drained or removed), ``x\\n2026-... forged``
(written raw into the health loop's text log lines), 60 KB ones. And a workers-file entry without an id gets
its URL as id (``http://host:port``), which no admin route could name either. Now an id given to the admin API
is 1 to 128 printable characters without ``/`` (400 naming ``id``), and the admin routes take an id with
slashes (a URL id, percent-encoded or not).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from tests.integration.test_gateway import error_of, wait_until

MODEL = "tiny"
ADMIN = "adm"


@pytest.fixture(scope="module")
def engines():
    engs = [SimEngineThread(model=MODEL, profile="cpu-tiny", seed=i, kv_events=False).start() for i in range(2)]
    try:
        yield engs
    finally:
        for e in engs:
            e.stop()


@pytest.fixture(scope="module")
def gw(engines, tmp_path_factory):
    path = tmp_path_factory.mktemp("workers") / "workers.yaml"
    path.write_text(f"workers:\n  - url: {engines[1].url}\n    engine: sim\n    models: [{MODEL}]\n")
    cfg = load_config({
        "models": [{"name": MODEL}],
        "gateway": {"admin_token": ADMIN},
        "health": {"interval_s": 30},
        "discovery": {"source": "file", "file": {"path": str(path), "interval_s": 0.2}},
    }, environ={})
    with GatewayThread(cfg) as g:
        yield g


@pytest.fixture
def admin(gw):
    with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30) as c:
        yield c


@pytest.mark.parametrize("wid", ["a/b", "x\n2026-01-01 forged line", "esc\x1b[31m", "tab\there", "x" * 129])
def test_an_admin_worker_id_that_cannot_be_named_or_logged_is_refused(gw, admin, engines, wid):
    before = sorted(w.id for w in gw.runtime.fleet.workers())
    r = admin.post("/admin/workers", json={"id": wid, "url": engines[0].url, "engine": "sim"})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "id" and err["code"] == "invalid_worker", err
    assert sorted(w.id for w in gw.runtime.fleet.workers()) == before


@pytest.mark.parametrize("wid", ["é中😀", "<img src=x onerror=alert(1)>", "\"onerror=x", "a b%2F?#"])
def test_an_unusual_but_printable_id_is_added_and_named_by_every_route(gw, admin, engines, wid):
    r = admin.post("/admin/workers", json={"id": wid, "url": engines[0].url, "engine": "sim"})
    assert r.status_code == 201, r.text
    try:
        path = "/admin/workers/" + quote(wid, safe="")
        for action, state in (("drain", "draining"), ("undrain", "healthy")):
            r = admin.post(f"{path}/{action}")
            assert r.status_code == 200 and r.json()["id"] == wid and r.json()["state"] == state, r.text
    finally:
        r = admin.delete("/admin/workers/" + quote(wid, safe=""))
    assert r.status_code == 200 and r.json()["removed"] == wid, r.text
    assert gw.runtime.fleet.get(wid) is None


def test_a_workers_file_entry_without_an_id_can_be_drained_and_undrained(gw, admin, engines):
    url = engines[1].url
    assert wait_until(lambda: gw.runtime.fleet.get(url) is not None, timeout=10)
    for path in ("/admin/workers/" + quote(url, safe=""), f"/admin/workers/{url}"):
        r = admin.post(f"{path}/drain")
        assert r.status_code == 200 and r.json()["id"] == url and r.json()["state"] == "draining", r.text
        r = admin.post(f"{path}/undrain")
        assert r.status_code == 200 and r.json()["state"] != "draining", r.text
    assert admin.post("/admin/workers/nobody/drain").status_code == 404
    r = admin.delete("/admin/workers/" + quote(url, safe=""))
    assert r.status_code == 200 and r.json()["removed"] == url, r.text


def test_concurrent_adds_of_one_worker_register_it_once(gw, engines):
    url = engines[0].url.replace("127.0.0.1", "localhost")

    def add(i):
        with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30) as c:
            return c.post("/admin/workers", json={"id": "twin" if i % 2 else f"twin-{i}", "url": url, "engine": "sim"})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(add, range(8)))
    try:
        assert sorted(r.status_code for r in answers) == [201] + [409] * 7, [r.text for r in answers]
        assert [w.id for w in gw.runtime.fleet.workers() if w.url == url] == \
            [next(r.json()["id"] for r in answers if r.status_code == 201)]
    finally:
        for w in list(gw.runtime.fleet.workers()):
            if w.url == url:
                httpx.delete(f"{gw.url}/admin/workers/{quote(w.id, safe='')}",
                             headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)


@pytest.mark.parametrize("chunked", [False, True])
def test_an_oversized_admin_body_is_a_413_that_does_not_name_the_client_body_setting(gw, admin, chunked):
    body = b'{"url": "http://127.0.0.1:9", "labels": {"k": "' + b"x" * 200_000 + b'"}}'
    content = iter([body[:1000], body[1000:]]) if chunked else body
    r = admin.post("/admin/workers", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    err = error_of(r)
    assert err["code"] == "payload_too_large" and "65536" in err["message"], err
    # (gateway.max_body_bytes bounds client requests; the admin API has its own, smaller limit)
    assert "gateway.max_body_bytes" not in err["message"], err
