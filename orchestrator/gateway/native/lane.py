"""The native data plane's Python half: what the compiled plane (``native/dataplane``) calls, under the GIL.

With ``gateway.data_plane: native`` the client's bytes are carried by compiled code (docs/architecture.md,
"The native data plane"). Python keeps every decision, through a few synchronous calls per request:

1. ``NativeLane.admit``: the request's head and body. It runs the same route handler as the Python gateway
   (``openai_routes._completion``: auth, validation, annotation, admission) without an event loop, because on
   the plain path nothing in it waits. It returns a *step*: an answer to write, a try on an engine
   (``NativeTry``), or "fallback" — the request goes to the Python gateway behind the plane.
2. The try's outcome (``NativeTry.answered`` / ``failed`` / ``streaming`` / ``first_event`` / ``stream_done``
   / ``stream_broken`` / ``client_gone``) is judged by the proxy's own rules (``ProxyResponse``: second
   opinions, breakers, retries): the next step is another try, the answer, or an error.

What does not run here is handed to the Python gateway, unchanged, through the fallback with a resume token:
- a request whose handler *does* wait (an admission queue, a Redis-backed limit or index, a tokenizer call):
  the handler's coroutine is parked as it stands and finished on the event loop. Network I/O must not start
  on this thread (client libraries need a task for their timeouts): code on the request path calls
  ``orchestrator.loop_thread.on_loop_thread()`` before its first network call, which parks it here;
- a model served by prefill/decode pairs, or by an https engine: the admitted request is parked before any
  decision and the Python proxy runs it;
- a stream that broke after its first bytes: the Python stream relay continues it on another worker
  (``failover.StreamRelay``, from the bytes the client already has) and the plane pipes its events through.
So every failure class keeps exactly one implementation: the Python one.

The plane calls in from its own thread. The asyncio loop's thread keeps health checks, discovery, the planner,
admin routes and the fallback. Both threads touch the same runtime objects, always under the GIL, as the loop's
callbacks already do among themselves.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import orjson

from adapters.base import Role
from orchestrator.errors import ApiError, GatewayTimeout, NoHealthyWorker, UpstreamError
from orchestrator.gateway import classify
from orchestrator.gateway import request as rq
from orchestrator.gateway.attempt import Attempt
from orchestrator.gateway.executor import engine_headers
from orchestrator.gateway.failover import StreamRelay
from orchestrator.gateway.fastpath import HotRequest
from orchestrator.gateway.http_server import apply_forwarded, trusted_proxies
from orchestrator.gateway.proxy import _JITTER, MAX_ERROR_BODY, ProxyResponse, _Retry
from orchestrator.gateway.stream_protocol import OpenAIChunks
from orchestrator.gateway.transport import drop_idle
from orchestrator.telemetry import tracing
from orchestrator.telemetry.children import child
from orchestrator.telemetry.logging import bind_request, request_context

if TYPE_CHECKING:
    from orchestrator.gateway.admission import _Admitted
    from orchestrator.gateway.runtime import GatewayRuntime

log = logging.getLogger(__name__)

HOT_PATHS = {rq.CHAT: "chat", rq.COMPLETIONS: "completions"}
SECRET = b"x-dyad-native-secret"
PEER = b"x-dyad-native-peer"
RESUME = b"x-dyad-native-resume"
CONTINUE_PATH = "/_dyad/native/continue"
FALLBACK: tuple[str] = ("fallback",)
_FORWARDED = frozenset((b"x-forwarded-for", b"x-forwarded-proto"))
_NO_FIELDS: dict[str, Any] = {}  # (never changed: bound as it is)
RESUME_TTL_S = 60.0  # a parked request the fallback never claimed (the plane lost it) is dropped after this


def _abandon(what: tuple[Any, ...]) -> None:
    """End parked work nobody will resume (``NativeLane.expire``) as a request whose client left."""
    kind = what[0]
    if kind == "handler":  # a handler that waited: closing it runs its own clean-up (the intake's, the drain's)
        what[1].close()
    elif kind == "admitted":  # admitted, never run: what the proxy and _Admitted would have done at its end
        admitted = what[1]
        proxy = getattr(admitted.inner, "proxy", admitted.inner)
        if isinstance(proxy, ProxyResponse):
            proxy.status = 499
            proxy.error_class = "client_gone"
            proxy.root_span.end()
            proxy._finish()
        admitted.give_back()
    elif kind == "continue":  # a broken stream whose continuation never started
        what[1].client_gone()


class _Suspended(Exception):
    """The coroutine waited: ``yielded`` is what it waits on (an asyncio future)."""

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self.coro = coro
        self.yielded = yielded


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to its end without an event loop; raises ``_Suspended`` (with the coroutine, alive) if it waits."""
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise _Suspended(coro, yielded)


