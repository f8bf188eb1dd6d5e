"""The admin API: list, add, remove, drain and undrain workers at run time.

Behind ``gateway.admin_token`` (a bearer token distinct from client keys). With no token
configured every admin route answers 404 saying the admin API is disabled. Every call that changes
the fleet writes one audit line (who, what, result; ``orchestrator/telemetry/audit.py``), refused
ones included.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.config import WorkerConfig
from orchestrator.errors import ApiError, InvalidRequest, NotFound
from orchestrator.fleet.registry import worker_from_config
from orchestrator.fleet.worker import Worker
from orchestrator.gateway import loop_guard
from orchestrator.gateway import request as rq
from orchestrator.gateway.auth import admin_runtime
from orchestrator.gateway.runtime import GatewayRuntime
from orchestrator.telemetry.audit import audited

ADMIN_BODY_LIMIT = 64 * 1024


class WorkerIdPath(Convertor):  # type: ignore[type-arg]
    """A worker id in an admin route's path: anything, slashes included (a workers-file entry without an id has
    its URL as id) and any character an id may hold (Starlette's ``path`` stops at a newline: such a request
    would miss the route, and its audit line)."""

    regex = r"[\s\S]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("worker_id", WorkerIdPath())


def worker_view(w: Worker) -> dict[str, Any]:
    load = w.load
    return {
        "id": w.id, "url": w.url, "engine": w.engine.value, "role": w.role.value, "models": w.models,
        "target_role": w.target_role.value if w.target_role else None,
        "labels": w.labels, "state": w.state.value, "inflight": w.inflight,
        "inflight_prefill_tokens": w.inflight_prefill_tokens,
        "consecutive_failures": w.consecutive_failures, "last_error": w.last_error,
        "load": {"running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage,
                 "prefix_cache_hit_ratio": load.cache_hit_ratio, "scraped_at": load.scraped_at},
    }


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _worker(rt: GatewayRuntime, request: Request) -> Worker:
    wid = request.path_params["worker_id"]
    w = rt.fleet.get(wid)
    if w is None:
        raise NotFound(f"No worker with id '{wid}'.", param="worker_id", code="worker_not_found")
    return w


async def list_workers(request: Request) -> Response:
    rt = admin_runtime(request)
    return _json({"workers": [worker_view(w) for w in rt.fleet.workers()]})


async def discovery_status(request: Request) -> Response:
    """What the discovery source last did: for a workers file its path, loads and ``last_error`` (why
    the list in force is not the file's contents: unreadable, invalid, refused), for Kubernetes each
    watch's lists, resumes and last error; the workers it owns and those withdrawn. A bad input is
    otherwise only in a log line and ``dyad_discovery_errors_total``."""
    rt = admin_runtime(request)
    discovery = getattr(rt, "discovery", None)
    if discovery is None:
        return _json({"source": "static", "workers": [w.id for w in rt.fleet.workers()]})
    return _json(discovery.status())


@audited("worker.add")
async def add_worker(request: Request) -> Response:
    """Body: a worker as in the config file (``url`` required; ``id``, ``engine``, ``role``,
    ``models``, ``labels``, ...). The worker is probed at once and joins when healthy."""
    rt = admin_runtime(request)
    body = await rq.read_json_object(request, ADMIN_BODY_LIMIT)
    try:
        wc = WorkerConfig.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidRequest("Invalid worker: " + "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(body)'}: {err['msg']}" for err in e.errors()),
            param=param, code="invalid_worker") from None
    if wc.id:
        _check_id(wc.id)
    # (before the checks against the fleet: from them to fleet.add nothing awaits, so two concurrent adds of one
    # id or URL cannot both pass)
    if await _leads_back(rt, wc.url):
        request.state.audit.update(target=wc.id or None, url=wc.url)
        raise InvalidRequest(f"The worker URL {wc.url} leads back to this gateway (its /health refused the gateway's "
                             "own probe as a loop): a gateway is not an engine.", param="url", code="worker_is_gateway")
    if not wc.id:  # none or "" (the registry would fall back to the url, which may be taken)
        n = len(rt.fleet)
        while rt.fleet.get(f"w{n}") is not None:
            n += 1
        wc.id = f"w{n}"
    request.state.audit.update(target=wc.id, url=wc.url, role=wc.role.value, engine=wc.engine.value)
    if rt.fleet.get(wc.id) is not None:
        raise ApiError(f"A worker with id '{wc.id}' already exists.", status=409, type="invalid_request_error",
                       param="id", code="worker_exists")
    same = rt.fleet.by_url(wc.url)
    if same is not None:  # one engine, two workers: twice its share of requests, capacity counted twice
        raise ApiError(f"Worker '{same.id}' already stands for the engine at {wc.url}.", status=409,
                       type="invalid_request_error", param="url", code="worker_url_exists")
    worker = rt.fleet.add(worker_from_config(wc))
    await rt.health.check_worker(worker)
    request.state.audit["state"] = worker.state.value
    return _json(worker_view(worker), status=201)


MAX_WORKER_ID = 128


def _check_id(wid: str) -> None:
    """An id given to ``POST /admin/workers``: addressable by the admin routes (no ``/``: the path
    ``/admin/workers/<id>/drain`` could not name it) and safe in a text log line (printable); bounded."""
    if len(wid) > MAX_WORKER_ID or not wid.isprintable() or "/" in wid:
        raise InvalidRequest(f"'id' must be 1 to {MAX_WORKER_ID} printable characters without '/' (got "
                             f"{wid[:40]!r}{'...' if len(wid) > 40 else ''}).", param="id", code="invalid_worker")


async def _leads_back(rt: GatewayRuntime, url: str) -> bool:
    """Whether ``url`` is this gateway (``loop_guard``: its ``/health`` answers the gateway's own probe 508
    ``gateway_loop``). Any other answer, or none, is for the health probe to judge."""
    try:
        r = await rt.http.get(url.rstrip("/") + "/health", timeout=rt.config.health.timeout_s)
        if r.status_code != loop_guard.GatewayLoop.status:
            return False
        return orjson.loads(r.content)["error"]["code"] == loop_guard.CODE
    except Exception:  # noqa: BLE001 - unreachable, slow, not JSON: not this gateway
        return False


@audited("worker.remove")
async def remove_worker(request: Request) -> Response:
    rt = admin_runtime(request)
    worker = _worker(rt, request)
    rt.fleet.remove(worker.id)
    request.state.audit.update(url=worker.url, inflight=worker.inflight)
    return _json({"removed": worker.id, "inflight": worker.inflight})


@audited("worker.drain")
async def drain_worker(request: Request) -> Response:
    rt = admin_runtime(request)
    worker = rt.fleet.drain(_worker(rt, request).id)
    request.state.audit.update(state=worker.state.value, inflight=worker.inflight)
    return _json(worker_view(worker))


@audited("worker.undrain")
async def undrain_worker(request: Request) -> Response:
    rt = admin_runtime(request)
    worker = rt.fleet.undrain(_worker(rt, request).id)
    request.state.audit["state"] = worker.state.value
    return _json(worker_view(worker))
