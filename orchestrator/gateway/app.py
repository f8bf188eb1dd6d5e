"""The gateway application: routes, error rendering, and the runtime's lifecycle.

``create_app(config)`` returns a FastAPI app whose lifespan starts a ``GatewayRuntime`` (stored
at ``app.state.runtime``) and stops it on shutdown. Hot paths are plain Starlette routes; every
refusal is an ``ApiError`` rendered in OpenAI's error shape, and anything unexpected becomes a
500 in the same shape (logged, never a traceback to the client).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator

import orjson
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from orchestrator.clock import Clock
from orchestrator.config import DyadConfig
from orchestrator.disagg import admin_routes as disagg_admin
from orchestrator.errors import ApiError, error_body
from orchestrator.gateway import admin, compose, loop_guard, openai_routes, responses_api
from orchestrator.gateway.fastpath import GatewayApp
from orchestrator.gateway.openapi import build_openapi
from orchestrator.gateway.runtime import GatewayRuntime
from orchestrator.planner.routes import planner_router
from orchestrator.telemetry.metrics import DyadMetrics
from orchestrator.ui import ui_router

log = logging.getLogger(__name__)


def _error_response(request: Request, status: int, body: dict, headers: dict[str, str] | None = None) -> Response:
    h = dict(headers or {})
    rid = getattr(request.state, "request_id", None)
    if rid:
        h["x-request-id"] = rid
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=h)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    rt: GatewayRuntime | None = getattr(request.app.state, "runtime", None)
    path = request.url.path
    if rt is not None and path.startswith("/v1/"):
        # Refused before routing: the model is not trusted as a label here (unbounded cardinality).
        rt.metrics.rejected.labels(exc.code or exc.type).inc()
        endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                    "/v1/responses": "responses"}.get(path, "other")
        rt.metrics.requests.labels("", endpoint, str(exc.status)).inc()
    return _error_response(request, exc.status, exc.body(), exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        message = f"No route {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    return _error_response(request, exc.status_code, error_body(message, kind), exc.headers)


async def _client_left(request: Request, exc: Exception) -> Response:
    """The client went away (or its body timed out, answered 408 by the server) before its request
    was read: its doing, not a gateway failure, so no error log per such connection. Nobody reads
    this answer (the server drops what is sent after a disconnect)."""
    log.debug("client left before its request was read: %s %s", request.method, request.url.path)
    return _error_response(request, 400, error_body("The client closed the connection before its request "
                                                    "body arrived.", "invalid_request_error"))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error_response(request, 500, error_body("Internal gateway error; see the gateway log.",
                                                    "server_error", None, "internal_error"))


async def health(request: Request) -> Response:
    loop_guard.check(request.headers)  # a worker that is this gateway is never healthy (loop_guard)
    return Response(b'{"status":"ok"}', media_type="application/json")


async def ready(request: Request) -> Response:
    """200 when every model the fleet knows has a worker that can decode it, counting health AND
    circuit breakers (a worker whose breaker is open serves nothing); 503 otherwise. Per model and
    role the JSON says how many workers are usable; a model whose prefill pool is all out (decode
    workers then prefill locally), or that no healthy worker serves while workers out only for slow
    probes take its requests (``health.last_resort``), is ``degraded`` — still 200, with the reason."""
    rt: GatewayRuntime = request.app.state.runtime
    from adapters.base import Role
    from orchestrator.fleet.worker import WorkerState

    blocked = rt.breakers.blocked(rt.clock.now())
    models: dict[str, dict] = {}
    reasons: list[str] = []
    degraded = False
    for m in rt.fleet.models():
        healthy = rt.router.candidates(m)
        usable = [w for w in healthy if w.id not in blocked]
        last_resort = sorted(w.id for w in healthy if w.state is not WorkerState.HEALTHY)
        entry: dict = {"healthy_workers": len(healthy) - len(last_resort), "usable_workers": len(usable)}
        if last_resort:
            entry["last_resort"] = last_resort
            if usable:
                degraded = True
                reasons.append(f"model '{m}': no healthy worker; its requests go to {', '.join(last_resort)}, out "
                               "of rotation only because their health probes time out (health.last_resort)")
        if len(usable) < len(healthy):
            entry["breaker_open"] = sorted(w.id for w in healthy if w.id in blocked)
        pool = [w for w in rt.fleet.workers() if m in w.models and w.role is Role.PREFILL]
        if pool:
            prefill_ok = [w for w in rt.fleet.candidates(m, Role.PREFILL)
                          if w.role is Role.PREFILL and w.id not in blocked]
            entry["roles"] = {"decode": len(usable), "prefill": len(prefill_ok)}
            if not prefill_ok and usable:
                degraded = True
                reasons.append(f"model '{m}': no usable prefill worker (health or breakers); decode workers "
                               "prefill locally")
        if not usable:
            reasons.append(f"model '{m}': no usable decode worker" + (" (circuit breakers open)" if healthy else ""))
        models[m] = entry
    ok = bool(models) and all(e["usable_workers"] for e in models.values()) and not rt.shutdown.draining
    status = "ready" if ok and not degraded else ("degraded" if ok else "unready")
    body: dict = {"ready": ok, "status": status, "models": models}
    if rt.shutdown.draining:
        reasons.append("shutting down (draining in-flight requests)")
    if not models:
        reasons.append("no models configured or discovered yet")
    if reasons:
        body["reason"] = "; ".join(reasons)
    headers = {} if ok else {"Retry-After": str(rt.config.gateway.retry_after_s)}
    return Response(orjson.dumps(body), status_code=200 if ok else 503, media_type="application/json",
                    headers=headers)


async def metrics_endpoint(request: Request) -> Response:
    rt: GatewayRuntime = request.app.state.runtime
    refresh_worker_gauges(rt)
    return Response(rt.metrics.render(), media_type=rt.metrics.content_type)


def metrics_text(rt: GatewayRuntime) -> bytes:
    """The gateway's exposition text, as /metrics serves it (the planner reads it in-process)."""
    refresh_worker_gauges(rt)
    return rt.metrics.render()


