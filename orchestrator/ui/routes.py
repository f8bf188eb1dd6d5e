"""``GET /ui`` (one static HTML page), ``GET /ui/api/state`` (the JSON it polls every second) and
``GET /ui/api/history`` (the last hour of traffic points, ``orchestrator/ui/history.py``, polled less often).

Add to a gateway with ``app.include_router(ui_router())``; the page reads ``app.state.runtime``.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from orchestrator.ui.state import fleet_state, jsonable


@cache
def _page() -> bytes:
    return resources.files("orchestrator.ui").joinpath("static/fleet.html").read_bytes()


async def ui_page(request: Request) -> Response:
    return Response(_page(), media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


async def ui_history(request: Request) -> Response:
    history = getattr(request.app.state.runtime, "ui_history", None)
    view = jsonable(history.view()) if history is not None else {"points": [], "interval_s": None}
    return Response(orjson.dumps(view), media_type="application/json", headers={"Cache-Control": "no-store"})


async def ui_state(request: Request) -> Response:
    body = orjson.dumps(fleet_state(request.app.state.runtime))
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})


def ui_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)
    router.add_api_route("/ui", ui_page, methods=["GET"])
    router.add_api_route("/ui/", ui_page, methods=["GET"])
    router.add_api_route("/ui/api/state", ui_state, methods=["GET"])
    router.add_api_route("/ui/api/history", ui_history, methods=["GET"])
    return router
