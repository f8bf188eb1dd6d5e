"""The OpenAI endpoints: read → validate (``request.py``) → annotate once (``annotate.py``) → admit
(``admission.py``) → hand over to the proxy (``proxy.py``: one ``Attempt`` per try).

Handlers are plain Starlette endpoints (no FastAPI dependency injection or pydantic on the hot
path); the heavy lifting is in ``ProxyResponse``.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.errors import ApiError, ModelNotFound, UpstreamError
from orchestrator.gateway import classify, loop_guard, responses_api
from orchestrator.gateway import request as rq
from orchestrator.gateway.annotate import annotate
from orchestrator.gateway.executor import UpstreamCall, worker_headers
from orchestrator.gateway.fastpath import child, new_request_id
from orchestrator.gateway.proxy import ProxyResponse
from orchestrator.gateway.responses import engine_error_body
from orchestrator.gateway.runtime import GatewayRuntime
from orchestrator.gateway.transport import AnswerTooLarge, read_all
from orchestrator.router.types import RouteRequest
from orchestrator.telemetry import tracing
from orchestrator.telemetry.access_log import AccessRecord
from orchestrator.telemetry.children import request_children
from orchestrator.telemetry.logging import bind_request_id

MAX_REQUEST_ID = 128
def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is usable (printable ASCII, at most 128 characters), else a fresh
    one; kept on request.state for errors."""
    rid = request.headers.get("x-request-id")
    if not rid or len(rid) > MAX_REQUEST_ID or not (rid.isascii() and rid.isprintable()):
        rid = new_request_id()
    request.scope.setdefault("state", {})["request_id"] = rid  # = request.state.request_id, without a State object
    return rid


async def _completion(request: Request, endpoint: str, label: str) -> Any:
    started = time.perf_counter()
    rt: GatewayRuntime = request.app.state.runtime
    rid = request_id_of(request)
    bind_request_id(rid)  # every log line of this request carries it (orchestrator.telemetry.logging)
    loop_guard.check(request.headers)  # sent by this gateway to a worker that is itself: 508, never routed again
    rt.shutdown.check()  # draining after SIGTERM: 503 + Retry-After (orchestrator/gateway/shutdown.py)
    rt.shutdown.started()  # from here a drain waits for this request, queued or not (ended by intake.wrap)
    # One root span per request: admission here, the exchange later in the ASGI response (proxy.py).
    root = tracing.begin("dyad.request", incoming=request.headers, endpoint=endpoint)
    try:
        if root.span is tracing.NO_SPAN:  # tracing off: nothing to make current
            response = await _admitted(request, rt, rid, endpoint, label, started)
        else:
            with root.activate():
                response = await _admitted(request, rt, rid, endpoint, label, started)
    except BaseException:
        root.end()
        rt.shutdown.finished()
        raise
    proxy = response.inner.proxy if isinstance(response.inner, responses_api.RecordOwner) else response.inner
    proxy.root_span = root  # the proxy ends it when the answer is over
    return response


