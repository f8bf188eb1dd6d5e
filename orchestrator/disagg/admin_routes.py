"""Admin routes for the prefill/decode pools: change a worker's role, see the pools.

Mounted on the gateway app with ``app.include_router(admin_routes.router)``; behind the same admin
token as the rest of ``/admin``.

* ``POST /admin/workers/{id}/role`` — body ``{"role": "prefill"|"decode"|"both", "wait": false}``.
  Answers 202 with the pending change (the worker drains its current work first), or with
  ``"wait": true`` 200 once the role is applied. 409 when another change is pending or the move
  would leave a model without a decode-capable worker. Audited (``orchestrator/telemetry/audit.py``):
  one line for the request, and for a change that drains in the background one more when it is applied.
* ``GET /admin/pools`` — worker ids per role, and those moving between roles.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.disagg.roles import RoleManager
from orchestrator.errors import InvalidRequest
from orchestrator.gateway import request as rq
from orchestrator.gateway.auth import admin_runtime
from orchestrator.telemetry import audit

ADMIN_BODY_LIMIT = 4096

router = APIRouter()


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _roles(request: Request) -> RoleManager:
    roles = getattr(admin_runtime(request), "roles", None)
    if roles is None:
        raise InvalidRequest("Role changes are unavailable: disaggregation is not installed on this gateway.",
                             code="disagg_disabled")
    return roles


def _view(roles: RoleManager, worker_id: str) -> dict[str, Any]:
    w = roles.fleet.get(worker_id)
    assert w is not None
    return {"id": w.id, "role": w.role.value, "target_role": w.target_role.value if w.target_role else None,
            "inflight": w.inflight, "pools": roles.pools()}


@audit.audited("worker.role_change")
async def set_role(request: Request) -> Response:
    roles = _roles(request)
    body = await rq.read_json_object(request, ADMIN_BODY_LIMIT)
    role = body.get("role")
    if not isinstance(role, str):
        raise InvalidRequest("'role' is required: one of prefill, decode, both.", param="role", code="invalid_role")
    wait = body.get("wait", False)
    if not isinstance(wait, bool):
        raise InvalidRequest("'wait' must be a boolean.", param="wait", code="invalid_type")
    worker_id = request.path_params["worker_id"]
    worker = roles.fleet.get(worker_id)
    request.state.audit.update(role_from=worker.role.value if worker else None, role_to=role[:32])
    task = roles.request(worker_id, role)
    if not task.done():  # a second line when the drained change is applied (or fails)
        who = {"actor": audit.actor_of(request), **audit.client_of(request)}
        task.add_done_callback(lambda t: _audit_applied(t, worker_id, role, who))
    if wait:
        change = await task
        out = _view(roles, worker_id)
        out["drained"] = change.drained
        return _json(out)
    return _json(_view(roles, worker_id), status=202 if not task.done() else 200)


def _audit_applied(task: asyncio.Future[Any], worker_id: str, role: str, who: dict[str, str]) -> None:
    if task.cancelled():
        audit.record("worker.role_change.applied", target=worker_id, result="error", error="cancelled",
                     role_to=role, **who)
    elif task.exception() is not None:
        e = task.exception()
        audit.record("worker.role_change.applied", target=worker_id, result="error", role_to=role,
                     error=f"{type(e).__name__}: {e}"[:300], **who)
    else:
        change = task.result()
        audit.record("worker.role_change.applied", target=worker_id, result="ok", role_from=change.from_role.value,
                     role_to=change.to_role.value, drained=change.drained, **who)


async def pools(request: Request) -> Response:
    roles = _roles(request)
    return _json({"pools": roles.pools()})


router.add_route("/admin/workers/{worker_id}/role", set_role, methods=["POST"])
router.add_route("/admin/pools", pools, methods=["GET"])
