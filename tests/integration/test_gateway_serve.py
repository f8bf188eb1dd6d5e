"""`dyad serve` as a real process: it starts from a config file, answers, and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from orchestrator.ports import free_port


def test_dyad_serve_process_answers_and_stops(tmp_path):
    port = free_port()
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text("models:\n  - name: m\nworkers:\n  - url: http://127.0.0.1:1\n    models: [m]\n"
                   "health:\n  interval_s: 0.2\n  timeout_s: 0.2\n")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(cfg),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "dyad serve did not come up"
                time.sleep(0.1)
        assert r.json() == {"status": "ok"}
        r = httpx.get(url + "/ready")
        assert r.status_code == 503 and r.json()["models"] == {"m": {"healthy_workers": 0, "usable_workers": 0}}
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a clean shutdown
    assert b"gateway on http://127.0.0.1:" in proc.stderr.read()
