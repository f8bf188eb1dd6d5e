"""Desired workers (what a source reports) versus the workers a source put in the registry.

``plan_changes`` is the decision, pure (plain data and ``now``, no registry, no I/O); ``Reconciler``
carries it out on a ``FleetRegistry``. The rules:

- a new, routable worker is **added** (unhealthy until the health loop's first good probe, so no
  request reaches it before the engine answers);
- a worker whose address or dialect changed is **replaced**; a changed role is set in place;
  changed models/labels are updated in place;
- a worker the source marks draining (a pod annotated by the planner's actuator, or a pod being
  deleted) is **drained**: no new requests, its in-flight ones finish; unmarked, it is undrained;
- a worker the source marks standby (a pod annotated by the planner's actuator) is **parked**:
  probed, never routed to; unmarked, it is **activated** (in rotation at once when its probe passed);
- a worker whose engine (URL) is already registered under another id is a **conflict**, reported
  once and not added until the other registration has gone;
- a worker that left the source (deleted from the file, a pod gone or no longer Ready) is
  **withdrawn**: drained at once, and **removed** when its in-flight requests are done or
  ``grace_s`` has passed. If it comes back before that, it is restored.

Only workers this source added are touched: static workers, and workers an operator drained
through the admin API, keep their state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from orchestrator.config import WorkerConfig
from orchestrator.fleet.registry import FleetRegistry, url_key, worker_from_config

# A change of these means another engine: replace the worker rather than edit it.
IDENTITY_FIELDS = ("url", "engine", "api_key", "bootstrap_port", "kv_events")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker as a source sees it. ``draining``: it exists but must take no new requests."""

    config: WorkerConfig  # ``id`` is set
    draining: bool = False
    standby: bool = False  # warm standby: probed, held out of rotation (draining wins over it)

    @property
    def id(self) -> str:
        assert self.config.id is not None
        return self.config.id


@dataclass
class Owned:
    """A worker the source added: what it was added with, and what the source did to it since."""

    config: WorkerConfig
    marked: bool = False  # drained because the source marked it draining
    parked: bool = False  # held in standby because the source marked it so
    withdrawn_at: float | None = None  # left the source at this time; removed when idle


@dataclass(frozen=True)
class Change:
    kind: Literal["add", "replace", "set_role", "update", "drain", "undrain", "park", "activate", "withdraw",
                  "restore", "remove", "conflict"]
    worker_id: str
    spec: WorkerSpec | None = None
    reason: str = ""


# The changes that follow a source's marks: the registry call, then ``Owned.marked`` and ``Owned.parked``
# afterwards (None: as it was).
MARKS: dict[str, tuple[str, bool | None, bool | None]] = {
    "drain": ("drain", True, False),
    "undrain": ("undrain", False, None),
    "park": ("park", False, True),
    "activate": ("activate", None, False),
}


def _identity(c: WorkerConfig) -> tuple:
    return tuple(getattr(c, f) for f in IDENTITY_FIELDS)


def plan_changes(desired: Mapping[str, WorkerSpec], owned: Mapping[str, Owned], inflight: Mapping[str, int],
                 foreign: set[str], now: float, grace_s: float, urls: Mapping[str, str] | None = None) -> list[Change]:
    """What to do so that the registry matches ``desired``.

    ``owned``: the workers this source added; ``inflight``: their in-flight request counts;
    ``foreign``: ids in the registry that the source does not own (static or admin-added workers,
    never touched: a clash is reported as ``conflict``); ``urls``: the engine address (``url_key``)
    of every registered worker → its id. A worker whose engine is already registered under another id
    is a ``conflict`` too, not added (one engine as two workers gets twice its share of requests and
    counts twice as capacity); it joins once the other registration has gone."""
    out: list[Change] = []
    # the addresses registered, plus those this plan adds: two new workers with one engine address in one
    # report (two pods given one IP and port, at the first list) were both added
    urls = dict(urls or {})

    def taken(wid: str, spec: WorkerSpec) -> str | None:
        other = urls.get(url_key(spec.config.url))
        return other if other is not None and other != wid else None

    def claim(wid: str, spec: WorkerSpec) -> None:
        urls[url_key(spec.config.url)] = wid

    for wid, spec in desired.items():
        o = owned.get(wid)
        if o is None:
            if wid in foreign:
                out.append(Change("conflict", wid, spec, "id already used by a worker the source does not own"))
            elif (other := taken(wid, spec)) is not None:
                out.append(Change("conflict", wid, spec, f"the engine at {spec.config.url} is already worker '{other}'"))
            elif not spec.draining:
                out.append(Change("add", wid, spec))
                claim(wid, spec)
            continue
        if (o.config is spec.config and o.withdrawn_at is None and o.marked == spec.draining
                and o.parked == (spec.standby and not spec.draining)):
            continue  # the same report object as last time (sources memoize): nothing to compare
        if _identity(o.config) != _identity(spec.config):
            if (other := taken(wid, spec)) is not None:
                out.append(Change("conflict", wid, spec, f"the engine at {spec.config.url} is already worker '{other}'"))
            else:
                out.append(Change("replace", wid, spec, f"{o.config.url} -> {spec.config.url}"))
                claim(wid, spec)
            continue
        if o.config.role is not spec.config.role:
            out.append(Change("set_role", wid, spec, f"{o.config.role.value} -> {spec.config.role.value}"))
        if o.config.models != spec.config.models or o.config.labels != spec.config.labels:
            out.append(Change("update", wid, spec))
        if o.withdrawn_at is not None:
            out.append(Change("restore", wid, spec, "back in the source"))
        elif spec.draining and not o.marked:
            out.append(Change("drain", wid, spec, "marked draining"))
        elif not spec.draining and spec.standby and not o.parked:
            out.append(Change("park", wid, spec, "marked standby"))
        elif not spec.draining and o.marked:
            out.append(Change("undrain", wid, spec, "draining mark cleared"))
        elif not spec.draining and not spec.standby and o.parked:
            out.append(Change("activate", wid, spec, "standby mark cleared"))
    for wid, o in owned.items():
        if wid in desired:
            continue
        if o.withdrawn_at is None:
            out.append(Change("withdraw", wid, None, "left the source"))
        elif inflight.get(wid, 0) <= 0:
            out.append(Change("remove", wid, None, "idle after leaving the source"))
        elif now - o.withdrawn_at >= grace_s:
            out.append(Change("remove", wid, None, f"still busy {grace_s:g}s after leaving the source"))
    return out


