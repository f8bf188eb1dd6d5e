"""A request body that arrives slowly, on both data planes (``resilience.body_timeout_s``).

Found by probing slow clients on both planes: the Python plane gives a body ``body_timeout_s`` (30 s by
default) after its headers; the native plane's hot routes gave it ``header_timeout_s`` (10 s) from the head —
so a large prompt uploaded in 10 to 30 s was served by one plane and refused (408) by the other, with another
message. Now the native plane uses ``body_timeout_s`` and the Python plane's words.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread

BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi " * 200}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def engine():
    e = SimEngineThread(model="tiny", profile="cpu-tiny", seed=0, kv_events=False).start()
    try:
        yield e
    finally:
        e.stop()


def _gateway(engine, body_timeout_s):
    return GatewayThread(load_config({
        "models": [{"name": "tiny"}],
        "workers": [{"id": "w0", "url": engine.url, "engine": "sim", "models": ["tiny"]}],
        "health": {"interval_s": 30},
        "resilience": {"header_timeout_s": 1.0, "body_timeout_s": body_timeout_s},
    }, environ={}))


def _send(port, pieces, pause):
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(BODY))
        s.sendall(head)
        for piece in pieces:
            time.sleep(pause)
            try:
                s.sendall(piece)
            except OSError:
                break
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    status = int(out.split(b" ", 2)[1])
    return status, json.loads(out.partition(b"\r\n\r\n")[2] or b"{}")


def test_a_body_sent_within_body_timeout_is_served_past_the_header_timeout(engine):
    # six pieces half a second apart: 3 s for the body, three times the header timeout, far inside the body timeout
    pieces = [BODY[i:i + len(BODY) // 6 + 1] for i in range(0, len(BODY), len(BODY) // 6 + 1)]
    with _gateway(engine, 60.0) as gw:
        status, answer = _send(gw.port, pieces, 0.5)
    assert status == 200 and answer["object"] == "chat.completion", answer


def test_a_body_that_stops_is_a_408_naming_the_body_timeout(engine):
    with _gateway(engine, 2.0) as gw:
        status, answer = _send(gw.port, [BODY[:20]], 0.0)
    assert status == 408, answer
    assert answer["error"]["code"] == "request_timeout"
    assert answer["error"]["message"] == "The request body did not arrive within 2 s.", answer
