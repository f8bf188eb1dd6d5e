"""Per-gateway telemetry set-up: the access log and tracing from the config (``access_log:``, ``tracing:``).

``configure(runtime)`` is called by the composition root (``gateway/compose.py``) when it builds
the runtime: it sets ``runtime.access_log`` to the configured one and turns tracing on when ``tracing.enabled``.
Tracing is process-wide (one OpenTelemetry provider), so a gateway that does not enable it leaves
another's alone, and ``close`` only turns off what this gateway turned on.
"""

from __future__ import annotations

from typing import Any

from orchestrator.telemetry import tracing
from orchestrator.telemetry.access_log import AccessLog


def configure(runtime: Any) -> None:
    config = runtime.config
    runtime.access_log = AccessLog.from_config(config.access_log)
    runtime.tracing_enabled = bool(config.tracing.enabled)
    if config.tracing.enabled:
        tracing.configure(config.tracing)


def close(runtime: Any) -> None:
    if getattr(runtime, "tracing_enabled", False):
        tracing.shutdown()  # flushes the last spans
    access = getattr(runtime, "access_log", None)
    if access is not None:
        access.close()
