"""The live fleet page in headless Chromium, against a live gateway with a simulated fleet.

Chromium's ``--dump-dom`` prints the DOM after the page's scripts ran (``--virtual-time-budget``
lets the page's fetch of ``/ui/api/state`` complete first); ``--screenshot`` saves what a person
would see, to ``artifacts/ui-fleet.png`` (and, under load, ``artifacts/ui-fleet-load.png``, the one
in ``docs/figures/``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.chromium

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"


def _chromium(tmp_path: Path, *mode: str, url: str, size: str = "1400,1000",
             budget_ms: int = 4000) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(exe).exists(), "chromium not installed; run scripts/setup_test_deps.sh"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
           f"--window-size={size}", f"--virtual-time-budget={budget_ms}", *mode, url]
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


def _load(url: str, stop: threading.Event, model: str, worker: int) -> None:
    """Streamed chat requests with a shared prefix until ``stop`` (bounded: at most 300 requests)."""
    system = "You are a careful assistant who answers briefly. " * 12
    with httpx.Client(base_url=url, timeout=30.0) as c:
        for i in range(300):
            if stop.is_set():
                return
            with c.stream("POST", "/v1/chat/completions", json={
                    "model": model, "max_tokens": 24, "stream": True,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"question {worker}-{i}"}]}) as r:
                for _ in r.iter_lines():
                    pass


def test_fleet_page_under_load_shows_traffic_history_and_the_planner(live_fleet, tmp_path):
    from tests.ops.conftest import MIXED_MODEL, MODEL

    stop = threading.Event()
    threads = [threading.Thread(target=_load, args=(live_fleet.url, stop, m, i), daemon=True)
               for i, m in enumerate([MODEL, MODEL, MIXED_MODEL, MIXED_MODEL])]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        points: list = []
        while time.monotonic() < deadline:  # until the history holds several seconds of traffic
            points = httpx.get(f"{live_fleet.url}/ui/api/history", timeout=10).json()["points"]
            busy = [p for p in points if p["req_rate"] and p["ttft_p99"] is not None and p["itl_p99"] is not None]
            if len(busy) >= 12:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the history never filled: {points[-3:]}")
        state = httpx.get(f"{live_fleet.url}/ui/api/state", timeout=10).json()
        assert state["traffic"]["req_rate"] > 0 and state["slo"] == {"ttft_s": 0.5, "itl_s": 0.05}
        assert state["planner"]["recent"], "the planner made decisions during the fixture"

        r = _chromium(tmp_path, "--dump-dom", url=f"{live_fleet.url}/ui", budget_ms=8000)  # a loaded machine
        assert r.returncode == 0, r.stderr[-2000:]
        dom = r.stdout
        assert 'data-loaded="1"' in dom and 'data-history="1"' in dom, dom[-3000:]
        charts = dict(re.findall(r'<div class="chart" data-chart="(\w+)">(.*?)</svg>', dom, re.S))
        assert set(charts) == {"rate", "errors", "ttft", "itl", "hit", "load"}, \
            ("every chart drew an SVG", re.findall(r'data-chart="\w+">.{0,300}', dom))
        for name in ("rate", "ttft", "itl", "load"):
            assert len(re.findall(r'L[\d.]+ [\d.]+', charts[name])) >= 5, (name, charts[name][-600:])  # lines
        for name in ("ttft", "itl"):
            assert 'class="slo"' in charts[name] and "SLO" in charts[name]
        assert "(req/s)" in charts["rate"] and "p50 / p99" in charts["ttft"]
        # integer ticks on the count chart
        ticks = re.findall(r'text-anchor="end">([^<]+)</text>', charts["load"])
        assert ticks and all(t.isdigit() for t in ticks if t != "now"), ticks
        rate = re.search(r'id="t-rate">([^<]+)<', dom).group(1)
        assert rate != "–" and float(rate) > 0
        for tile in ("t-ttft", "t-itl"):  # "43 ms / 1.40 s": p50 / p99 with their units
            assert re.search(rf'id="{tile}">[\d.]+ m?s / [\d.]+ m?s<', dom), re.findall(rf'id="{tile}">[^<]*<', dom)
        assert "Targets: TTFT p99 ≤ " in dom and dom.count('<tr class="plan">') >= 1
        assert re.search(r'<div class="role" data-role="(prefill|decode|both)">', dom)

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "ui-fleet-load.png"
        shot.unlink(missing_ok=True)
        r = _chromium(tmp_path, f"--screenshot={shot}", url=f"{live_fleet.url}/ui", size="1400,1900", budget_ms=8000)
        assert r.returncode == 0, r.stderr[-2000:]
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
