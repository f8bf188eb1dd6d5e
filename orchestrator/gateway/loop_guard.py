"""A worker whose URL leads back to this gateway is refused, not routed to in a loop.

A worker listed (config, workers file, ``POST /admin/workers``) with the gateway's own address — or that of a
load balancer in front of it — is a gateway, not an engine. Without a guard it passed its health probe (the
gateway's ``/health`` answers 200) and learned its models from the gateway's ``/v1/models``, and every request
routed to it came back into the same gateway, which could route it there again: one client request went round
thousands of times (each a connection and a task, one access-log line each) until something ran out.

Every call this gateway process makes to a worker — requests on both data planes (``executor.worker_headers``),
health probes, model cards, metric scrapes (the engine client's default headers, ``compose.build_runtime``) —
carries ``x-dyad-gateway: <this process' random id>``. A request that arrives carrying the same id came from
this process: ``/health`` and ``/v1/models`` answer it 508 ``gateway_loop`` (so the probe fails, the worker is
never healthy, and ``POST /admin/workers`` refuses it at once), and so does every ``/v1`` route (a request
sent before a probe could tell). The id is random per process and never shown to clients; a client that sends
the header only gets its own request refused.

Not covered: a cycle through two different gateways (A's worker is B, B's worker is A): each forwards with
its own id only.
"""

from __future__ import annotations

import secrets
from typing import Any

from orchestrator.errors import ApiError

HEADER = "x-dyad-gateway"
GATEWAY_ID = secrets.token_hex(8)  # this process (one gateway per ``dyad serve``)
CODE = "gateway_loop"


class GatewayLoop(ApiError):
    """508: the request came from this gateway itself (a worker's URL leads back to it)."""

    status = 508
    type = "invalid_request_error"


def came_from_here(headers: Any) -> bool:
    """Whether the request's headers (a Starlette ``Headers`` or any mapping) carry this process' id."""
    return headers.get(HEADER) == GATEWAY_ID


def check(headers: Any) -> None:
    """Raise ``GatewayLoop`` for a request this gateway process sent itself."""
    if came_from_here(headers):
        raise GatewayLoop("This request came from this gateway itself: a worker's URL leads back to the gateway "
                          "(its own address, or a load balancer in front of it). Remove that worker: a gateway "
                          "is not an engine.", code=CODE)
