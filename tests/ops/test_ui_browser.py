"""The live fleet page in headless Chromium, against a live gateway with a simulated fleet.

Chromium's ``--dump-dom`` prints the DOM after the page's scripts ran (``--virtual-time-budget``
lets the page's fetch of ``/ui/api/state`` complete first); ``--screenshot`` saves what a person
would see, to ``artifacts/ui-fleet.png``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.chromium

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"


def _chromium(tmp_path: Path, *mode: str, url: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(exe).exists(), "chromium not installed; run scripts/setup_test_deps.sh"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
           "--window-size=1400,1000", "--virtual-time-budget=4000", *mode, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_fleet_page_shows_every_worker_and_recent_decisions(live_fleet, tmp_path):
    state = httpx.get(f"{live_fleet.url}/ui/api/state", timeout=10).json()
    worker_ids = {w["id"] for w in state["workers"]}
    assert worker_ids == set(live_fleet.engines)
    assert state["decisions"], "the fixture's traffic produced routing decisions"

    r = _chromium(tmp_path, "--dump-dom", url=f"{live_fleet.url}/ui")
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    assert 'data-loaded="1"' in dom, "the page never rendered data from /ui/api/state"
    assert set(re.findall(r'data-worker-id="([^"]+)"', dom)) == worker_ids
    for wid in worker_ids:  # the id is visible text, not only an attribute
        assert f'<div class="wid">{wid}</div>' in dom
    for role in ("prefill", "decode", "both"):
        assert f'class="badge {role}"' in dom
    assert dom.count('<tr class="decision">') == len(state["decisions"])
    assert "Cannot reach the gateway" not in dom or 'class="banner show"' not in dom

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "ui-fleet.png"
    shot.unlink(missing_ok=True)
    r = _chromium(tmp_path, f"--screenshot={shot}", url=f"{live_fleet.url}/ui")
    assert r.returncode == 0, r.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a real, non-blank render
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 1000)


def test_fleet_page_reports_an_unreachable_gateway(live_fleet, tmp_path):
    # The page itself comes from the gateway; its state URL is then pointed at a closed port by
    # serving a copy of the page from a file with the fetch target rewritten.
    page = httpx.get(f"{live_fleet.url}/ui", timeout=10).text
    assert 'location.pathname.replace(/\\/+$/, "") + "/api/state"' in page
    broken = page.replace('location.pathname.replace(/\\/+$/, "") + "/api/state"',
                          '"http://127.0.0.1:9/ui/api/state"')
    html = tmp_path / "fleet.html"
    html.write_text(broken)
    r = _chromium(tmp_path, "--dump-dom", url=html.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'class="banner show"' in r.stdout and "Cannot reach the gateway" in r.stdout
    assert 'data-loaded="1"' not in r.stdout
