"""How a relayed stream ends honestly, keyed by the stream's protocol (the endpoint that produced it).

A stream relayed to a client has two honest endings: the engine's own complete end, or an error the
client's SDK recognises, written by the gateway before the connection closes. Anything else — EOF,
reset, a stall, bytes that are not server-sent events, a 200 JSON error body — must never look like
a complete answer. What "complete" and "error" look like depends on the protocol:

* **OpenAI chunks** (``/v1/chat/completions``, ``/v1/completions``): ``data:`` chunks ending with
  ``data: [DONE]``; a failure ends with ``data: {"error": {...}}`` then ``data: [DONE]``. A broken
  stream can be continued on another worker (``failover.py``).
* **Responses events** (``/v1/responses``): typed events (``event: response.created`` ...
  ``response.output_text.delta`` ...) ending with a terminal event — ``response.completed``,
  ``response.failed``, ``response.incomplete`` or ``error`` (the engine reporting its own failure).
  There is no ``[DONE]``. A failure ends with ``event: error`` followed by ``event: response.failed``
  (the response object with ``status: "failed"`` and its ``error``), numbered after the last
  ``sequence_number`` the client saw, as OpenAI's Responses API ends a failed stream. Such a stream
  is not continued elsewhere: its output items, ids and sequence numbers belong to the engine that
  started it (and a stored response lives only there).

``StreamRelay`` (``failover.py``) asks ``protocol_for(endpoint)`` and uses only this interface.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

DONE_EVENT = b"data: [DONE]\n\n"
RESPONSES = "/v1/responses"
RESPONSE_TERMINALS = frozenset({b"response.completed", b"response.failed", b"response.incomplete", b"error"})
_TERMINAL_HINTS = (b"response.completed", b"response.failed", b"response.incomplete", b"error")
_FIRST_TOKEN_HINTS = (b".delta\n", b'.delta"', b"event: response.completed", b"event: response.failed",
                      b"event: response.incomplete", b"event: error", b'"type":"error"')


_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")
_NO_CHOICE = "a stream that ended without any choice (every event had an empty choices list)"


def bad_event(event: bytes) -> str | None:
    """What is wrong with one whole SSE event (no trailing blank line) for a JSON stream: a line that is
    no SSE field, or data that is not a JSON object (``[DONE]`` aside); None for a good event. A
    client's SDK parses every ``data:`` payload as JSON, so one bad event breaks its stream."""
    if event.startswith(b"data: {") and b"\n" not in event:  # (the usual event: one JSON data line)
        try:
            orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return f"an event whose data is not JSON: {event[:60]!r}"
        return None
    data = []
    for line in event.split(b"\n"):
        if line and not line.startswith(_SSE_FIELDS):  # (an empty line only separates events)
            return f"bytes that are not server-sent events: {line[:60]!r}"
        if line.startswith(b"data:"):
            data.append(line[5:].strip())
    if not data:
        return None  # a comment or an event name alone (keep-alive)
    payload = b"\n".join(data)
    if payload == b"[DONE]":
        return None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        return f"an event whose data is not a JSON object: {event[:60]!r}"
    return None


def sse_fields(event: bytes) -> tuple[bytes | None, bytes | None]:
    """(event name, data payload) of one whole SSE event (``data`` lines joined by newlines)."""
    name = None
    data: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            name = line[6:].strip()
        elif line.startswith(b"data:"):
            data.append(line[5:].strip())
    return name, (b"\n".join(data) if data else None)


