"""Structured logs: one JSON object per line, each carrying the request id of the request it is about.

The gateway binds the request id (the client's ``X-Request-Id`` or one it generated) once, at the
edge, with ``request_context(rid)``; every log line written while that request is handled — in the
router, the proxy, the P/D flow, in any task spawned from it — carries ``"request_id"`` without
passing it around, because it lives in a ``ContextVar`` (asyncio copies the context into tasks).

    configure_logging(json=True, level="INFO")
    with request_context("req-123", model="tiny"):
        log.info("routed", extra={"worker": "w0", "predicted_cached_tokens": 96})
    # {"ts": "...", "level": "info", "logger": "...", "msg": "routed", "request_id": "req-123",
    #  "model": "tiny", "worker": "w0", "predicted_cached_tokens": 96}
"""

from __future__ import annotations

import json as _json
import logging
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import IO, Any

_request_id: ContextVar[str | None] = ContextVar("dyad_request_id", default=None)
_fields: ContextVar[Mapping[str, Any]] = ContextVar("dyad_log_fields",
                                                    default=MappingProxyType({}))

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is logged.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime",
                                                                                    "request_id"}
# Extra attributes other libraries put on their records that are not information: uvicorn adds an
# ANSI-coloured copy of every message (``color_message``) for its own terminal formatter.
_NOISE_ATTRS = frozenset({"color_message"})
# uvicorn logs its lifecycle ("Started server process", "Shutting down") on a logger named
# "uvicorn.error"; at level info that name only misleads whoever greps for errors.
_LOGGER_NAMES = {"uvicorn.error": "uvicorn"}
_HANDLER_NAME = "dyad"


def get_request_id() -> str | None:
    return _request_id.get()


class request_context:  # noqa: N801 - used as a function: ``with request_context(rid, model=...)``
    """Bind a request id (and optional fields such as ``model``) to every log line inside the block.
    (A class, not a generator context manager: it is entered once per request on the hot path.)"""

    __slots__ = ("_rid", "_fields", "_tokens")

    def __init__(self, request_id: str | None, **fields: Any) -> None:
        self._rid = request_id
        self._fields = fields
        self._tokens: tuple[Any, Any] | None = None

    def __enter__(self) -> None:
        fields = self._fields
        self._tokens = (_request_id.set(self._rid), _fields.set({**_fields.get(), **fields}) if fields else None)

    def __exit__(self, *exc: object) -> None:
        tokens = self._tokens
        if tokens is not None:
            rid_token, fields_token = tokens
            if fields_token is not None:
                _fields.reset(fields_token)
            _request_id.reset(rid_token)


def bind_request_id(request_id: str | None) -> None:
    """Set the request id for the rest of the current context (for code that cannot use ``with``)."""
    _request_id.set(request_id)


def bind_request(request_id: str | None, fields: dict[str, Any]) -> None:
    """Bind exactly this request id and these fields for the rest of the current context, replacing what was
    bound: for a thread that serves many requests' steps in turn (the native data plane's), each step binding
    its own request first. ``fields`` is kept as given (not copied): do not change it afterwards."""
    _request_id.set(request_id)
    _fields.set(fields)


class RequestContextFilter(logging.Filter):
    """Copies the bound request id and fields onto each record (``record.request_id`` for text logs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        for key, value in _fields.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "request_id", ...extra fields, "exc"}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": _LOGGER_NAMES.get(record.name, record.name),
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            entry["request_id"] = rid
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and key not in _NOISE_ATTRS and not key.startswith("_") and key not in entry:
                entry[key] = _jsonable(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        return _json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Human-readable lines for a terminal, with the request id when there is one."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.rid = f" [{rid}]" if rid else ""
        return super().format(record)


def configure_logging(json: bool = True, level: str | int = "INFO", stream: IO[str] | None = None) -> logging.Handler:
    """Send every log record (Dyad's, uvicorn's, httpx's) through one handler on the root logger.

    Idempotent: calling it again replaces Dyad's handler instead of adding a second one. Returns the
    handler (tests attach it to a StringIO via ``stream``).
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == _HANDLER_NAME:
            root.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    handler.addFilter(RequestContextFilter())
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # uvicorn installs its own handlers when it configures logging; route its loggers through ours.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    logging.getLogger("httpx").setLevel(max(root.level, logging.WARNING))  # one line per request is noise
    return handler