async def _finish_on_loop(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    """Resume on the event loop a coroutine that ``drive`` began and that waited on ``yielded``."""
    return await _Resume(coro, yielded)


class _Resume:
    """An awaitable that hands the loop what the coroutine waits on, and the coroutine what the loop sends back."""

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self.coro = coro
        self.yielded = yielded

    def __await__(self) -> Any:
        coro, yielded = self.coro, self.yielded
        while True:
            try:
                sent = yield yielded
            except BaseException as exc:  # noqa: BLE001 - passed into the coroutine, as the loop would
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


class _RunningLoop:
    """The gateway's event loop as this thread's running loop for the length of a callback: futures the code
    makes belong to that loop (where a parked handler is finished), and work it starts there without waiting
    (a background task, a queued request woken, a drain told, a timer) is queued on it through
    ``loop.PlaneSafeLoop``, which hands calls from this thread over to the loop's own."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __enter__(self) -> None:
        asyncio.events._set_running_loop(self.loop)

    def __exit__(self, *exc: Any) -> None:
        asyncio.events._set_running_loop(None)


class _BodyRequest:
    """The receive side of a request whose body the plane has read already. Asked again (only the admission
    queue does: for the client leaving), it waits for ``gone``, which the fallback sets when the parked
    request's connection closes (``fallback.py``)."""

    __slots__ = ("body", "sent", "gone")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.sent = False
        self.gone: asyncio.Future[dict[str, Any]] | None = None

    async def __call__(self) -> dict[str, Any]:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if self.gone is None:
            self.gone = asyncio.get_running_loop().create_future()
        return await self.gone

    def disconnected(self) -> None:
        if self.gone is None:
            self.gone = asyncio.get_running_loop().create_future()
        if not self.gone.done():
            self.gone.set_result({"type": "http.disconnect"})


class NativeTask:
    """What ``Attempt.abort`` cancels for a try the plane runs: the plane's cancel handle for the request (each
    abort its own reason: the handle cancels once per reason). Also the try's progress for
    ``Attempt.quiet_for``: the plane's time since the stream's last data event."""

    __slots__ = ("handle", "finished", "aborts")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.finished = False
        self.aborts = 0

    def done(self) -> bool:
        return self.finished

    def cancel(self) -> None:
        self.aborts += 1
        self.handle.cancel(f"aborted-{self.aborts}")

    def quiet_for(self) -> float:
        q = self.handle.quiet_for()
        return 0.0 if q is None else q


class NativeLane:
    """One gateway's lane: built by ``plane.NativePlane.start`` with the app and its running loop."""

    def __init__(self, app: Any, loop: asyncio.AbstractEventLoop) -> None:
        from orchestrator.gateway.openai_routes import _completion  # (the route handler itself)

        self.app = app
        self.rt: GatewayRuntime = app.state.runtime
        self.loop = loop
        self.secret = secrets.token_hex(16)
        self._completion = _completion
        self._parked: dict[str, tuple[float, Any]] = {}
        self._heads: dict[tuple[str, str | None], list[tuple[bytes, bytes]]] = {}
        self.trusted_proxies = trusted_proxies()  # (the fallback's uvicorn trusts the same hosts)
        self._native: bool | None = None  # (``_native_fleet``)
        self.rt.fleet.subscribe(self._fleet_changed)
        self._running = _RunningLoop(loop)
        self.handled = {"native": 0, "fallback": 0, "parked": 0, "continued": 0}
        counter = self.rt.metrics.native_plane_requests
        self._counted = {way: child(counter, label) for way, label in (
            ("native", "native"), ("fallback", "handed_over"), ("parked", "parked"), ("continued", "continued"))}

    # --- called by the plane ------------------------------------------------------------------------

    def admit(self, path: str, query: str, headers: list[tuple[bytes, bytes]], body: bytes, peer: str,
              cancel: Any) -> tuple[Any, ...]:
        label = HOT_PATHS.get(path)
        if label is None or tracing.enabled():
            self._count("fallback")
            return FALLBACK
        if self._parked:  # (parked work the plane lost ends once due, whether or not more is parked)
            self.expire(time.monotonic())
        bind_request(None, _NO_FIELDS)  # (the previous request's fields off this thread: the handler binds its id)
        with self._running:
            return self._admit(path, query, headers, body, peer, cancel, label)

    def _admit(self, path: str, query: str, headers: list[tuple[bytes, bytes]], body: bytes, peer: str,
               cancel: Any, label: str) -> tuple[Any, ...]:
        host, _, port = peer.rpartition(":")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": query.encode(), "headers": headers, "client": (host, int(port or 0)),
                 "server": None, "app": self.app, "state": {}}
        for k, _ in headers:
            if k in _FORWARDED:  # from a trusted proxy: the client it names (as uvicorn's proxy-headers middleware)
                apply_forwarded(scope, self.trusted_proxies)
                break
        receive = _BodyRequest(body)
        request = HotRequest(scope, receive)
        coro = self._completion(request, path, label)
        try:
            admitted = drive(coro)
        except _Suspended as s:  # it waits (queue, Redis, tokenizer): the loop finishes it, the fallback serves it
            return self._park_handler(s, receive)
        except ApiError as err:
            return self._render_error(request, err)
        proxy = admitted.inner
        if not isinstance(proxy, ProxyResponse) or not self._native_fleet():
            return self._park_admitted(admitted)
        self._count("native")
        return Exchange(self, admitted, proxy, cancel).first()

    def engine_head(self, call: Any, worker: Any) -> list[tuple[bytes, bytes]]:
        """``executor.engine_headers`` as the plane sends them: what is the same for every request to a worker
        (encoded once per worker and key) and the request id."""
        rid = (b"x-request-id", call.request_id.encode())
        if call.headers:  # (a call with headers of its own: built in full)
            return [(k.encode(), v.encode()) for k, v in engine_headers(call, worker).items()]
        key = (worker.url, worker.api_key)
        same = self._heads.get(key)
        if same is None:
            if len(self._heads) > 4 * len(self.rt.fleet.workers()) + 16:  # (workers come and go: bounded)
                self._heads.clear()
            same = self._heads[key] = [(k.encode(), v.encode()) for k, v in engine_headers(call, worker).items()
                                       if k != "x-request-id"]
        return [*same, rid]

    def _count(self, way: str) -> None:
        self.handled[way] += 1
        self._counted[way].inc()

    def internal_error(self, where: str, exc: BaseException) -> None:
        log.error("native data plane: %s raised", where, exc_info=(type(exc), exc, exc.__traceback__))

    # --- what the fallback serves (``native.fallback``) -------------------------------------------------

    def claim(self, token: str) -> Any:
        """The parked work for ``token`` (once), or None."""
        entry = self._parked.pop(token, None)
        return None if entry is None else entry[1]

    def park(self, what: Any) -> str:
        now = time.monotonic()
        self.expire(now)
        token = secrets.token_hex(12)
        self._parked[token] = (now, what)
        return token

    def expire(self, now: float) -> int:
        """Give up parked work older than ``RESUME_TTL_S`` that the fallback never claimed (the plane lost it: the
        client left before the hand-over, the loopback refused it): each ends as if its client had left, so that
        nothing stays counted (the drain's count, the client's, the dispatch slot). Run on every park and every
        admit while anything is parked; oldest first: O(1) when none is due. Returns how many."""
        parked = self._parked
        gone = 0
        while parked:
            token = next(iter(parked))
            at, what = parked[token]
            if now - at <= RESUME_TTL_S:
                break
            del parked[token]
            gone += 1
            try:
                _abandon(what)
            except Exception:  # noqa: BLE001 - one bad entry must not keep the others
                log.exception("native data plane: giving up parked work failed")
        return gone

    def _park_handler(self, s: _Suspended, receive: _BodyRequest) -> tuple[Any, ...]:
        self._count("parked")
        token = self.park(("handler", s.coro, s.yielded, receive))
        return ("fallback", [(RESUME, token.encode())])

    def _park_admitted(self, admitted: _Admitted) -> tuple[Any, ...]:
        self._count("fallback")
        token = self.park(("admitted", admitted))
        return ("fallback", [(RESUME, token.encode())])

    def _native_fleet(self) -> bool:
        """Whether the plane can carry tries itself: a fleet of plain http engines with no prefill/decode split
        (any exception anywhere in the fleet hands every request over: a decision may pick any worker). Known
        until a worker is added or removed or changes its role (``_fleet_changed``): not a walk per request."""
        native = self._native
        if native is None:
            native = self._native = all(w.role is Role.BOTH and w.url.startswith("http://")
                                        for w in self.rt.fleet.workers())
        return native

    def _fleet_changed(self, event: str, worker: Any) -> None:
        if event != "state":
            self._native = None

    def _render_error(self, request: Any, err: ApiError) -> tuple[Any, ...]:
        handler = self.app._handler(err)
        response = drive(handler(request, err))
        return ("reply", response.status_code, response.raw_headers, response.body)


