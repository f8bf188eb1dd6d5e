"""The per-request access log: one record per request, written when the request ends.

The request path fills one ``AccessRecord`` per client request (whatever way it ended: answered,
refused, failed, client gone) and hands it to ``AccessLog.emit``. The record holds facts only;
formatting (JSON or key=value), sampling and the destination are the log's business.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

log = logging.getLogger("dyad.access")


@dataclass
class AccessRecord:
    request_id: str
    model: str | None = None
    endpoint: str = ""
    stream: bool = False
    # (worker id, role) of every attempt and P/D leg, in order: ("w1", "prefill"), ("w2", "decode")
    workers: list[tuple[str, str]] = field(default_factory=list)
    attempts: int = 0
    status: int = 0
    error_class: str | None = None  # None when answered; else e.g. "rate_limited", "worker_failed", "client_gone"
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # predicted prefix-cache hit (router) or reported by the engine
    generated_tokens: int | None = None
    ttft_s: float | None = None
    itl_mean_s: float | None = None
    total_s: float = 0.0
    client_key_id: str | None = None  # the key's configured name or digest prefix, never the key
    trace_id: str | None = None


class AccessLog:
    """Writes access records. Disabled unless configured; ``emit`` must never raise."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled

    def emit(self, record: AccessRecord) -> None:
        if not self.enabled:
            return
        try:
            log.info("access", extra={"access": asdict(record)})
        except Exception:  # noqa: BLE001 - logging must not break a request
            pass