async def _admitted(request: Request, rt: GatewayRuntime, rid: str, endpoint: str, label: str,
                    started: float) -> Any:
    gw = rt.config.gateway
    intake = rt.intake  # orchestrator.gateway.admission: auth, rate limits, admission control, queue
    record = AccessRecord(request_id=rid, endpoint=endpoint)
    client_key = None
    responses = endpoint == responses_api.RESPONSES  # the Responses API: its own fields (responses_api.py)
    pinned_away: frozenset[str] = frozenset()
    try:
        client = intake.authenticate(request)
        record.client_key_id = client.name
        body = await rq.read_json_object(request, gw.max_body_bytes, "gateway.max_body_bytes")
        model = responses_api.validate(body) if responses else rq.validate(endpoint, body)
        canonical = rt.config.model(model)
        client.check_model(model, (canonical.name, *canonical.aliases) if canonical is not None else ())
        if canonical is not None and canonical.name != model:
            model = body["model"] = canonical.name  # an alias: the engines know the model by its name
        if not rt.fleet.knows_model(model):
            raise ModelNotFound(model)
        record.model = model
        stream = record.stream = body.get("stream") is True
        if responses:
            prev = body.get("previous_response_id")
            if prev is not None:  # continues a stored response: only its engine has it
                owner = await responses_api.continuation_worker(rt, prev, client.name, model)
                pinned_away = frozenset(w.id for w in rt.fleet.workers() if w.id != owner.id)
            # routed on the chat messages vLLM renders from instructions + input (prefix-aware)
            # (never split: the P/D hand-off, disagg/vllm_flow.py, speaks chat/completions only)
            route_req = await annotate(rt, request.headers, rid, rq.CHAT, model, responses_api.routing_body(body),
                                       split_allowed=False)
        else:
            route_req = await annotate(rt, request.headers, rid, endpoint, model, body)
        # Demand, counted before admission: queued, refused and failed requests are demand too (the planner).
        counted = request_children(rt.metrics, model, label)
        counted.arrivals.inc()
        counted.arrival_prompt_tokens.inc(route_req.prompt_tokens)
        intake.enter(key := intake.client_key(client, request))  # limits.max_concurrent_per_client
        client_key = key
        # The body is read: request.receive now returns only when the client hangs up (frees a queued place).
        if not tracing.enabled():
            slot, limit_headers = await intake.admit(client, route_req, request.headers, request.receive)
        else:
            with tracing.span("dyad.admission", model=model):
                slot, limit_headers = await intake.admit(client, route_req, request.headers, request.receive)
    except BaseException as err:
        intake.leave(client_key)
        if not isinstance(err, ApiError):
            raise
        record.status = err.status
        record.error_class = err.code if isinstance(err.code, str) else type(err).__name__
        record.total_s = time.perf_counter() - started
        rt.access_log.emit(record)
        raise
    strip_usage = stream and not responses and rq.ask_for_usage(body)  # (a Responses stream always has usage)
    call = UpstreamCall(endpoint=endpoint, body=body, request_id=rid, model=model, stream=stream,
                        prompt_tokens=route_req.prompt_tokens, headers=loop_guard.forwarded(request.headers))
    counted.inflight.inc()
    proxy = ProxyResponse(rt, call, route_req, label, started, record, strip_usage, limit_headers,
                          pinned_away=pinned_away)
    # (a response created with store: false is kept nowhere: its id is not remembered either - it would only take
    # a place in the bounded map from a response that is stored)
    inner: Any = responses_api.RecordOwner(proxy, client.name) if responses and body.get("store") is not False \
        else proxy
    return intake.wrap(inner, model, rid, slot, client_key, intake.settler(client, route_req, record))


async def chat_completions(request: Request) -> ProxyResponse:
    return await _completion(request, rq.CHAT, "chat")


async def completions(request: Request) -> ProxyResponse:
    return await _completion(request, rq.COMPLETIONS, "completions")


async def responses_create(request: Request) -> ProxyResponse:
    """POST /v1/responses: as chat, with the Responses API's fields, stream events and id ownership."""
    return await _completion(request, responses_api.RESPONSES, "responses")


async def responses_retrieve(request: Request) -> Any:
    """GET /v1/responses/{response_id} (``?stream=true&starting_after=N`` replays its events)."""
    return await _stored_response(request, "GET", "")


async def responses_cancel(request: Request) -> Any:
    """POST /v1/responses/{response_id}/cancel."""
    return await _stored_response(request, "POST", "/cancel")