class NativeTry:
    """One try on one engine, as the plane reads it (attributes) and reports on it (methods)."""

    __slots__ = ("x", "attempt", "last_try", "url", "body", "headers", "stream", "delay_s", "first_byte_timeout",
                 "idle_timeout", "deadline_s", "max_answer_bytes", "error_body_bytes", "reply_headers", "strip_usage")

    def __init__(self, x: Exchange, attempt: Attempt, last_try: bool, delay_s: float) -> None:
        rt = x.rt
        call = x.proxy.call
        worker = attempt.decision.worker
        self.x = x
        self.attempt = attempt
        self.last_try = last_try
        self.url = worker.url + call.endpoint
        self.body = orjson.dumps(rt.adapter_for(worker.engine).shape_request(call.endpoint, call.body,
                                                                              call.request_id))
        self.headers = x.lane.engine_head(call, worker)
        self.stream = call.stream
        self.delay_s = delay_s
        self.first_byte_timeout = rt.config.gateway.first_byte_timeout_s
        self.idle_timeout = rt.config.resilience.stream_idle_timeout_s
        self.deadline_s = x.timeout
        self.max_answer_bytes = rt.config.gateway.max_answer_bytes
        self.error_body_bytes = MAX_ERROR_BODY
        self.reply_headers = x.proxy._headers()
        self.strip_usage = x.proxy.strip_usage

    # Each call runs with the gateway's loop as this thread's running loop (``_RunningLoop``). One that raises is
    # Dyad's own failure: the plane answers it with a 500 (or ends the stream with an internal error event) and
    # reports it (``NativeLane.internal_error``); the exchange is ended first, so that nothing stays counted.

    def failed(self, kind: str, detail: str) -> tuple[Any, ...]:
        return self.x.guarded(self.x.failed, self, kind, detail)  # type: ignore[no-any-return]

    def answered(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None) -> tuple[Any, ...]:
        return self.x.guarded(self.x.answered, self, status, headers, body)  # type: ignore[no-any-return]

    def streaming(self) -> None:
        self.x.guarded(self.x.streaming, self)

    def first_event(self, first_s: float) -> None:
        self.x.guarded(self.x.first_event, self, first_s)

    def stream_done(self, usage: str | None, events: int, first_s: float | None, last_s: float | None,
                    gaps: list[float] | None = None) -> None:
        self.x.guarded(self.x.stream_done, self, usage, events, gaps)

    def stream_broken(self, kind: str, detail: str, sent: bytes | None, usage: str | None, events: int,
                      first_s: float | None, last_s: float | None, gaps: list[float] | None = None) -> tuple[Any, ...]:
        return self.x.guarded(self.x.stream_broken, self, kind, detail, sent, usage, events,  # type: ignore[no-any-return]
                              gaps)

    def client_gone(self) -> None:
        self.x.guarded(self.x.client_gone)


