"""SIGTERM to a real `dyad serve` process under streaming load: intake stops, in-flight streams finish.

The gateway is a real process (``python -m orchestrator.cli serve``); its engine is Dyad's simulated
engine (profile gpu-like, in this process) because the test needs streams that last a few seconds
at a known pace — the drain logic does not depend on the engine kind.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from orchestrator.sim.server import SimEngineThread

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_streams_refuses_new_work_and_exits_zero(tmp_path):
    engine = SimEngineThread(model="m", profile="gpu-like", kv_events=False).start()
    port = free_port()
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": [{"name": "m"}],
        "workers": [{"id": "sim", "url": engine.url, "engine": "sim", "models": ["m"]}],
        "gateway": {"retry_after_s": 3},
        "resilience": {"shutdown_grace_s": 60},
    }))
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(cfg), "--port",
                             str(port), "--log-level", "info"], cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()
            time.sleep(0.1)

        results: list[tuple[int, list[str]]] = []
        first_chunk = threading.Barrier(5)

        def stream_one() -> None:
            events: list[str] = []
            body = {"model": "m", "prompt": "drain me", "max_tokens": 150, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not events:
                            first_chunk.wait(10)
                        events.append(line[6:])
            results.append((r.status_code, events))

        threads = [threading.Thread(target=stream_one) for _ in range(4)]
        for t in threads:
            t.start()
        first_chunk.wait(20)  # every stream is under way
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)

        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "late", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "3" and r.json()["error"]["code"] == "shutting_down"
        ready = httpx.get(f"{url}/ready", timeout=5)
        assert ready.status_code == 503 and "shutting down" in ready.json()["reason"]
        assert proc.poll() is None  # still serving the streams

        for t in threads:
            t.join(60)
        assert len(results) == 4
        for status, events in results:
            assert status == 200
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[-1]["usage"]["completion_tokens"] == 150  # nothing cut short
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        engine.stop()
