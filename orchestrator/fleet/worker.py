"""A worker as the router sees it: plain data, no I/O.

The health loop, the scrape loop and the gateway's in-flight accounting write into it; routing
policies only read it. The same object is used live and in the virtual-time simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from adapters.base import EngineKind, LoadSnapshot, Role

if TYPE_CHECKING:
    from orchestrator.config import KvEventsConfig


class WorkerState(StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"  # finishes what it has, accepts nothing new
    # warm standby: started and health-checked, held out of rotation until activated (the planner's
    # ``activate``); not draining: nothing is finishing there, it is capacity waiting to be used
    STANDBY = "standby"


@dataclass
class Worker:
    id: str
    url: str
    engine: EngineKind = EngineKind.VLLM
    role: Role = Role.BOTH
    models: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    state: WorkerState = WorkerState.HEALTHY
    load: LoadSnapshot = field(default_factory=LoadSnapshot)
    # The gateway's own accounting (fresher than any scrape):
    inflight: int = 0  # requests dispatched and not finished
    inflight_prefill_tokens: int = 0  # uncached prompt tokens dispatched whose first token has not come back
    # ...of which the worker has probably not computed yet (router.inflight drains it at a learned
    # rate; None until the ledger has seen the worker: then it is all of inflight_prefill_tokens)
    prefill_backlog_tokens: float | None = None
    # Health bookkeeping:
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_health_at: float | None = None
    last_served_at: float | None = None  # when a request last completed successfully (passive health)
    last_progress_at: float | None = None  # a first token or a whole answer came back (tells stalls from slow requests)
    generating_at: float | None = None  # a scrape found its generated-token counter risen (the engine is working)
    last_error: str | None = None
    health_ok: bool | None = None  # last verdict of the health thresholds; None = never probed
    # Every probe failure since the last success was a timeout (the engine accepts connections but answers
    # late: busy, not gone): the registry's ``last_resort`` when no worker is healthy.
    out_by_timeouts: bool = False
    ready_at: float | None = None  # when its health probe first passed (None: never ready yet)
    # A pending role change (applied once the worker has drained its old-role work):
    target_role: Role | None = None
    api_key: str | None = None
    bootstrap_port: int | None = None
    configured_models: bool = False  # models came from config (else discovered from the engine)
    # model -> context length the engine reports on /v1/models (read once, at the first good probe)
    max_model_len: dict[str, int] = field(default_factory=dict)
    model_cards_read: bool = False
    kv_events: KvEventsConfig | None = None  # where the engine publishes KV events, if it does

    @property
    def queued_prefill_tokens(self) -> float:
        """Uncached prompt tokens this gateway sent that the worker has probably still to prefill."""
        b = self.prefill_backlog_tokens
        return float(self.inflight_prefill_tokens) if b is None else b

    @property
    def accepting(self) -> bool:
        """May receive new requests."""
        return self.state == WorkerState.HEALTHY

    def can_prefill(self) -> bool:
        return self.role in (Role.PREFILL, Role.BOTH)

    def can_decode(self) -> bool:
        return self.role in (Role.DECODE, Role.BOTH)