def refresh_worker_gauges(rt: GatewayRuntime) -> None:
    """Per-worker gauges are set at scrape time from the registry (always current, never stale)."""
    from adapters.base import Role
    from orchestrator.fleet.worker import WorkerState

    m = rt.metrics
    for gauge in (m.worker_inflight, m.worker_healthy, m.worker_role, m.worker_state, m.worker_running,
                  m.worker_waiting, m.worker_kv_usage, m.worker_cache_hit_ratio, m.worker_actual_cached_tokens):
        gauge.clear()  # removed workers disappear from the scrape
    # ... and so do their counters (a try or scrape that ended after the removal counted once more)
    m.forget_absent_workers({w.id for w in rt.fleet.workers()})
    for w in rt.fleet.workers():
        m.worker_inflight.labels(w.id).set(w.inflight)
        m.worker_healthy.labels(w.id).set(1 if w.health_ok else 0)
        for role in Role:
            m.worker_role.labels(w.id, role.value).set(1 if w.role is role else 0)
        for state in WorkerState:
            m.worker_state.labels(w.id, state.value).set(1 if w.state is state else 0)
        m.worker_running.labels(w.id).set(w.load.running)
        m.worker_waiting.labels(w.id).set(w.load.waiting)
        m.worker_kv_usage.labels(w.id).set(w.load.kv_usage)
        ratio = w.load.cache_hit_ratio
        if ratio is not None:
            m.worker_cache_hit_ratio.labels(w.id).set(ratio)
        if w.load.prefix_cache_hits is not None:
            m.worker_actual_cached_tokens.labels(w.id).set(w.load.prefix_cache_hits)


