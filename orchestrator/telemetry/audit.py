"""Audit log: one line per admin action (and per planner action that changes the fleet): who did what
to which worker, and how it ended.

Lines go to the ``dyad.audit`` logger at INFO, which ``configure_logging`` keeps enabled whatever
``--log-level`` says (an audit trail that a log level can switch off is not one). In JSON they read::

    {"ts": "...", "level": "info", "logger": "dyad.audit", "msg": "admin worker.drain w1: ok",
     "audit": true, "action": "worker.drain", "target": "w1", "actor": "admin-token:3f2a9c1e",
     "client": "10.0.0.7", "result": "ok", "status": 200}

``actor`` names the credential, never the credential itself: ``admin-token:<first 8 hex of its
SHA-256>`` (enough to tell a rotated token from the old one), ``invalid-token`` for a wrong one,
``no-token`` when none was sent, ``planner`` for the planner. ``client`` is the caller's address as uvicorn resolves it: the peer of
the connection, or the ``X-Forwarded-For`` address when the peer is a trusted proxy (uvicorn's
``forwarded_allow_ips``, loopback by default); the raw header is recorded beside it as
``forwarded_for``. ``result`` is ``ok``, ``accepted`` (started and
still running, e.g. a role change draining), ``denied`` (401/403) or ``error``; refused requests carry
the error ``code``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from orchestrator.errors import ApiError

AUDIT_LOGGER = "dyad.audit"
log = logging.getLogger(AUDIT_LOGGER)
log.setLevel(logging.INFO)  # on by default, also before configure_logging

Handler = Callable[[Request], Awaitable[Response]]


def actor_of(request: Request) -> str:
    """Which credential the caller presented (a fingerprint, never the token)."""
    from orchestrator.gateway.auth import bearer_token  # (read as the admin check reads it)

    token = bearer_token(request.headers.get("authorization"))
    if token is None:
        return "no-token"
    gateway = getattr(getattr(getattr(request.app.state, "runtime", None), "config", None), "gateway", None)
    expected = getattr(gateway, "admin_token", None)
    if expected and hmac.compare_digest(token.encode(), expected.encode()):
        return "admin-token:" + hashlib.sha256(token.encode()).hexdigest()[:8]
    return "invalid-token"


def client_of(request: Request) -> dict[str, str]:
    out = {"client": request.client.host if request.client else "unknown"}
    forwarded = request.headers.get("x-forwarded-for")
    if forwarded:
        out["forwarded_for"] = forwarded[:200]
    return out


def _clean(value: str, limit: int = 128) -> str:
    """A caller-supplied string (a worker id from the path, a header) made safe for one log line:
    bounded, control characters escaped (``%0A`` in a path would otherwise forge a text-log line)."""
    value = value[:limit]
    return value if value.isprintable() else value.encode("unicode_escape").decode("ascii")


def record(action: str, *, actor: str, result: str, target: str | None = None, **fields: Any) -> None:
    """Write one audit line. ``fields``: who (``client``), outcome details (``status``, ``code``,
    ``error``) and what changed (``role_from``, ``role_to``, ``url``, ...)."""
    target = _clean(target) if target is not None else None
    fields = {k: _clean(v, 300) if isinstance(v, str) else v for k, v in fields.items()}
    msg = f"{'planner' if actor == 'planner' else 'admin'} {action}{' ' + target if target else ''}: {result}"
    log.info(msg, extra={"audit": True, "action": action, "target": target, "actor": actor, "result": result,
                         **{k: v for k, v in fields.items() if v is not None}})


def audited(action: str) -> Callable[[Handler], Handler]:
    """Wrap an admin route: one audit line per call, whatever its outcome. The route may add details
    (``request.state.audit = {...}``); the target is the ``worker_id`` path parameter, or
    ``request.state.audit["target"]``."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def run(request: Request) -> Response:
            request.state.audit = {}
            who = {"actor": actor_of(request), **client_of(request)}

            def line(result: str, status: int, **outcome: Any) -> None:
                details = dict(request.state.audit)
                target = details.pop("target", request.path_params.get("worker_id"))
                result = details.pop("result", result)
                record(action, target=target, result=result, status=status, **who, **outcome, **details)

            try:
                response = await handler(request)
            except ApiError as e:
                line("denied" if e.status in (401, 403) else "error", e.status, code=e.code, error=str(e)[:300])
                raise
            except Exception as e:
                line("error", 500, error=f"{type(e).__name__}: {e}"[:300])
                raise
            line("accepted" if response.status_code == 202 else "ok", response.status_code)
            return response

        return run

    return wrap
