"""``EngineClient``: httpx's answers without their reference cycle (answer ↔ bound stream), for answers
read whole and streamed ones once closed. Any transport: here httpx's in-memory ``MockTransport``."""

from __future__ import annotations

import gc
import weakref

import httpx
import pytest

from orchestrator.gateway.transport import EngineClient


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for c in self.chunks:
            yield c


def _app(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, stream=_Chunks(b"ok ", request.url.path.encode()))


async def _answer(client: httpx.AsyncClient, how: str) -> tuple[weakref.ref, bytes]:
    """One answer, read as ``how`` says; a weak reference to it and its body (the answer itself is dropped)."""
    if how == "whole":
        r = await client.get("http://engine/health")
        body = r.content
    elif how == "send-stream":
        r = await client.send(client.build_request("GET", "http://engine/metrics"), stream=True)
        body = b"".join([c async for c in r.aiter_raw()])
        await r.aclose()
    else:
        async with client.stream("GET", "http://engine/v1/models") as r:
            body = await r.aread()
    assert r.is_closed
    return weakref.ref(r), body


@pytest.mark.parametrize("how", ["whole", "send-stream", "stream-context"])
async def test_an_answer_is_freed_by_reference_counts_once_done(how):
    gc.disable()  # (so that only reference counting frees anything during the test)
    try:
        async with EngineClient(transport=httpx.MockTransport(_app)) as client:
            ref, body = await _answer(client, how)
            assert body.startswith(b"ok /")
            assert ref() is None
        async with httpx.AsyncClient(transport=httpx.MockTransport(_app)) as plain:
            ref, _ = await _answer(plain, how)
            assert ref() is not None  # (httpx's own client: the cycle EngineClient undoes is there)
    finally:
        gc.enable()
