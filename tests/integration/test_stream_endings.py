"""Every relayed stream ends honestly: one test per way a stream can end after its headers were sent.

After the gateway has sent a stream's 200 and headers it can no longer change the status, so each way
the stream can end must end with the stream protocol's own ending (``stream_protocol.py``):

* ``/v1/chat/completions`` and ``/v1/completions``: ``data: [DONE]`` after a complete answer, else an
  OpenAI-style ``data: {"error": {...}}`` then ``data: [DONE]`` — or the rest of the answer from another
  worker when the tokens sent so far can be replayed (``failover.py``);
* ``/v1/responses``: a terminal event, else ``event: error`` then ``event: response.failed``.

Only a client that leaves gets no ending (nobody is there to read it). The ways covered here, one
test each: the engine ends the stream without its end (EOF), resets the connection, sends bytes that
are not SSE, goes silent (idle timeout); the total stream timeout (``resilience.stream_timeout_s``)
runs out; the worker is marked down by the health loop while its stream is being relayed; the stall
watchdog pulls a try after the headers; the worker is pulled while the gateway waits on a slow client
(outside the relay's read loop); the gateway's own code fails mid-stream; the gateway's own shutdown
cuts a stream that outlived the drain's grace and uvicorn's window; and the one exception, a client
that leaves (the engine's request is aborted, nothing more is written).

The engines are Dyad's simulated engine (``dyad sim-engine``): its fault injection (``POST /sim/faults``:
``stream_fault`` eof | reset | garbage | hang after N chunks, ``responses_fault`` the same for
/v1/responses, ``healthy: false`` for a failing ``/health``) makes an engine misbehave at an exact
token, which a real vLLM cannot do on cue; the gateway is real (uvicorn, real sockets), and for the
shutdown test a real ``dyad serve`` process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.ports import free_port, wait_ready
from orchestrator.sim.server import SimEngineThread

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
# 20 tokens/s on one sequence: a stream lasts max_tokens / 20 s
PACED = {"base": "zero", "name": "paced", "step_fixed_s": 0.05}


def body_for(endpoint: str, tokens: int) -> dict[str, Any]:
    if endpoint == RESPONSES:
        return {"model": "m", "input": "tell me", "max_output_tokens": tokens, "stream": True}
    prompt = {"messages": [{"role": "user", "content": "tell me"}]} if endpoint == CHAT else {"prompt": "tell me"}
    return {"model": "m", **prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}


def read_stream(url: str, endpoint: str, body: dict[str, Any]) -> tuple[int, list[tuple[str | None, str]]]:
    """The status and every SSE event as (event name, data)."""
    with httpx.stream("POST", url + endpoint, json=body, timeout=60) as r:
        raw = r.read().decode()
    return r.status_code, sse_events(raw)


def sse_events(raw: str) -> list[tuple[str | None, str]]:
    """Every SSE event of a stream's text as (event name, data)."""
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        events.append((name, "\n".join(data)))
    return events


def complete(endpoint: str, events: list[tuple[str | None, str]], tokens: int) -> None:
    """A whole answer: the protocol's complete end, no error, ``tokens`` tokens of text."""
    if endpoint == RESPONSES:
        assert events[-1][0] == "response.completed", events[-3:]
        assert not any(name in ("error", "response.failed") for name, _ in events)
        assert sum(1 for name, _ in events if name == "response.output_text.delta") == tokens
        return
    datas = [d for _, d in events]
    assert datas[-1] == "[DONE]" and datas.count("[DONE]") == 1, datas[-3:]
    chunks = [json.loads(d) for d in datas[:-1]]
    assert not any("error" in c for c in chunks), chunks[-2:]
    pieces = [(ch.get("delta") or {}).get("content") if endpoint == CHAT else ch.get("text")
              for c in chunks for ch in c["choices"]]
    assert sum(len(p.split()) for p in pieces if p) >= tokens  # (one word per token; failover.py's budget)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def error_ending(endpoint: str, events: list[tuple[str | None, str]], *words: str) -> dict[str, Any]:
    """The protocol's error ending, last; returns the error (its message contains every one of ``words``)."""
    if endpoint == RESPONSES:
        (n1, d1), (n2, d2) = events[-2:]
        assert (n1, n2) == ("error", "response.failed"), events[-3:]
        err, failed = json.loads(d1), json.loads(d2)
        assert failed["response"]["status"] == "failed" and failed["sequence_number"] == err["sequence_number"] + 1
        assert not any(name == "response.completed" for name, _ in events)
    else:
        datas = [d for _, d in events]
        assert datas[-1] == "[DONE]" and datas.count("[DONE]") == 1, datas[-3:]
        err = json.loads(datas[-2])["error"]
        assert err["type"] and "message" in err
    for w in words:
        assert w in err["message"], err
    return err


