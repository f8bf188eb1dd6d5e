"""Mid-stream failover: when a worker dies while streaming, finish the stream on another worker.

Once a stream's first byte has reached the client the status (200) cannot change, and a stream that
just stops is a silent truncation the client may take for a complete answer. So the relay keeps what
the client has been sent (whole SSE events only: an event split across engine chunks is held back
until it is complete), and when the upstream breaks — connection lost, or no event with data for longer
than ``resilience.stream_idle_timeout_s`` (dribbled bytes and comments are no progress) — it:

1. rebuilds the request as a *continuation*: completions get the text sent so far appended to the
   prompt; chat gets an assistant message with the partial content and ``continue_final_message:
   true, add_generation_prompt: false`` (vLLM's chat template continues the last message instead of
   opening a new turn); ``max_tokens`` (and ``min_tokens``) shrink by the tokens already sent,
   counted as content-carrying chunks (vLLM sends one token per chunk; a multi-token chunk makes the
   budget slightly generous, never short);
2. routes it again, excluding the failed worker, and relays the new stream with the original
   ``id``/``created`` (the chat role-only opening chunk is dropped; ``usage`` moves the replayed
   tokens from prompt to completion), so the client sees one stream;
3. where that is impossible — ``n`` > 1, ``best_of``, logprobs, tools, structured output, ``echo``,
   ``suffix``, non-text or multiple prompts, a chat on an engine other than vLLM (or Dyad's
   simulator), no other worker, ``resilience.max_failovers`` used up, or a stream longer than
   ``gateway.max_answer_bytes`` (what was sent is kept only up to that bound: ``SseRecorder``; past it the
   stream is relayed on but cannot be replayed) — ends the stream with an SSE error event
   ``data: {"error": {...}}`` and ``data: [DONE]``.

The text of the continuation is not token-for-token what the dead engine would have produced
(sampling, and re-tokenizing the replayed text can merge tokens across the cut); at temperature 0 it
is the same text in practice. Only the failure path parses events; the healthy path finds event
boundaries with one ``rfind`` per chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from adapters.base import EngineKind
from orchestrator.errors import ApiError
from orchestrator.gateway import classify
from orchestrator.gateway.attempt import aborted_by_gateway
from orchestrator.gateway.executor import UpstreamCall
from orchestrator.gateway.stream_protocol import OpenAIChunks, StreamProtocol, protocol_for
from orchestrator.gateway.transport import raw_chunks

if TYPE_CHECKING:
    from orchestrator.fleet.worker import Worker
    from orchestrator.gateway.proxy import ProxyResponse

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
DONE_EVENT = b"data: [DONE]\n\n"
# Defaults the engine applies when max_tokens is absent (OpenAI and vLLM: 16 for completions).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_CHAT_CONTINUABLE = frozenset({EngineKind.VLLM, EngineKind.SIM})
MAX_PENDING_EVENT = 1 << 20  # an incomplete event longer than this is not SSE either
# After the protocol's end (``[DONE]``, a Responses terminal event) the body's own end is waited for this long
# (it normally comes in the same write); an engine that then closes, resets or keeps the connection open
# without ending the body has still answered whole: the stream is complete, the connection is not reused.
DONE_GRACE_S = 1.0
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


_REPEATABLE = frozenset({"reset", "garbage", "eof"})  # breaks that, repeated on a continuation, are the request's


def error_event(message: str, code: str | int = "upstream_stream_failed", type_: str = "upstream_error") -> bytes:
    """An SSE error event followed by ``[DONE]``: how a stream that cannot complete ends."""
    err = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + orjson.dumps(err) + b"\n\n" + DONE_EVENT


class SseRecorder:
    """Forwards whole SSE events only and keeps what was forwarded (for a continuation), up to ``limit`` bytes.

    Past ``limit`` (``gateway.max_answer_bytes`` for a relayed stream) the stream is no longer kept whole: ``cut``
    is set and ``sent`` holds only the first chunk relayed and the latest one with data (what an error ending
    reads: a Responses stream's ``response`` object and its last sequence number), so that what a stream keeps
    is bounded whatever its length. A cut stream that breaks is not continued (its text cannot be replayed).
    """

    __slots__ = ("pending", "sent", "done", "protocol", "cr_end", "limit", "kept", "cut")

    def __init__(self, protocol: StreamProtocol | None = None, limit: int | None = None) -> None:
        self.pending = b""
        self.cr_end = False  # the last chunk ended with CR: an LF starting the next one is part of that line end
        self.sent: list[bytes] = []
        self.done = False  # saw the protocol's honest end (data: [DONE] for OpenAI chunks)
        self.protocol = protocol or OpenAIChunks()  # stream_protocol.py: what ends this stream
        self.limit = limit  # the most bytes kept in ``sent`` (None: no bound)
        self.kept = 0  # bytes relayed so far (while not cut: the bytes in ``sent``)
        self.cut = False  # more than ``limit`` was relayed: ``sent`` is only [first chunk, latest chunk with data]

    def split(self, chunk: bytes) -> bytes:
        """The complete events in ``pending + chunk``; keeps the incomplete tail. Lines ended with CRLF or
        a lone CR (both allowed by SSE besides LF) are relayed ended with LF: a CR ends its line at once,
        and an LF right after it (in the next chunk too) belongs to it."""
        if not chunk:  # (nothing to split; a CR that ended the last chunk still waits for its LF)
            return b""
        if self.cr_end:
            self.cr_end = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\r" in chunk:
            self.cr_end = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        data = self.pending + chunk if self.pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            return b""
        self.pending = data[cut + 2:]
        return data[:cut + 2]

    def record(self, out: bytes) -> None:
        if self.protocol.ended(out):
            self.done = True
        if not out:
            return
        self.kept += len(out)
        if self.cut:
            if b"data:" in out:
                self.sent[-1] = out
        elif self.limit is not None and self.kept > self.limit:
            self.lose(out)
        else:
            self.sent.append(out)

    def lose(self, latest: bytes = b"") -> None:
        """Stop keeping the stream whole (it outgrew ``limit``, or the native plane did not keep it)."""
        self.cut = True
        self.sent = [self.sent[0] if self.sent else latest, latest]


def _events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of complete SSE events in ``raw``."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            out.append(line[5:].strip())
    return out


@dataclass
class SentStream:
    """What the client has received of a stream (choice 0 only; other choices make it non-continuable)."""

    id: str | None = None
    created: int | None = None
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    role_sent: bool = False
    other_choices: bool = False
    tool_calls: bool = False
    reasoning: bool = False
    errored: bool = False
    done: bool = False

    @property
    def content(self) -> str:
        return "".join(self.text)


def parse_sent(chunks: list[bytes], chat: bool) -> SentStream:
    s = SentStream()
    for payload in _events(b"".join(chunks)):
        if payload == b"[DONE]":
            s.done = True
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            s.errored = True
            continue
        if s.id is None and isinstance(obj.get("id"), str):
            s.id = obj["id"]
            s.created = obj.get("created") if isinstance(obj.get("created"), int) else None
        for ch in obj.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            if ch.get("index", 0) != 0:
                s.other_choices = True
                continue
            if chat:
                delta = ch.get("delta") or {}
                if delta.get("role"):
                    s.role_sent = True
                if delta.get("tool_calls"):
                    s.tool_calls = True
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    s.reasoning = True
                piece = delta.get("content")
            else:
                piece = ch.get("text")
            if isinstance(piece, str) and piece:
                s.text.append(piece)
                s.tokens += 1
            if ch.get("finish_reason"):
                s.finish_reason = ch["finish_reason"]
    return s


def why_not_continuable(endpoint: str, body: dict[str, Any], engine: EngineKind) -> str | None:
    """None when a broken stream of this request can be continued elsewhere; else the reason."""
    n = body.get("n")
    if n not in (None, 1):
        return "n > 1"
    if body.get("best_of") not in (None, 1):
        return "best_of"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        return "logprobs"
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none"):
        return "tools"
    rf = body.get("response_format")
    if (isinstance(rf, dict) and rf.get("type") not in (None, "text")) or any(body.get(k) for k in _STRUCTURED):
        return "structured output"
    if body.get("echo"):
        return "echo"
    if endpoint == CHAT:
        if engine not in _CHAT_CONTINUABLE:
            return f"chat continuation is not supported on {engine.value} engines"
        if body.get("continue_final_message"):
            return "the request already continues a message"
    else:
        if not isinstance(body.get("prompt"), str):
            return "the prompt is not a single string"
        if body.get("suffix"):
            return "suffix"
    return None


def continuation_body(endpoint: str, body: dict[str, Any], sent: SentStream) -> dict[str, Any] | None:
    """The request that produces the rest of the stream; None when the token budget is already spent."""
    out = dict(body)
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int):
            if v - sent.tokens < 1:
                return None
            out[key] = v - sent.tokens
    if endpoint != CHAT and body.get("max_tokens") is None:
        remaining = COMPLETIONS_DEFAULT_MAX_TOKENS - sent.tokens
        if remaining < 1:
            return None
        out["max_tokens"] = remaining
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - sent.tokens)
    if endpoint == CHAT:
        out["messages"] = [*body["messages"], {"role": "assistant", "content": sent.content}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        out["prompt"] = body["prompt"] + sent.content
    return out


class ContinuationRewriter:
    """Turns a continuation's events into events of the original stream (ids, role chunk, usage)."""

    def __init__(self, sent: SentStream, chat: bool) -> None:
        self.sent = sent
        self.chat = chat
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data
            return b""
        self._pending = data[cut + 2:]
        out = []
        for payload in _events(data[:cut + 2]):
            event = self._rewrite(payload)
            if event is not None:
                out.append(event)
        return b"".join(out)

    def _rewrite(self, payload: bytes) -> bytes | None:
        if payload == b"[DONE]":
            return DONE_EVENT
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return b"data: " + payload + b"\n\n"
        if not isinstance(obj, dict) or "error" in obj:
            return b"data: " + payload + b"\n\n"
        if self.sent.id is not None:
            obj["id"] = self.sent.id
        if self.sent.created is not None and "created" in obj:
            obj["created"] = self.sent.created
        choices = obj.get("choices") or []
        if self.chat and choices and not obj.get("usage"):
            ch = choices[0]
            delta = ch.get("delta") or {}
            if not ch.get("finish_reason") and not delta.get("content") and set(delta) <= {"role", "content"}:
                return None  # the opening role chunk: the client has it already
            delta.pop("role", None)
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            moved = self.sent.tokens
            usage["completion_tokens"] += moved
            if isinstance(usage.get("prompt_tokens"), int):
                usage["prompt_tokens"] = max(0, usage["prompt_tokens"] - moved)
        return b"data: " + orjson.dumps(obj) + b"\n\n"


def _final_length_event(sent: SentStream, chat: bool) -> bytes:
    """The closing chunk when the token budget ran out exactly at the cut."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["delta"] = {}
        obj = {"id": sent.id, "object": "chat.completion.chunk", "created": sent.created, "choices": [choice]}
    else:
        choice["text"] = ""
        obj = {"id": sent.id, "object": "text_completion", "created": sent.created, "choices": [choice]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"



class IdleTimer:
    """Calls ``expire(now)`` when no chunk came for a while, with one timer per idle period (the relay
    passes a callback that cancels its task; ``asyncio.Timeout.reschedule`` works too).

    Moving an ``asyncio.Timeout`` at every chunk (cancel one timer handle, push another) costs a heap
    operation twice per chunk; here a chunk only writes down when its wait ended, and the one timer,
    when it fires early, re-arms itself for the remaining time. Paused (between ``pause`` and
    ``resume``: the chunk is being relayed to a possibly slow client) it never expires.
    """

    __slots__ = ("_loop", "_expire", "_due", "_paused", "_idle", "_handle", "_armed")

    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[float], object], first_wait: float,
                 idle: float | None = None) -> None:
        """``idle``: the wait that will follow the first (when shorter, the one timer is armed for it at once,
        and re-arms for the rest of the first wait if it fires before: no timer moved at the first chunk)."""
        self._loop = loop
        self._expire = expire
        now = loop.time()
        self._due = now + first_wait
        self._idle = first_wait
        self._paused = False
        self._armed = now + idle if idle is not None and idle < first_wait else self._due
        self._handle: asyncio.TimerHandle | None = loop.call_at(self._armed, self._check)

    def pause(self) -> None:
        self._paused = True

    def unpause(self) -> None:
        """End a pause without counting it as progress: the idle period keeps its start (when the pause
        outlasted it, the check comes at the next re-arm, at most one idle period later)."""
        self._paused = False

    def resume(self, idle: float) -> None:
        self._idle = idle
        self._due = due = self._loop.time() + idle
        self._paused = False
        if due < self._armed and self._handle is not None:  # (the first wait was longer than the idle one)
            self._arm(due)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = when
        self._handle = self._loop.call_at(when, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def quiet_for(self) -> float:
        """Seconds since the last progress (``resume``), or since the timer started when none came yet:
        read only when asked (``Attempt.quiet_for``), so a chunk costs nothing more than ``resume``."""
        return self._loop.time() - (self._due - self._idle)

    def _check(self) -> None:
        now = self._loop.time()
        self._handle = None
        if self._paused:
            self._arm(now + self._idle)
        elif now >= self._due:
            self._expire(now)
        else:
            self._arm(self._due)


class StreamRelay:
    """Relays one stream to the client, continuing it on another worker when its worker fails.

    Every way a stream can end is either complete (the engine's ``data: [DONE]``) or an SSE error
    event followed by ``[DONE]``: an upstream that ends without ``[DONE]``, resets, goes silent,
    sends bytes that are not server-sent events, or is pulled by the gateway (its worker was marked
    down, or stalled) is a failure, continued elsewhere when the tokens can be replayed.

    Usage: a final usage chunk (asked for by the gateway when the client did not: ``strip_usage``)
    is read into ``proxy.usage`` and not relayed unless the client asked for it; without one, the
    content events relayed are the generated-token count.
    """

    def __init__(self, proxy: ProxyResponse) -> None:
        self.proxy = proxy
        self.rt = proxy.rt
        self.protocol = protocol_for(proxy.call.endpoint)  # how this stream ends (stream_protocol.py)
        # (what the client was sent is kept for a continuation up to the bound of a whole non-streamed answer:
        # past it the stream is relayed on, but a break ends it with an error event: SseRecorder)
        self.recorder = SseRecorder(self.protocol, self.rt.config.gateway.max_answer_bytes)
        self.chat = proxy.call.endpoint == CHAT
        self.failovers = 0
        self.breaks: list[str] = []  # how each upstream of this stream broke (kinds, in order)
        self.judge = classify.SecondOpinion()  # breaks held until the continuation shows whose they were
        self.events = 0  # data: events relayed
        self.held: list[bytes] | None = [] if self.protocol.holds_preamble else None  # (until the first token)
        self.held_bytes = 0  # (in ``held``: bounded as what the recorder keeps)
        self.on_bytes: Callable[[bytes], None] | None = None  # sees every body relayed (ITL: TokenTimer.on_bytes)

    async def run(self, send: Any, response: httpx.Response | None, on_bytes: Callable[[bytes], None] | None = None,
                  broken: tuple[str, str] | None = None) -> None:
        """``on_bytes``: called with each body relayed, before it is sent (``stream_timing.TokenTimer``).
        ``broken``: (kind, description) of a break that already happened elsewhere (the native data plane
        relayed the stream this far: what it sent is in ``recorder``); then ``response`` is None and the relay
        starts at the recovery."""
        self.on_bytes = on_bytes
        p = self.proxy
        rewriter: ContinuationRewriter | None = None
        while True:
            failure = broken or await self._pump(send, response, rewriter)  # type: ignore[arg-type]
            broken = None
            if failure is None:
                break
            worker = self._end_attempt(*failure)
            # (closed before a continuation opens: from its attempt on, every await is in _pump)
            if response is not None:
                await response.aclose()
            self.recorder.pending = b""  # the broken engine's unfinished event is never relayed
            self.recorder.cr_end = False
            ending, next_response, rewriter = await self._recover(worker, failure[1])
            if next_response is None:
                if ending:
                    await self._emit(send, ending)
                break
            response = next_response
            p.upstream = response  # the proxy closes whatever is current when it is done
        # Breaks held for the continuation's opinion: it ended without breaking the same way (complete, or no
        # other worker could take it), so they were their workers'. (A client that leaves first settles none.)
        p.settle_held(False, self.judge)
        p.done = True  # from here a disconnect is the end of our own response, not the client leaving
        content = self.events - (1 if self.recorder.done else 0) - (1 if self.chat else 0)
        p.relayed_tokens = max(0, self.protocol.content_events(self.events, self.recorder.done, content))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _emit(self, send: Any, out: bytes) -> None:
        self.recorder.record(out)
        if self.on_bytes is not None:
            self.on_bytes(out)
        await send({"type": "http.response.body", "body": out, "more_body": True})

    async def cut(self, send: Any, message: str, code: str) -> None:
        """The gateway ends the stream now (its total timeout, its worker pulled outside ``_pump``, its
        shutdown): the protocol's error ending unless the answer was already complete, then the end.
        The ending is not a token: ``on_bytes`` does not see it."""
        ending = b"" if self.recorder.done else self.protocol.error_ending(message, code, self.recorder.sent)
        self.recorder.record(ending)
        await send({"type": "http.response.body", "body": ending, "more_body": False})

    def _take_usage(self, out: bytes) -> bytes:
        """Read the usage object(s) in ``out``; drop usage-only events the client did not ask for."""
        p = self.proxy
        kept = []
        for event in out.split(b"\n\n"):
            if not event:
                continue
            if b'"usage"' in event and event.startswith(b"data:"):
                try:
                    obj = orjson.loads(event[5:].strip())
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                    p.usage = obj["usage"]
                    if p.strip_usage and not obj.get("choices"):
                        continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    async def _pump(self, send: Any, response: httpx.Response,
                    rewriter: ContinuationRewriter | None) -> tuple[str, str] | None:
        """Forward until the upstream completes (None) or fails: (kind, description)."""
        p = self.proxy
        res = self.rt.config.resilience
        loop = asyncio.get_running_loop()
        idle = res.stream_idle_timeout_s
        first_wait = self.rt.config.gateway.first_byte_timeout_s if not self.recorder.sent else idle
        chunks = raw_chunks(response)
        recorder = self.recorder
        first = True
        task = asyncio.current_task()
        assert task is not None
        went_idle = False

        def expire(now: float) -> None:  # (a plain task cancel: ``asyncio.timeout`` costs more per stream)
            nonlocal went_idle
            went_idle = True
            task.cancel()

        idle_timer = IdleTimer(loop, expire, first_wait, idle)
        if p.attempt is not None:
            p.attempt.progress = idle_timer  # (how long its stream has been quiet: Attempt.quiet_for)
        try:
            async for chunk in chunks:
                if recorder.done:  # bytes after the stream's end: it is complete, they are not relayed
                    break
                # (this response's first token — for OpenAI chunks its first bytes —, or a continuation's)
                if first and self.protocol.first_token(chunk):
                    p.mark_first_token()
                    first = False
                out = recorder.split(chunk)
                if not out:
                    if len(recorder.pending) > MAX_PENDING_EVENT:
                        return "garbage", f"the engine sent {len(recorder.pending)} bytes without an SSE event end"
                    continue  # (bytes of an unfinished event are no progress: the idle clock runs on)
                # Only an event with data is progress: bytes dribbled without an event end, or comments
                # alone, never hold the stream open past its idle timeout.
                progress = b"data:" in out
                # (what is not the protocol, and anything after its end, never reaches the client)
                out, problem, beyond_end = self.protocol.screen(out)
                if rewriter is not None and out:
                    out = rewriter.feed(out)
                if out and b'"usage"' in out:
                    out = self._take_usage(out) if self.protocol.continuable else self.protocol.take_usage(out, p)
                if self.held is not None:  # events before the first token wait for it (stream_protocol)
                    if problem is not None:
                        out = b""  # (nothing has reached the client: the stream starts over elsewhere)
                    else:
                        self.held.append(out)
                        self.held_bytes += len(out)
                        if recorder.limit is not None and self.held_bytes > recorder.limit:
                            return "garbage", f"the engine sent {self.held_bytes} bytes before its first token"
                        if first:
                            if progress:
                                idle_timer.resume(first_wait)
                            continue
                        out, self.held = b"".join(self.held), None
                if out:
                    self.events += out.count(b"data:")
                    idle_timer.pause()  # a slow client is not an idle engine
                    await self._emit(send, out)
                    if not progress:
                        idle_timer.unpause()
                if problem is not None:
                    return "garbage", f"the engine sent {problem}"
                if beyond_end:  # (the engine kept sending after its end: the stream is complete)
                    break
                if progress:
                    if recorder.done:  # the protocol's end: the answer is whole, only the body's own end is left
                        if p.attempt is not None:
                            p.attempt.abortable = False
                        idle_timer.resume(DONE_GRACE_S)
                    else:
                        idle_timer.resume(idle if not first else first_wait)
        except httpx.HTTPError as e:
            if not recorder.done:  # (after the protocol's end a broken body is no broken answer)
                return "reset", f"{type(e).__name__}: {e}"
        except asyncio.CancelledError:
            quiet = False
            if went_idle:
                task.uncancel()
                quiet = task.cancelling() == 0  # nothing else cancelled the task: the engine went quiet
            if not quiet:
                if not aborted_by_gateway(p.attempt):
                    raise
                return "aborted", p.attempt.aborted if p.attempt is not None and p.attempt.aborted else "aborted"
            if not recorder.done:
                return "idle", f"no data event from the engine for {first_wait if not recorder.sent else idle:g} s"
        finally:
            idle_timer.cancel()
        if recorder.done and p.attempt is not None:
            p.attempt.abortable = False
        if not recorder.done:
            if recorder.pending.strip():
                return "garbage", f"the engine stream ended inside an event: {recorder.pending[:60]!r}"
            return "eof", f"the engine ended the stream without {self.protocol.end_marker}"
        return None

    def _repeated(self) -> bool:
        """The last break is one this stream already had on another worker (a reset, garbage or an end
        without the protocol's end): what breaks it is the request (the continuation carries the same
        input), as for a 5xx the same request gets on a second worker (classify.py)."""
        return len(self.breaks) >= 2 and self.breaks[-1] in _REPEATABLE and self.breaks[-1] in self.breaks[:-1]

    def _blame(self, kind: str, failure: str) -> None:
        """End the failed attempt with its classified outcome (classify.py)."""
        attempt = self.proxy.attempt
        assert attempt is not None
        self.breaks.append(kind)
        if kind == "idle" and attempt.worker_progressed():
            attempt.request_failed()  # the worker serves others: this stream is slow, not the worker
        elif self._repeated():
            attempt.request_failed()  # the same break again: the request's doing, not this worker's
            self.proxy.settle_held(True, self.judge)  # (nor the earlier workers' it broke the same way on)
        elif kind == "aborted":
            attempt.worker_failed("stalled" if attempt.stalled else "down", failure)
        elif kind in _REPEATABLE:
            # Judged by the continuation, as a 5xx is by the next try (classify.py): it carries the same
            # input, so the same break there is the request's (a query of death), and a continuation that
            # ends well makes this the worker's (``run`` settles it). Meanwhile the worker stays in rotation
            # and its other streams go on: a dead engine refuses the next connection (out at once then),
            # and each of its own streams breaks and is continued by itself.
            attempt.request_failed()
            self.judge.hold(attempt.worker_id, "stream" if kind != "garbage" else "garbage")
        else:
            attempt.worker_failed("stream", f"stream broke: {failure}")

    def _end_attempt(self, kind: str, failure: str) -> Worker:
        """The broken upstream's attempt ends (classified); returns its worker."""
        attempt = self.proxy.attempt
        assert attempt is not None
        self._blame(kind, failure)
        self.proxy.attempt = None
        return attempt.decision.worker

    async def _recover(self, worker: Worker, failure: str) -> tuple[bytes, httpx.Response | None,
                                                                    ContinuationRewriter | None]:
        """After a broken upstream: the bytes that end the stream, or a continuation response to relay."""
        p = self.proxy
        rt = self.rt
        if self.recorder.done:
            return b"", None, None
        if not self.protocol.continuable:  # e.g. Responses events: their items live on the engine that began them
            if not self.recorder.sent and self.held is not None:
                return await self._start_over(failure)
            return self._give_up(f"the engine stream broke ({failure})",
                                 f"a {self.protocol.name} stream's items and ids belong to the engine that began it")
        if self.recorder.cut:  # (the stream was relayed on past the bound, not kept whole: it cannot be replayed)
            return self._give_up(f"the engine stream broke ({failure})",
                                 f"the answer was too long to continue elsewhere: longer than "
                                 f"gateway.max_answer_bytes ({self.recorder.limit} bytes)")
        sent = parse_sent(self.recorder.sent, self.chat)
        if sent.done or sent.errored:
            return DONE_EVENT if not sent.done else b"", None, None
        message = f"the engine stream broke after {sent.tokens} tokens ({failure})"
        res = rt.config.resilience
        reason = None
        if not res.stream_failover:
            reason = "resilience.stream_failover is off"
        elif self.failovers >= res.max_failovers:
            reason = f"resilience.max_failovers={res.max_failovers} reached"
        elif self._repeated():
            reason = f"it broke the same way ({self.breaks[-1]}) on {self.breaks.count(self.breaks[-1])} workers"
        elif sent.other_choices or sent.tool_calls or sent.reasoning:
            reason = "the stream has several choices, tool calls or reasoning"
        else:
            reason = why_not_continuable(p.call.endpoint, p.call.body, worker.engine)
        if reason is not None:
            return self._give_up(message, reason)
        if sent.finish_reason is not None:  # every token was sent; only the end markers were lost
            rt.metrics.stream_failovers.labels("completed").inc()
            return DONE_EVENT, None, None
        body = continuation_body(p.call.endpoint, p.call.body, sent)
        if body is None:
            rt.metrics.stream_failovers.labels("completed").inc()
            return _final_length_event(sent, self.chat) + DONE_EVENT, None, None
        self.failovers += 1
        call = UpstreamCall(endpoint=p.call.endpoint, body=body, request_id=p.call.request_id, model=p.call.model,
                            stream=True, headers=p.call.headers, prompt_tokens=p.call.prompt_tokens)
        try:
            next_attempt, _ = await p.open_attempt(call)
        except ApiError as e:
            return self._give_up(message, f"no worker could continue it: {e.message}")
        log.warning("request %s: stream on %s broke after %d tokens (%s); continuing on %s", p.call.request_id,
                    worker.id, sent.tokens, failure, next_attempt.worker_id)
        rt.metrics.stream_failovers.labels("continued").inc()
        assert next_attempt.response is not None
        return b"", next_attempt.response, ContinuationRewriter(sent, self.chat)

    async def _start_over(self, failure: str) -> tuple[bytes, httpx.Response | None, None]:
        """Nothing of this stream reached the client (its preamble was held back): route it again from
        the start, as before the first byte (the failed worker is excluded)."""
        p = self.proxy
        res = self.rt.config.resilience
        message = f"the engine stream broke before its first token ({failure})"
        if self.failovers >= res.max_failovers:
            return self._give_up(message, f"resilience.max_failovers={res.max_failovers} reached")
        if self._repeated():
            return self._give_up(message, f"it broke the same way ({self.breaks[-1]}) on "
                                          f"{self.breaks.count(self.breaks[-1])} workers")
        self.failovers += 1
        self.held = []
        self.held_bytes = 0
        self.recorder.pending = b""
        self.recorder.cr_end = False
        try:
            next_attempt, _ = await p.open_attempt(retry=True)
        except ApiError as e:
            return self._give_up(message, f"no worker could take it: {e.message}")
        log.warning("request %s: %s; started again on %s", p.call.request_id, message, next_attempt.worker_id)
        self.rt.metrics.stream_failovers.labels("restarted").inc()
        assert next_attempt.response is not None
        return b"", next_attempt.response, None

    def _give_up(self, message: str, reason: str) -> tuple[bytes, None, None]:
        self.rt.metrics.stream_failovers.labels("error_event").inc()
        self.proxy.status = 502
        self.proxy.error_class = "stream_failed"
        log.warning("request %s: %s; not continued: %s", self.proxy.call.request_id, message, reason)
        return self.protocol.error_ending(f"{message}; it could not be continued on another worker ({reason}).",
                                          "upstream_stream_failed", self.recorder.sent), None, None
