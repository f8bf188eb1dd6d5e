"""``GET /ui`` (one static HTML page), ``GET /ui/api/state`` (the JSON it polls every second) and
``GET /ui/api/history`` (the last hour of traffic points, ``orchestrator/ui/history.py``, polled less often).

Add to a gateway with ``app.include_router(ui_router())``; the page reads ``app.state.runtime``.

The JSON shows every client's recent requests (ids, models) and the fleet's addresses and engine errors, so
it is the admin's: with ``gateway.admin_token`` set it needs that token (the page sends the one in its URL
fragment, ``/ui#token=<admin token>``, which never leaves the browser); a gateway with client keys but no
admin token refuses it (404 saying so); an open gateway (no keys) serves it to anyone, as before. The page
itself holds no data and is served to anyone.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from orchestrator.errors import ApiError
from orchestrator.gateway.auth import check_admin
from orchestrator.ui.state import fleet_state, jsonable


@cache
def _page() -> bytes:
    return resources.files("orchestrator.ui").joinpath("static/fleet.html").read_bytes()


async def ui_page(request: Request) -> Response:
    return Response(_page(), media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


def _check_access(request: Request) -> None:
    rt = request.app.state.runtime
    token = rt.config.gateway.admin_token
    if token:
        check_admin(request, token)
    elif not rt.intake.keys.open:
        raise ApiError("The fleet page's data shows every client's recent requests and the fleet's addresses: on a "
                       "gateway with client keys it needs the admin token. Set gateway.admin_token, then open "
                       "/ui#token=<admin token>.", status=404, type="invalid_request_error", code="ui_needs_admin_token")


async def ui_history(request: Request) -> Response:
    _check_access(request)
    history = getattr(request.app.state.runtime, "ui_history", None)
    view = jsonable(history.view()) if history is not None else {"points": [], "interval_s": None}
    return Response(orjson.dumps(view), media_type="application/json", headers={"Cache-Control": "no-store"})


async def ui_state(request: Request) -> Response:
    _check_access(request)
    body = orjson.dumps(fleet_state(request.app.state.runtime))
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})


def ui_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)
    router.add_api_route("/ui", ui_page, methods=["GET"])
    router.add_api_route("/ui/", ui_page, methods=["GET"])
    router.add_api_route("/ui/api/state", ui_state, methods=["GET"])
    router.add_api_route("/ui/api/history", ui_history, methods=["GET"])
    return router
