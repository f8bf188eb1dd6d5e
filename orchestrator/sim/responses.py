"""The simulated engine's OpenAI Responses API (``/v1/responses``), in vLLM 0.32's shape and event grammar.

``POST /v1/responses`` (streamed and not), ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.
As vLLM builds the prompt: ``instructions`` become a system message, a string ``input`` a user
message, message items their role and text; ``previous_response_id`` prepends that response's output
as an assistant message (404 when this engine does not hold it). Every answered response is kept
(the last ``STORE_MAX``; vLLM keeps them with ``VLLM_ENABLE_RESPONSES_API_STORE=1``), so the
gateway's id routing can be tested. A stream is what vLLM's simple (non-harmony) path sends:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
``response.completed`` (status ``incomplete`` when ``max_output_tokens`` ran out, as vLLM does).

Faults for this route (``POST /sim/faults {"responses_fault": MODE, "responses_fault_after": N}``;
after N text deltas; ``null`` turns it off): ``eof`` (the stream ends cleanly without a terminal
event), ``reset`` (the connection is cut), ``garbage`` (bytes that are not SSE, or a non-JSON 200 for a
non-streamed request), ``hang`` (nothing more until the client leaves), ``json_error_200`` (a stream
request answered with a 200 JSON error body; a non-streamed one with a 200 ``{"error": ...}``),
``error_event`` (the engine's own ``event: error`` ending, an honest end).
"""

from __future__ import annotations

import collections
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from orchestrator.sim.server import Receive, Scope, Send, SimServer

RESPONSE_FAULTS = frozenset({"eof", "reset", "garbage", "hang", "json_error_200", "error_event"})
STORE_MAX = 1024
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class ResponseStore:
    """The responses this engine answered (bounded: oldest out first)."""

    def __init__(self, max_entries: int = STORE_MAX) -> None:
        self.max_entries = max_entries
        self._d: collections.OrderedDict[str, tuple[dict[str, Any], list[bytes] | None]] = collections.OrderedDict()

    def put(self, resp: dict[str, Any], events: list[bytes] | None = None) -> None:
        self._d[resp["id"]] = (resp, events)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    def get(self, rid: str) -> dict[str, Any] | None:
        entry = self._d.get(rid)
        return entry[0] if entry is not None else None

    def events(self, rid: str) -> list[bytes] | None:
        entry = self._d.get(rid)
        return entry[1] if entry is not None else None


def input_messages(body: dict[str, Any], previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The chat messages vLLM renders from a Responses request (``construct_input_messages``)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if previous is not None:
        for item in previous.get("output") or ():
            for part in item.get("content") or ():
                messages.append({"role": "assistant", "content": part.get("text", "")})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    else:
        for item in inp or ():
            if isinstance(item, dict) and isinstance(item.get("role"), str):
                content = item.get("content")
                if isinstance(content, list):
                    content = [{"type": "text", "text": p.get("text", "")} for p in content if isinstance(p, dict)]
                messages.append({"role": item["role"], "content": content})
    return messages


def _usage(prompt: int, out: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + out}


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({"type": kind, "sequence_number": seq, **fields}) + b"\n\n")


async def _send(send: Send, body: bytes, more: bool = True, keep: list[bytes] | None = None) -> None:
    if keep is not None:
        keep.append(body)
    await send({"type": "http.response.body", "body": body, "more_body": more})