class Exchange:
    """One client request carried by the plane: ``ProxyResponse.open_attempt``'s loop, one step per callback,
    with the proxy's own judgments (``_error_status``, ``_garbage``, ``_check_json`` ...)."""

    def __init__(self, lane: NativeLane, admitted: _Admitted, proxy: ProxyResponse, cancel: Any) -> None:
        self.lane = lane
        self.rt = lane.rt
        self.admitted = admitted
        self.proxy = proxy
        self.task = NativeTask(cancel)
        self.tries = 0
        self.last_error: ApiError | None = None
        self.ended = False
        cfg = self.rt.config
        self.timeout = cfg.resilience.stream_timeout_s if proxy.call.stream else cfg.gateway.request_timeout_s
        self.rid = admitted.rid
        self.log_fields = {"model": admitted.model}

    # --- tries ------------------------------------------------------------------------------------------

    def first(self) -> tuple[Any, ...]:
        """The first try (called by ``NativeLane.admit``, under the running loop already)."""
        bind_request(self.rid, self.log_fields)
        try:
            return self._settled(self._next_try)
        except BaseException:
            self._broke()
            raise

    def guarded(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with the gateway's loop as this thread's running loop and this request's id (and model)
        bound for every log line, as the Python gateway runs a request (``admission._Admitted``; the plane's
        thread serves many requests' steps in turn, each binding its own); if it raises, the exchange is ended as a gateway error (its places in the
        limits and its counts given back) before the plane hears of it."""
        bind_request(self.rid, self.log_fields)  # (kept after the call: the plane reports a failure with it)
        with self.lane._running:
            try:
                return fn(*args)
            except BaseException:
                self._broke()
                raise

    def _broke(self) -> None:
        if self.ended:
            return
        p = self.proxy
        p.status = 500
        p.error_class = "gateway_error"
        if p.attempt is not None:
            p.attempt.cancelled()  # (not the worker's doing)
        try:
            self._end()
        except Exception:  # noqa: BLE001 - reported by the plane with the first failure
            log.exception("native data plane: ending request %s after a failure failed too", p.call.request_id)

    def _next_try(self) -> tuple[Any, ...]:
        """``ProxyResponse.open_attempt``, one try at a time: route (skipping workers tried and breakers open),
        begin the attempt, hand it to the plane (after the backoff when it is a retry)."""
        p, rt = self.proxy, self.rt
        max_attempts = rt.config.gateway.max_attempts
        if self.tries >= max_attempts:
            assert self.last_error is not None
            raise self.last_error
        n = self.tries
        blocked = rt.breakers.blocked(rt.clock.now())
        exclude = p._tried | blocked if blocked else p._tried
        try:
            decision = self._decide(exclude)
        except NoHealthyWorker:
            p.settle_held(request_caused=False)
            if self.last_error is not None:
                raise self.last_error from None
            raise
        if n:
            rt.metrics.retries.labels(p.call.model).inc()
        p._tried.add(decision.worker.id)
        attempt = Attempt(rt, p.req, decision, task=self.task)
        p.attempt = attempt
        p.record.attempts += 1
        p.record.workers.extend(attempt.workers())
        self.tries = n + 1
        attempt.watch()
        delay = rt.backoff.delay(n, _JITTER) if n else 0.0
        return ("send", NativeTry(self, attempt, n + 1 >= max_attempts, delay))

    def _decide(self, exclude: Any) -> Any:
        """``Router.decide``; it does not wait unless a prefix-tracker hook does (an index on Redis, which
        parks the request's handler before any decision: lane.admit). Should it wait all the same, the loop
        finishes it and this thread waits for the decision (the GIL released meanwhile)."""
        try:
            return drive(self.rt.router.decide(self.proxy.req, exclude))
        except _Suspended as s:
            waited = asyncio.run_coroutine_threadsafe(_finish_on_loop(s.coro, s.yielded), self.lane.loop)
            # (bounded: this thread carries every native request meanwhile; past it the request fails as the
            # gateway's own error and the plane goes on)
            return waited.result(timeout=self.rt.config.gateway.first_byte_timeout_s)

    def _settled(self, judge: Any, *args: Any) -> tuple[Any, ...]:
        """Run a judgment: a retry is the next try; an ``ApiError`` is the client's answer."""
        while True:
            try:
                return judge(*args)  # type: ignore[no-any-return]
            except _Retry as r:
                self.last_error = r.error
                judge, args = self._next_try, ()
            except ApiError as err:
                return self._error(err)

    def _error(self, err: ApiError) -> tuple[Any, ...]:
        p = self.proxy
        p.status = err.status
        p.done = True
        p.error_class = p.error_class or (err.code if isinstance(err.code, str) else "upstream_error")
        extra = [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
        body = orjson.dumps(err.body())
        self._end()
        return ("reply", err.status, [(b"content-type", b"application/json"), *p._headers(), *extra], body)

    # --- outcomes (``ProxyResponse._try``'s branches) ---------------------------------------------------------

    def failed(self, t: NativeTry, kind: str, detail: str) -> tuple[Any, ...]:
        return self._settled(self._failed, t, kind, detail)

    def _failed(self, t: NativeTry, kind: str, detail: str) -> tuple[Any, ...]:
        p, rt, attempt = self.proxy, self.rt, t.attempt
        worker = attempt.decision.worker
        model = p.call.model
        if kind == "connect":
            attempt.worker_failed("connect", f"cannot connect to {worker.url}: {detail}", down=True)
            raise _Retry(NoHealthyWorker(model, rt.config.gateway.retry_after_s,
                                         reason=f"{worker.id}: cannot connect to {worker.url}: {detail}"))
        if kind == "reset":
            p._garbage(attempt, t.last_try, f"{worker.url} closed the connection: {detail}", UpstreamError(
                502, f"The engine ({worker.id}) closed the connection without answering this request: {detail}.",
                code="engine_closed_connection"), classify.DROPPED)
        if kind == "bad_http":
            attempt.worker_failed("malformed", f"{worker.url} answered malformed HTTP/1.1: {detail}")
            p.error_class = "bad_engine_answer"
            raise _Retry(UpstreamError(502, f"The engine ({worker.id}): {worker.url} answered malformed "
                                            f"HTTP/1.1: {detail}.", code="bad_engine_answer"))
        if kind == "timeout":
            attempt.request_failed()
            p.error_class = "timeout"
            raise GatewayTimeout(f"no response from {worker.url} in time ({detail}) (gateway.first_byte_timeout_s)",
                                 code="upstream_timeout")
        if kind == "broke_off":  # the body stopped after the head (ProxyResponse._try: judged like a drop)
            p._garbage(attempt, t.last_try, f"answer broke off: {detail}", UpstreamError(
                502, f"The answer from the engine ({worker.id}) broke off: {detail}.", code="upstream_broke_off"),
                classify.DROPPED)
        if kind == "stalled_body":
            p._garbage(attempt, t.last_try, f"answer broke off: {detail}", UpstreamError(
                502, f"The answer from the engine ({worker.id}) broke off: {detail}.", code="upstream_broke_off"),
                classify.STALLED)
        if kind == "deadline":
            attempt.cancelled()
            rt.metrics.upstream_errors.labels(worker.id, "timeout").inc()
            p.error_class = "timeout"
            which = "resilience.stream_timeout_s" if p.call.stream else "gateway.request_timeout_s"
            raise GatewayTimeout(f"The request did not complete within {self.timeout:g} s ({which}).", code="timeout")
        if kind.startswith("cancelled"):
            err = NoHealthyWorker(model, rt.config.gateway.retry_after_s, reason=attempt.aborted or "down")
            if attempt.stalled:  # (no byte came back: its pooled connections may lead nowhere: dropped, here and in the plane)
                drop_idle(rt.http, worker.url)
                p._garbage(attempt, t.last_try, attempt.aborted or "stalled", err, classify.STALLED)
            attempt.worker_failed("down", attempt.aborted or "down", down=False)
            raise _Retry(err)
        raise RuntimeError(f"unknown failure kind from the native plane: {kind!r}")

    def answered(self, t: NativeTry, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None) -> tuple[Any, ...]:
        return self._settled(self._answered, t, status, headers, body)

    def _answered(self, t: NativeTry, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None) -> tuple[Any, ...]:
        p, attempt = self.proxy, t.attempt
        worker = attempt.decision.worker
        raw = body or b""
        if status >= 400:
            retry_after = next((v for k, v in headers if k.lower() == b"retry-after"), None)
            p._error_status(attempt, status, raw, t.last_try, retry_after)
        if status != 200:
            p._garbage(attempt, t.last_try, f"answered HTTP {status}", UpstreamError(
                502, f"The engine ({worker.id}) answered HTTP {status}, which is no answer to this request.",
                code="bad_engine_answer"))
        encoding = next((v for k, v in headers if k.lower() == b"content-encoding"), None)
        if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
            p._unreadable(attempt, status, encoding)
        if p.call.stream:  # a head that is no event stream (the plane relays those itself)
            p._not_sse(attempt, raw, t.last_try)
        if body is None:
            p._too_large(attempt, t.max_answer_bytes)
        attempt.abortable = False
        assert body is not None
        p._check_json(attempt, status, body, None, t.last_try)
        # ``_whole``: the answer is relayed as it came, its bookkeeping done first (a client that holds the answer
        # finds it counted and its places in the limits given back; measured against bookkeeping after the write:
        # docs/benchmarks.md, session 14)
        p._first_token_at = time.perf_counter()
        p.status = status
        p.done = True
        p.mark_first_token()
        self._end()
        return ("relay",)

    def streaming(self, t: NativeTry) -> None:
        p = self.proxy
        p.settle_held(request_caused=False)  # another worker streams it: held 5xx were the workers'
        p.status = 200

    def first_event(self, t: NativeTry, first_s: float) -> None:
        t.attempt.progress = self.task  # (Attempt.quiet_for: a worker marked down keeps a stream that delivers)
        self.proxy.mark_first_token()

    def stream_done(self, t: NativeTry, usage: str | None, events: int, gaps: list[float] | None) -> None:
        p = self.proxy
        t.attempt.abortable = False
        self._stream_counts(usage, events, gaps)
        p.settle_held(False)
        p.done = True
        self._end()

    def _stream_counts(self, usage: str | None, events: int, gaps: list[float] | None) -> None:
        p = self.proxy
        if events and p._first_token_at is None:  # (first_event comes first; this only keeps the counts whole)
            p.mark_first_token()
        if usage:
            try:
                u = orjson.loads(usage)
            except orjson.JSONDecodeError:
                u = None
            if isinstance(u, dict):
                p.usage = u
        chat = p.call.endpoint == rq.CHAT
        p.relayed_tokens += max(0, events - (1 if chat else 0))
        if gaps:
            observe = p.metrics.itl.observe
            for g in gaps:
                observe(g)

    def stream_broken(self, t: NativeTry, kind: str, detail: str, sent: bytes | None, usage: str | None, events: int,
                      gaps: list[float] | None) -> tuple[Any, ...]:
        """``sent``: what the plane wrote to the client; None when that was more than ``max_answer_bytes`` (the
        plane stopped keeping it: the stream cannot be continued, it ends with an error event)."""
        p = self.proxy
        relay = p._relay = StreamRelay(p)
        if sent is None:
            relay.recorder.lose()
            relay.events = events
        else:
            relay.recorder.record(sent)
            relay.events = sent.count(b"data:")
        self._stream_counts(usage, 0, gaps)
        if kind == "deadline":
            t.attempt.cancelled()
            self.rt.metrics.upstream_errors.labels(t.attempt.worker_id, "timeout").inc()
            p.error_class = "timeout"
            p.status = 504
            ending = relay.protocol.error_ending(
                f"The request did not complete within {self.timeout:g} s (resilience.stream_timeout_s).", "timeout",
                relay.recorder.sent) if not relay.recorder.done else b""
            p.done = True
            self._end()
            return ("end", ending)
        if kind.startswith("cancelled"):
            kind, detail = "aborted", t.attempt.aborted or "aborted"
        elif kind == "idle":  # (the Python relay's words, so that a message reads the same from either plane)
            detail = f"no data event from the engine for {t.idle_timeout if events else t.first_byte_timeout:g} s"
        elif kind == "eof":
            detail = f"the engine ended the stream without {relay.protocol.end_marker}"
        elif kind == "garbage":
            detail = f"the engine sent {detail}"
        self.lane._count("continued")
        token = self.lane.park(("continue", self, kind, detail))
        return ("continue", CONTINUE_PATH, [(RESUME, token.encode())], b"")

    async def continue_stream(self, send: Any, kind: str, detail: str) -> None:
        """On the event loop (the fallback's ``/_dyad/native/continue``): the Python relay recovers the stream
        the plane relayed this far and writes what follows (the plane pipes the body to the client)."""
        from orchestrator.gateway.stream_timing import TokenTimer

        p = self.proxy
        relay = p._relay
        assert relay is not None
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        timer = TokenTimer(p.metrics.itl, relay.protocol.token_event, relay.protocol.no_token_event)
        try:
            with request_context(self.admitted.rid, model=self.admitted.model):  # (its log lines, on the loop)
                await relay.run(send, None, timer.on_bytes, broken=(kind, detail))
        except Exception:
            log.exception("request %s: continuing the native plane's stream failed", p.call.request_id)
            p.error_class = "gateway_error"
            p.status = 502
            ending = b"" if relay.recorder.done else OpenAIChunks().error_ending(
                "The gateway failed while continuing the stream.", "gateway_error", relay.recorder.sent)
            await send({"type": "http.response.body", "body": ending, "more_body": False})
        finally:
            if p.upstream is not None:
                await p.upstream.aclose()
            p._relay = None
            self._end()

    def client_gone(self) -> None:
        p = self.proxy
        if self.ended:
            return
        p.status = 499
        p.error_class = "client_gone"
        self.rt.metrics.client_disconnects.labels(p.call.model).inc()
        if p.attempt is not None:
            p.attempt.cancelled()
        self._end()

    # --- the end ------------------------------------------------------------------------------------------------

    def _end(self) -> None:
        """``ProxyResponse.__call__``'s and ``_Admitted``'s ends: accounting, the slot, the shutdown tracker."""
        if self.ended:
            return
        self.ended = True
        self.task.finished = True
        p = self.proxy
        try:
            p.root_span.end()
            p.done = True
            p._finish()
        finally:
            self.admitted.give_back()  # (whatever happened above: the limits' places are given back)
        a = self.admitted
        if a.settle is not None:
            settle = a.settle
            self.lane.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(settle()))
