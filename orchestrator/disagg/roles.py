"""Role changes without restart: move a ``kv_both`` engine between the prefill and decode pools.

A vLLM engine started with ``kv_role: kv_both`` can prefill for a remote decode and decode with a
remote prefill, so its role is purely a routing decision. Changing it is a two-phase move:

1. ``target_role`` is set: the worker leaves both pools (pair selection skips it) and takes no new
   work, while the requests it already has — in its old role — run to completion;
2. once it has nothing in flight (or ``drain_timeout_s`` passed: the engine can still finish the
   stragglers, it only decodes them alongside new work), ``role`` becomes the target.

No request is refused or cut off at any point. The admin API (``POST /admin/workers/{id}/role``)
and the planner (``set_role``) drive the same ``RoleManager``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from adapters.base import Role
from orchestrator.clock import Clock
from orchestrator.errors import ApiError, NotFound
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 120.0
POLL_S = 0.05


class RoleConflict(ApiError):
    def __init__(self, message: str, code: str = "role_conflict") -> None:
        super().__init__(message, status=409, type="invalid_request_error", param="role", code=code)


@dataclass
class RoleChange:
    worker_id: str
    from_role: Role
    to_role: Role
    started_at: float
    finished_at: float | None = None
    drained: bool = True  # False when the drain timed out and the role was applied anyway


class RoleManager:
    def __init__(self, fleet: FleetRegistry, clock: Clock, metrics: DyadMetrics | None = None,
                 drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        self.fleet = fleet
        self.clock = clock
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self._pending: dict[str, asyncio.Task[RoleChange]] = {}
        self.history: list[RoleChange] = []

    # --- the interface the planner uses -----------------------------------------------------------

    async def set_role(self, worker_id: str, role: Role | str) -> RoleChange:
        """Move ``worker_id`` to ``role`` once it has drained its current work; returns when applied."""
        return await self.request(worker_id, role)

    def request(self, worker_id: str, role: Role | str) -> asyncio.Task[RoleChange]:
        """Start a role change and return its task (await it to wait for the drain)."""
        worker = self.fleet.get(worker_id)
        if worker is None:
            raise NotFound(f"No worker with id '{worker_id}'.", param="worker_id", code="worker_not_found")
        try:
            target = Role(role)
        except ValueError:
            raise RoleConflict(f"'{role}' is not a role (choose from prefill, decode, both).",
                               code="invalid_role") from None
        pending = self._pending.get(worker_id)
        if pending is not None and not pending.done():
            if worker.target_role == target:
                return pending
            raise RoleConflict(f"Worker '{worker_id}' is already moving to '{worker.target_role.value}'; "
                               "wait for that change to finish.", code="role_change_pending")
        if worker.role == target:
            done: asyncio.Future[RoleChange] = asyncio.get_running_loop().create_future()
            now = self.clock.now()
            done.set_result(RoleChange(worker_id, target, target, now, now))
            return done  # type: ignore[return-value]
        self._check_keeps_decoders(worker, target)
        worker.target_role = target
        change = RoleChange(worker_id, worker.role, target, self.clock.now())
        task = asyncio.create_task(self._drain_then_apply(worker, change), name=f"dyad-role-{worker_id}")
        self._pending[worker_id] = task
        return task

    def pending(self) -> dict[str, Role]:
        return {w.id: w.target_role for w in self.fleet.workers() if w.target_role is not None}

    def pools(self) -> dict[str, list[str]]:
        """Current pools by role, plus the workers moving between them."""
        out: dict[str, list[str]] = {r.value: [] for r in Role}
        out["moving"] = []
        for w in self.fleet.workers():
            if w.target_role is not None:
                out["moving"].append(w.id)
            else:
                out[w.role.value].append(w.id)
        return out

    async def close(self) -> None:
        """Abandon pending changes: the workers keep their current role."""
        for worker_id, task in self._pending.items():
            if not task.done():
                task.cancel()
                worker = self.fleet.get(worker_id)
                if worker is not None:
                    worker.target_role = None
        for task in self._pending.values():
            try:
                await task
            except BaseException:  # noqa: BLE001 - shutting down
                pass
        self._pending.clear()

    # --- internals ---------------------------------------------------------------------------------

    def _check_keeps_decoders(self, worker: Worker, target: Role) -> None:
        """Refuse a move that would leave a model without any worker able to decode it."""
        if target != Role.PREFILL or not worker.can_decode():
            return
        for model in worker.models:
            others = [w for w in self.fleet.workers()
                      if w.id != worker.id and model in w.models and w.state is not WorkerState.UNHEALTHY
                      and (w.target_role or w.role) in (Role.DECODE, Role.BOTH)]
            if not others:
                raise RoleConflict(f"Moving '{worker.id}' to prefill would leave model '{model}' with no worker "
                                   "able to decode it.", code="last_decoder")

    async def _drain_then_apply(self, worker: Worker, change: RoleChange) -> RoleChange:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        try:
            while worker.inflight > 0 or worker.inflight_prefill_tokens > 0:
                if loop.time() >= deadline:
                    change.drained = False
                    log.warning("worker %s still has %d requests after %.0fs of draining; applying role %s",
                                worker.id, worker.inflight, self.drain_timeout_s, change.to_role.value)
                    break
                await asyncio.sleep(POLL_S)
        except asyncio.CancelledError:
            worker.target_role = None
            raise
        if self.fleet.get(worker.id) is worker:
            self.fleet.set_role(worker.id, change.to_role)  # (the fleet's listeners hear it: "role")
        else:  # (removed while it drained)
            worker.role = change.to_role
        worker.target_role = None
        change.finished_at = self.clock.now()
        self.history.append(change)
        if self.metrics is not None:
            self.metrics.role_changes.labels(change.from_role.value, change.to_role.value).inc()
        log.info("worker %s: role %s → %s after %.2fs", worker.id, change.from_role.value, change.to_role.value,
                 change.finished_at - change.started_at)
        return change