class Reconciler:
    """Applies a source's desired workers to the registry (``plan_changes``, then the changes).

    ``update(desired, now)`` when the source reports; ``sweep(now)`` between reports removes the
    withdrawn workers that have gone idle. No I/O: the same object runs live and in tests.
    """

    def __init__(self, fleet: FleetRegistry, source: str, grace_s: float,
                 on_change: Callable[[Change], None] | None = None) -> None:
        self.fleet = fleet
        self.source = source
        self.grace_s = grace_s
        self.on_change = on_change
        self.owned: dict[str, Owned] = {}
        self.desired: dict[str, WorkerSpec] = {}
        self._conflicts: set[tuple[str, str]] = set()  # conflicts already reported (worker id, reason)

    def conflicts(self) -> set[tuple[str, str]]:
        """(worker id, why) of each reported worker that is not added because of a conflict, now."""
        return set(self._conflicts)

    def update(self, desired: Mapping[str, WorkerSpec], now: float) -> list[Change]:
        self.desired = dict(desired)
        return self.sweep(now)

    def sweep(self, now: float) -> list[Change]:
        for wid in [w for w in self.owned if self.fleet.get(w) is None]:
            del self.owned[wid]  # removed behind our back (admin API): re-added if still desired
        workers = {w.id: w for w in self.fleet.workers()}
        inflight = {wid: workers[wid].inflight for wid in self.owned}
        foreign = set(workers) - set(self.owned)
        urls = {url_key(w.url): w.id for w in workers.values()}
        changes = plan_changes(self.desired, self.owned, inflight, foreign, now, self.grace_s, urls)
        conflicts = set()
        for c in changes:
            self._apply(c, now)
            if c.kind == "conflict":  # standing until resolved: told once, not at every sweep
                conflicts.add((c.worker_id, c.reason))
                if (c.worker_id, c.reason) in self._conflicts:
                    continue
            if self.on_change is not None:
                self.on_change(c)
        self._conflicts = conflicts
        return changes

    def _apply(self, c: Change, now: float) -> None:
        fleet, wid = self.fleet, c.worker_id
        if c.kind in ("add", "replace"):
            assert c.spec is not None
            if c.kind == "replace":
                fleet.remove(wid)
            # owned before it is added: a listener that fails during ``add`` leaves a worker this source
            # still answers for (withdrawn when it leaves), not a foreign one it would never touch
            self.owned[wid] = Owned(c.spec.config)
            fleet.add(worker_from_config(c.spec.config))
            if c.spec.draining:
                fleet.drain(wid)
                self.owned[wid].marked = True
            elif c.spec.standby:
                fleet.park(wid)
                self.owned[wid].parked = True
        elif c.kind == "set_role":
            assert c.spec is not None
            fleet.set_role(wid, c.spec.config.role)
            self.owned[wid].config = c.spec.config
        elif c.kind == "update":
            assert c.spec is not None
            w = fleet.get(wid)
            if w is not None:
                w.labels = dict(c.spec.config.labels)
                if c.spec.config.models:
                    w.models, w.configured_models = list(c.spec.config.models), True
            self.owned[wid].config = c.spec.config
        elif c.kind in MARKS:
            call, marked, parked = MARKS[c.kind]
            getattr(fleet, call)(wid)
            o = self.owned[wid]
            o.marked = o.marked if marked is None else marked
            o.parked = o.parked if parked is None else parked
        elif c.kind == "withdraw":
            fleet.drain(wid)
            self.owned[wid].withdrawn_at = now
        elif c.kind == "restore":
            assert c.spec is not None
            o = self.owned[wid]
            o.withdrawn_at = None
            o.marked = c.spec.draining
            o.parked = c.spec.standby and not c.spec.draining
            if o.parked:
                fleet.park(wid)
            elif not c.spec.draining:
                fleet.undrain(wid)
        elif c.kind == "remove":
            fleet.remove(wid)
            del self.owned[wid]