async def _wait_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def handle_create(server: SimServer, body: dict[str, Any], scope: Scope, receive: Receive,
                        send: Send) -> None:
    """POST /v1/responses."""
    from orchestrator.sim.server import (
        _ClientGone,
        _EngineDied,
        _GenParams,
        _HttpError,
        _send_json,
        _send_raw,
    )

    server._check_model(body)
    inp = body.get("input")
    if not isinstance(inp, (str, list)) or not inp:
        raise _HttpError(400, "'input' must be a non-empty string or a list of input items", "input")
    if body.get("background"):
        raise _HttpError(400, "This simulated engine does not support the background mode.", "background")
    prev_id = body.get("previous_response_id")
    previous = None
    if prev_id is not None:
        previous = server.response_store.get(prev_id) if isinstance(prev_id, str) else None
        if previous is None:
            raise _HttpError(404, f"Response with id '{prev_id}' not found.", "response_id", "invalid_request_error")
    mot = body.get("max_output_tokens")
    if mot is not None and (isinstance(mot, bool) or not isinstance(mot, int) or mot < 1):
        raise _HttpError(400, "'max_output_tokens' must be a positive integer", "max_output_tokens")
    stream = body.get("stream") is True
    prompt_ids = server.tokenizer.encode_chat(input_messages(body, previous))
    request_id = server._request_id(scope)
    g = _GenParams(prompt_ids, mot, stream, False, False, None, None, request_id)
    resp_id = "resp_" + uuid.uuid4().hex
    msg_id = "msg_" + uuid.uuid4().hex
    created = int(time.time())
    base = {"id": resp_id, "object": "response", "created_at": created, "model": server.config.model,
            "instructions": body.get("instructions"), "max_output_tokens": mot, "metadata": body.get("metadata"),
            "parallel_tool_calls": True, "previous_response_id": prev_id, "temperature": body.get("temperature"),
            "tool_choice": "auto", "tools": [], "top_p": body.get("top_p"), "background": False,
            "truncation": "disabled", "error": None, "incomplete_details": None, "user": body.get("user")}
    fault = server.config.responses_fault
    after = server.config.responses_fault_after
    dec = server.tokenizer.decode
    if not stream and fault == "garbage":
        await _send_raw(send, 200, b"<html>simulated garbage</html>", b"text/html")
        return
    if fault == "json_error_200":
        await _send_json(send, 200, {"error": {"message": "simulated engine error in a 200 answer",
                                               "type": "InternalServerError", "param": None, "code": 500}})
        return
    pieces: list[str] = []
    sent: list[bytes] = []  # a streamed response's events, kept for GET ...?stream=true
    last = None
    started = False
    seq = 0

    def final(status: str) -> dict[str, Any]:
        text = "".join(pieces)
        item = {"id": msg_id, "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]}
        out = {**base, "status": status, "output": [item],
               "usage": _usage(len(prompt_ids), len(pieces), last.num_cached_tokens if last else 0)}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    try:
        async with contextlib.aclosing(server._generate_outputs(g, receive)) as outputs:
            async for o in outputs:
                words = dec(o.token_ids()).split(" ") if o.times else []
                if not stream:
                    pieces.extend((" " if pieces or i else "") + w for i, w in enumerate(words))
                    last = o
                    continue
                if not started:
                    started = True
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
                    opening = {**base, "status": "in_progress", "output": [], "usage": None}
                    item = {"id": msg_id, "type": "message", "role": "assistant", "status": "in_progress",
                            "content": []}
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    await _send(send, _event("response.created", 0, response=opening)
                                + _event("response.in_progress", 1, response=opening)
                                + _event("response.output_item.added", 2, output_index=0, item=item)
                                + _event("response.content_part.added", 3, item_id=msg_id, output_index=0,
                                         content_index=0, part=part), keep=sent)
                    seq = 4
                for w in words:
                    if fault is not None and len(pieces) >= after:
                        await _fault(fault, seq, send, receive)
                        return
                    delta = (" " if pieces else "") + w
                    pieces.append(delta)
                    await _send(send, _event("response.output_text.delta", seq, item_id=msg_id, output_index=0,
                                             content_index=0, delta=delta, logprobs=[]), keep=sent)
                    seq += 1
                last = o
    except _HttpError:
        if started:
            raise _EngineDied() from None
        raise
    except _ClientGone:
        raise
    status = "incomplete" if last is not None and last.finish_reason == "length" else "completed"
    resp = final(status)
    if not stream:
        server.response_store.put(resp)
        await _send_json(send, 200, resp)
        return
    if fault is not None:  # the answer was shorter than responses_fault_after: the fault comes at its end
        await _fault(fault, seq, send, receive)
        return
    text = "".join(pieces)
    item = resp["output"][0]
    await _send(send, _event("response.output_text.done", seq, item_id=msg_id, output_index=0, content_index=0,
                             text=text, logprobs=[])
                + _event("response.content_part.done", seq + 1, item_id=msg_id, output_index=0, content_index=0,
                         part=item["content"][0])
                + _event("response.output_item.done", seq + 2, output_index=0, item=item)
                + _event("response.completed", seq + 3, response=resp), more=False, keep=sent)
    server.response_store.put(resp, b"".join(sent).split(b"\n\n")[:-1])


async def _fault(fault: str, seq: int, send: Send, receive: Receive) -> None:
    from orchestrator.sim.server import _ClientGone, _EngineDied

    if fault == "eof":
        await _send(send, b"", more=False)
    elif fault == "reset":
        raise _EngineDied()
    elif fault == "garbage":
        await _send(send, b"<html>simulated garbage</html>\n\n", more=False)
    elif fault == "error_event":
        err = {"type": "error", "code": "server_error", "message": "simulated engine failure", "param": None,
               "sequence_number": seq}
        await _send(send, b"event: error\ndata: " + orjson.dumps(err) + b"\n\n", more=False)
    elif fault == "hang":
        await _wait_gone(receive)
        raise _ClientGone()


async def handle_retrieve(server: SimServer, scope: Scope, send: Send) -> None:
    """GET /v1/responses/{id}; ``?stream=true&starting_after=N`` replays a streamed response's events after
    sequence number N (vLLM does this for background responses). The ``eof`` fault cuts a replay after
    ``responses_fault_after`` events."""
    from urllib.parse import parse_qs

    from orchestrator.sim.server import _HttpError, _send_json

    rid = scope["path"][len("/v1/responses/"):]
    resp = server.response_store.get(rid)
    if resp is None:
        raise _HttpError(404, f"Response with id '{rid}' not found.", "response_id", "invalid_request_error")
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("stream", ["false"])[0].lower() not in ("true", "1"):
        await _send_json(send, 200, resp)
        return
    events = server.response_store.events(rid)
    if events is None:
        raise _HttpError(400, f"Unknown response_id: {rid}", "response_id")
    after = query.get("starting_after", [None])[0]
    start = int(after) + 1 if after is not None and after.lstrip("-").isdigit() else 0
    events = events[start:]
    if server.config.responses_fault == "eof":
        events = events[:server.config.responses_fault_after]
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    await _send(send, b"".join(e + b"\n\n" for e in events), more=False)


async def handle_cancel(server: SimServer, scope: Scope, send: Send) -> None:
    from orchestrator.sim.server import _HttpError

    rid = scope["path"][len("/v1/responses/"):-len("/cancel")]
    if server.response_store.get(rid) is None:
        raise _HttpError(404, f"Response with id '{rid}' not found.", "response_id", "invalid_request_error")
    raise _HttpError(400, "Cannot cancel a synchronous response.", "response_id", "invalid_request_error")


def set_faults(server: SimServer, body: dict[str, Any]) -> dict[str, Any]:
    """The ``responses_fault`` / ``responses_fault_after`` part of ``POST /sim/faults``."""
    from orchestrator.sim.server import _HttpError

    c = server.config
    if "responses_fault" in body:
        mode = body["responses_fault"]
        if mode is not None and mode not in RESPONSE_FAULTS:
            raise _HttpError(400, f"'responses_fault' must be null or one of {sorted(RESPONSE_FAULTS)}",
                             "responses_fault")
        c.responses_fault = mode
    if "responses_fault_after" in body:
        after = body["responses_fault_after"]
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise _HttpError(400, "'responses_fault_after' must be a non-negative integer", "responses_fault_after")
        c.responses_fault_after = after
    return {"responses_fault": c.responses_fault, "responses_fault_after": c.responses_fault_after}
