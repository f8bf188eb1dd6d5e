"""One client request, from routing to the last byte: attempts, retries, streaming, cancellation.

``ProxyResponse`` is an ASGI response. For each try it routes the annotated request, opens an
``Attempt`` (``attempt.py``: the try's accounting, from start to its classified end) and asks the
executor to open the upstream response. Until the first byte of a good answer nothing has reached
the client, so a try that fails is left behind and the request is routed again (up to
``gateway.max_attempts``, with backoff, skipping open breakers). What reaches the client is checked
first: a non-streamed answer must be a JSON object (garbage becomes a retry, then a 502), a stream
must be server-sent events (a 200 JSON error body becomes the error it is). Failures are classified
(``classify.py``): only the worker's own (connect errors, resets, stalls, garbage, a 5xx this
request does not get elsewhere) count against it. A watcher on the client connection cancels
everything if the client goes away: the upstream connection is closed, which makes vLLM abort.

Streams are relayed by ``failover.StreamRelay`` (whole SSE events, usage accounting, and a
continuation on another worker when the stream breaks); both meet only through this class's public
members (``attempt``, ``open_attempt``, ``mark_first_token``, ``done``, ``call``, ``req``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from orchestrator.errors import ApiError, GatewayTimeout, NoHealthyWorker, UpstreamError
from orchestrator.gateway import classify
from orchestrator.gateway.attempt import Attempt, aborted_by_gateway
from orchestrator.gateway.executor import AttemptFailed, UpstreamCall
from orchestrator.gateway.failover import StreamRelay
from orchestrator.gateway.responses import send_error
from orchestrator.gateway.stream_timing import TokenTimer
from orchestrator.gateway.transport import (
    AnswerTooLarge,
    MalformedAnswer,
    discard_connection,
    drop_idle,
    header,
    raw_headers,
    read_all,
)
from orchestrator.router.estimate import estimate_text_tokens
from orchestrator.router.types import RouteRequest
from orchestrator.telemetry import tracing
from orchestrator.telemetry.access_log import AccessRecord
from orchestrator.telemetry.children import request_children

if TYPE_CHECKING:
    from orchestrator.gateway.runtime import GatewayRuntime

log = logging.getLogger(__name__)
_PASS_HEADERS = (b"content-type",)  # (the gateway asks engines for identity encoding: it reads every answer)
_JITTER = random.Random()
# what an answer to each generation endpoint must carry (a list): without it, it is no answer
_ANSWER_LISTS = {"/v1/chat/completions": "choices", "/v1/completions": "choices", "/v1/responses": "output"}
WATCH_AFTER_S = 0.02  # the client watcher starts this late: a disconnect is seen within 20 ms more
ON_DISCONNECT = "dyad.on_disconnect"  # scope["extensions"][ON_DISCONNECT](callback or None): see http_server.py
_NO_EXTENSIONS: dict[str, Any] = {}
MAX_ERROR_BODY = 1 << 20  # an engine's non-stream answer to a stream request is read up to this


class _Retry(Exception):
    """This try failed in a way another worker may not: route again (``error`` if none is left)."""

    def __init__(self, error: ApiError) -> None:
        self.error = error


class ProxyResponse:
    def __init__(self, runtime: GatewayRuntime, call: UpstreamCall, req: RouteRequest, endpoint_label: str,
                 started: float, record: AccessRecord | None = None, strip_usage: bool = False,
                 extra_headers: list[tuple[bytes, bytes]] | None = None, pinned_away: frozenset[str] = frozenset()) -> None:
        self.rt = runtime
        self.call = call
        self.req = req
        self.endpoint_label = endpoint_label
        self.metrics = request_children(runtime.metrics, call.model, endpoint_label)  # (children: one look-up)
        self.started = started
        self.status = 0
        self.done = False  # our own response is complete: a disconnect from here on is not the client leaving
        self.attempt: Attempt | None = None  # the try whose answer is (being) relayed
        self.record = record or AccessRecord(request_id=call.request_id, model=call.model, endpoint=call.endpoint,
                                             stream=call.stream)
        self.root_span: tracing.OpenSpan = tracing.OpenSpan(None)  # dyad.request, begun by the route handler
        self.extra_headers = extra_headers or []  # e.g. x-ratelimit-* from intake
        self.strip_usage = strip_usage  # the gateway asked for the stream's usage chunk: do not relay it
        self.usage: dict[str, Any] | None = None  # the engine's usage, when it gave one
        self.relayed_tokens = 0  # content events relayed (the count when the engine gives no usage)
        self.error_class: str | None = None
        self._disconnected = False
        self._timed_out = False  # the request's total time ran out (``_time_out``)
        self._first_token_at: float | None = None
        # workers that failed this request (never tried again for it); ``pinned_away``: workers it must not use
        # (a /v1/responses continuation lives on the engine that stored its previous response)
        self._tried: set[str] = set(pinned_away)
        self._judge = classify.SecondOpinion()
        self.upstream: httpx.Response | None = None  # the engine response being relayed
        self._relay: StreamRelay | None = None  # the stream relay, from before the stream's headers are sent
        self._watcher: asyncio.Future[None] | None = None

    # --- ASGI entry ------------------------------------------------------------------------------

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        # The client leaving cancels the work. The gateway's connection protocol says so itself (ASGI
        # extension ``dyad.on_disconnect``: http_server.py); under another server a watcher task reads
        # ``receive``, started late because most answers are done before.
        on_disconnect = scope.get("extensions", _NO_EXTENSIONS).get(ON_DISCONNECT)
        if on_disconnect is not None:
            on_disconnect(lambda: self._client_left(task))
            start_watching = None
        else:
            start_watching = loop.call_later(WATCH_AFTER_S, self._start_watcher, receive, task)
        # A stream is bounded by its idle timeout (failover.py), and in total only if configured. The
        # bound is a plain timer that cancels the task (``asyncio.timeout`` costs ~5x as much per request).
        timeout = self.rt.config.resilience.stream_timeout_s if self.call.stream \
            else self.rt.config.gateway.request_timeout_s
        deadline = None if timeout is None else loop.call_later(timeout, self._time_out, task)
        try:
            if self.root_span.span is tracing.NO_SPAN:  # tracing off: no span to make current
                await self._run(send)
            else:
                with self.root_span.activate() as span:
                    span.set_attributes({"model": self.call.model, "stream": self.call.stream})
                    self.record.trace_id = span.trace_id_hex()
                    await self._run(send)
        except asyncio.CancelledError:
            if self._disconnected:  # the client left: the only end that writes nothing more
                task.uncancel()
                self.status = 499  # nginx's "client closed request"
                self.error_class = "client_gone"
                self.rt.metrics.client_disconnects.labels(self.call.model).inc()
                return
            if self._timed_out:
                task.uncancel()
                if task.cancelling() == 0:  # nothing but our deadline cancelled the task
                    await self._answer_timeout(send, timeout)
                    return
            elif aborted_by_gateway(self.attempt):
                # pulled between the checks that handle it (worker marked down): end honestly
                self.error_class = "worker_down"
                await self._answer_cut(send, UpstreamError(
                    502, "The worker serving the request was marked down.", code="worker_down"))
                return
            # Any other cancellation from inside the gateway (its shutdown cancelling what still runs
            # after the drain's grace and uvicorn's window): the answer ends honestly, then the task ends.
            task.uncancel()
            self.error_class = self.error_class or "gateway_cancelled"
            await self._answer_cut(send, ApiError(
                "The gateway stopped serving this request (it is shutting down); retry.", status=503,
                type="service_unavailable", code="gateway_cancelled"))
        except TimeoutError:  # (a timeout inside that nothing below handled: the same answer)
            await self._answer_timeout(send, timeout)
        except Exception:
            if self.status == 0 or self.done:
                raise  # (nothing sent yet: the server answers 500; all sent: nothing left to end)
            # a failure of the gateway's own code mid-stream: logged, and the stream still ends honestly
            log.exception("request %s: the stream relay failed", self.call.request_id)
            self.error_class = "gateway_error"
            await self._answer_cut(send, ApiError("The gateway failed while relaying the stream.",
                                                  code="gateway_error"))
        finally:
            if deadline is not None:
                deadline.cancel()
            self.root_span.end()
            self.done = True
            if start_watching is not None:
                start_watching.cancel()
            else:
                on_disconnect(None)
            if self._watcher is not None:
                self._watcher.cancel()
            self._finish()
            self._relay = None  # (it points back here: the collector need not free this request's objects)

    def _time_out(self, task: asyncio.Task[Any]) -> None:
        """The request's total time ran out (timer callback): cancel the work; ``__call__`` answers."""
        if not task.done():
            self._timed_out = True
            task.cancel()

    async def _answer_timeout(self, send: Any, timeout: float | None) -> None:
        self.rt.metrics.upstream_errors.labels(self._worker_label(), "timeout").inc()
        self.error_class = "timeout"
        which = "resilience.stream_timeout_s" if self.call.stream else "gateway.request_timeout_s"
        await self._answer_cut(send, GatewayTimeout(
            f"The request did not complete within {timeout:g} s ({which}).", code="timeout"))

    async def _answer_cut(self, send: Any, err: ApiError) -> None:
        """End an answer the gateway itself cut short (total timeout, worker marked down, shutdown), honestly:
        before anything was sent, ``err`` as the status and body; a stream whose headers are out gets its
        protocol's error ending (``StreamRelay.cut``: an SSE error event, then ``[DONE]``; for /v1/responses
        ``event: error`` + ``response.failed``); an answer already complete is left as it is."""
        if self.done:
            return
        self.done = True
        if self.status == 0:
            self.status = err.status
            await send_error(send, err, self._headers())
            return
        self.status = err.status  # (the client saw 200; the record and metrics say how it ended)
        if self._relay is not None:
            await self._relay.cut(send, err.message, err.code if isinstance(err.code, str) else "upstream_error")

    def _client_left(self, task: asyncio.Task[Any]) -> None:
        if not self.done:
            self._disconnected = True
            task.cancel()

    def _start_watcher(self, receive: Any, task: asyncio.Task[Any]) -> None:
        if not self.done:  # (a client that left meanwhile is seen at once: receive() says so)
            self._watcher = asyncio.ensure_future(self._watch_disconnect(receive, task))

    async def _watch_disconnect(self, receive: Any, task: asyncio.Task[Any]) -> None:
        # The body was read already, so the next message is http.disconnect: either the client
        # left, or (uvicorn) our own response completed. Only the first case cancels the work.
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.done:
                    self._disconnected = True
                    task.cancel()
                return

    def _worker_label(self) -> str:
        return self.attempt.worker_id if self.attempt else "none"

    def _headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-request-id", self.call.request_id.encode()), *self.extra_headers]
        if self.attempt is not None and self.rt.config.router.debug_headers:
            d = self.attempt.decision
            headers.append((b"x-dyad-worker", d.worker.id.encode()))
            headers.append((b"x-dyad-predicted-cached-tokens", str(d.predicted_cached_tokens).encode()))
            if d.prefill_worker is not None:
                headers.append((b"x-dyad-prefill-worker", d.prefill_worker.id.encode()))
        return headers

    # --- the exchange --------------------------------------------------------------------------

    async def _run(self, send: Any) -> None:
        try:
            attempt, body = await self.open_attempt()
        except ApiError as err:
            self.status = err.status
            self.done = True
            self.error_class = self.error_class or (err.code if isinstance(err.code, str) else "upstream_error")
            await send_error(send, err, self._headers())
            return
        response = self.upstream = attempt.response
        assert response is not None
        try:
            if self.call.stream:
                await self._stream(send, response)
            else:
                assert body is not None
                await self._whole(send, response, body)
        finally:
            await self.upstream.aclose()

    async def open_attempt(self, call: UpstreamCall | None = None, *,
                           retry: bool = False) -> tuple[Attempt, bytes | None]:
        """Route and send until a worker gives an answer worth relaying; returns its attempt (now
        ``self.attempt``) and, for a non-streamed call, the whole answer (already checked to be JSON).

        Workers that failed this request and workers whose breaker is open are skipped; each retry
        first waits ``Backoff.delay``. ``call`` replaces the client's request (a stream continuation);
        ``retry`` says an earlier try failed already. Raises the ``ApiError`` the client should get.
        """
        rt = self.rt
        call = call or self.call
        max_attempts = rt.config.gateway.max_attempts
        last_error: ApiError | None = None
        for attempt_no in range(max_attempts):
            if attempt_no or retry:
                await asyncio.sleep(rt.backoff.delay(attempt_no + (1 if retry else 0), _JITTER))
            blocked = rt.breakers.blocked(rt.clock.now())
            exclude = self._tried | blocked if blocked else self._tried
            traced = tracing.enabled()  # (off: no span objects or attribute dicts per request)
            try:
                if not traced:
                    decision = await rt.router.decide(self.req, exclude)
                else:
                    with tracing.span("dyad.route", policy=rt.router.policy.name) as route_span:
                        decision = await rt.router.decide(self.req, exclude)
                        route_span.set_attributes({
                            "worker": decision.worker.id, "predicted_cached_tokens": decision.predicted_cached_tokens,
                            "prefill_worker": decision.prefill_worker.id if decision.prefill_worker else ""})
            except NoHealthyWorker:
                self.settle_held(request_caused=False)  # no second opinion: the held 5xx were the workers'
                if last_error is not None:
                    raise last_error from None
                raise
            if attempt_no or retry:
                rt.metrics.retries.labels(call.model).inc()
            self._tried.add(decision.worker.id)  # (a prefill worker only once its leg failed: below)
            attempt = Attempt(rt, self.req, decision)
            self.record.attempts += 1
            self.record.workers.extend(attempt.workers())
            try:
                if not traced:
                    body = await self._try(attempt, call, last_try=attempt_no + 1 >= max_attempts)
                else:
                    with tracing.span("dyad.attempt", worker=decision.worker.id,
                                      role="decode" if decision.prefill_worker else "both") as span:
                        body = await self._try(attempt, call, last_try=attempt_no + 1 >= max_attempts)
                        span.set_attribute("outcome", "answered")
            except _Retry as r:
                last_error = r.error
                continue
            finally:
                if decision.failed_prefill:  # (P/D) a prefill worker that failed this request is not asked again
                    self._tried.update(decision.failed_prefill)
            self.attempt = attempt
            return attempt, body
        assert last_error is not None
        raise last_error

    async def _try(self, attempt: Attempt, call: UpstreamCall, last_try: bool) -> bytes | None:
        """One try: open, check what came back, classify any failure. Raises ``_Retry`` when another
        worker may do better, the client's ``ApiError`` when not."""
        rt = self.rt
        worker = attempt.decision.worker
        attempt.watch()  # the stall watchdog, until the first token (attempt.py)
        try:
            executor = rt.executor_for(attempt.decision) if call.generation else rt.executor
            response = attempt.response = await executor.open(call, attempt.decision)
            status = response.status_code
            try:
                if status >= 400:
                    raw = await self._read_bounded(response)
                    return self._error_status(attempt, status, raw, last_try, header(response, b"retry-after"))
                if status != 200:  # a redirect or another 2xx is no answer to these requests (1xx: skipped, transport.py)
                    await self._read_bounded(response)
                    return self._garbage(attempt, last_try, f"answered HTTP {status}", UpstreamError(
                        502, f"The engine ({worker.id}) answered HTTP {status}, which is no answer to this request.",
                        code="bad_engine_answer"))
                encoding = header(response, b"content-encoding")
                if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
                    discard_connection(response)
                    await response.aclose()
                    return self._unreadable(attempt, status, encoding)
                if not call.stream:
                    try:
                        body = await read_all(response, rt.config.gateway.max_answer_bytes)
                    except AnswerTooLarge as e:
                        return self._too_large(attempt, e.limit)
                    attempt.abortable = False
                    return self._check_json(attempt, status, body, response, last_try)
                ctype = header(response, b"content-type") or b""
                if b"event-stream" not in ctype:
                    discard_connection(response)
                    raw = await self._read_bounded(response)
                    return self._not_sse(attempt, raw, last_try)
            except httpx.HTTPError as e:  # the engine failed while its answer was read (before any byte was relayed)
                await response.aclose()
                # Judged as a connection closed before the answer (or, for a body that stopped coming, a stall;
                # bytes that are not HTTP, garbage): a request can cause it too, so the same break on a second
                # worker is the request's, and it takes the worker out only once another one answers.
                failure = classify.GARBAGE if isinstance(e, MalformedAnswer) else \
                    classify.STALLED if isinstance(e, httpx.TimeoutException) else classify.DROPPED
                return self._garbage(attempt, last_try, f"answer broke off: {type(e).__name__}: {e}", UpstreamError(
                    502, f"The answer from the engine ({worker.id}) broke off: {type(e).__name__}: {e}.",
                    code="upstream_broke_off"), failure)
            self.settle_held(request_caused=False)  # another worker streams it: held 5xx were the workers'
            return None
        except AttemptFailed as e:
            if e.kind == "timeout":
                # The first-byte timeout ran out while the worker kept working for others (the stall
                # watchdog would have pulled it otherwise): this request is slow, not the worker.
                attempt.request_failed()
                self.error_class = "timeout"
                raise GatewayTimeout(f"{e} (gateway.first_byte_timeout_s)", code="upstream_timeout") from None
            if e.kind == "protocol" and not e.reachable:  # closed before answering: judged like garbage (a
                # request may trip it too); held, it takes the worker out of rotation when another one answers
                return self._garbage(attempt, last_try, str(e), UpstreamError(
                    502, f"The engine ({worker.id}) closed the connection without answering this request: {e}.",
                    code="engine_closed_connection"), classify.DROPPED)
            attempt.worker_failed(e.kind, str(e), down=not e.reachable)
            if e.kind == "malformed":  # it answered, wrongly: a bad gateway, not an unavailable one
                self.error_class = "bad_engine_answer"
                raise _Retry(UpstreamError(502, f"The engine ({worker.id}): {e}.", code="bad_engine_answer")) from None
            raise _Retry(NoHealthyWorker(call.model, rt.config.gateway.retry_after_s,
                                         reason=f"{worker.id}: {e}")) from None
        except asyncio.CancelledError:
            if not aborted_by_gateway(attempt):
                attempt.cancelled()
                raise
            if attempt.response is not None:
                await attempt.response.aclose()
            kind = "stalled" if attempt.stalled else "down"
            err = NoHealthyWorker(call.model, rt.config.gateway.retry_after_s, reason=attempt.aborted or kind)
            if attempt.stalled:  # judged like garbage: a stall the same request gets on a second worker is its own
                # (no byte came back: its pooled connections may lead nowhere, so the next try connects afresh)
                drop_idle(rt.http, worker.url)
                return self._garbage(attempt, last_try, attempt.aborted or kind, err, classify.STALLED)
            attempt.worker_failed(kind, attempt.aborted or kind, down=False)
            raise _Retry(err) from None
        except (ApiError, _Retry):
            if attempt.outcome is None:  # an executor's own refusal (e.g. no SGLang prefill worker left)
                attempt.request_failed()
            raise
        except BaseException:
            attempt.cancelled()
            raise

    @staticmethod
    async def _read_bounded(response: httpx.Response) -> bytes:
        """An error or non-answer body, its first ``MAX_ERROR_BODY`` bytes (the rest is not read: the
        connection is closed); the response is closed."""
        try:
            return await read_all(response, MAX_ERROR_BODY)
        except AnswerTooLarge:
            return b""  # (its start is not kept: a cut JSON body would read as garbage; the status still speaks)
        finally:
            await response.aclose()

    def _too_large(self, attempt: Attempt, limit: int) -> None:
        """A non-streamed answer longer than ``gateway.max_answer_bytes``: no retry (the same request would
        produce as much elsewhere), held against nobody."""
        attempt.request_failed()
        self.settle_held(request_caused=False)
        self.error_class = "answer_too_large"
        raise UpstreamError(502, f"The engine's answer ({attempt.worker_id}) is longer than {limit} bytes "
                                 "(gateway.max_answer_bytes); ask for less (max_tokens, n, logprobs) or stream it.",
                            code="answer_too_large")

    def _unreadable(self, attempt: Attempt, status: int, encoding: bytes) -> None:
        """An answer in a content encoding the gateway did not ask for (it asks for identity): it cannot be
        checked, so it is not relayed; the worker's fault (another worker may do better)."""
        name = encoding[:40].decode("latin-1")
        attempt.worker_failed("garbage", f"answered with Content-Encoding {name!r}")
        self.settle_held(request_caused=False)
        self.error_class = "bad_engine_answer"
        raise _Retry(UpstreamError(502, f"The engine ({attempt.worker_id}) answered HTTP {status} with Content-Encoding "
                                        f"{name!r}; the gateway asks engines for identity encoding (uncompressed) "
                                        "so that it can check every answer.", code="bad_engine_answer"))

    def _error_status(self, attempt: Attempt, status: int, raw: bytes, last_try: bool,
                      retry_after: bytes | None = None) -> bytes | None:
        """An engine error answer: 4xx back to the client (the worker is fine); a 5xx is held for a
        second opinion from another worker (``classify.SecondOpinion``). A 429/503 says when to retry
        (``retry_after``: the engine's Retry-After header)."""
        err = classify.engine_error(status, raw, attempt.worker_id)
        if status in classify.RETRY_AFTER_STATUSES:
            err.headers["Retry-After"] = classify.retry_after(retry_after, self.rt.config.gateway.retry_after_s)
        if status not in classify.RETRY_STATUSES:
            attempt.request_failed(alive=True)
            self.settle_held(request_caused=True)
            self.error_class = "engine_rejected"
            raise err
        if self._judge.same_again(status):  # the same 5xx on a second worker: the request's doing
            attempt.request_failed()
            self.settle_held(request_caused=True)
            self.error_class = "engine_error"
            raise err
        if last_try or not self._other_worker_left(attempt):
            attempt.request_failed()
            self._judge.hold(attempt.worker_id, status)
            self.settle_held(request_caused=False)
            self.error_class = "engine_error"
            raise err
        attempt.request_failed()  # provisionally: judged by the next try
        self._judge.hold(attempt.worker_id, status)
        raise _Retry(err)

    def _other_worker_left(self, attempt: Attempt) -> bool:
        blocked = self.rt.breakers.blocked(self.rt.clock.now())
        return any(w.id not in self._tried and w.id not in blocked for w in self.rt.router.candidates(self.call.model))

    def settle_held(self, request_caused: bool, judge: classify.SecondOpinion | None = None) -> None:
        """Count the failures held for a second opinion against their workers, unless ``request_caused``.
        ``judge``: another holder than this request's tries (the stream relay's mid-stream breaks)."""
        judge = judge or self._judge
        if not judge.pending:  # (nothing held: the usual case)
            return
        rt = self.rt
        now = rt.clock.now()
        for wid, failure in judge.settle(request_caused):
            rt.metrics.upstream_errors.labels(wid, failure if isinstance(failure, str) else f"http_{failure}").inc()
            if failure in classify.UNCOUNTED_STATUSES:
                continue
            rt.breakers.record_failure(wid, now)
            w = rt.fleet.get(wid)
            if w is not None and failure in classify.UNAVAILABLE_STATUSES:
                rt.fleet.record_health(w, False, now, f"answered HTTP {failure}")
            elif w is not None and failure == classify.DROPPED:  # (it looks down: out of rotation now)
                rt.fleet.mark_failed(w, now, "closed the connection without answering")

    def _check_json(self, attempt: Attempt, status: int, body: bytes, response: httpx.Response,
                    last_try: bool) -> bytes:
        """A non-streamed answer must be a JSON object; a 200 carrying an error is that error."""
        try:
            obj = orjson.loads(body)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except (orjson.JSONDecodeError, ValueError):
            self._bad_answer(attempt, status, body, "is not JSON", "not a JSON object", last_try)
        bad = classify.error_in_answer(obj)
        if bad is not None:
            return self._error_status(attempt, bad[0], orjson.dumps({"error": bad[1]}), last_try)
        need = _ANSWER_LISTS.get(self.call.endpoint)
        if need is not None:
            answer = obj.get(need)
            if not isinstance(answer, list):
                self._bad_answer(attempt, status, body, f"has no {need}", f"a JSON object without {need}", last_try)
            if need == "choices" and not answer:  # (an empty output may be a response with nothing to say)
                self._bad_answer(attempt, status, body, "has no choice in choices", "an empty choices list", last_try)
        self.settle_held(request_caused=False)
        usage = obj.get("usage")
        self.usage = usage if isinstance(usage, dict) else None
        if self.usage is None:
            self.relayed_tokens = sum(estimate_text_tokens(_answer_text(c)) for c in obj.get("choices") or ()
                                      if isinstance(c, dict))
        return body

    def _bad_answer(self, attempt: Attempt, status: int, body: bytes, what: str, detail: str, last_try: bool) -> None:
        """A 200 whose body is not an answer (garbage): another worker may do better.
        (Its connection was released already: a whole answer read to its end leaves nothing behind.)"""
        snippet = body[:80].decode("utf-8", "replace")
        self._garbage(attempt, last_try, f"answered {detail}: {snippet!r}", UpstreamError(
            502, f"The engine ({attempt.worker_id}) answered HTTP {status} with a body that {what} ({len(body)} bytes, "
                 f"starting {snippet!r}).", code="bad_engine_answer"))

    def _garbage(self, attempt: Attempt, last_try: bool, message: str, err: ApiError,
                 failure: str = classify.GARBAGE) -> None:
        """An answer that is not one (or, ``failure`` STALLED, no sign of work on it), judged like a 5xx
        (``classify``): the same again on a second worker is the request's doing (an input that trips an
        engine bug, or keeps it busy without a sign), counted against nobody; where another worker answers
        it was the worker's. Tried elsewhere while a worker is left."""
        self.error_class = "bad_engine_answer" if failure == classify.GARBAGE else failure
        if self._judge.same_again(failure) and (failure == classify.GARBAGE or self._served_lately(attempt, failure)):
            attempt.request_failed()
            self.settle_held(request_caused=True)
            raise err
        if last_try or not self._other_worker_left(attempt):
            attempt.worker_failed(failure, message, down=failure == classify.DROPPED)  # no second opinion
            self.settle_held(request_caused=False)
            raise err
        attempt.request_failed()  # provisionally: judged by the next try
        self._judge.hold(attempt.worker_id, failure)
        raise _Retry(err)

    def _served_lately(self, attempt: Attempt, failure: str) -> bool:
        """Did a worker this request failed on that way answer any request shortly before (a first token or an
        answer within ``classify.SERVED_LATELY_STALLS`` stall timeouts of this try)? This try's worker, or one
        holding the same failure: an idle worker (a second decode worker that light traffic never reached) has
        no record, yet the same stall or drop on a worker that was serving others shows the input. An input
        that stalls or drops every worker leaves them answering others; engines that all hang or drop every
        request answer nothing, and their failures count."""
        window = classify.SERVED_LATELY_STALLS * self.rt.config.resilience.stall_timeout_s
        workers = [attempt.decision.worker]
        workers += [w for wid, f in self._judge.pending if f == failure and (w := self.rt.fleet.get(wid)) is not None]
        return any(w.last_progress_at is not None and attempt.started - w.last_progress_at < window for w in workers)

    def _not_sse(self, attempt: Attempt, raw: bytes, last_try: bool) -> None:
        """A stream request answered with something other than server-sent events."""
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        bad = classify.error_in_answer(obj)
        if bad is not None:
            self._error_status(attempt, bad[0], orjson.dumps({"error": bad[1]}), last_try)
            return None
        snippet = raw[:80].decode("utf-8", "replace")
        self._garbage(attempt, last_try, f"answered a stream request without server-sent events: {snippet!r}",
                      UpstreamError(502, f"The engine ({attempt.worker_id}) answered a stream request without "
                                         f"server-sent events (starting {snippet!r}).", code="bad_engine_answer"))

    def _response_headers(self, response: httpx.Response, with_length: bytes | None) -> list[tuple[bytes, bytes]]:
        headers = [(k.lower(), v) for k, v in raw_headers(response) if k.lower() in _PASS_HEADERS]
        if with_length is not None:
            headers.append((b"content-length", with_length))
        return headers + self._headers()

    async def _stream(self, send: Any, response: httpx.Response) -> None:
        relay = self._relay = StreamRelay(self)
        self.status = response.status_code
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": self._response_headers(response, None)})
        # Too late to change the status from here on: a broken upstream is continued on another
        # worker, or the stream ends with an SSE error event (failover.py; cut short by the gateway
        # itself: ``_answer_cut``).
        timer = TokenTimer(self.metrics.itl, relay.protocol.token_event,
                           relay.protocol.no_token_event)
        await relay.run(send, response, timer.on_bytes)  # ITL

    async def _whole(self, send: Any, response: httpx.Response, body: bytes) -> None:
        if self._first_token_at is None:
            self._first_token_at = time.perf_counter()
        self.status = response.status_code
        self.done = True
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": self._response_headers(response, str(len(body)).encode())})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        # The router's bookkeeping after the answer has left (the client does not wait for it; nothing
        # awaited in between: no other request decides first). The attempt can no longer be aborted.
        self.mark_first_token()

    # --- accounting ----------------------------------------------------------------------------

    def mark_first_token(self) -> None:
        if self._first_token_at is None:
            self._first_token_at = time.perf_counter()
            if self.call.stream:
                self.metrics.ttft.observe(self._first_token_at - self.started)
        if self.attempt is not None:
            self.attempt.first_token()

    def _finish(self) -> None:
        rt = self.rt
        attempt = self.attempt
        ok = 200 <= self.status < 400
        if attempt is not None:
            if ok:
                attempt.succeeded()
            elif self.status == 499:
                attempt.cancelled()
            else:
                attempt.request_failed()
        m = self.metrics  # (this request's metric children: telemetry/children.py)
        elapsed = time.perf_counter() - self.started
        m.inflight.dec()
        m.requests(str(self.status or 500)).inc()
        m.e2e.observe(elapsed)
        prompt, generated = self._token_counts()
        if prompt is not None:
            m.prompt_tokens.observe(prompt)
        if generated is not None:
            m.generation_tokens.observe(generated)
        rec = self.record
        rec.status = self.status or 500
        rec.error_class = None if ok else (self.error_class or "failed")
        rec.prompt_tokens = prompt
        rec.generated_tokens = generated
        rec.total_s = elapsed
        if self._first_token_at is not None:
            rec.ttft_s = self._first_token_at - self.started
            if generated and generated > 1 and self.call.stream:
                rec.itl_mean_s = (elapsed - rec.ttft_s) / (generated - 1)
        if attempt is not None:
            rec.cached_tokens = attempt.decision.predicted_cached_tokens
        rt.access_log.emit(rec)

    def _token_counts(self) -> tuple[int | None, int | None]:
        """Prompt and generated tokens: the engine's usage, else what was estimated and relayed.
        Only requests that got an answer are counted (a refusal generated nothing)."""
        if self._first_token_at is None or not self.call.generation:
            return None, None
        usage = self.usage
        prompt = generated = None
        if usage is not None:
            p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if p is None and c is None:  # the Responses API's names (/v1/responses)
                p, c = usage.get("input_tokens"), usage.get("output_tokens")
            prompt = p if isinstance(p, int) else None
            generated = c if isinstance(c, int) else None
        if prompt is None:
            prompt = self.req.prompt_tokens
        if generated is None:
            generated = self.relayed_tokens
        return prompt, generated


def _answer_text(choice: dict[str, Any]) -> str:
    text = choice.get("text")
    if isinstance(text, str):
        return text
    message = choice.get("message")
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return message["content"]
    return ""