class StreamProtocol:
    """One stream protocol's ending rules (see the module docstring)."""

    name = "base"
    end_marker = ""  # what a complete stream ends with, for messages
    continuable = False  # a broken stream may be continued on another worker (failover.py)
    holds_preamble = False  # events before the first token are held back until it comes (see first_token)
    token_event = b"data: {"  # how a token-carrying event starts (stream_timing.TokenTimer counts these)
    no_token_event: bytes | None = b'"choices":[]'  # ... unless it also holds this (a usage-only event)

    def first_token(self, chunk: bytes) -> bool:
        """True when ``chunk`` (raw engine bytes) carries the first generated token or the end."""
        return True

    def ended(self, out: bytes) -> bool:
        """True when ``out`` (whole events, as relayed) holds the stream's honest end."""
        raise NotImplementedError

    def screen(self, out: bytes) -> tuple[bytes, str | None, bool]:
        """``out`` (whole events as the engine sent them) cut to what may reach the client: (the events
        before the first bad one, what is wrong with that one or None, whether the cut removed events
        after the stream's end). Nothing after the honest end reaches the client (``end_event``)."""
        n = len(out)
        if out.startswith(b"data: {") and out.find(b"\n") == n - 2:  # (the usual chunk: one JSON event)
            try:
                orjson.loads(memoryview(out)[6:-2])
                return out, None, False
            except orjson.JSONDecodeError:
                return b"", f"an event whose data is not JSON: {out[:60]!r}", False
        start = 0
        while start < n:
            end = out.find(b"\n\n", start)
            if end < 0:  # (``SseRecorder.split`` hands over whole events only)
                end = n
            event = out[start:end]
            if event:
                problem = bad_event(event)
                if problem is not None:
                    return out[:start], problem, False
                if self.end_event(event):
                    return out[:end + 2], None, end + 2 < n
            start = end + 2
        return out, None, False

    def end_event(self, event: bytes) -> bool:
        """True for the event that ends a complete stream (nothing after it is relayed)."""
        return False

    def error_ending(self, message: str, code: str, sent: list[bytes]) -> bytes:
        """The bytes that end a stream which cannot complete; ``sent`` is what the client has received."""
        raise NotImplementedError

    def take_usage(self, out: bytes, proxy: Any) -> bytes:
        """Read the engine's usage from ``out`` into ``proxy.usage``; returns what to relay."""
        return out

    def content_events(self, relayed_events: int, done: bool, out_tokens: int) -> int:
        """Generated tokens by count of relayed events (used only when the engine gives no usage)."""
        return out_tokens


class OpenAIChunks(StreamProtocol):
    """OpenAI chunks. A stream must carry at least one choice (or the engine's error) before its
    ``[DONE]``: one whose events all have ``choices: []`` is an empty answer, not a complete one (its
    ``[DONE]`` is not relayed; the relay fails it like any bad event)."""

    name = "openai_chunks"
    end_marker = "data: [DONE]"
    continuable = True

    def __init__(self) -> None:
        self.answered = False  # an event with a choice (or an error) was screened

    def ended(self, out: bytes) -> bool:
        if out.endswith(DONE_EVENT) or out.endswith(b"data:[DONE]\n\n"):  # (how engines end: the usual case)
            return True
        # ``[DONE]`` as any SSE event whose data is ``[DONE]`` (``screen`` cuts there, so it is the last one)
        return b"[DONE]" in out and out.endswith(b"\n\n") and self.end_event(out[:-2].rsplit(b"\n\n", 1)[-1])

    def end_event(self, event: bytes) -> bool:
        """The event whose data is ``[DONE]``, with other SSE fields (``id:``, ``event:``, comments) or
        whitespace around it too: ``bad_event`` passes such an event as the end and the client's SDK reads it
        as the end, so the stream is complete there (it was judged broken after it: the worker blamed, and
        events after it relayed)."""
        if event == b"data: [DONE]" or event == b"data:[DONE]":
            return True
        return b"[DONE]" in event and sse_fields(event)[1] == b"[DONE]"

    def screen(self, out: bytes) -> tuple[bytes, str | None, bool]:
        if out == DONE_EVENT:  # (the end of every stream, alone in its chunk)
            return (out, None, False) if self.answered else (b"", _NO_CHOICE, False)
        n = len(out)
        if out.startswith(b"data: {") and out.find(b"\n") == n - 2:  # (the usual chunk: one JSON event)
            try:
                obj = orjson.loads(memoryview(out)[6:-2])
            except orjson.JSONDecodeError:
                return b"", f"an event whose data is not JSON: {out[:60]!r}", False
            if not self.answered and isinstance(obj, dict) and (obj.get("choices") or "error" in obj):
                self.answered = True
            return out, None, False
        good, problem, beyond_end = super().screen(out)
        if self.answered:
            return good, problem, beyond_end
        start = 0
        while start < len(good):  # (until the first choice: then ``answered`` skips this)
            end = good.find(b"\n\n", start)
            end = len(good) if end < 0 else end
            _, data = sse_fields(good[start:end])
            if data == b"[DONE]":
                return good[:start], _NO_CHOICE, False
            obj = _loads(data)
            if obj is not None and (obj.get("choices") or "error" in obj):
                self.answered = True
                break
            start = end + 2
        return good, problem, beyond_end

    def error_ending(self, message: str, code: str, sent: list[bytes]) -> bytes:
        err = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
        return b"data: " + orjson.dumps(err) + b"\n\n" + DONE_EVENT


