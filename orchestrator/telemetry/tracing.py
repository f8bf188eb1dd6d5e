"""Request tracing (OpenTelemetry), off by default.

The request path opens spans through this module only, so it does not care whether tracing is on:
``span(name, **attributes)`` is a context manager yielding a span (a no-op one when tracing is off),
and ``inject(headers)`` adds W3C ``traceparent`` (and ``tracestate``) for the current span to the
headers sent to an engine, so an engine that traces (vLLM ``--otlp-traces-endpoint``) joins the trace.

Span names used by the gateway: ``dyad.request`` (root, one per client request), ``dyad.admission``,
``dyad.route`` (attributes: policy, worker, prefill_worker, predicted_cached_tokens),
``dyad.attempt`` (one per attempt: worker, role, outcome) and ``dyad.pd.prefill`` / ``dyad.pd.decode``.

The root span continues the client's trace: ``span("dyad.request", incoming=headers, ...)`` reads a
W3C ``traceparent`` from the client's headers (a ``{name: value}`` mapping or ASGI ``[(b"name",
b"value")]`` pairs) and makes it the parent. A malformed ``traceparent`` is ignored (a new trace starts).

When the root span must outlive one ``with`` block (admission happens in the route handler, the
exchange later in the ASGI response), ``root = begin("dyad.request", incoming=headers, ...)`` starts
it, ``with root.activate():`` makes it the parent in each phase, and ``root.end()`` ends it.

``configure(TracingConfig)`` turns tracing on for the process (the gateway's runtime calls it at start):
spans are batched to an OTLP/HTTP endpoint (``tracing.endpoint``), sampled by ``tracing.sample_ratio``
unless the client's ``traceparent`` already decided (parent-based sampling). The OpenTelemetry SDK is
the optional extra ``tracing`` (``pip install 'dyad-serve[tracing]'``); enabling tracing without it
raises ``TracingUnavailable`` naming the extra. Tracing is process-wide: the last ``configure`` wins.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.config import TracingConfig

INSTALL_HINT = "pip install 'dyad-serve[tracing]'"


class TracingUnavailable(RuntimeError):
    """Tracing is enabled but the OpenTelemetry SDK or OTLP exporter is not installed."""


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


class _Off:
    """``with`` block of a span while tracing is off: yields ``NO_SPAN`` (one object for every call,
    no generator: ``span`` and ``activate`` run several times per request)."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return NO_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry attribute values are str/bool/int/float (or lists of one of them); None is dropped."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        if isinstance(v, str | bool | int | float):
            out[k] = v
        elif isinstance(v, list | tuple) and all(isinstance(x, str) for x in v):
            out[k] = list(v)
        else:
            out[k] = str(getattr(v, "value", v))  # enums (Role) by value, anything else as text
    return out


class _Span:
    """The live span, behind the same four methods as ``_NoSpan``."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def set_attribute(self, key: str, value: Any) -> None:
        for k, v in _clean({key: value}).items():
            self._span.set_attribute(k, v)

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self._span.set_attributes(_clean(attributes))

    def record_exception(self, exc: BaseException) -> None:
        self._span.record_exception(exc)

    def trace_id_hex(self) -> str | None:
        ctx = self._span.get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else None


class _Tracing:
    """What ``configure`` sets up: a provider of our own (not the global one, so a test or a second
    ``configure`` can replace it), its tracer, and the W3C propagator."""

    def __init__(self, provider: Any, tracer: Any, propagator: Any) -> None:
        from opentelemetry import trace

        self.provider = provider
        self.tracer = tracer
        self.propagator = propagator
        self.get_current_span = trace.get_current_span


_state: _Tracing | None = None


def enabled() -> bool:
    return _state is not None


def configure(config: TracingConfig | None, *, exporter: Any = None) -> None:
    """Turn tracing on (``config.enabled``) or off. ``exporter`` replaces the OTLP exporter (tests pass
    the SDK's ``InMemorySpanExporter``; spans are then exported synchronously as each one ends)."""
    global _state
    shutdown()
    if config is None or not config.enabled:
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as e:
        raise TracingUnavailable(
            f"tracing.enabled is true but the OpenTelemetry SDK is not installed ({e.name}): {INSTALL_HINT}"
        ) from None
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise TracingUnavailable(
                f"tracing.enabled is true but the OTLP exporter is not installed ({e.name}): {INSTALL_HINT}"
            ) from None
        exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=config.export_timeout_s,
                                    headers=dict(config.headers) or None)
        processor: Any = BatchSpanProcessor(exporter, schedule_delay_millis=int(config.batch_delay_s * 1000),
                                            max_queue_size=config.max_queue_size,
                                            max_export_batch_size=min(512, config.max_queue_size))
    else:
        processor = SimpleSpanProcessor(exporter)
    resource = Resource.create({"service.name": config.service_name, **config.resource_attributes})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    provider.add_span_processor(processor)
    _state = _Tracing(provider, provider.get_tracer("dyad"), TraceContextTextMapPropagator())


