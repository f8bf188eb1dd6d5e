"""Every engine answer shape in ``raw_engine.MODES`` x {alone, beside a good worker} x {whole, streamed}
(chat for two of the four, completions for the others): what reaches the client is always one of the
honest endings.

A RawEngine test double (tests/integration/raw_engine.py) writes each faulty shape byte by byte. The
invariants, whatever the shape:
- a non-streamed answer is a 200 JSON object with ``choices``, or an OpenAI-style error object;
- a streamed 200 is server-sent events whose every data payload is a JSON object or ``[DONE]``, ending
  with exactly one ``[DONE]``, with an error event only right before it; a streamed non-200 is an
  OpenAI-style error object;
- beside a good worker, a worker-caused fault never reaches the client: the answer is complete, and
  well-formed but unusual shapes are served whole by the engine itself;
- no request takes longer than the gateway's own bounds.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.integration.fake_engine import FakeEngine
from tests.integration.raw_engine import MODES, WELL_FORMED, WORKER_FAULTS, RawEngine
from tests.integration.test_request_path_failures import MODEL, gateway, healthy


def check_whole(r: httpx.Response) -> str:
    """'ok' or 'error'; fails on anything else."""
    body = r.json()
    assert isinstance(body, dict), r.text
    if r.status_code == 200:
        assert isinstance(body.get("choices"), list) and body["choices"], r.text
        return "ok"
    assert r.status_code >= 400 and isinstance(body.get("error"), dict), r.text
    assert isinstance(body["error"].get("message"), str) and body["error"]["message"], r.text
    return "error"


def check_stream(r: httpx.Response, chat: bool) -> tuple[str, str]:
    """('ok' | 'error_event' | 'error', the text relayed); fails on anything else."""
    if r.status_code != 200:
        return check_whole(r), ""
    assert r.headers["content-type"].startswith("text/event-stream"), r.text
    payloads = []
    for block in r.text.split("\n\n"):
        data = []
        for line in block.split("\n"):  # (comments and event names are SSE too: SDKs skip or read them)
            assert line.startswith(("data: ", ":", "event: ")) or not line, f"not SSE: {line!r} in {r.text!r}"
            if line.startswith("data: "):
                data.append(line[6:])
        if data:
            payloads.append("\n".join(data))
    assert payloads and payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1, r.text
    objs = [json.loads(p) for p in payloads[:-1]]
    assert all(isinstance(o, dict) for o in objs), r.text
    errors = [i for i, o in enumerate(objs) if "error" in o]
    assert errors in ([], [len(objs) - 1]), r.text
    text = "".join((c.get("delta", {}).get("content") or "") if chat else (c.get("text") or "")
                   for o in objs for c in o.get("choices") or ())
    return ("error_event" if errors else "ok"), text


def ask(gw, raw: RawEngine, chat: bool, stream: bool) -> httpx.Response:
    """One request the raw engine answers (round robin: the good worker may take the first)."""
    healthy(gw)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 2, "stream": stream,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    for _ in range(3):
        started = time.monotonic()
        r = httpx.post(gw.url + path, json=body, timeout=60)
        assert time.monotonic() - started < 15  # the gateway's own bounds (5-10 s here), not a hang
        if raw.generations:
            return r
    raise AssertionError(f"the raw engine was never asked: {r.text[:300]}")


@pytest.mark.parametrize("mode", MODES)
def test_every_answer_shape_ends_honestly(mode):
    for beside_good in (False, True):
        for stream in (False, True):
            for chat in (beside_good != stream,):  # (each endpoint twice, alone and beside a good worker)
                raw = RawEngine(mode)  # (a fresh gateway each time: a fault may take the worker out of rotation)
                fleet = [raw, FakeEngine("ok", tokens=2).start()] if beside_good else [raw]
                with gateway(fleet, gateway={"first_byte_timeout_s": 5, "request_timeout_s": 10},
                             resilience={"stream_idle_timeout_s": 5, "stall_timeout_s": 5}) as gw:
                    r = ask(gw, raw, chat, stream)
                where = f"{mode} beside_good={beside_good} chat={chat} stream={stream}: {r.text[:300]}"
                outcome, text = check_stream(r, chat) if stream else (check_whole(r), None)
                if mode in WELL_FORMED:
                    assert outcome == "ok", where
                    if stream and not beside_good:
                        assert text == "a b", where
                elif beside_good and (mode in WORKER_FAULTS or mode == "status_404"):
                    assert outcome == "ok", where  # (a 404: that engine does not serve the model; the other does)
                elif mode in ("status_400", "status_404"):
                    assert outcome == "error" and r.status_code == int(mode[7:]), where
                elif not beside_good:  # (nothing to fall back on: the fault shows, honestly)
                    assert outcome != "ok", where


@pytest.mark.parametrize("mode", MODES)
def test_every_answer_shape_of_a_pd_leg_ends_honestly(mode):
    """Under P/D: the shape from the prefill engine (a good decode engine beside it) never reaches the
    client — the decode engine prefills locally — unless the request itself is refused (4xx other than a 404,
    which says that engine does not serve the model); from the
    decode engine (a good prefill engine beside it) it ends honestly, as from an engine alone."""
    disagg = {"enabled": True, "min_prefill_tokens": 1, "connector": "nixl"}
    for raw_role, stream in (("prefill", True), ("decode", False), ("decode", True)):
        raw = RawEngine(mode)
        good = FakeEngine("ok", tokens=2).start()
        fleet, roles = ([raw, good], ["prefill", "decode"]) if raw_role == "prefill" else ([good, raw], ["prefill", "decode"])
        with gateway(fleet, roles, disagg=disagg, gateway={"first_byte_timeout_s": 5, "request_timeout_s": 10},
                     resilience={"stream_idle_timeout_s": 5, "stall_timeout_s": 5}) as gw:
            r = ask(gw, raw, chat=stream, stream=stream)
        where = f"{mode} raw {raw_role} stream={stream}: {r.text[:300]}"
        outcome, _ = check_stream(r, stream) if stream else (check_whole(r), None)
        if mode == "status_400" or (mode == "status_404" and raw_role == "decode"):
            assert outcome == "error" and r.status_code == int(mode[7:]), where
        elif raw_role == "prefill" or mode in WELL_FORMED:  # (a prefill 404: that engine does not serve the model)
            assert outcome == "ok", where
        else:
            assert outcome != "ok", where


@pytest.mark.parametrize("mode", MODES)
def test_no_answer_shape_passes_for_a_responses_answer(mode):
    """/v1/responses answered with chat/completions shapes (or worse): never a 200 answer without
    ``output``; a stream ends with the Responses protocol's own terminal event."""
    for stream in (False, True):
        raw = RawEngine(mode)
        with gateway([raw], gateway={"first_byte_timeout_s": 5, "request_timeout_s": 10},
                     resilience={"stream_idle_timeout_s": 5, "stall_timeout_s": 5}) as gw:
            healthy(gw)
            r = httpx.post(f"{gw.url}/v1/responses", timeout=60,
                           json={"model": MODEL, "input": "hi", "stream": stream, "max_output_tokens": 2})
        where = f"{mode} stream={stream}: {r.text[:300]}"
        if r.status_code != 200:
            assert check_whole(r) == "error", where
            continue
        assert stream and r.headers["content-type"].startswith("text/event-stream"), where
        events = [block for block in r.text.split("\n\n") if block]
        assert events[-1].startswith("event: response.failed\n"), where
        assert json.loads(events[-1].split("\ndata: ", 1)[1])["response"]["status"] == "failed", where