def set_faults(engine: SimEngineThread, **faults: Any) -> None:
    r = httpx.post(f"{engine.url}/sim/faults", json=faults, timeout=5)
    assert r.status_code == 200, r.text


def fault_for(endpoint: str, mode: str, after: int) -> dict[str, Any]:
    if endpoint == RESPONSES:
        return {"responses_fault": mode, "responses_fault_after": after}
    return {"stream_fault": mode, "stream_fault_after": after}


def gateway_config(engines: list[SimEngineThread], **sections: Any) -> Any:
    return load_config({
        "models": [{"name": "m"}],
        "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "models": ["m"]} for i, e in enumerate(engines)],
        "router": {"policy": "round_robin", "debug_headers": True},
        **{"health": {"interval_s": 30}, **sections},
    }, environ={})


# --- the engine breaks the stream: EOF, reset, garbage, silence ---------------------------------------

ENGINE_FAULTS = ["eof", "reset", "garbage", "hang"]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("mode", ENGINE_FAULTS)
def test_an_engine_fault_with_nowhere_to_go_ends_with_the_protocols_error(engines, endpoint, mode):
    (engine,) = engines(1)
    set_faults(engine, **fault_for(endpoint, mode, 3))
    with GatewayThread(gateway_config([engine], resilience={"stream_idle_timeout_s": 0.5})) as gw:
        status, events = read_stream(gw.url, endpoint, body_for(endpoint, 10))
    assert status == 200
    expected = {"eof": "without", "reset": "broke", "garbage": "not server-sent events", "hang": "no data"}[mode]
    error_ending(endpoint, events, expected)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("mode", ENGINE_FAULTS)
def test_an_engine_fault_is_continued_on_another_worker(engines, endpoint, mode):
    bad, good = engines(2)
    set_faults(bad, **fault_for(endpoint, mode, 3))
    with GatewayThread(gateway_config([bad, good], resilience={"stream_idle_timeout_s": 0.5})) as gw:
        status, events = read_stream(gw.url, endpoint, body_for(endpoint, 10))
        text = gw.runtime.metrics.render().decode()
    assert status == 200
    complete(endpoint, events, 10)
    assert 'dyad_stream_failovers_total{outcome="continued"} 1.0' in text


@pytest.mark.parametrize("mode", ENGINE_FAULTS)
def test_a_responses_stream_broken_before_its_first_token_starts_again_elsewhere(engines, mode):
    bad, good = engines(2)
    set_faults(bad, **fault_for(RESPONSES, mode, 0))
    with GatewayThread(gateway_config([bad, good], resilience={"stream_idle_timeout_s": 0.5, "stall_timeout_s": 1})) as gw:
        status, events = read_stream(gw.url, RESPONSES, body_for(RESPONSES, 6))
    assert status == 200
    complete(RESPONSES, events, 6)


# --- the gateway ends it: total timeout, worker marked down, slow client, shutdown ---------------------

@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, RESPONSES])
def test_the_total_stream_timeout_ends_with_the_protocols_error(engines, endpoint):
    (engine,) = engines(1, PACED)
    with GatewayThread(gateway_config([engine], resilience={"stream_timeout_s": 0.6})) as gw:
        status, events = read_stream(gw.url, endpoint, body_for(endpoint, 100))  # ≈ 5 s of tokens
        text = gw.runtime.metrics.render().decode()
    assert status == 200
    err = error_ending(endpoint, events, "resilience.stream_timeout_s")
    assert err["code"] == "timeout"
    assert 0 < len(events) < 100  # tokens came, then the timeout, not the whole answer
    assert 'status="504"' in text  # the record says how it ended (the client saw 200, then the error)


@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES])
def test_a_worker_marked_down_mid_stream_with_nowhere_to_go_ends_with_the_protocols_error(engines, endpoint):
    (engine,) = engines(1)
    set_faults(engine, **fault_for(endpoint, "hang", 3))  # silent, but well inside the idle timeout
    config = gateway_config([engine], health={"interval_s": 0.2, "timeout_s": 1, "failure_threshold": 1},
                            resilience={"stream_idle_timeout_s": 60})
    with GatewayThread(config) as gw:
        threading.Timer(1.0, set_faults, args=(engine,), kwargs={"healthy": False}).start()
        t0 = time.monotonic()
        status, events = read_stream(gw.url, endpoint, body_for(endpoint, 10))
        took = time.monotonic() - t0
    assert status == 200
    error_ending(endpoint, events, "marked down")
    assert took < 30  # the health loop pulled it, not the 60 s idle timeout