async def _stored_response(request: Request, method: str, suffix: str) -> Any:
    """A call about a stored response, sent to the engine that created it (responses_api.ResponseOwners);
    no retries elsewhere: no other engine has it."""
    started = time.perf_counter()
    rt: GatewayRuntime = request.app.state.runtime
    rid = request_id_of(request)
    bind_request_id(rid)
    loop_guard.check(request.headers)
    endpoint = f"{responses_api.RESPONSES}/{{id}}{suffix}"
    record = AccessRecord(request_id=rid, endpoint=endpoint)
    root = tracing.begin("dyad.request", incoming=request.headers, endpoint=endpoint)
    upstream = None
    try:
        with root.activate() as span:
            record.trace_id = span.trace_id_hex()
            client = rt.intake.authenticate(request)
            record.client_key_id = client.name
            response_id = responses_api.check_response_id(request.path_params.get("response_id"), "response_id")
            stream, params = responses_api.stored_query(request.query_params, method)
            record.stream = stream
            worker = await responses_api.owner_worker(rt, response_id, client.name)
            record.workers.append((worker.id, worker.role.value))
            record.attempts = 1
            url = f"{worker.url}{responses_api.RESPONSES}/{quote(response_id, safe='')}{suffix}"
            with tracing.span("dyad.attempt", worker=worker.id, role=worker.role.value) as attempt_span:
                try:
                    upstream = await rt.http.send(rt.http.build_request(
                        method, url, params=params,
                        headers={**worker_headers(worker, rid), **loop_guard.forwarded(request.headers)}), stream=True)
                except httpx.HTTPError as e:
                    raise UpstreamError(502, f"The engine holding response '{response_id}' ({worker.id}) did not "
                                             f"answer: {type(e).__name__}.", code="upstream_unreachable") from None
                attempt_span.set_attribute("status", upstream.status_code)
            headers = [(b"x-request-id", rid.encode())]
            if upstream.status_code == 200 and stream and "event-stream" in upstream.headers.get("content-type", ""):
                record.status = 200
                return _StoredStream(rt, upstream, headers, record, started, root)  # it logs and ends the span
            try:
                raw = await read_all(upstream, rt.config.gateway.max_answer_bytes)
            except AnswerTooLarge as e:
                raise UpstreamError(502, f"The stored response '{response_id}' ({worker.id}) is longer than "
                                         f"{e.limit} bytes (gateway.max_answer_bytes).", code="answer_too_large") from None
            except httpx.HTTPError as e:
                raise UpstreamError(502, f"The engine holding response '{response_id}' ({worker.id}) broke off its "
                                         f"answer: {type(e).__name__}.", code="upstream_broke_off") from None
            await upstream.aclose()
            if upstream.status_code in classify.ACCESS_STATUSES:  # the engine refuses the gateway's key, not the client's
                raise classify.engine_error(upstream.status_code, raw, worker.id)
            if upstream.status_code < 400 and (upstream.status_code != 200 or not _json_object(raw)):
                raise UpstreamError(502, f"The engine holding response '{response_id}' ({worker.id}) answered HTTP "
                                         f"{upstream.status_code} with a body that is not a JSON object ({len(raw)} "
                                         f"bytes, starting {raw[:80].decode('utf-8', 'replace')!r}).",
                                    code="bad_engine_answer")
    except ApiError as err:
        if upstream is not None:
            await upstream.aclose()
        record.status = err.status
        record.error_class = err.code if isinstance(err.code, str) else type(err).__name__
        _close_record(rt, record, started, root)
        raise
    except BaseException:
        if upstream is not None:
            await upstream.aclose()
        root.end()
        raise
    record.status = upstream.status_code
    out_headers = {"x-request-id": rid}
    if upstream.status_code >= 400:
        raw = engine_error_body(upstream.status_code, raw)
        record.error_class = "engine_rejected"
        if upstream.status_code in classify.RETRY_AFTER_STATUSES:  # (as every engine 429/503 the gateway relays)
            out_headers["retry-after"] = classify.retry_after(
                upstream.headers.get("retry-after", "").encode("latin-1"), rt.config.gateway.retry_after_s)
    _close_record(rt, record, started, root)
    return Response(raw, status_code=upstream.status_code, media_type="application/json", headers=out_headers)


def _json_object(raw: bytes) -> bool:
    try:
        return isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        return False


