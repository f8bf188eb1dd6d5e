"""Errors as types, rendered in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.

Anything the gateway refuses is raised as an ``ApiError``; one exception handler turns it into a
JSON response with the right status. Clients never see a traceback.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status: int = 500
    type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class InvalidRequest(ApiError):
    """400: malformed JSON, missing or wrong-typed field (``param`` names it)."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"


class Forbidden(ApiError):
    status = 403
    type = "permission_error"


class ModelNotFound(ApiError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist or is not served by this fleet.",
                         param="model", code="model_not_found")


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class RateLimited(ApiError):
    status = 429
    type = "rate_limit_error"


class NoHealthyWorker(ApiError):
    """503 with Retry-After: nothing can serve the model right now."""

    status = 503
    type = "service_unavailable"

    def __init__(self, model: str, retry_after: int = 1, reason: str = "no healthy worker") -> None:
        super().__init__(f"No worker can serve model '{model}' right now ({reason}). Retry later.",
                         param="model", code="no_healthy_worker",
                         headers={"Retry-After": str(retry_after)})


class UpstreamError(ApiError):
    """An engine answered with an error: keep its status and its message."""

    type = "upstream_error"

    def __init__(self, status: int, message: str, engine_type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, status=status, type=engine_type or "upstream_error", param=param, code=code)


class GatewayTimeout(ApiError):
    status = 504
    type = "timeout_error"