def test_a_worker_marked_down_mid_stream_is_continued_on_another(engines):
    bad, good = engines(2)
    set_faults(bad, stream_fault="hang", stream_fault_after=3)
    config = gateway_config([bad, good], health={"interval_s": 0.2, "timeout_s": 1, "failure_threshold": 1},
                            resilience={"stream_idle_timeout_s": 60})
    with GatewayThread(config) as gw:
        threading.Timer(1.0, set_faults, args=(bad,), kwargs={"healthy": False}).start()
        status, events = read_stream(gw.url, CHAT, body_for(CHAT, 10))
        text = gw.runtime.metrics.render().decode()
    assert status == 200
    complete(CHAT, events, 10)
    assert 'dyad_stream_failovers_total{outcome="continued"} 1.0' in text


@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES])
def test_a_stalled_worker_pulled_by_the_watchdog_after_the_headers_ends_with_the_protocols_error(engines, endpoint):
    """The engine answers the stream's headers and then nothing, while doing no work at all: the stall
    watchdog (``resilience.stall_timeout_s``) pulls the try after the client got its 200 and headers."""
    (engine,) = engines(1)
    set_faults(engine, **fault_for(endpoint, "hang", 0))
    config = gateway_config([engine], resilience={"stall_timeout_s": 0.5, "stream_idle_timeout_s": 60})
    with GatewayThread(config) as gw:
        t0 = time.monotonic()
        status, events = read_stream(gw.url, endpoint, body_for(endpoint, 5))
        took = time.monotonic() - t0
    assert status == 200
    error_ending(endpoint, events, "stalled")
    assert took < 30  # the watchdog, not the 60 s idle timeout


def test_a_stalled_worker_pulled_after_the_headers_is_continued_on_another(engines):
    bad, good = engines(2)
    set_faults(bad, stream_fault="hang", stream_fault_after=0)
    config = gateway_config([bad, good], resilience={"stall_timeout_s": 0.5, "stream_idle_timeout_s": 60})
    with GatewayThread(config) as gw:
        status, events = read_stream(gw.url, CHAT, body_for(CHAT, 6))
        text = gw.runtime.metrics.render().decode()
    assert status == 200
    complete(CHAT, events, 6)
    assert 'dyad_stream_failovers_total{outcome="continued"} 1.0' in text  # (it began on the stalled worker)


@pytest.mark.python_plane  # (it wraps the Python server's ASGI send; the native plane's case: test_native_plane.py)
@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES])
def test_a_worker_pulled_while_the_gateway_waits_on_the_client_ends_with_the_protocols_error(engines, endpoint):
    """The worker is marked down while the gateway is blocked writing to the client (here: the headers,
    as with a client that reads slowly): the cancellation lands outside the relay's read loop, in the
    proxy, which still ends the stream with the protocol's error ending."""
    (engine,) = engines(1)
    gw = GatewayThread(gateway_config([engine]))
    inner = gw.app

    async def slow_client_app(scope: Any, receive: Any, send: Any) -> None:
        async def send_then_wait(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.start" and scope.get("path") == endpoint:
                rt = gw.runtime
                worker = rt.fleet.get("w0")
                rt.fleet.mark_failed(worker, rt.clock.now(), "test: marked down during a slow write")
                await asyncio.sleep(0.05)  # a write that waits for the client (as under pause_writing)

        await inner(scope, receive, send_then_wait)

    gw._server.config.app = slow_client_app  # the same gateway behind a slow client (uvicorn loads it at start)
    with gw:
        status, events = read_stream(gw.url, endpoint, body_for(endpoint, 5))
    assert status == 200
    error_ending(endpoint, events, "marked down")


@pytest.mark.python_plane  # (the native plane's own case: tests/integration/test_native_plane.py)
@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES])
def test_a_failure_of_the_gateways_own_code_mid_stream_ends_with_the_protocols_error(engines, endpoint, monkeypatch):
    """A bug in the relay (injected: reading the usage event raises) after tokens reached the client: the
    proxy logs it and still ends the stream with the protocol's error ending, not a cut connection."""
    from orchestrator.gateway.failover import StreamRelay
    from orchestrator.gateway.stream_protocol import ResponsesEvents

    def broken(*args: Any) -> bytes:
        raise RuntimeError("injected relay failure")

    monkeypatch.setattr(StreamRelay, "_take_usage", broken)
    monkeypatch.setattr(ResponsesEvents, "take_usage", broken)
    (engine,) = engines(1)
    body = body_for(endpoint, 5)
    if endpoint != RESPONSES:
        body["stream_options"] = {"include_usage": True}
    with GatewayThread(gateway_config([engine])) as gw:
        status, events = read_stream(gw.url, endpoint, body)
        text = gw.runtime.metrics.render().decode()
    assert status == 200
    err = error_ending(endpoint, events, "failed while relaying")
    assert err["code"] == "gateway_error"
    assert 'status="500"' in text


