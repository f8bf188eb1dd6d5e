"""The fleet page (``/ui``) fed hostile text and sizes, rendered by headless Chromium (marker ``chromium``).

Worker ids (``POST /admin/workers``), model names (an engine's ``/v1/models``, read by the health probe) and
engine metrics (absurd values, NaN) are text and numbers from outside the gateway. The page inserts
everything with ``textContent`` (orchestrator/ui/static/fleet.html): checked here end to end — HTML in a worker
id or a model name is shown as text, no handler in it runs (it would retitle the page), and the page still
renders all of 300 workers with a worker whose metrics are 1e308 and NaN. The JSON endpoints ignore query
parameters they do not read. The data needs the admin token (``/ui#token=...``; test_surface_unseen_ui_access.py):
without it the page shows the gateway's refusal in its banner.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from tests.integration.socket_engine import SocketEngine
from tests.integration.test_gateway import wait_until

pytestmark = pytest.mark.chromium

ADMIN = "adm"
PWN = "document.title='pwned'"
HOSTILE_ID = f'<img src=x onerror="{PWN}">'
HOSTILE_MODEL = f'"><svg onload="{PWN}">'
QUOTE_ID = f'"onerror={PWN} x="'
METRICS = (b"vllm:num_requests_running 1e308\nvllm:num_requests_waiting NaN\n"
           b"vllm:kv_cache_usage_perc 1e308\nvllm:gpu_cache_usage_perc NaN\n")


class HostileEngine(SocketEngine):
    """A test double (no real engine reports such names or values): healthy, serving one model whose name is
    HTML, with metrics at 1e308 and NaN."""

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if path.startswith("/v1/models"):
            payload = json.dumps({"object": "list", "data": [{"id": HOSTILE_MODEL, "object": "model",
                                                              "max_model_len": 4096}]}).encode()
            kind = b"application/json"
        elif path.startswith("/metrics"):
            payload, kind = METRICS, b"text/plain"
        else:
            payload, kind = b'{"status":"ok"}', b"application/json"
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                     % (kind, len(payload), payload))
        return True


def _chromium(tmp_path: Path, url: str) -> str:
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(exe).exists(), "chromium not installed; run scripts/setup_test_deps.sh"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
           "--window-size=1400,1000", "--virtual-time-budget=6000", "--dump-dom", url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_hostile_names_and_absurd_metrics_render_as_text_on_the_fleet_page(tmp_path):
    sim = SimEngineThread(model="tiny", profile="cpu-tiny", seed=0, kv_events=False).start()
    hostile = HostileEngine().start()
    cfg = load_config({"models": [{"name": "tiny"}],
                       "workers": [{"id": "w0", "url": sim.url, "engine": "sim", "models": ["tiny"]}],
                       "gateway": {"admin_token": ADMIN}, "health": {"interval_s": 0.5},
                       "scrape": {"interval_s": 0.5}}, environ={})
    try:
        with GatewayThread(cfg) as gw, \
                httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30) as admin:
            r = admin.post("/admin/workers", json={"id": HOSTILE_ID, "url": hostile.url, "engine": "vllm"})
            assert r.status_code == 201 and r.json()["models"] == [HOSTILE_MODEL], r.text
            r = admin.post("/admin/workers", json={"id": QUOTE_ID, "url": "http://127.0.0.1:9", "engine": "vllm"})
            assert r.status_code == 201, r.text
            for i in range(300):  # unreachable: each shows as failing, with its error as the cell's title
                r = admin.post("/admin/workers", json={"id": f"many-{i:03d}", "url": f"http://127.0.0.2:{1000 + i}",
                                                       "engine": "vllm", "models": ["tiny"]})
                assert r.status_code == 201, r.text
            worker = gw.runtime.fleet.get(HOSTILE_ID)
            assert wait_until(lambda: worker.load.running > 1e300, timeout=30), worker.load

            state = admin.get("/ui/api/state?workers=%ff&limit=-1&x=<script>")
            assert state.status_code == 200
            assert len(state.json()["workers"]) == 303
            hist = admin.get("/ui/api/history?since=abc&points=1e999")
            assert hist.status_code == 200 and "points" in hist.json()

            dom = _chromium(tmp_path, f"{gw.url}/ui#token={ADMIN}")  # (the admin token, as the page reads it)
            refused = _chromium(tmp_path, f"{gw.url}/ui")
    finally:
        hostile.stop()
        sim.stop()
    assert 'data-loaded="1"' in dom, dom[-2000:]
    assert "pwned" not in re.sub(r"<[^>]*>", "", dom.split("<body", 1)[0]), "a handler ran and retitled the page"
    title = re.search(r"<title>(.*?)</title>", dom, re.S)
    assert title is None or "pwned" not in title.group(1)
    assert "<svg onload" not in dom and "<img" not in dom  # the markup is text, never elements
    assert f'<div class="wid">{html.escape(HOSTILE_ID, quote=False)}</div>' in dom
    assert html.escape(HOSTILE_MODEL, quote=False) in dom
    assert f'<div class="wid">{html.escape(QUOTE_ID, quote=False)}</div>' in dom
    assert len(re.findall(r'<tr class="(?:failing )?worker"', dom)) == 303
    # without the token the page says why it shows nothing (the gateway's own message, as text)
    assert 'data-loaded="1"' not in refused and 'class="banner show"' in refused
    assert "HTTP 401: Missing admin token" in refused, refused[-3000:]
