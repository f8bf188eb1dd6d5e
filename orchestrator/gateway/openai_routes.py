"""The OpenAI endpoints: read → validate → build the routing view → hand over to the proxy.

Handlers are plain Starlette endpoints (no FastAPI dependency injection or pydantic on the hot
path); the heavy lifting is in ``ProxyResponse``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.errors import ApiError, ModelNotFound
from orchestrator.gateway import request as rq
from orchestrator.gateway.executor import UpstreamCall
from orchestrator.gateway.fastpath import child, new_request_id
from orchestrator.gateway.proxy import ProxyResponse
from orchestrator.gateway.runtime import GatewayRuntime
from orchestrator.router.estimate import estimate_prompt_tokens
from orchestrator.router.types import RouteRequest
from orchestrator.telemetry.access_log import AccessRecord
from orchestrator.telemetry.logging import bind_request_id

MAX_REQUEST_ID = 128


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is usable, else a fresh one; kept on request.state for errors."""
    rid = request.headers.get("x-request-id")
    if not rid or len(rid) > MAX_REQUEST_ID or not rid.isprintable():
        rid = new_request_id()
    request.state.request_id = rid
    return rid


async def _completion(request: Request, endpoint: str, label: str) -> Any:
    started = time.perf_counter()
    rt: GatewayRuntime = request.app.state.runtime
    rid = request_id_of(request)
    bind_request_id(rid)  # every log line of this request carries it (orchestrator.telemetry.logging)
    rt.shutdown.check()  # draining after SIGTERM: 503 + Retry-After (orchestrator/gateway/shutdown.py)
    rt.shutdown.started()  # from here a drain waits for this request, queued or not (ended by intake.wrap)
    try:
        return await _admitted(request, rt, rid, endpoint, label, started)
    except BaseException as err:
        rt.shutdown.finished()
        access = getattr(rt, "access_log", None)  # set at start (orchestrator/telemetry/install.py)
        if isinstance(err, ApiError) and access is not None and access.enabled:  # refused before the proxy
            access.emit(AccessRecord(
                request_id=rid, model=getattr(request.state, "model", None), endpoint=endpoint, status=err.status,
                error_class=err.code if isinstance(err.code, str) else err.type,
                total_s=time.perf_counter() - started, client_key_id=getattr(request.state, "client_key_id", None)))
        raise


async def _admitted(request: Request, rt: GatewayRuntime, rid: str, endpoint: str, label: str,
                    started: float) -> Any:
    gw = rt.config.gateway
    intake = rt.intake  # orchestrator.gateway.admission: auth, rate limits, admission control, queue
    client = intake.authenticate(request)
    request.state.client_key_id = getattr(client, "name", None)  # the key's name (access log), never the key
    body = rq.parse_json_object(await rq.read_body(request, gw.max_body_bytes))
    model = rq.validate(endpoint, body)
    canonical = rt.config.model(model)
    client.check_model(model, (canonical.name, *canonical.aliases) if canonical is not None else ())
    if canonical is not None and canonical.name != model:
        model = body["model"] = canonical.name  # an alias: the engines know the model by its name
    request.state.model = model
    if not rt.fleet.knows_model(model):
        raise ModelNotFound(model)
    stream = body.get("stream") is True
    block_size = canonical.block_size if canonical is not None else 32
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    session_header = rt.config.router.kv_aware.session_header
    route_req = RouteRequest(request_id=rid, model=model, prompt_tokens=estimate_prompt_tokens(endpoint, body),
                             max_tokens=max_tokens, block_size=block_size,
                             session_key=request.headers.get(session_header))
    # The body is read: request.receive now returns only when the client hangs up (frees a queued place).
    slot = await intake.admit(client, route_req, request.headers, request.receive)
    call = UpstreamCall(endpoint=endpoint, body=body, request_id=rid, model=model, stream=stream)
    child(rt.metrics.inflight, model).inc()
    proxy = ProxyResponse(rt, call, route_req, label, started)
    proxy.client_key_id = request.state.client_key_id
    return intake.wrap(proxy, model, rid, slot)


async def chat_completions(request: Request) -> ProxyResponse:
    return await _completion(request, rq.CHAT, "chat")


async def completions(request: Request) -> ProxyResponse:
    return await _completion(request, rq.COMPLETIONS, "completions")


async def list_models(request: Request) -> Response:
    rt: GatewayRuntime = request.app.state.runtime
    request_id_of(request)
    client = rt.intake.authenticate(request)
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "dyad"} for name in rt.fleet.models()
            if client.allows(name)]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")
