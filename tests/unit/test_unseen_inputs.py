"""Unit checks behind tests/integration/test_unseen_inputs.py (pure code: no sockets)."""

from __future__ import annotations

import pytest

from orchestrator.gateway.http_server import MAX_HEADER_BYTES, UpgradeBody
from orchestrator.gateway.stream_protocol import OpenAIChunks


def feed_bytewise(body: UpgradeBody, data: bytes) -> tuple[bytes, bool, bytes]:
    got, rest = b"", b""
    for i in range(len(data)):
        pieces, done, rest = body.feed(data[i:i + 1])
        got += b"".join(pieces)
        if done:
            return got, True, rest + data[i + 1:]
    return got, False, rest


def test_an_upgrade_offers_body_is_framed_by_its_length_or_chunks_byte_by_byte():
    assert feed_bytewise(UpgradeBody(5), b"helloGET") == (b"hello", True, b"GET")
    chunked = b"3;ext=1\r\nabc\r\nA\r\n0123456789\r\n0\r\nx-t: 1\r\n\r\nNEXT"
    assert feed_bytewise(UpgradeBody(None), chunked) == (b"abc0123456789", True, b"NEXT")
    pieces, done, rest = UpgradeBody(None).feed(chunked)  # (in one piece too)
    assert b"".join(pieces) == b"abc0123456789" and done and rest == b"NEXT"


@pytest.mark.parametrize("data", [b"zz\r\n", b"3\r\nabcXY", b"-1\r\n", b"1" * 17 + b"\r\n", b"3" * 5000,
                                  b"0\r\n" + b"x: " + b"y" * (MAX_HEADER_BYTES // 2) + b"\r\n" + b"x: " + b"y" * MAX_HEADER_BYTES + b"\r\n"])
def test_a_broken_chunked_framing_is_refused_not_taken_for_a_shorter_body(data):
    with pytest.raises(ValueError):
        UpgradeBody(None).feed(data)


@pytest.mark.parametrize("done", [b"data: [DONE]\nid: 3", b": c\ndata: [DONE]", b"data: [DONE] ", b"data:  [DONE]",
                                  b"event: done\ndata: [DONE]"])
def test_the_done_event_is_the_end_whatever_sse_fields_it_carries(done):
    chunks = OpenAIChunks()
    answer = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    out, problem, beyond = chunks.screen(answer + done + b"\n\n" + answer)
    assert out == answer + done + b"\n\n" and problem is None and beyond
    assert chunks.ended(out) and not chunks.ended(answer)
    assert not chunks.end_event(b'data: {"text": "[DONE]"}')
