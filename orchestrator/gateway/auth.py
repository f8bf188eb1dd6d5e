"""Bearer-token checks: client keys for /v1/*, a separate admin token for /admin/*."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from orchestrator.errors import ApiError, Forbidden, Unauthorized


def bearer(request: Request) -> str | None:
    value = request.headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str, allowed: list[str]) -> bool:
    # Compare against every key in constant time, so timing does not reveal which one nearly matched.
    found = False
    for key in allowed:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


def check_client(request: Request, api_keys: list[str]) -> None:
    """No keys configured: open. Otherwise a valid ``Authorization: Bearer <key>`` is required."""
    if not api_keys:
        return
    token = bearer(request)
    if token is None:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key")
    if not _matches(token, api_keys):
        raise Unauthorized("Invalid API key.", code="invalid_api_key")


def check_admin(request: Request, admin_token: str | None) -> None:
    if not admin_token:
        raise ApiError("The admin API is disabled: set gateway.admin_token to enable it.", status=404,
                       type="invalid_request_error", code="admin_disabled")
    token = bearer(request)
    if token is None:
        raise Unauthorized("Missing admin token: send 'Authorization: Bearer <admin token>'.",
                           code="missing_admin_token")
    if not _matches(token, [admin_token]):
        raise Forbidden("Invalid admin token.", code="invalid_admin_token")
