"""What a relayed stream keeps for its continuation is bounded (``SseRecorder.limit``: gateway.max_answer_bytes).

The integration side (both data planes: a long stream that breaks ends with an error event, a short one is
continued) is tests/integration/test_stream_memory.py.
"""

from __future__ import annotations

import json

import orjson

from orchestrator.gateway.failover import SseRecorder, parse_sent
from orchestrator.gateway.stream_protocol import OpenAIChunks, ResponsesEvents


def text_event(i: int) -> bytes:
    return b"data: " + orjson.dumps({"id": "x", "choices": [{"index": 0, "text": f"t{i} "}]}) + b"\n\n"


def test_below_the_limit_every_chunk_is_kept_for_the_continuation():
    r = SseRecorder(OpenAIChunks(), limit=1 << 20)
    for i in range(100):
        r.record(text_event(i))
    assert not r.cut and len(r.sent) == 100
    assert parse_sent(r.sent, chat=False).content == "".join(f"t{i} " for i in range(100))


def test_past_the_limit_the_recorder_keeps_a_bounded_amount_however_long_the_stream():
    """Relaying 10 MB through a recorder bounded at 4 KiB keeps two chunks (the first and the latest): before,
    ``sent`` held all 10 MB."""
    limit = 4096
    r = SseRecorder(OpenAIChunks(), limit=limit)
    relayed = 0
    i = 0
    while relayed < 10_000_000:
        e = text_event(i)
        r.record(e)
        relayed += len(e)
        i += 1
        assert sum(map(len, r.sent)) <= limit + 2 * len(e)  # (at every step, not only at the end)
    assert r.cut and r.kept == relayed
    assert r.sent == [text_event(0), text_event(i - 1)]
    r.record(b": keep-alive\n\n")  # (a chunk without data does not replace the latest one with data)
    assert r.sent[-1] == text_event(i - 1)
    r.record(b"data: [DONE]\n\n")
    assert r.done  # (the end is still seen)


def test_the_cut_comes_at_the_chunk_that_would_pass_the_limit():
    e = text_event(0)
    r = SseRecorder(OpenAIChunks(), limit=3 * len(e))
    for _ in range(3):
        r.record(e)
    assert not r.cut and len(r.sent) == 3
    r.record(e)
    assert r.cut and len(r.sent) == 2


def test_no_limit_keeps_everything():
    r = SseRecorder(OpenAIChunks())
    for i in range(1000):
        r.record(text_event(i))
    assert not r.cut and len(r.sent) == 1000


def test_a_cut_responses_stream_still_ends_with_the_next_sequence_number_and_its_response():
    """The Responses error ending reads the ``response`` object (first chunk) and the last sequence number
    (latest chunk): both survive the cut."""
    created = {"type": "response.created", "sequence_number": 0,
               "response": {"id": "resp_1", "object": "response", "status": "in_progress", "model": "m"}}
    p = ResponsesEvents()
    r = SseRecorder(p, limit=2048)
    r.record(b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n")
    for seq in range(1, 500):
        delta = {"type": "response.output_text.delta", "sequence_number": seq, "delta": "x"}
        r.record(b"event: response.output_text.delta\ndata: " + orjson.dumps(delta) + b"\n\n")
    assert r.cut and len(r.sent) == 2
    ending = p.error_ending("broke", "upstream_stream_failed", r.sent)
    events = [json.loads(line[6:]) for line in ending.decode().split("\n") if line.startswith("data: ")]
    assert events[0]["type"] == "error" and events[0]["sequence_number"] == 500
    assert events[1]["type"] == "response.failed" and events[1]["sequence_number"] == 501
    assert events[1]["response"]["id"] == "resp_1" and events[1]["response"]["status"] == "failed"


def test_lose_marks_a_stream_the_native_plane_did_not_keep():
    r = SseRecorder(OpenAIChunks(), limit=4096)
    r.lose()
    assert r.cut and not r.done


class _Upstream:
    """A stored Responses stream as ``relay_stream`` reads it (``aiter_raw``): ``n`` events, then a reset."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def aiter_raw(self):
        import httpx

        yield b"event: response.created\ndata: " + orjson.dumps(
            {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress"}}) + b"\n\n"
        for i in range(1, self.n):
            yield b"event: response.output_text.delta\ndata: " + orjson.dumps(
                {"type": "response.output_text.delta", "sequence_number": i, "delta": "x" * 2000}) + b"\n\n"
            if i % 97 == 0:
                yield b": keep-alive\n\n"  # (a chunk without data: not the latest with data)
        raise httpx.ReadError("reset by the engine")


def test_a_replayed_responses_stream_that_breaks_keeps_two_chunks_and_ends_numbered_on():
    """``GET /v1/responses/{id}?stream=true`` (responses_api.relay_stream) kept every relayed chunk for its error
    ending; it needs only the response object (first chunk) and the last sequence number (latest chunk with
    data). 40 MB relayed: the peak of what stays allocated is a small fraction of it, and the ending is right."""
    import asyncio
    import tracemalloc

    from orchestrator.gateway.responses_api import relay_stream

    n = 20_000
    bodies: list[int] = []
    endings: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            bodies.append(len(message["body"]))
            if not message.get("more_body"):
                endings.append(message["body"])

    tracemalloc.start()
    try:
        complete = asyncio.run(relay_stream(send, _Upstream(n), []))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    relayed = sum(bodies)
    assert not complete and relayed > 40_000_000
    assert peak < relayed / 10, (peak, relayed)
    events = [e for e in endings[0].split(b"\n\n") if e]
    error = json.loads(events[0].split(b"data: ", 1)[1])
    failed = json.loads(events[1].split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["sequence_number"] == n and "reset by the engine" in error["message"]
    assert failed["type"] == "response.failed" and failed["sequence_number"] == n + 1
    assert failed["response"]["id"] == "resp_1" and failed["response"]["status"] == "failed"
