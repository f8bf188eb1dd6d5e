"""The P/D executor's look at a split stream's first event (``_peek_first_event``): the stream comes back whole,
and an error as its first data event is found whatever the framing."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from orchestrator.disagg.executor import _peek_first_event


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], broken: bool = False) -> None:
        self.chunks = chunks
        self.broken = broken
        self.closed = False

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        if self.broken:
            raise httpx.ReadError("reset")

    async def aclose(self) -> None:
        self.closed = True


async def _peek(chunks: list[bytes], broken: bool = False) -> tuple[bytes, str | None, BaseException | None]:
    stream = _Chunks(chunks, broken)
    response, error = await _peek_first_event(httpx.Response(200, stream=stream))
    body, failure = b"", None
    try:
        async for piece in response.aiter_raw():
            body += piece
    except httpx.HTTPError as e:
        failure = e
    await response.aclose()
    assert stream.closed
    return body, error, failure


ERROR = b'data: {"error": {"message": "KV load failed", "code": 500}}\n\n'
TOKEN = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'


@pytest.mark.parametrize("chunks,error", [
    ([TOKEN, ERROR], None),  # (an error after a token is the relay's to judge)
    ([ERROR, b"data: [DONE]\n\n"], "KV load failed"),
    ([b": keep-alive\r\n\r\n", ERROR.replace(b"\n", b"\r\n")], "KV load failed"),  # comments, CRLF
    ([ERROR[:10], ERROR[10:30], ERROR[30:]], "KV load failed"),  # an event split across chunks
    ([b'data: {"object": "error", "message": "boom"}\n\n'], "boom"),  # vLLM's error object
    ([b"data: not json\n\n", ERROR], None),
    ([b"event: x\n", b"\n", TOKEN], None),
    ([], None),
])
def test_the_first_data_event_is_read_and_the_stream_comes_back_whole(chunks, error):
    body, found, failure = asyncio.run(_peek(chunks))
    assert found == error and body == b"".join(chunks) and failure is None


def test_a_stream_that_breaks_before_its_first_event_breaks_for_its_reader():
    body, found, failure = asyncio.run(_peek([b": hello\n\n", b'data: {"cho'], broken=True))
    assert found is None and body == b': hello\n\ndata: {"cho' and isinstance(failure, httpx.ReadError)
