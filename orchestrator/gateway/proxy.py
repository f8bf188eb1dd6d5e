"""One client request, from routing to the last byte: attempts, retries, streaming, cancellation.

``ProxyResponse`` is an ASGI response. It routes the request, opens the upstream response
through an executor, and passes the engine's bytes to the client unchanged (SSE included: no
re-encoding). Until the first byte of a successful answer nothing has reached the client, so a
worker that cannot be reached, or answers 5xx, is left out and the request is routed again (up to
``gateway.max_attempts``). A watcher on the client connection cancels everything if the client
goes away: the upstream connection is closed, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from orchestrator.errors import ApiError, GatewayTimeout, NoHealthyWorker, UpstreamError
from orchestrator.gateway.executor import AttemptFailed, UpstreamCall
from orchestrator.gateway.responses import engine_error_body, send_bytes, send_error
from orchestrator.router.types import RouteDecision, RouteRequest

if TYPE_CHECKING:
    from orchestrator.gateway.runtime import GatewayRuntime

RETRY_STATUSES = frozenset({500, 502, 503, 504})  # answered before any byte: another worker may do better
UNAVAILABLE_STATUSES = frozenset({502, 503})  # the engine says it cannot serve: counts against its health
_PASS_HEADERS = (b"content-type", b"content-encoding")


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

    # --- ASGI entry ------------------------------------------------------------------------------

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(self._watch_disconnect(receive, task))
        try:
            timeout = self.rt.config.gateway.request_timeout_s
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
                await send_error(send, GatewayTimeout(
                    f"The request did not complete within {self.rt.config.gateway.request_timeout_s:g} s "
                    "(gateway.request_timeout_s).", code="timeout"), self._headers())
        finally:
            self._done = True
            watcher.cancel()
            self._finish()

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
        except ApiError as err:
            self.status = err.status
            self._done = True
            await send_error(send, err, self._headers())
            return
        response = attempt.response
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
                await self._whole(send, response)
        finally:
            await response.aclose()

    async def _open(self) -> _Attempt:
        """Route and send until a worker answers something other than a retryable failure."""
        rt = self.rt
        max_attempts = rt.config.gateway.max_attempts
        tried: set[str] = set()
        last_error: ApiError | None = None
        for attempt_no in range(max_attempts):
            try:
                decision = await rt.router.route(self.req, self.call.body, self.call.endpoint, tried)
            except NoHealthyWorker:
                if last_error is not None:
                    raise last_error from None
                raise
            if attempt_no:
                rt.metrics.retries.labels(self.call.model).inc()
            worker = decision.worker
            tried.add(worker.id)
            if decision.prefill_worker is not None:
                tried.add(decision.prefill_worker.id)
            rt.router.begin(decision, self.req)
            try:
                response = await rt.executor_for(decision).open(self.call, decision)
            except AttemptFailed as e:
                rt.router.finish(decision, self.req, ok=False)
                rt.metrics.upstream_errors.labels(e.worker.id, e.kind).inc()
                if not e.reachable:
                    rt.fleet.mark_failed(e.worker, rt.clock.now(), str(e))
                if e.kind == "timeout":  # the engine may still be working on it: do not send it twice
                    raise GatewayTimeout(str(e), code="upstream_timeout") from None
                last_error = NoHealthyWorker(self.call.model, rt.config.gateway.retry_after_s,
                                             reason=f"attempt {attempt_no + 1} failed: {e}")
                continue
            except BaseException:
                rt.router.finish(decision, self.req, ok=False)
                raise
            status = response.status_code
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
        tail = b""
        try:
            async for chunk in response.aiter_raw():
                if self._first_token_at is None:
                    self._mark_first_token()
                tail = chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as e:
            # Too late to change the status: end the stream with an SSE error event, as vLLM does.
            self.rt.metrics.upstream_errors.labels(self._worker_label(), "stream").inc()
            self.status = 502
            err = {"error": {"message": f"upstream stream broke: {type(e).__name__}: {e}",
                             "type": "upstream_error", "param": None, "code": 502}}
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(err) + b"\n\n",
                        "more_body": True})
        self._done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._observe_usage_sse(tail)

    async def _whole(self, send: Any, response: httpx.Response) -> None:
        chunks = [chunk async for chunk in response.aiter_raw()]
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._mark_first_token()
        self.status = response.status_code
        self._done = True
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": self._response_headers(response, str(len(body)).encode())})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        if b'"usage"' in body and not response.headers.get("content-encoding"):
            try:
                self._observe_usage(orjson.loads(body).get("usage"))
            except (orjson.JSONDecodeError, AttributeError):
                pass

    # --- accounting ----------------------------------------------------------------------------

    def _mark_first_token(self) -> None:
        self._first_token_at = time.perf_counter()
        if self._attempt is not None:
            self.rt.router.first_token(self._attempt.decision, self.req)
        if self.call.stream:
            self.rt.metrics.ttft.labels(self.call.model).observe(self._first_token_at - self.started)

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
        if isinstance(prompt, int):
            m.prompt_tokens.labels(self.call.model).observe(prompt)
        if isinstance(completion, int):
            m.generation_tokens.labels(self.call.model).observe(completion)

    def _finish(self) -> None:
        rt = self.rt
        if self._attempt is not None:
            rt.router.finish(self._attempt.decision, self.req, ok=200 <= self.status < 400)
        model = self.call.model
        rt.metrics.inflight.labels(model).dec()
        rt.metrics.requests.labels(model, self.endpoint_label, str(self.status or 500)).inc()
        rt.metrics.e2e.labels(model, self.endpoint_label).observe(time.perf_counter() - self.started)
