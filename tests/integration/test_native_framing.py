"""Requests whose framing or target is unusual, sent as raw bytes, on both data planes (the Makefile's NATIVE_SUITES).

A request framed two ways (Transfer-Encoding and Content-Length, RFC 9112 6.3) is the request-smuggling shape:
a front proxy that frames it by its Content-Length and a gateway that frames it by its chunks disagree on
where the next request starts. The native plane (hyper) accepted it, framed it by the chunks and kept the
connection; the Python plane (httptools) answers 400 and closes. Now both answer 400 (OpenAI-shaped JSON,
``invalid_http``) and close the connection: a request pipelined behind it is never answered. Its
neighbours (several Content-Lengths, one that is not a number, a transfer coding other than a final
chunked, chunked twice) are refused the same way on both.

``OPTIONS *`` (or any target that is not a path) got a 503 saying "too many connections" from the native
plane (the fallback URL it built did not parse, and every failure to reach the fallback was reported so).
Now the asterisk-form is answered as the Python plane answers it (404 "No route"), an absolute-form target is
served by its path on both (RFC 9112 3.2.2), an authority-form one is a 400, and a fallback that cannot be
reached is a 502 saying so.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.sim.server import SimEngineThread
from tests.integration.test_request_path_failures import MODEL, healthy

BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
NEXT = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"  # pipelined behind each request


@pytest.fixture(scope="module")
def gw() -> Iterator[Any]:
    from orchestrator.config import load_config
    from orchestrator.gateway.serve import GatewayThread

    engine = SimEngineThread(model=MODEL, profile="cpu-tiny", kv_events=False).start()
    config = load_config({"models": [{"name": MODEL, "block_size": 16}],
                          "workers": [{"id": "s0", "url": engine.url, "engine": "sim", "models": [MODEL]}],
                          "health": {"interval_s": 30}}, environ={})
    gateway = GatewayThread(config).start()
    try:
        healthy(gateway)
        yield gateway
    finally:
        gateway.stop()
        engine.stop()


def answers(port: int, raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``raw`` on one connection and read until the gateway closes it: every answer (status, headers,
    body) that came back."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(raw)
        while more := s.recv(65536):
            data += more
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, data
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers["content-length"])
        out.append((int(lines[0].split(" ")[1]), headers, rest[:length]))
        data = rest[length:]
    return out


def refused(port: int, raw: bytes, problem: str = "") -> None:
    """``raw`` (followed by a pipelined GET) gets one answer: a 400 in OpenAI's shape, and the connection closes
    with nothing pipelined behind it answered."""
    got = answers(port, raw + NEXT)
    assert len(got) == 1, [(s, b[:200]) for s, _, b in got]  # (the pipelined GET never read as a request)
    status, headers, body = got[0]
    assert status == 400, (status, body)
    assert headers.get("connection") == "close" and headers["content-type"] == "application/json", headers
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http", error
    assert error["message"].startswith("The request is not valid HTTP/1.1"), error
    if problem:
        assert problem in error["message"] or error["message"] == "The request is not valid HTTP/1.1.", error


def post(headers: bytes, body: bytes, version: bytes = b"1.1") -> bytes:
    return (b"POST /v1/completions HTTP/" + version + b"\r\nhost: x\r\ncontent-type: application/json\r\n" + headers
            + b"\r\n" + body)


CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)


def test_a_request_with_transfer_encoding_and_content_length_is_refused_and_the_connection_closed(gw):
    """Both orders of the two headers, on the hot path (a POST the plane serves) and off it (a GET the
    fallback serves); the Content-Length says less than the chunks carry, as a smuggler's would."""
    te, cl = b"transfer-encoding: chunked\r\n", b"content-length: 4\r\n"
    for first, second in ((te, cl), (cl, te)):
        refused(gw.port, post(first + second, CHUNKED), "both Transfer-Encoding and Content-Length")
        get = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + first + second + b"\r\n0\r\n\r\n"
        refused(gw.port, get, "both Transfer-Encoding and Content-Length")
    # (the same on an HTTP/1.0 request)
    refused(gw.port, post(te + b"content-length: %d\r\n" % len(BODY), BODY, b"1.0"))


def test_content_lengths_that_disagree_repeat_or_are_not_numbers_are_refused(gw):
    n = len(BODY)
    for headers in (b"content-length: %d\r\ncontent-length: 3\r\n" % n,  # (two values)
                    b"content-length: %d\r\ncontent-length: %d\r\n" % (n, n),  # (the same value twice)
                    b"content-length: %d, %d\r\n" % (n, n),
                    b"content-length: abc\r\n",
                    b"content-length: +%d\r\n" % n):
        refused(gw.port, post(headers, BODY), "more than one Content-Length")


