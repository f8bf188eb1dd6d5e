"""Request tracing (OpenTelemetry), off by default.

The request path opens spans through this module only, so it does not care whether tracing is on:
``span(name, **attributes)`` is a context manager yielding a span (a no-op one when tracing is off),
and ``inject(headers)`` adds W3C ``traceparent`` (and ``tracestate``) for the current span to the
headers sent to an engine, so an engine that traces (vLLM ``--otlp-traces-endpoint``) joins the trace.

Span names used by the gateway: ``dyad.request`` (root, one per client request), ``dyad.admission``,
``dyad.route`` (attributes: policy, worker, prefill_worker, predicted_cached_tokens),
``dyad.attempt`` (one per attempt: worker, role, outcome) and ``dyad.pd.prefill`` / ``dyad.pd.decode``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class _NoSpan:
    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def record_exception(self, exc: BaseException) -> None:
        pass

    def trace_id_hex(self) -> str | None:
        return None


NO_SPAN = _NoSpan()


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    """A span around a block (no-op while tracing is off)."""
    yield NO_SPAN


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context to ``headers`` (unchanged while tracing is off)."""
    return headers
