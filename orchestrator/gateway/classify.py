"""Who caused a failure: the worker or the request (pure decision logic, no I/O).

Envoy's outlier detection separates what an upstream host does wrong from what a request does
wrong; Dyad does the same so that a handful of bad requests cannot open every breaker:

* **worker-caused** — it could not be reached or answered bytes that are not HTTP; or it closed the
  connection before answering (or in the middle of a non-streamed answer), stalled (did no work at all while a request waited:
  ``Attempt.worker_progressed``) or answered a 5xx or garbage (a body that is not the answer: not JSON,
  no choices, not server-sent events for a stream) that **the same request does not get elsewhere**.
  These feed the worker's breaker (and take it out of rotation when it looks down).
* **the gateway's access** — an engine 401/403/407 is about the gateway's own key for that worker
  (``workers[].api_key``) or the engine's set-up, never the client's: a client's credentials never
  reach an engine. Judged like a 5xx (below); the client gets a 502 naming the setting, never the
  engine's 401, which would tell it that its own key is wrong.
* **request-caused** — any other engine 4xx (the worker is fine: it answered), the same 5xx status,
  garbage, stall or dropped connection again on a second worker (the request is what fails: an input
  that trips an engine bug, or keeps it busy before its first token without a sign of work, say; a
  stall or a drop only where that worker was answering others shortly before), a first-byte timeout
  while the worker kept serving others. These go back to the client once and count against nobody.
* **busy** — a 429 (the engine, or a proxy in front of it, sheds load): the request is tried on another
  worker like a 5xx, and the same 429 everywhere goes back to the client; it counts against nobody.
* **not served here** — a 404 (vLLM's "the model does not exist": the engine does not serve the model, alias or
  adapter the gateway's configuration says it does, or not any more): tried on another worker like a 429, and
  the same 404 everywhere goes back to the client; it counts against nobody (a breaker is per worker, and a
  worker that lacks one model may serve others). Its ``dyad_upstream_errors_total{kind="http_404"}`` shows it.

A 5xx, garbage, a stall or a dropped connection is therefore judged only when the next try's result is
known: ``SecondOpinion`` holds it until then. A stream that breaks after its first bytes (reset, garbage,
an end without the protocol's end) is held the same way until its continuation on another worker ends
(``failover.StreamRelay``): the same break again is the request's, a continuation that ends otherwise
makes it the worker's. One with no second opinion possible (the last try, or no other worker) counts against
the worker: without a comparison it is the worker's answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from orchestrator.errors import UpstreamError
from orchestrator.gateway.responses import engine_error_body

ACCESS_STATUSES = frozenset({401, 403, 407})  # the engine refuses the gateway's access (module docstring)
# answered before any byte: another worker may do better
# (508: the worker is a gateway that found the request looping back to it: gateway/loop_guard.py)
RETRY_STATUSES = frozenset({404, 429, 500, 502, 503, 504, 508}) | ACCESS_STATUSES
UNAVAILABLE_STATUSES = frozenset({502, 503})  # the engine says it cannot serve: counts against its health
BUSY_STATUSES = frozenset({429})  # the engine is busy, not broken: tried elsewhere, never held against it
NOT_SERVED_STATUSES = frozenset({404})  # the engine does not serve this model here: tried elsewhere, held against nobody
UNCOUNTED_STATUSES = BUSY_STATUSES | NOT_SERVED_STATUSES  # (no breaker counts them)


def engine_error(status: int, raw: bytes, worker_id: str = "?") -> UpstreamError:
    """An engine's error answer as the client will see it (its message, type, param and code kept); one
    refusing the gateway's access (``ACCESS_STATUSES``) is a 502 naming the setting."""
    err = orjson.loads(engine_error_body(status, raw))["error"]
    if status in ACCESS_STATUSES:
        return UpstreamError(502, f"The engine ({worker_id}) refused the gateway's access with HTTP {status} "
                                  f"({str(err.get('message'))[:200]}); check the key the gateway sends it "
                                  "(workers[].api_key) and the engine's own settings.", code="engine_access_refused")
    return UpstreamError(status, str(err.get("message")), engine_type=err.get("type") or None,
                         param=err.get("param"), code=err.get("code"))


RETRY_AFTER_STATUSES = frozenset({429, 503})  # relayed with a Retry-After, as the gateway's own are


def retry_after(engine_value: bytes | None, default: int) -> str:
    """The Retry-After to relay with an engine's 429/503: the engine's own when it is delta-seconds
    (digits; an HTTP date or anything else is replaced), else the gateway's ``default``."""
    if engine_value is not None:
        value = engine_value.strip()
        if value.isdigit() and len(value) <= 6:
            return value.decode("ascii")
    return str(default)


def error_in_answer(obj: Any) -> tuple[int, dict[str, Any]] | None:
    """A 200 answer that is really an error (``{"error": ...}`` or vLLM's ``{"object": "error"}``):
    the status it stands for (its integer code when that is an HTTP error status, else 502) and the
    error object; None for a normal answer."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if err is None and obj.get("object") == "error":
        err = obj
    if err is None:
        return None
    if not isinstance(err, dict):
        err = {"message": str(err)}
    code = err.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 502
    return status, err


GARBAGE = "garbage"  # what SecondOpinion holds for an answer that is not one (5xx answers: their status)
STALLED = "stalled"  # ... and for a try the stall watchdog pulled (no sign of work on it: attempt.py)
# A stall or dropped connection again on a second worker is the request's only if that worker answered something
# within this many stall timeouts before (proxy._served_lately): engines that all hang (or drop every request)
# answer nothing, and their failures count.
SERVED_LATELY_STALLS = 4
DROPPED = "protocol"  # ... and for a connection the engine closed before answering (the label it always had)


@dataclass
class SecondOpinion:
    """Failures of one request waiting for a second opinion (see the module docstring): a 5xx (or
    access-refused) status, ``GARBAGE``, ``STALLED`` or ``DROPPED``."""

    pending: list[tuple[str, int | str]] = field(default_factory=list)  # (worker id, status or kind)

    def hold(self, worker_id: str, failure: int | str) -> None:
        self.pending.append((worker_id, failure))

    def same_again(self, failure: int | str) -> bool:
        """``failure`` again on another worker: the request is the cause."""
        return any(f == failure for _, f in self.pending)

    def settle(self, request_caused: bool) -> list[tuple[str, int | str]]:
        """The held failures to count against their workers (none when the request was the cause)."""
        held, self.pending = self.pending, []
        return [] if request_caused else held