def test_a_client_that_leaves_gets_no_ending_and_the_engine_request_is_aborted(engines):
    (engine,) = engines(1, PACED)
    with GatewayThread(gateway_config([engine])) as gw:
        with httpx.stream("POST", gw.url + CHAT, json=body_for(CHAT, 200), timeout=30) as r:  # ≈ 10 s
            got: list[str] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(line)
                    if len(got) == 3:
                        break  # the client leaves mid-stream
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = gw.runtime.metrics.render().decode()
            if 'status="499"' in text:
                break
            time.sleep(0.05)
        assert 'status="499"' in text and "dyad_client_disconnects_total" in text
        assert len(gw.runtime.attempts) == 0  # the try ended (cancelled), nothing left in flight
        deadline = time.monotonic() + 10
        while httpx.get(f"{engine.url}/load", timeout=5).json()["server_load"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{engine.url}/load", timeout=5).json()["server_load"] == 0  # the engine aborted it
    assert len(got) == 3 and all("error" not in line for line in got)


def test_the_gateways_shutdown_ends_a_stream_it_cuts_with_an_error_event(engines, tmp_path):
    """SIGTERM with a stream longer than the drain's grace (1 s) plus uvicorn's own window (5 s): the
    gateway's shutdown cancels it, and the client still gets an error event and [DONE], not a cut."""
    (engine,) = engines(1, PACED)
    port = free_port()
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": [{"name": "m"}],
        "workers": [{"id": "sim", "url": engine.url, "engine": "sim", "models": ["m"]}],
        "resilience": {"shutdown_grace_s": 1},
    }))
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 - the child keeps its own descriptor
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(cfg), "--port",
                             str(port)], cwd=ROOT, stdout=log, stderr=log)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_ready(f"{url}/ready", proc), (tmp_path / "gateway.log").read_text()
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["status"], out["events"] = read_stream(url, COMPLETIONS, body_for(COMPLETIONS, 400))  # ≈ 20 s
            except httpx.HTTPError as e:
                out["error"] = repr(e)

        client = threading.Thread(target=run)
        client.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        client.join(60)
        assert "error" not in out, (out, (tmp_path / "gateway.log").read_text())
        assert out["status"] == 200
        err = error_ending(COMPLETIONS, out["events"], "shutting down")
        assert err["code"] == "gateway_cancelled"
        assert 20 < len(out["events"]) < 400
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- P/D: the decode leg of a split stream breaks after the client got its 200 -------------------------
# A prefill worker and a decode worker (the simulator in the vLLM dialect: the gateway sends the prefill
# leg, then streams the decode leg to the client). With no other decode worker the stream cannot be
# continued: it must end with the protocol's error ending, never look like a short, complete answer.

PD_PROMPT = "Explain the plan: " + " ".join(f"step{i} then" for i in range(150))  # well past min_prefill_tokens


def pd_body(endpoint: str, tokens: int) -> dict[str, Any]:
    prompt = {"messages": [{"role": "user", "content": PD_PROMPT}]} if endpoint == CHAT else {"prompt": PD_PROMPT}
    return {"model": "m", **prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}


def pd_config(prefill_url: str, decode_url: str, engine: str = "sim", **resilience: Any) -> Any:
    """Worker p prefills, d decodes; ``engine: sglang`` adds p's bootstrap port (the simulator serves it
    on its main port)."""
    prefill = {"id": "p", "url": prefill_url, "engine": engine, "role": "prefill", "models": ["m"]}
    if engine == "sglang":
        prefill["bootstrap_port"] = int(prefill_url.rsplit(":", 1)[1])
    return load_config({
        "models": [{"name": "m", "block_size": 32}],
        "workers": [prefill, {"id": "d", "url": decode_url, "engine": engine, "role": "decode", "models": ["m"]}],
        "router": {"policy": "least_load", "debug_headers": True},
        "health": {"interval_s": 30},
        "disagg": {"min_prefill_tokens": 32, "prefill_timeout_s": 30},
        "resilience": resilience,
    }, environ={})


