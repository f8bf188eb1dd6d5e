"""`dyad serve` as a real process: it starts from a config file, answers, and stops on SIGTERM."""

from __future__ import annotations

import signal

import httpx

from tests.fixtures.dyad_process import dyad_serve


def test_dyad_serve_process_answers_and_stops(tmp_path):
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text("models:\n  - name: m\nworkers:\n  - url: http://127.0.0.1:1\n    models: [m]\n"
                   "health:\n  interval_s: 0.2\n  timeout_s: 0.2\n")
    gw = dyad_serve("--config", str(cfg), ready_path="/health")  # /ready stays 503: its worker is down
    try:
        gw.start()
        url = gw.url
        r = httpx.get(url + "/health", timeout=10)
        assert r.json() == {"status": "ok"}
        r = httpx.get(url + "/ready")
        assert r.status_code == 503 and r.json()["models"] == {"m": {"healthy_workers": 0, "usable_workers": 0}}
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        code = gw.stop()
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a clean shutdown
    assert "gateway on http://127.0.0.1:" in gw.log_text()
