"""Start and stop the native data plane in front of a running Python gateway (``gateway.data_plane: native``).

The Python gateway (the fallback, ``fallback.FallbackApp``) listens on a loopback port; the plane listens on
the configured address, serves the OpenAI routes itself through ``lane.NativeLane`` and forwards everything
else to the fallback. Called on the gateway's event loop once the fallback listens.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import orjson

from orchestrator.config import DyadConfig
from orchestrator.errors import error_body
from orchestrator.gateway.native import require
from orchestrator.gateway.native.fallback import FallbackApp
from orchestrator.gateway.native.lane import HOT_PATHS, NativeLane
from orchestrator.gateway.native.loop import PlaneSafeLoop

SWITCH_INTERVAL_S = 0.0005  # (measured: 2.3 ms p50 against a busy loop, 0.7 ms against an idle one)


def _error(message: str, type_: str, code: str) -> bytes:
    return orjson.dumps(error_body(message, type_, None, code))


def limits_of(config: DyadConfig) -> dict[str, Any]:
    gw, res = config.gateway, config.resilience
    return {
        "hot_paths": list(HOT_PATHS),
        "max_body_bytes": gw.max_body_bytes,
        "body_too_large": _error(f"Request body exceeds the limit of {gw.max_body_bytes} bytes "
                                 "(gateway.max_body_bytes).", "invalid_request_error", "payload_too_large"),
        "max_connections": gw.max_connections or 0,
        "overloaded": _error(f"The gateway has too many open connections (gateway.max_connections="
                             f"{gw.max_connections}); retry.", "service_unavailable", "too_many_connections"),
        "header_timeout_s": res.header_timeout_s,
        # a hot request's body: within body_timeout_s of its head, as on the Python plane (http_server)
        "body_timeout_s": res.body_timeout_s,
        "body_timeout": _error(f"The request body did not arrive within {res.body_timeout_s:g} s.",
                               "invalid_request_error", "request_timeout"),
        "keepalive_s": 75.0,
        "server_error": _error("internal gateway error", "server_error", "internal_error"),
        "retry_after_s": gw.retry_after_s,
        "client_write_timeout_s": res.client_write_timeout_s,
    }


class NativePlane:
    """The running plane: ``start`` on the gateway's loop, ``stop`` before the fallback stops."""

    def __init__(self, config: DyadConfig, fallback: FallbackApp, fallback_port: int, host: str, port: int) -> None:
        self.config = config
        self.fallback = fallback
        self.fallback_port = fallback_port
        self.host = host
        self.port = port
        self.lane: NativeLane | None = None
        self._plane: Any = None

    def start(self, loop: asyncio.AbstractEventLoop) -> int:
        module = require()
        if not isinstance(loop, PlaneSafeLoop):  # (serve.uvicorn_config chooses it for native mode)
            raise RuntimeError("the native data plane needs the gateway's loop to be "
                               "orchestrator.gateway.native.loop.PlaneSafeLoop (its thread schedules on it)")
        loop.adopt()  # from here, loop work started on the plane's thread is handed to the loop's
        # Each callback of the plane takes the GIL. While the event loop's thread runs Python (a request handed
        # over, a health round), a callback waits up to the interpreter's switch interval for it: 5 ms by
        # default, measured at 12 ms p50 per request against a busy loop; SWITCH_INTERVAL_S bounds that wait.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        lane = self.lane = NativeLane(self.fallback.app, loop)
        self.fallback.lane = lane
        self._plane = module.Plane(self.host, self.port, lane, f"127.0.0.1:{self.fallback_port}", lane.secret,
                                   limits_of(self.config))
        self.port = self._plane.start()
        transport = getattr(lane.rt.http, "_transport", None)
        if transport is not None and hasattr(transport, "idle_listeners"):  # a failed probe drops the plane's too
            plane = self._plane
            transport.idle_listeners.append(lambda key: plane.drop_idle(f"http://{key[0]}:{key[1]}"))
        return self.port

    def stop(self, grace_s: float = 5.0) -> None:
        if self._plane is not None:
            self._plane.stop(grace_s)
            self._plane = None

    def stats(self) -> dict[str, Any]:
        out = dict(self._plane.stats()) if self._plane is not None else {}
        if self.lane is not None:
            out.update(self.lane.handled)
        return out