def split_once(gw: GatewayThread) -> None:
    """The request really was split (disaggregated): one P/D request, its prefill leg on p."""
    assert gw.runtime.metrics.registry.get_sample_value("dyad_pd_requests_total", {"mode": "disaggregated"}) == 1


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("mode,after,resilience,words", [
    # silent after tokens: the idle timer (the stall watchdog is for an engine that does no work at all)
    ("hang", 3, {"stream_idle_timeout_s": 1.0}, ("no data",)),
    ("hang", 0, {"stall_timeout_s": 0.5, "stream_idle_timeout_s": 60}, ("stalled",)),
    ("reset", 3, {}, ("broke",)),
    ("eof", 3, {}, ("without",)),
], ids=["stall-mid-stream", "stall-after-headers", "reset", "eof"])
def test_a_split_streams_decode_leg_broken_after_the_headers_ends_with_the_protocols_error(
        engines, endpoint, mode, after, resilience, words):
    p, d = engines(2)
    set_faults(d, **fault_for(endpoint, mode, after))
    with GatewayThread(pd_config(p.url, d.url, **resilience)) as gw:
        t0 = time.monotonic()
        with httpx.stream("POST", gw.url + endpoint, json=pd_body(endpoint, 20), timeout=60) as r:
            status, raw = r.status_code, r.read().decode()
        took = time.monotonic() - t0
        split_once(gw)
    if after == 0:  # (the P/D executor reads a split stream up to its first event before relaying it: nothing was
        # relayed when the stall watchdog pulled the try, so the client gets the stall as an error status)
        assert status == 503 and all(w in json.loads(raw)["error"]["message"] for w in words), raw
    else:
        assert status == 200
        error_ending(endpoint, sse_events(raw), *words)
    assert took < 30  # ended by the gateway (watchdog, idle timer or the engine's own end), not the 60 s bound


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_a_split_stream_whose_decode_engine_is_killed_mid_stream_ends_with_the_protocols_error(
        engines, endpoint, tmp_path):
    """The decode engine is a ``dyad sim-engine`` process, SIGKILLed after the client has read tokens."""
    from tests.fixtures.dyad_process import dyad_sim_engine

    (p,) = engines(1)
    profile = tmp_path / "paced.json"
    profile.write_text(json.dumps(PACED))  # 20 tokens/s: the stream lasts long enough to be cut
    decode = dyad_sim_engine("--model", "m", "--profile", str(profile), "--no-kv-events",
                             log_path=tmp_path / "decode.log").start()
    try:
        with GatewayThread(pd_config(p.url, decode.url)) as gw:
            with httpx.stream("POST", gw.url + endpoint, json=pd_body(endpoint, 400), timeout=60) as r:
                assert r.status_code == 200 and r.headers["x-dyad-prefill-worker"] == "p"
                raw = b""
                chunks = r.iter_raw()
                while raw.count(b"data: ") < 5:  # tokens reached the client
                    raw += next(chunks)
                decode.proc.kill()
                raw += b"".join(chunks)
            split_once(gw)
    finally:
        decode.stop()
    events = sse_events(raw.decode())
    error_ending(endpoint, events)
    assert 5 <= len(events) < 400


@pytest.mark.parametrize("mode,words", [("reset", ("broke",)), ("eof", ("without",))])
def test_an_sglang_split_streams_decode_leg_broken_after_the_headers_ends_with_the_protocols_error(mode, words):
    """The SGLang dialect (simulated: SGLang cannot run here): the gateway sends the request to the prefill
    and the decode server at once and relays the decode server's stream, which breaks after 3 chunks."""
    p = SimEngineThread(model="m", profile="cpu-tiny", dialect="sglang", disaggregation_mode="prefill",
                        kv_events=False).start()
    d = SimEngineThread(model="m", profile="cpu-tiny", dialect="sglang", disaggregation_mode="decode",
                        kv_events=False).start()
    try:
        set_faults(d, **fault_for(CHAT, mode, 3))
        with GatewayThread(pd_config(p.url, d.url, "sglang")) as gw:
            status, events = read_stream(gw.url, CHAT, pd_body(CHAT, 20))
            split_once(gw)
        assert status == 200
        error_ending(CHAT, events, *words)
    finally:
        p.stop()
        d.stop()