def freeze_heap() -> None:
    """Move every object alive now into the collector's permanent generation (``gc.freeze``).

    A gateway process holds a large, long-lived heap from start-up (FastAPI, pydantic, httpx, the
    config, the runtime): ~76 ms for each full collection, which CPython runs every few thousand
    requests as the per-request objects that outlive a collection pile up. Frozen, a full collection
    walks only what was made since (docs/benchmarks.md, issue 13, session 10). For a process that
    serves one gateway (``dyad serve``); not in tests, where frozen objects of ended gateways would
    never be collected."""
    gc.collect()
    gc.freeze()


def create_app(config: DyadConfig, *, clock: Clock | None = None, metrics: DyadMetrics | None = None,
               runtime: GatewayRuntime | None = None, freeze: bool = False) -> FastAPI:
    """The gateway for ``config``. Pass ``runtime`` to use a pre-built one (tests, the simulator);
    ``freeze``: once started, ``freeze_heap`` (the process serves this gateway only: ``dyad serve``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = compose.build_runtime(config, clock=clock, metrics=metrics, runtime=runtime)  # the composition root
        app.state.runtime = rt
        await compose.start(rt, lambda: metrics_text(rt))
        if freeze:
            freeze_heap()
        try:
            yield
        finally:
            await compose.stop(rt)

    # The two completion routes skip FastAPI's middleware and routing layers (fastpath.py).
    app = GatewayApp(title="Dyad gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                     openapi_url="/openapi.json")
    schema: dict = {}

    def openapi() -> dict:
        """Hand-written hot-path schemas (openapi.py) plus what FastAPI derives for the other routers."""
        if not schema:
            schema.update(build_openapi())
            derived = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, item in derived.get("paths", {}).items():
                schema["paths"].setdefault(path, item)
            schema["components"]["schemas"].update(derived.get("components", {}).get("schemas", {}))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_hot_route("/v1/chat/completions", openai_routes.chat_completions)
    app.add_hot_route("/v1/completions", openai_routes.completions)
    app.add_hot_route("/v1/responses", openai_routes.responses_create)  # the Responses API (responses_api.py)
    # ... and its stored responses, behind the same per-client limits (responses_api.limited)
    app.add_route("/v1/responses/{response_id}", responses_api.limited(
        openai_routes.responses_retrieve, "/v1/responses/{id}"), methods=["GET"])
    app.add_route("/v1/responses/{response_id}/cancel", responses_api.limited(
        openai_routes.responses_cancel, "/v1/responses/{id}/cancel"), methods=["POST"])
    app.add_hot_route("/v1/embeddings", openai_routes.embeddings)  # routed by model, one worker
    app.add_hot_route("/tokenize", openai_routes.tokenize)
    app.add_hot_route("/detokenize", openai_routes.detokenize)
    app.add_route("/v1/models", openai_routes.list_models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/ready", ready, methods=["GET"])
    app.add_route("/metrics", metrics_endpoint, methods=["GET"])
    app.add_route("/admin/workers", admin.list_workers, methods=["GET"])
    app.add_route("/admin/workers", admin.add_worker, methods=["POST"])
    # (any id, slashes included: admin.WorkerIdPath)
    app.add_route("/admin/workers/{worker_id:worker_id}", admin.remove_worker, methods=["DELETE"])
    app.add_route("/admin/workers/{worker_id:worker_id}/drain", admin.drain_worker, methods=["POST"])
    app.add_route("/admin/workers/{worker_id:worker_id}/undrain", admin.undrain_worker, methods=["POST"])
    app.add_route("/admin/discovery", admin.discovery_status, methods=["GET"])
    app.include_router(disagg_admin.router)  # POST /admin/workers/{id}/role, GET /admin/pools
    app.include_router(ui_router())  # the live fleet page, /ui (orchestrator/ui)
    app.include_router(planner_router())  # GET /admin/planner (orchestrator/planner)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.add_exception_handler(Exception, _unexpected)
    return app