def test_a_transfer_coding_other_than_one_final_chunked_is_refused(gw):
    for headers in (b"transfer-encoding: chunked, gzip\r\n",
                    b"transfer-encoding: gzip\r\n",
                    b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n"):
        refused(gw.port, post(headers, CHUNKED), "chunked more than once")


def test_transfer_encoding_on_an_http_1_0_request_is_refused_and_closes_the_connection(gw):
    """RFC 9112 6.1: HTTP/1.0 has no transfer codings; a server must treat such a message's framing as faulty
    and close the connection after it. Both planes refuse it (400 invalid_http; the Python plane framed it by
    its chunks and answered it, until this session); nothing pipelined behind it is answered."""
    got = answers(gw.port, post(b"transfer-encoding: chunked\r\n", CHUNKED, b"1.0") + NEXT)
    assert len(got) == 1, [(s, b[:200]) for s, _, b in got]
    status, headers, body = got[0]
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_http", (status, headers, body)


def test_a_plain_request_and_its_pipelined_successor_are_both_answered(gw):
    """(the control: the checks above leave sound requests, pipelined or chunked, alone)"""
    plain = post(b"content-length: %d\r\n" % len(BODY), BODY)
    chunked = post(b"transfer-encoding: Chunked\r\n", b"5;ext=1\r\n" + BODY[:5] + b"\r\n"
                   + b"%x\r\n%s\r\n0\r\nx-trailer: t\r\n\r\n" % (len(BODY) - 5, BODY[5:]))
    got = answers(gw.port, plain + chunked + NEXT)
    assert [s for s, _, _ in got] == [200, 200, 200], [(s, b[:200]) for s, _, b in got]
    assert json.loads(got[0][2])["choices"] and json.loads(got[1][2])["choices"] and json.loads(got[2][2])["data"]


def test_options_asterisk_is_answered_as_the_python_plane_answers_it_and_the_connection_goes_on(gw):
    """The native plane answered 503 "too many connections (gateway.max_connections=None)" to ``OPTIONS *``:
    the fallback URL it built (``http://127.0.0.1:port*``) did not parse."""
    got = answers(gw.port, b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n" + NEXT)
    assert [s for s, _, _ in got] == [404, 200], [(s, b[:200]) for s, _, b in got]
    error = json.loads(got[0][2])["error"]
    assert error["message"] == "No route OPTIONS /*." and error["type"] == "invalid_request_error", error
    assert json.loads(got[1][2])["data"][0]["id"] == MODEL


def test_an_absolute_form_target_is_served_by_its_path(gw):
    """RFC 9112 3.2.2: a server must accept the absolute-form (what a client configured with a proxy sends)."""
    body = post(b"content-length: %d\r\n" % len(BODY), BODY).replace(b"POST /v1/", b"POST http://x/v1/", 1)
    got = answers(gw.port, b"GET http://x/v1/models HTTP/1.1\r\nhost: x\r\n\r\n" + body + NEXT)
    assert [s for s, _, _ in got] == [200, 200, 200], [(s, b[:200]) for s, _, b in got]
    assert json.loads(got[0][2])["data"] and json.loads(got[1][2])["choices"]


def test_an_authority_form_target_is_refused(gw):
    """(a target that is not a path: the native plane sent it to the fallback as ``/``, a 404 for ``GET /``)"""
    refused(gw.port, b"GET x:443 HTTP/1.1\r\nhost: x\r\n\r\n", "is not a path")
    refused(gw.port, b"CONNECT x:443 HTTP/1.1\r\nhost: x:443\r\n\r\n")


def test_a_fallback_that_cannot_be_reached_is_a_502_that_says_so():
    """Native plane only (the Python plane has no fallback): a plane whose fallback's port is closed answered
    what it does not serve itself with 503 "too many connections"; now a 502 naming the fallback."""
    from orchestrator.config import load_config
    from orchestrator.gateway import native
    from orchestrator.gateway.native.plane import limits_of

    module = native.load()
    if module is None:
        pytest.skip(f"the native data plane is not built: {native.BUILD}")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # (bound, never listening: a connection to it is refused)
    config = load_config({"models": [{"name": MODEL, "block_size": 16}],
                          "workers": [{"id": "s0", "url": "http://127.0.0.1:9", "engine": "sim", "models": [MODEL]}]},
                         environ={})
    plane = module.Plane("127.0.0.1", 0, None, f"127.0.0.1:{dead.getsockname()[1]}", "secret", limits_of(config))
    port = plane.start()
    try:
        got = answers(port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        assert len(got) == 1, got
        status, headers, body = got[0]
        error = json.loads(body)["error"]
        assert status == 502 and headers.get("connection") == "close", (status, headers, body)
        assert error["code"] == "fallback_unreachable" and "could not reach its own fallback" in error["message"], error
        assert "too many" not in error["message"], error
    finally:
        plane.stop(0.0)
        dead.close()
