"""One client request, from routing to the last byte: attempts, retries, streaming, cancellation.

``ProxyResponse`` is an ASGI response. It routes the request, opens the upstream response
through an executor, and passes the engine's bytes to the client unchanged (SSE included: no
re-encoding). Until the first byte of a successful answer nothing has reached the client, so a
worker that cannot be reached, or answers 5xx, is left out and the request is routed again (up to
``gateway.max_attempts``). A watcher on the client connection cancels everything if the client
goes away: the upstream connection is closed, which makes vLLM abort the request.

Failure handling lives beside it: retries wait a jittered exponential backoff and skip workers
whose circuit breaker is open (``resilience.py``); a stream whose worker dies is continued on
another worker or ended with an SSE error event (``failover.py``).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from orchestrator.errors import ApiError, GatewayTimeout, NoHealthyWorker, UpstreamError
from orchestrator.gateway.executor import AttemptFailed, UpstreamCall
from orchestrator.gateway.failover import StreamRelay
from orchestrator.gateway.fastpath import child, usage_of
from orchestrator.gateway.responses import engine_error_body, send_bytes, send_error
from orchestrator.gateway.stream_timing import TokenTimer
from orchestrator.gateway.transport import read_all
from orchestrator.router.types import RouteDecision, RouteRequest
from orchestrator.telemetry import tracing
from orchestrator.telemetry.access_log import AccessRecord

if TYPE_CHECKING:
    from orchestrator.gateway.runtime import GatewayRuntime

RETRY_STATUSES = frozenset({500, 502, 503, 504})  # answered before any byte: another worker may do better
UNAVAILABLE_STATUSES = frozenset({502, 503})  # the engine says it cannot serve: counts against its health
_PASS_HEADERS = (b"content-type", b"content-encoding")
_JITTER = random.Random()
WATCH_AFTER_S = 0.02  # the client watcher starts this late: a disconnect is seen within 20 ms more


class _Attempt:
    __slots__ = ("decision", "response")

    def __init__(self, decision: RouteDecision, response: httpx.Response) -> None:
        self.decision = decision
        self.response = response


class ProxyResponse:
    def __init__(self, runtime: GatewayRuntime, call: UpstreamCall, req: RouteRequest, endpoint_label: str,
                 started: float) -> None:
        self.rt = runtime
        self.call = call
        self.req = req
        self.endpoint_label = endpoint_label
        self.started = started
        self.status = 0
        self._disconnected = False
        self._done = False
        self._attempt: _Attempt | None = None
        self._first_token_at: float | None = None
        self._tried: set[str] = set()  # workers that failed this request (never tried again for it)
        self.upstream: httpx.Response | None = None  # the engine response being relayed
        self._watcher: asyncio.Future[None] | None = None
        self._legs: list[tuple[str, str]] = []  # (worker, role) of every attempt and P/D leg (access log)
        self._usage: tuple[int | None, int | None] = (None, None)  # prompt, completion tokens (engine usage)
        self._error_class: str | None = None
        self._trace_id: str | None = None
        self.client_key_id: str | None = None  # the client key's name, set by the route (access log)

    # --- ASGI entry ------------------------------------------------------------------------------

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        # The client watcher is a task of its own; most answers are done before it would start.
        start_watching = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start_watcher, receive, task)
        try:
            # A stream is bounded by its idle timeout (failover.py), and in total only if configured.
            timeout = self.rt.config.resilience.stream_timeout_s if self.call.stream \
                else self.rt.config.gateway.request_timeout_s
            with tracing.span("dyad.request", incoming=scope.get("headers", ()), model=self.call.model,
                              endpoint=self.call.endpoint, stream=self.call.stream) as root:
                self._trace_id = root.trace_id_hex()
                async with asyncio.timeout(timeout):
                    await self._run(send)
        except asyncio.CancelledError:
            if not self._disconnected:
                raise
            task.uncancel()
            self.status = 499  # nginx's "client closed request"
            self.rt.metrics.client_disconnects.labels(self.call.model).inc()
        except TimeoutError:
            self.rt.metrics.upstream_errors.labels(self._worker_label(), "timeout").inc()
            if self.status == 0:
                self.status = 504
                self._done = True
                which = "resilience.stream_timeout_s" if self.call.stream else "gateway.request_timeout_s"
                await send_error(send, GatewayTimeout(
                    f"The request did not complete within {timeout:g} s ({which}).", code="timeout"),
                    self._headers())
        finally:
            self._done = True
            start_watching.cancel()
            if self._watcher is not None:
                self._watcher.cancel()
            self._finish()

    def _start_watcher(self, receive: Any, task: asyncio.Task[Any]) -> None:
        if not self._done:  # (a client that left meanwhile is seen at once: receive() says so)
            self._watcher = asyncio.ensure_future(self._watch_disconnect(receive, task))

    async def _watch_disconnect(self, receive: Any, task: asyncio.Task[Any]) -> None:
        # The body was read already, so the next message is http.disconnect: either the client
        # left, or (uvicorn) our own response completed. Only the first case cancels the work.
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self._done:
                    self._disconnected = True
                    task.cancel()
                return

    def _worker_label(self) -> str:
        return self._attempt.decision.worker.id if self._attempt else "none"

    def _headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-request-id", self.call.request_id.encode())]
        if self._attempt is not None and self.rt.config.router.debug_headers:
            d = self._attempt.decision
            headers.append((b"x-dyad-worker", d.worker.id.encode()))
            headers.append((b"x-dyad-predicted-cached-tokens", str(d.predicted_cached_tokens).encode()))
            if d.prefill_worker is not None:
                headers.append((b"x-dyad-prefill-worker", d.prefill_worker.id.encode()))
        return headers

    # --- the exchange --------------------------------------------------------------------------

    async def _run(self, send: Any) -> None:
        try:
            attempt = await self._open()
            if not self.call.stream and attempt.response.status_code < 400:
                body = await self._read_whole(attempt)
        except ApiError as err:
            self.status = err.status
            self._error_class = err.code if isinstance(err.code, str) else type(err).__name__
            self._done = True
            await send_error(send, err, self._headers())
            return
        assert self._attempt is not None  # _read_whole may have moved to another worker
        response = self.upstream = self._attempt.response
        try:
            if response.status_code >= 400:
                raw = await response.aread()
                self.status = response.status_code
                self._done = True
                await send_bytes(send, response.status_code, engine_error_body(response.status_code, raw),
                                 headers=self._headers())
            elif self.call.stream:
                await self._stream(send, response)
            else:
                await self._whole(send, response, body)
        finally:
            await self.upstream.aclose()

    async def _read_whole(self, attempt: _Attempt) -> bytes:
        """A non-streamed answer, read in full before the client sees anything: if the engine dies
        while sending it, the request is sent again elsewhere (within ``gateway.max_attempts``)."""
        attempts = 1
        while True:
            try:
                return await read_all(attempt.response)
            except httpx.HTTPError as e:
                await attempt.response.aclose()
                self._attempt_failed(attempt.decision, AttemptFailed(
                    attempt.decision.worker, "protocol", f"answer broke off: {type(e).__name__}: {e}",
                    reachable=False))
                self._attempt = None
                attempts += 1
                if attempts > self.rt.config.gateway.max_attempts:
                    raise NoHealthyWorker(self.call.model, self.rt.config.gateway.retry_after_s,
                                          reason=f"the answer broke off on every attempt: {e}") from None
                attempt = await self._open(retry=True)
                if attempt.response.status_code >= 400:
                    raw = await attempt.response.aread()
                    await attempt.response.aclose()
                    raise UpstreamError(attempt.response.status_code, orjson.loads(
                        engine_error_body(attempt.response.status_code, raw))["error"]["message"]) from None

    def _attempt_failed(self, decision: RouteDecision, e: AttemptFailed) -> None:
        rt = self.rt
        now = rt.clock.now()
        rt.router.finish(decision, self.req, ok=False)
        rt.metrics.upstream_errors.labels(e.worker.id, e.kind).inc()
        rt.breakers.record_failure(e.worker.id, now)
        if not e.reachable:
            rt.fleet.mark_failed(e.worker, now, str(e))

    async def _open(self, call: UpstreamCall | None = None, *, retry: bool = False) -> _Attempt:
        """Route and send until a worker answers something other than a retryable failure.

        Workers that failed this request, and workers whose circuit breaker is open, are skipped;
        each retry first waits ``Backoff.delay`` (``resilience.backoff_*``). ``call`` replaces the
        client's request (a stream continuation); ``retry`` says an earlier attempt failed already.
        """
        rt = self.rt
        call = call or self.call
        max_attempts = rt.config.gateway.max_attempts
        tried = self._tried
        last_error: ApiError | None = None
        for attempt_no in range(max_attempts):
            if attempt_no or retry:
                await asyncio.sleep(rt.backoff.delay(attempt_no + (1 if retry else 0), _JITTER))
            blocked = rt.breakers.blocked(rt.clock.now())
            try:
                with tracing.span("dyad.route") as route_span:
                    decision = await rt.router.route(self.req, call.body, call.endpoint,
                                                     tried | blocked if blocked else tried)
                    route_span.set_attributes({
                        "policy": decision.policy, "worker": decision.worker.id,
                        "prefill_worker": decision.prefill_worker.id if decision.prefill_worker else None,
                        "predicted_cached_tokens": decision.predicted_cached_tokens})
            except NoHealthyWorker:
                if last_error is not None:
                    raise last_error from None
                raise
            if attempt_no or retry:
                rt.metrics.retries.labels(call.model).inc()
            worker = decision.worker
            tried.add(worker.id)
            if decision.prefill_worker is not None:
                tried.add(decision.prefill_worker.id)
            rt.router.begin(decision, self.req)
            probe = rt.breakers.dispatched(worker.id)
            if decision.prefill_worker is not None:
                self._legs.append((decision.prefill_worker.id, "prefill"))
            self._legs.append((worker.id, "decode" if decision.prefill_worker is not None else worker.role.value))
            try:
                with tracing.span("dyad.attempt", worker=worker.id, role=self._legs[-1][1]) as attempt_span:
                    response = await rt.executor_for(decision).open(call, decision)
                    attempt_span.set_attribute("outcome", f"http_{response.status_code}")
            except AttemptFailed as e:
                self._attempt_failed(decision, e)
                if e.kind == "timeout":  # the engine may still be working on it: do not send it twice
                    raise GatewayTimeout(str(e), code="upstream_timeout") from None
                last_error = NoHealthyWorker(call.model, rt.config.gateway.retry_after_s,
                                             reason=f"attempt {attempt_no + 1} failed: {e}")
                continue
            except BaseException:
                rt.router.finish(decision, self.req, ok=False)
                raise
            finally:
                if probe:
                    rt.breakers.probe_done(worker.id)
            status = response.status_code
            if status in RETRY_STATUSES:
                rt.breakers.record_failure(worker.id, rt.clock.now())
            else:
                rt.breakers.record_success(worker.id, rt.clock.now())
            if status in RETRY_STATUSES and attempt_no + 1 < max_attempts:
                raw = await response.aread()
                await response.aclose()
                rt.router.finish(decision, self.req, ok=False)
                rt.metrics.upstream_errors.labels(worker.id, f"http_{status}").inc()
                if status in UNAVAILABLE_STATUSES:
                    rt.fleet.record_health(worker, False, rt.clock.now(), f"answered HTTP {status}")
                last_error = UpstreamError(status, orjson.loads(engine_error_body(status, raw))["error"]["message"])
                continue
            self._attempt = _Attempt(decision, response)
            return self._attempt
        assert last_error is not None
        raise last_error

    def _response_headers(self, response: httpx.Response, with_length: bytes | None) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in response.headers.raw if k.lower() in _PASS_HEADERS]
        if with_length is not None:
            headers.append((b"content-length", with_length))
        return headers + self._headers()

    async def _stream(self, send: Any, response: httpx.Response) -> None:
        self.status = response.status_code
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": self._response_headers(response, None)})
        # Too late to change the status from here on: a broken upstream is continued on another
        # worker, or the stream ends with an SSE error event (failover.py).
        relay = StreamRelay(self)
        await relay.run(TokenTimer(child(self.rt.metrics.itl, self.call.model)).wrap(send), response)  # ITL
        self._observe_usage_sse(relay.usage_tail or relay.tail)

    async def _whole(self, send: Any, response: httpx.Response, body: bytes) -> None:
        self._mark_first_token()
        self.status = response.status_code
        self._done = True
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": self._response_headers(response, str(len(body)).encode())})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        if not response.headers.get("content-encoding"):
            self._observe_usage(usage_of(body))  # only the usage object is parsed

    # --- accounting ----------------------------------------------------------------------------

    def _mark_first_token(self) -> None:
        self._first_token_at = time.perf_counter()
        if self._attempt is not None:
            self.rt.router.first_token(self._attempt.decision, self.req)
        if self.call.stream:
            child(self.rt.metrics.ttft, self.call.model).observe(self._first_token_at - self.started)

    def _observe_usage_sse(self, tail: bytes) -> None:
        idx = tail.rfind(b'"usage"')
        if idx < 0:
            return
        start = tail.rfind(b"data: ", 0, idx)
        end = tail.find(b"\n", idx)
        if start < 0:
            return
        try:
            self._observe_usage(orjson.loads(tail[start + 6:end if end > 0 else None]).get("usage"))
        except (orjson.JSONDecodeError, AttributeError):
            pass

    def _observe_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        m = self.rt.metrics
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        self._usage = (prompt if isinstance(prompt, int) else None, completion if isinstance(completion, int) else None)
        if isinstance(prompt, int):
            child(m.prompt_tokens, self.call.model).observe(prompt)
        if isinstance(completion, int):
            child(m.generation_tokens, self.call.model).observe(completion)

    def _finish(self) -> None:
        rt = self.rt
        if self._attempt is not None:
            rt.router.finish(self._attempt.decision, self.req, ok=200 <= self.status < 400)
        model = self.call.model
        m = rt.metrics  # (children cached per label values: fastpath.child)
        child(m.inflight, model).dec()
        child(m.requests, model, self.endpoint_label, str(self.status or 500)).inc()
        elapsed = time.perf_counter() - self.started
        child(m.e2e, model, self.endpoint_label).observe(elapsed)
        # The access-log record (orchestrator/telemetry/access_log.py; a no-op unless access_log.enabled).
        access = getattr(rt, "access_log", None)  # set at start (orchestrator/telemetry/install.py)
        if access is not None and access.enabled:
            status = self.status or 500
            ttft = self._first_token_at - self.started if self._first_token_at is not None else None
            prompt, generated = self._usage
            itl = (elapsed - ttft) / (generated - 1) if self.call.stream and ttft is not None and generated \
                and generated > 1 else None
            error = None if 200 <= status < 400 else (self._error_class or ("client_gone" if status == 499
                                                                             else f"http_{status}"))
            access.emit(AccessRecord(
                request_id=self.call.request_id, model=model, endpoint=self.call.endpoint, stream=self.call.stream,
                workers=list(self._legs), attempts=sum(1 for _, role in self._legs if role != "prefill"),
                status=status, error_class=error, prompt_tokens=prompt,
                cached_tokens=self._attempt.decision.predicted_cached_tokens if self._attempt else None,
                generated_tokens=generated, ttft_s=ttft, itl_mean_s=itl, total_s=elapsed,
                client_key_id=self.client_key_id, trace_id=self._trace_id))
