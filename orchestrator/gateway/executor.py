"""Executors: how one routed attempt reaches the engine(s).

The proxy asks an executor to *open* an upstream response for a routing decision; the executor
returns an ``httpx.Response`` whose headers have arrived and whose body is still unread, so the
proxy can stream it (or read it) and close it. ``AggregatedExecutor`` sends the request to the one
chosen worker. A P/D executor (``orchestrator.disagg``) implements the same ``open`` and is used
when ``RouteDecision.prefill_worker`` is set: it runs the prefill step first, then opens the
decode response.

Failures that happen before any response (connection refused, reset, timeout) are raised as
``AttemptFailed`` naming the worker at fault, so the proxy can retry elsewhere and tell the
fleet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson

from adapters.base import EngineAdapter, EngineKind
from orchestrator.fleet.worker import Worker
from orchestrator.gateway import loop_guard
from orchestrator.gateway.transport import MalformedAnswer, send_post
from orchestrator.router.types import RouteDecision
from orchestrator.telemetry import tracing


@dataclass
class UpstreamCall:
    """One client request as the executors see it (the same for every attempt)."""

    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any]
    request_id: str
    model: str
    stream: bool
    headers: dict[str, str] = field(default_factory=dict)  # extra headers for the engine
    generation: bool = True  # False: embeddings, tokenize, detokenize (one worker, no P/D, no token accounting)
    prompt_tokens: int = 0  # the annotated prompt's tokens (sizes the P/D prefill leg's stall budget)


class AttemptFailed(Exception):
    """No usable response from ``worker``. ``kind``: connect | timeout | protocol (the connection went
    away) | malformed (an answer that is not readable HTTP/1.1: the engine's fault, yet it is up).

    ``reachable`` is False when the worker itself looks down (take it out of rotation now).
    """

    def __init__(self, worker: Worker, kind: str, message: str, *, reachable: bool) -> None:
        super().__init__(message)
        self.worker = worker
        self.kind = kind
        self.reachable = reachable


class Executor(Protocol):
    async def open(self, call: UpstreamCall, decision: RouteDecision) -> httpx.Response:
        """Send the request; return the engine's response with its body not yet read."""
        ...


def worker_headers(worker: Worker, request_id: str) -> dict[str, str]:
    """What every request to an engine carries: the request id, the worker's key, identity encoding
    (the gateway reads and checks every answer; a compressed one is refused, proxy.py), and the W3C
    traceparent of the current span (nothing while tracing is off), and this gateway's mark (a worker
    whose URL leads back to the gateway refuses it: ``loop_guard``)."""
    headers = {"accept-encoding": "identity", "x-request-id": request_id, loop_guard.HEADER: loop_guard.GATEWAY_ID}
    if worker.api_key:
        headers["authorization"] = f"Bearer {worker.api_key}"
    return tracing.inject(headers)


def engine_headers(call: UpstreamCall, worker: Worker) -> dict[str, str]:
    """``worker_headers`` for a JSON POST of ``call``, plus the call's own headers."""
    headers = {"content-type": "application/json", **worker_headers(worker, call.request_id)}
    if call.headers:
        headers.update(call.headers)
    return headers


async def send_to_worker(http: httpx.AsyncClient, worker: Worker, path: str, body: dict[str, Any],
                         headers: dict[str, str]) -> httpx.Response:
    """POST ``body`` to ``worker`` and return once the response headers are in (body unread).

    On the gateway's own client this goes straight to its ``FastTransport`` (``transport.send_post``:
    no ``httpx.Request``, none of ``AsyncClient.send``'s layers), with the client's timeouts.
    """
    try:
        return await send_post(http, worker.url + path, orjson.dumps(body), headers)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise AttemptFailed(worker, "connect", f"cannot connect to {worker.url}: {e or type(e).__name__}",
                            reachable=False) from e
    except httpx.TimeoutException as e:
        raise AttemptFailed(worker, "timeout", f"no response from {worker.url} in time ({type(e).__name__})",
                            reachable=True) from e
    except MalformedAnswer as e:
        raise AttemptFailed(worker, "malformed", f"{worker.url} answered malformed HTTP/1.1: {e}",
                            reachable=True) from e
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        # The connection died before any response: the engine went away mid-request.
        raise AttemptFailed(worker, "protocol", f"{worker.url} closed the connection: {e or type(e).__name__}",
                            reachable=False) from e


class AggregatedExecutor:
    """Prefill and decode on the same worker: forward the (adapter-shaped) body to it."""

    def __init__(self, http: httpx.AsyncClient, adapter_for: Callable[[EngineKind], EngineAdapter]) -> None:
        self.http = http
        self.adapter_for = adapter_for

    async def open(self, call: UpstreamCall, decision: RouteDecision) -> httpx.Response:
        worker = decision.worker
        body = self.adapter_for(worker.engine).shape_request(call.endpoint, call.body, call.request_id)
        return await send_to_worker(self.http, worker, call.endpoint, body, engine_headers(call, worker))