class ResponsesEvents(StreamProtocol):
    """The Responses API's typed events. ``response.created``, ``response.in_progress`` and the opening
    ``output_item``/``content_part`` events come before the engine has computed anything: they are held
    back until the first ``*.delta`` (or a terminal event), so that the first byte the client gets is
    the first token, TTFT means the same as for chat, and a stream that breaks before its first token
    is tried again on another worker from the start (nothing of it reached the client)."""

    name = "responses_events"
    end_marker = "a terminal event (response.completed, response.failed, response.incomplete or error)"
    continuable = False
    holds_preamble = True
    token_event = b".delta\n"  # the end of an "event: response.<...>.delta" line (newlines in JSON are escaped)
    no_token_event = None

    def first_token(self, chunk: bytes) -> bool:
        return any(h in chunk for h in _FIRST_TOKEN_HINTS)

    def __init__(self) -> None:
        self.text_deltas = 0  # response.output_text.delta events relayed (generated tokens without usage)

    def ended(self, out: bytes) -> bool:
        self.text_deltas += out.count(b"event: response.output_text.delta\n")
        if not any(t in out for t in _TERMINAL_HINTS):  # (text deltas, the bulk of a stream, stop here)
            return False
        for event in out.split(b"\n\n"):
            name, data = sse_fields(event)
            if name is None and data is not None:  # no event line: the data's own "type" names it
                name = _data_type(data)
            if name in RESPONSE_TERMINALS:
                return True
        return False

    def end_event(self, event: bytes) -> bool:
        if not any(t in event for t in _TERMINAL_HINTS):
            return False
        name, data = sse_fields(event)
        if name is None and data is not None:
            name = _data_type(data)
        return name in RESPONSE_TERMINALS

    def take_usage(self, out: bytes, proxy: Any) -> bytes:
        for event in out.split(b"\n\n"):
            if b'"usage"' not in event:
                continue
            _, data = sse_fields(event)
            obj = _loads(data)
            response = obj.get("response") if obj is not None else None
            if isinstance(response, dict) and isinstance(response.get("usage"), dict):
                proxy.usage = response["usage"]
        return out

    def content_events(self, relayed_events: int, done: bool, out_tokens: int) -> int:
        return self.text_deltas

    def error_ending(self, message: str, code: str, sent: list[bytes]) -> bytes:
        created = last_sequence = None
        for chunk in sent:
            for event in chunk.split(b"\n\n"):
                _, data = sse_fields(event)
                obj = _loads(data)
                if obj is None:
                    continue
                seq = obj.get("sequence_number")
                if isinstance(seq, int) and not isinstance(seq, bool):
                    last_sequence = seq
                if created is None and isinstance(obj.get("response"), dict):
                    created = obj["response"]
        seq = 0 if last_sequence is None else last_sequence + 1
        error = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": seq}
        response: dict[str, Any] = {"id": None, "object": "response", "created_at": int(time.time()),
                                    "model": None, "output": [], "usage": None}
        if created is not None:
            response = {**created, "output": [], "usage": None}
        response["status"] = "failed"
        response["error"] = {"code": "server_error", "message": message}
        failed = {"type": "response.failed", "sequence_number": seq + 1, "response": response}
        return (b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"
                + b"event: response.failed\ndata: " + orjson.dumps(failed) + b"\n\n")


def _loads(data: bytes | None) -> dict[str, Any] | None:
    if not data:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _data_type(data: bytes) -> bytes | None:
    obj = _loads(data)
    t = obj.get("type") if obj is not None else None
    return t.encode() if isinstance(t, str) else None


def protocol_for(endpoint: str) -> StreamProtocol:
    """The ending rules of the stream an endpoint produces (a fresh object per stream: it may count)."""
    if endpoint == RESPONSES:
        return ResponsesEvents()
    return OpenAIChunks()
