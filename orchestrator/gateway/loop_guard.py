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

A request that came from another gateway (Dyad in front of Dyad) carries that gateway's id, and more ids when
it passed several: each gateway forwards the list it received with its own id added (``forwarded``). So a
cycle through several gateways (A's worker is B, B's worker is A) comes back to a gateway that finds its own
id in the list: 508 at once, after one round. A list of ``MAX_GATEWAYS`` ids or more is refused with a 400 naming
the header (a chain that long is a mistake or a client's own header, and the header stays short). A 508 from a worker is tried on another worker
(``classify.RETRY_STATUSES``), so a loop through one worker costs a retry, not the request.
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


MAX_GATEWAYS = 8
MAX_HEADER = MAX_GATEWAYS * 40  # (ids are 16 hex digits; room for another version's longer ones)


def _ids(value: str) -> list[str]:
    return [part.strip() for part in value[:MAX_HEADER].split(",")]


def check(headers: Any) -> None:
    """Raise ``GatewayLoop`` for a request this gateway process sent (itself, or through other gateways), or
    one that passed ``MAX_GATEWAYS`` gateways."""
    value = headers.get(HEADER)
    if value is None:
        return
    ids = _ids(value)
    if GATEWAY_ID in ids:
        if ids[-1] == GATEWAY_ID and len(ids) == 1:
            raise GatewayLoop("This request came from this gateway itself: a worker's URL leads back to the "
                              "gateway (its own address, or a load balancer in front of it). Remove that worker: a "
                              "gateway is not an engine.", code=CODE)
        raise GatewayLoop(f"This request came back to this gateway through {len(ids) - 1} other gateway(s): their "
                          "workers lead in a cycle. Remove the worker that points back: a gateway is not an engine.",
                          code=CODE)
    if len(ids) >= MAX_GATEWAYS or len(value) > MAX_HEADER:
        # A 400, not a 508: without this gateway's own id in it, the list is what the sender wrote (a client, or a
        # chain of gateways too long), and a client's header never earns it a server error.
        raise ApiError(f"{HEADER} lists {len(ids)} gateways, the most a request may pass is {MAX_GATEWAYS}: their "
                       "workers lead in a chain too long, or the header was not written by a gateway.",
                       param=HEADER, code=CODE, status=400, type="invalid_request_error")


def forwarded(headers: Any) -> dict[str, str]:
    """The header for this request's calls to workers when it came from another gateway (its list, this gateway
    added); empty otherwise (every call carries this gateway's own id: ``executor.worker_headers``). Call after
    ``check``."""
    value = headers.get(HEADER)
    if value is None:
        return {}
    return {HEADER: ",".join([*_ids(value), GATEWAY_ID])}