def _close_record(rt: GatewayRuntime, record: AccessRecord, started: float, root: tracing.OpenSpan) -> None:
    record.total_s = time.perf_counter() - started
    rt.access_log.emit(record)
    root.end()


class _StoredStream:
    """A replayed Responses stream (GET ...?stream=true), ended by the Responses rule."""

    def __init__(self, rt: GatewayRuntime, upstream: httpx.Response, headers: list[tuple[bytes, bytes]],
                 record: AccessRecord, started: float, root: tracing.OpenSpan) -> None:
        self.rt, self.upstream, self.headers, self.record, self.started, self.root = \
            rt, upstream, headers, record, started, root

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            complete = await responses_api.relay_stream(send, self.upstream, self.headers)
            if not complete:  # logged as the proxy logs a broken stream (the client saw 200 + the error events)
                self.record.status = 502
                self.record.error_class = "stream_failed"
        finally:
            await self.upstream.aclose()
            _close_record(self.rt, self.record, self.started, self.root)


async def _passthrough(request: Request, endpoint: str, label: str) -> Any:
    """Embeddings, tokenize and detokenize: routed by model to one worker that serves it (never split),
    with the same intake, retries, breakers and answer checks as completions; not counted as generation
    demand or tokens."""
    started = time.perf_counter()
    rt: GatewayRuntime = request.app.state.runtime
    rid = request_id_of(request)
    bind_request_id(rid)
    loop_guard.check(request.headers)
    rt.shutdown.check()
    rt.shutdown.started()
    intake = rt.intake
    record = AccessRecord(request_id=rid, endpoint=endpoint)
    client_key = None
    try:
        client = intake.authenticate(request)
        record.client_key_id = client.name
        body = await rq.read_json_object(request, rt.config.gateway.max_body_bytes, "gateway.max_body_bytes")
        model = rq.validate_model_only(body)
        canonical = rt.config.model(model)
        client.check_model(model, (canonical.name, *canonical.aliases) if canonical is not None else ())
        if canonical is not None and canonical.name != model:
            model = body["model"] = canonical.name
        if not rt.fleet.knows_model(model):
            raise ModelNotFound(model)
        record.model = model
        route_req = RouteRequest(request_id=rid, model=model, prompt_tokens=1)
        intake.enter(key := intake.client_key(client, request))
        client_key = key
        slot, limit_headers = await intake.admit(client, route_req, request.headers, request.receive)
    except BaseException as err:
        intake.leave(client_key)
        rt.shutdown.finished()
        if isinstance(err, ApiError):
            record.status = err.status
            record.error_class = err.code if isinstance(err.code, str) else type(err).__name__
            rt.access_log.emit(record)
        raise
    call = UpstreamCall(endpoint=endpoint, body=body, request_id=rid, model=model, stream=False, generation=False,
                        headers=loop_guard.forwarded(request.headers))
    child(rt.metrics.inflight, model).inc()
    return intake.wrap(ProxyResponse(rt, call, route_req, label, started, record, extra_headers=limit_headers), model, rid, slot, client_key)


async def embeddings(request: Request) -> ProxyResponse:
    return await _passthrough(request, "/v1/embeddings", "embeddings")


async def tokenize(request: Request) -> ProxyResponse:
    return await _passthrough(request, "/tokenize", "tokenize")


async def detokenize(request: Request) -> ProxyResponse:
    return await _passthrough(request, "/detokenize", "detokenize")


async def list_models(request: Request) -> Response:
    rt: GatewayRuntime = request.app.state.runtime
    request_id_of(request)
    loop_guard.check(request.headers)  # (a health probe reads the models of a worker that is this gateway)
    client = rt.intake.authenticate(request)
    data = []
    for name in rt.fleet.models():
        if client.allows(name):
            card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "dyad"}
            limit = rt.fleet.max_model_len(name)
            if limit is not None:
                card["max_model_len"] = limit  # as vLLM reports it: the smallest of the workers serving it
            data.append(card)
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")