def shutdown() -> None:
    """Flush pending spans and turn tracing off (the gateway's runtime calls this at stop)."""
    global _state
    state, _state = _state, None
    if state is not None:
        with contextlib.suppress(Exception):
            state.provider.shutdown()


def force_flush(timeout_s: float = 5.0) -> bool:
    """Export every finished span now (tests; a batch otherwise leaves every ``batch_delay_s``)."""
    state = _state
    return True if state is None else bool(state.provider.force_flush(int(timeout_s * 1000)))


# W3C trace context limits, as the OpenTelemetry propagator applies them (it ignores what breaks them, but logs a
# WARNING for each such header, with an invalid tracestate member quoted: client text, up to 8 KiB a request)
MAX_TRACEPARENT = 512
MAX_TRACESTATE = 8192
MAX_TRACESTATE_MEMBERS = 32
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


def _tracestate_ok(value: str) -> bool:
    if len(value) > MAX_TRACESTATE:
        return False
    members = [m for m in (part.strip(" \t") for part in value.split(",")) if m]
    return len(members) <= MAX_TRACESTATE_MEMBERS and all(_TRACESTATE_MEMBER.fullmatch(m) for m in members)


def _carrier(incoming: Mapping[str, str] | Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """The client's ``traceparent``/``tracestate``, without what the propagator would refuse with a log line (a
    client's malformed header starts a new trace, or loses its tracestate, silently: never a log line per request
    carrying the client's text)."""
    out: dict[str, str] = {}
    if isinstance(incoming, Mapping):
        for k, v in incoming.items():
            name = str(k).lower()
            if name in ("traceparent", "tracestate"):
                out[name] = str(v)
    else:
        for k, v in incoming:
            name = k.decode("latin-1").lower()
            if name in ("traceparent", "tracestate"):
                out[name] = v.decode("latin-1")
    parent = out.get("traceparent")
    if parent is not None and len(parent) > MAX_TRACEPARENT:
        return {}  # (no parent: a new trace, whose state the client's tracestate is not)
    state = out.get("tracestate")
    if state is not None and not _tracestate_ok(state):
        del out["tracestate"]
    return out


def span(name: str, *, incoming: Mapping[str, str] | Sequence[tuple[bytes, bytes]] | None = None,
         **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span around a block (no-op while tracing is off). ``incoming``: the client's headers, whose
    ``traceparent`` becomes the parent (root spans only). An exception leaving the block is recorded
    on the span and marks it as an error."""
    if _state is None:
        return _OFF
    return _span(_state, name, incoming, attributes)


@contextlib.contextmanager
def _span(state: _Tracing, name: str, incoming: Mapping[str, str] | Sequence[tuple[bytes, bytes]] | None,
          attributes: dict[str, Any]) -> Iterator[Any]:
    if incoming is None:
        current = state.get_current_span()
        if not current.is_recording() and current.get_span_context().is_valid:
            yield _Span(current)  # inside a trace that is not sampled: no child spans (they cost ~12 µs each)
            return
    context = state.propagator.extract(_carrier(incoming)) if incoming is not None else None
    with state.tracer.start_as_current_span(name, context=context, attributes=_clean(attributes)) as s:
        yield _Span(s)


class OpenSpan:
    """A span begun with ``begin`` and ended with ``end``, made current with ``activate()`` in as many
    phases as the request has (admission in the route handler, then the proxy's ASGI response)."""

    __slots__ = ("_span", "span")

    def __init__(self, span: Any) -> None:
        self._span = span
        self.span = _Span(span) if span is not None else NO_SPAN

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        return _OFF if self._span is None else self._activate()

    @contextlib.contextmanager
    def _activate(self) -> Iterator[Any]:
        from opentelemetry import trace

        with trace.use_span(self._span, end_on_exit=False, record_exception=True, set_status_on_exception=True):
            yield self.span

    def trace_id_hex(self) -> str | None:
        return self.span.trace_id_hex()

    def end(self) -> None:
        if self._span is not None:
            self._span.end()
            self._span = None


def begin(name: str, *, incoming: Mapping[str, str] | Sequence[tuple[bytes, bytes]] | None = None,
          **attributes: Any) -> OpenSpan:
    """Start a span that outlives one ``with`` block (the root ``dyad.request``: admission runs in the
    route handler, the exchange in the ASGI response); ``incoming`` as for ``span``. Children opened
    inside ``open_span.activate()`` hang under it; call ``end()`` once, when the request is over."""
    state = _state
    if state is None:
        return OpenSpan(None)
    context = state.propagator.extract(_carrier(incoming)) if incoming is not None else None
    return OpenSpan(state.tracer.start_span(name, context=context, attributes=_clean(attributes)))


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context to ``headers`` (unchanged while tracing is off)."""
    state = _state
    if state is not None:
        state.propagator.inject(headers)
    return headers


def current_trace_id() -> str | None:
    """The current span's trace id (32 hex digits), or None outside a span or while tracing is off."""
    if _state is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
