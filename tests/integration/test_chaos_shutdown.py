"""SIGTERM to a real `dyad serve` process under streaming load: intake stops, in-flight streams finish,
requests waiting in the admission queue are served or refused cleanly (503 + Retry-After), never cut.

The gateway is a real process (``python -m orchestrator.cli serve``); its engine is Dyad's simulated
engine (in this process) because the tests need streams that last a few seconds at a known pace —
the drain logic does not depend on the engine kind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from orchestrator.sim.profiles import load_profile
from orchestrator.sim.server import SimEngineThread
from tests.fixtures.dyad_process import dyad_serve


def test_sigterm_drains_in_flight_streams_refuses_new_work_and_exits_zero(tmp_path):
    engine = SimEngineThread(model="m", profile="gpu-like", kv_events=False).start()
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": [{"name": "m"}],
        "workers": [{"id": "sim", "url": engine.url, "engine": "sim", "models": ["m"]}],
        "gateway": {"retry_after_s": 3},
        "resilience": {"shutdown_grace_s": 60},
    }))
    gw = dyad_serve("--config", str(cfg), "--log-level", "info", log_path=tmp_path / "gateway.log")
    try:
        proc, url = gw.start().proc, gw.url

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
        deadline = time.monotonic() + 20  # (the signal's handling is not instant on a loaded machine)
        while (ready := httpx.get(f"{url}/ready", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "SIGTERM not seen in 20 s"
            time.sleep(0.05)
        assert ready.status_code == 503 and "shutting down" in ready.json()["reason"]

        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "late", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "3" and r.json()["error"]["code"] == "shutting_down"
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
        if gw.proc is not None and gw.proc.poll() is None:
            gw.proc.kill()
            gw.proc.wait()
        engine.stop()


# --- requests waiting in the admission queue at SIGTERM ------------------------------------------

# 20 tokens/s on one sequence: a stream's length is set by max_tokens (one slot per worker, so the
# second request waits in the gateway's queue).
PACED = {"base": "zero", "name": "paced", "step_fixed_s": 0.05}


def _serve(tmp_path: Path, engine_url: str, grace_s: float) -> tuple[subprocess.Popen, str]:
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": [{"name": "m"}],
        "workers": [{"id": "sim", "url": engine_url, "engine": "sim", "models": ["m"]}],
        "gateway": {"retry_after_s": 3},
        "limits": {"max_inflight_per_worker": 1, "queue_size": 4, "queue_timeout_s": 60},
        "resilience": {"shutdown_grace_s": grace_s},
    }))
    gw = dyad_serve("--config", str(cfg), "--log-level", "info", log_path=tmp_path / "gateway.log").start()
    return gw.proc, gw.url


def _queue_depth(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dyad_admission_queue_depth{"))


def _wait_queued(url: str) -> None:
    """Until the gateway's admission queue holds a request (the second one)."""
    deadline = time.monotonic() + 10
    while _queue_depth(url) < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.05)


def _stream(url: str, max_tokens: int, out: dict, started: threading.Event | None = None) -> None:
    """One streamed completion; ``out`` gets the status, the data events, any transport error, headers."""
    body = {"model": "m", "prompt": "queued at sigterm", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            out["status"], out["headers"] = r.status_code, dict(r.headers)
            if r.status_code != 200:
                out["body"] = r.read().decode()
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if started is not None:
                        started.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)  # a cut connection
    out["events"] = events


def _complete_stream(out: dict, tokens: int) -> None:
    assert "error" not in out and out["status"] == 200, out
    assert out["events"][-1] == "[DONE]", out["events"][-3:]
    assert json.loads(out["events"][-2])["usage"]["completion_tokens"] == tokens


def _in_flight_and_queued(url: str, first_tokens: int, queued_tokens: int) -> tuple[dict, dict, list[threading.Thread]]:
    """One stream running on the gateway's single slot and one queued behind it; then SIGTERM comes."""
    first: dict = {}
    queued: dict = {}
    running = threading.Event()
    threads = [threading.Thread(target=_stream, args=(url, first_tokens, first, running)),
               threading.Thread(target=_stream, args=(url, queued_tokens, queued))]
    threads[0].start()
    assert running.wait(20)
    threads[1].start()
    _wait_queued(url)
    return first, queued, threads


def test_sigterm_serves_a_request_queued_behind_in_flight_work(tmp_path):
    """Grace to spare: the queued request is dispatched when the slot frees and runs to its end — longer
    than uvicorn's own 5 s shutdown timeout, which would cut it if the drain did not wait for it."""
    engine = SimEngineThread(model="m", profile=load_profile(PACED), kv_events=False).start()
    proc, url = _serve(tmp_path, engine.url, grace_s=60)
    try:
        first, queued, threads = _in_flight_and_queued(url, 30, 130)  # ≈ 1.5 s, then ≈ 6.5 s
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "late", "max_tokens": 2},
                          timeout=10).status_code == 503
        for t in threads:
            t.join(60)
        _complete_stream(first, 30)
        _complete_stream(queued, 130)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        engine.stop()


def test_sigterm_out_of_grace_refuses_queued_requests_with_503_not_a_cut(tmp_path):
    """Grace shorter than the in-flight stream: the request still queued when it runs out gets 503 +
    Retry-After (it can go to another replica); the in-flight one finishes in uvicorn's own window."""
    engine = SimEngineThread(model="m", profile=load_profile(PACED), kv_events=False).start()
    proc, url = _serve(tmp_path, engine.url, grace_s=1)
    try:
        first, queued, threads = _in_flight_and_queued(url, 50, 130)  # ≈ 2.5 s, then ≈ 6.5 s
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        _complete_stream(first, 50)
        assert "error" not in queued and queued["status"] == 503, queued
        assert queued["headers"]["retry-after"] == "3"
        assert json.loads(queued["body"])["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        engine.stop()
