"""``GET /admin/planner``: the planner's targets, limits and recent decisions (JSON).

Mount with ``app.include_router(planner_router())``; it reads ``app.state.runtime.planner`` (a
``PlannerService``) and sits behind the admin token like the rest of ``/admin``.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.errors import NotFound
from orchestrator.gateway.auth import admin_runtime


async def planner_status(request: Request) -> Response:
    service = getattr(admin_runtime(request), "planner", None)
    if service is None:
        raise NotFound("The planner is not enabled on this gateway (set planner.enabled: true).",
                       code="planner_disabled")
    return Response(orjson.dumps(service.status()), media_type="application/json")


def planner_router() -> APIRouter:
    router = APIRouter()
    router.add_route("/admin/planner", planner_status, methods=["GET"])
    return router
