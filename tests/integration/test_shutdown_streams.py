"""SIGTERM to a real ``dyad serve`` process with streams of every kind in flight: each one either
finishes or ends with its protocol's error ending, none hangs, and the process exits 0.

tests/integration/test_chaos_shutdown.py covers completions streams that fit in the drain's grace and
the admission queue; test_stream_endings.py one completions stream cut at exit. Here, at once: chat,
completions and Responses streams longer than the grace (cut when uvicorn's own window ends), a short
stream that finishes inside the grace, a stream whose engine has gone silent (the idle timer would only
end it after 60 s), chat and Responses, and a split (P/D) stream; then the same with a second SIGTERM
that skips the wait. (A replayed Responses stream, ``GET /v1/responses/{id}?stream=true``, is not here:
the simulator replays a stored stream in one write, so none is in flight at SIGTERM.)

The engines are Dyad's simulated engines (``dyad sim-engine`` in this process): streams at a known pace
(20 tokens/s) and an engine that goes silent on cue, which a real vLLM cannot do on demand.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.sim.profiles import load_profile
from orchestrator.sim.server import SimEngineThread
from tests.fixtures.dyad_process import dyad_serve
from tests.integration.test_stream_endings import (
    CHAT,
    COMPLETIONS,
    PACED,
    PD_PROMPT,
    RESPONSES,
    body_for,
    complete,
    error_ending,
    set_faults,
    sse_events,
)

UVICORN_WINDOW_S = 5  # serve.uvicorn_config: timeout_graceful_shutdown


@pytest.fixture
def fleet():
    """Three engines, one model each: ``m`` paced (20 tokens/s), ``h`` goes silent after 2 tokens, ``pd``
    a prefill + decode pair (the decode side paced)."""
    paced = load_profile(PACED)
    engines = {"m": SimEngineThread(model="m", profile=paced, kv_events=False).start(),
               "h": SimEngineThread(model="h", profile="cpu-tiny", kv_events=False).start(),
               "pd-p": SimEngineThread(model="pd", profile="cpu-tiny", kv_events=False).start(),
               "pd-d": SimEngineThread(model="pd", profile=paced, kv_events=False).start()}
    set_faults(engines["h"], stream_fault="hang", stream_fault_after=2, responses_fault="hang",
               responses_fault_after=4)
    try:
        yield engines
    finally:
        for e in engines.values():
            e.stop()


def serve(tmp_path: Path, engines: dict[str, SimEngineThread], grace_s: float):
    cfg = tmp_path / "dyad.yaml"
    workers = [{"id": "m", "url": engines["m"].url, "engine": "sim", "models": ["m"]},
               {"id": "h", "url": engines["h"].url, "engine": "sim", "models": ["h"]},
               {"id": "pd-p", "url": engines["pd-p"].url, "engine": "sim", "models": ["pd"], "role": "prefill"},
               {"id": "pd-d", "url": engines["pd-d"].url, "engine": "sim", "models": ["pd"], "role": "decode"}]
    cfg.write_text(yaml.safe_dump({
        "models": [{"name": "m"}, {"name": "h"}, {"name": "pd", "block_size": 32}],
        "workers": workers,
        "disagg": {"min_prefill_tokens": 32},
        "resilience": {"shutdown_grace_s": grace_s, "stream_idle_timeout_s": 60},
    }))
    return dyad_serve("--config", str(cfg), log_path=tmp_path / "gateway.log").start()


def streams() -> dict[str, tuple[str, dict[str, Any]]]:
    """name → (endpoint, body) of every stream in flight at SIGTERM."""
    def on(model: str, endpoint: str, tokens: int) -> dict[str, Any]:
        return {**body_for(endpoint, tokens), "model": model}

    return {"chat": (CHAT, on("m", CHAT, 400)),  # ≈ 20 s: longer than the grace and uvicorn's window
            "completions": (COMPLETIONS, on("m", COMPLETIONS, 400)),
            "responses": (RESPONSES, on("m", RESPONSES, 400)),
            "short": (CHAT, on("m", CHAT, 20)),  # ≈ 1 s: inside the grace
            "silent": (CHAT, on("h", CHAT, 50)),  # its engine says nothing after 2 tokens
            "silent-responses": (RESPONSES, on("h", RESPONSES, 50)),
            "split": (COMPLETIONS, {**on("pd", COMPLETIONS, 400), "prompt": PD_PROMPT})}


def run_all(url: str) -> tuple[dict[str, dict[str, Any]], list[threading.Thread], threading.Barrier]:
    todo = streams()
    out: dict[str, dict[str, Any]] = {name: {} for name in todo}
    under_way = threading.Barrier(len(todo) + 1)

    def one(name: str, endpoint: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url + endpoint, json=body, timeout=httpx.Timeout(10, read=90)) as r:
                out[name]["status"] = r.status_code
                raw = b""
                for chunk in r.iter_raw():
                    if not raw:
                        under_way.wait(30)
                    raw += chunk
            out[name]["events"] = sse_events(raw.decode())
        except (httpx.HTTPError, threading.BrokenBarrierError) as e:
            out[name]["error"] = repr(e)

    threads = [threading.Thread(target=one, args=(n, e, b), daemon=True) for n, (e, b) in todo.items()]
    for t in threads:
        t.start()
    return out, threads, under_way


def check_endings(out: dict[str, dict[str, Any]]) -> None:
    for name, got in out.items():
        assert "error" not in got and got.get("status") == 200, (name, got)
    complete(CHAT, out["short"]["events"], 20)
    for name in ("chat", "completions", "responses", "silent", "silent-responses", "split"):
        endpoint = streams()[name][0]
        err = error_ending(endpoint, out[name]["events"], "shutting down")
        assert err["code"] == "gateway_cancelled", (name, err)


@pytest.mark.parametrize("signals", [1, 2], ids=["sigterm", "sigterm-twice"])
def test_sigterm_with_every_kind_of_stream_in_flight_ends_each_one_honestly(fleet, tmp_path, signals):
    grace = 3.0
    gw = serve(tmp_path, fleet, grace)
    try:
        out, threads, under_way = run_all(gw.url)
        under_way.wait(30)  # every stream has sent its first bytes
        time.sleep(0.5)
        t0 = time.monotonic()
        for _ in range(signals):
            gw.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        for t in threads:
            t.join(grace + UVICORN_WINDOW_S + 30)
            assert not t.is_alive(), f"a stream hung through the shutdown\n{gw.log_text()[-3000:]}"
        check_endings(out)
        assert gw.proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        assert took < grace + UVICORN_WINDOW_S + 20, took  # a liveness bound (no stream waited for its idle timer)
    finally:
        gw.stop()

