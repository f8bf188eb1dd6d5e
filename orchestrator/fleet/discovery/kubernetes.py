"""Kubernetes source: engine pods by label selector, one selector per role, kept by list + watch.

Pods, not EndpointSlices: the drain protocol lives on the pod (the planner's actuator annotates the
pod it is about to remove, ``discovery.kubernetes.draining_annotation``), and the role label and
named ports are on the pod too; EndpointSlices carry neither. The watch is the API server's usual
contract:

- list (``resourceVersion`` of the list), then watch from it with ``allowWatchBookmarks``;
- ``ADDED``/``MODIFIED``/``DELETED`` update the cache, ``BOOKMARK`` only advances the
  resourceVersion (so a resumed watch starts from a recent point and is rarely too old);
- a watch that ends (server timeout, dropped connection) resumes from the last resourceVersion;
- ``410 Gone`` (that version is compacted away) means re-list: the list replaces the whole cache,
  so deletions missed while disconnected are noticed.

``pod_to_spec`` is the mapping, pure: only a Ready pod with an IP becomes a routable worker; a pod
marked draining or being deleted (``deletionTimestamp``) is a worker that takes nothing new; a pod
annotated ``standby_annotation`` is warm standby (probed, held out of rotation until the planner's
actuator removes the mark); role
from ``role_label`` (else the selector's role; a value that is not a role: not used), URL from the pod
IP and a named or numbered port. ``pod_mapping`` says why a pod is not a worker (``UNUSED_REASONS``);
``GET /admin/discovery`` lists them and ``dyad_discovery_unused_pods{reason}`` counts them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapters.base import Role
from orchestrator.config import KubernetesDiscoveryConfig, KvEventsConfig, WorkerConfig
from orchestrator.fleet.discovery.reconcile import WorkerSpec
from orchestrator.fleet.kube_api import Gone, KubeApi, pod_namespace

log = logging.getLogger("dyad.discovery")

Pod = dict[str, Any]
COALESCE_S = 0.05  # events within this long after a change are reported together
MIN_WATCH_S = 0.5  # a watch the server ends sooner than this is followed by a pause before the next
UNUSED_SHOWN = 100  # pods not used that GET /admin/discovery names (all are counted)


def pod_ready(pod: Pod) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def container_port(pod: Pod, port: int | str) -> int | None:
    """A numbered port as is; a named one looked up in the pod's containers."""
    if isinstance(port, int):
        return port
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == port and p.get("containerPort"):
                return int(p["containerPort"])
    return None


class UnknownRole(ValueError):
    """The pod's role label has a value that is not a role."""


def pod_role(pod: Pod, selector_role: Role, role_label: str | None) -> Role:
    """The role label's value, else (no label) the selector's role. A value that is not a role raises
    ``UnknownRole``: it used to fall back to the selector's role silently, and a pod labelled for a role
    Dyad does not know (a typo, ``decoder``) may well not be an engine of that role (P/D engines are
    configured per role: a decode engine sent prefills fails every KV transfer)."""
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(role_label or "")
    if not value:
        return selector_role
    try:
        return Role(value)
    except ValueError:
        raise UnknownRole(f"label {role_label}={value!r} is not a role ({', '.join(r.value for r in Role)})") from None


# why a pod the selectors match is not a worker (the ``reason`` label of ``dyad_discovery_unused_pods``)
UNUSED_REASONS = ("not_ready", "no_ip", "no_port", "unknown_role", "unmappable")


@dataclass(frozen=True)
class Unused:
    """A pod that is not a worker, and why: ``reason`` one of ``UNUSED_REASONS``, ``detail`` a sentence."""

    reason: str
    detail: str


def pod_to_spec(pod: Pod, selector_role: Role, cfg: KubernetesDiscoveryConfig) -> WorkerSpec | None:
    """The worker a pod stands for, or None when it must not be a worker (not Ready, no IP, no port,
    an unknown role label; ``pod_mapping`` says which)."""
    spec = pod_mapping(pod, selector_role, cfg)
    return spec if isinstance(spec, WorkerSpec) else None


def pod_mapping(pod: Pod, selector_role: Role, cfg: KubernetesDiscoveryConfig) -> WorkerSpec | Unused:
    """The worker a pod stands for, or why it is not one."""
    meta = pod.get("metadata") or {}
    ip = (pod.get("status") or {}).get("podIP")
    name = meta.get("name")
    if not name:
        return Unused("unmappable", "no metadata.name")
    if not pod_ready(pod):
        deleting = " (being deleted)" if meta.get("deletionTimestamp") else ""
        return Unused("not_ready", f"not Ready{deleting}")
    if not ip:
        return Unused("no_ip", "no status.podIP yet")
    port = container_port(pod, cfg.port)
    if port is None:
        return Unused("no_port", f"no container port named {cfg.port!r} (discovery.kubernetes.port)")
    try:
        role = pod_role(pod, selector_role, cfg.role_label)
    except UnknownRole as e:
        return Unused("unknown_role", f"{e} (discovery.kubernetes.role_label)")
    host = f"[{ip}]" if ":" in ip else ip
    kv_events = None
    ev = container_port(pod, cfg.kv_events_port) if cfg.kv_events_port else None
    if ev is not None:
        replay = container_port(pod, cfg.kv_replay_port) if cfg.kv_replay_port else None
        kv_events = KvEventsConfig(endpoint=f"tcp://{host}:{ev}", topic=cfg.kv_events_topic,
                                   replay_endpoint=f"tcp://{host}:{replay}" if replay else None)
    labels = {"pod": name}
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        labels["node"] = node
    bootstrap = container_port(pod, cfg.bootstrap_port) if cfg.bootstrap_port is not None and role == Role.PREFILL \
        else None
    config = WorkerConfig(id=name, url=f"{cfg.scheme}://{host}:{port}", engine=cfg.engine, role=role,
                          models=list(cfg.models), labels=labels, kv_events=kv_events, bootstrap_port=bootstrap)
    annotations = meta.get("annotations") or {}
    marked = annotations.get(cfg.draining_annotation, "").lower() == "true"
    standby = annotations.get(cfg.standby_annotation, "").lower() == "true"
    return WorkerSpec(config, draining=marked or meta.get("deletionTimestamp") is not None, standby=standby)


def desired_from_pods(caches: list[tuple[Role, dict[str, Pod]]], cfg: KubernetesDiscoveryConfig,
                      memo: dict[tuple[Role, str], tuple[str | None, WorkerSpec | Unused]] | None = None,
                      unused: dict[str, Unused] | None = None) -> dict[str, WorkerSpec]:
    """Every selector's pods → workers (a pod two selectors match counts once, for the first).
    ``memo`` keeps each pod's mapping by resourceVersion, so a report after one event maps one pod;
    ``unused`` (filled when given) gets every matched pod that is not a worker, and why."""
    out: dict[str, WorkerSpec] = {}
    seen: set[tuple[Role, str]] = set()
    for role, pods in caches:
        for name in sorted(pods):
            if name in out:
                continue
            pod = pods[name]
            rv = (pod.get("metadata") or {}).get("resourceVersion")
            hit = memo.get((role, name)) if memo is not None else None
            if hit is not None and rv is not None and hit[0] == rv:
                spec = hit[1]
            else:
                try:
                    spec = pod_mapping(pod, role, cfg)
                except (TypeError, ValueError, KeyError, AttributeError) as e:
                    # a pod of an unexpected shape is not a worker; it must not stop the report of the others
                    log.warning("discovery: pod %s cannot be a worker: %s: %s", name, type(e).__name__, e)
                    spec = Unused("unmappable", f"{type(e).__name__}: {e}"[:200])
                if isinstance(spec, Unused) and spec.reason == "unknown_role":
                    log.warning("discovery: pod %s is not used: %s", name, spec.detail)
            if memo is not None:
                memo[(role, name)] = (rv, spec)
                seen.add((role, name))
            if isinstance(spec, WorkerSpec):
                out[name] = spec
                if unused is not None:
                    unused.pop(name, None)  # another selector's pod of that name is a worker
            elif unused is not None and name not in unused:
                unused[name] = spec
    if memo is not None:
        for key in [k for k in memo if k not in seen]:
            del memo[key]
    return out


def apply_event(cache: dict[str, Pod], event: dict[str, Any]) -> str | None:
    """One watch event into ``cache``; returns the resourceVersion to resume from (None: unchanged).
    Pure: the watch loop and the tests share it."""
    if not isinstance(event, dict):
        raise ValueError(f"watch event is not an object: {str(event)[:80]}")
    kind = event.get("type")
    obj = event.get("object") or {}
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if kind != "BOOKMARK" and not isinstance(meta, dict):
        raise ValueError(f"{kind} event without an object's metadata: {str(obj)[:80]}")
    meta = meta or {}
    name = meta.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{kind} event with a pod name that is not a string: {name!r}"[:120])
    if kind in ("ADDED", "MODIFIED") and name:
        cache[name] = obj
    elif kind == "DELETED" and name:
        cache.pop(name, None)
    elif kind != "BOOKMARK":
        return None
    return meta.get("resourceVersion")


class PodListWatch:
    """The pods one label selector matches, kept current by list + watch (see the module doc)."""

    def __init__(self, api: KubeApi, namespace: str, selector: str, on_change: Callable[[], None],
                 watch_timeout_s: int = 300, backoff_max_s: float = 10.0,
                 on_error: Callable[[], None] | None = None) -> None:
        self.on_error = on_error
        self.api = api
        self.path = f"/api/v1/namespaces/{namespace}/pods"
        self.selector = selector
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.backoff_max_s = backoff_max_s
        self.pods: dict[str, Pod] = {}
        self.resource_version: str | None = None
        self.synced = asyncio.Event()  # set after the first successful list
        # what happened, for /admin and the tests
        self.lists = 0
        self.gone = 0
        self.bookmarks = 0
        self.resumes = 0
        self.errors = 0
        self.last_error: str | None = None

    async def relist(self) -> None:
        body = await self.api.get(self.path, {"labelSelector": self.selector})
        pods: dict[str, Pod] = {}
        for p in body.get("items") or []:
            name = ((p.get("metadata") or {}) if isinstance(p, dict) else {}).get("name")
            if isinstance(name, str) and name:
                pods[name] = p
            else:  # nothing to key it by: not a pod we can follow
                log.warning("pod list (%s): skipped an item without metadata.name", self.selector)
        self.pods = pods
        self.resource_version = (body.get("metadata") or {}).get("resourceVersion")
        self.lists += 1
        self.synced.set()
        self.on_change()

    async def watch_once(self) -> None:
        """One watch request from the current resourceVersion, until the server ends it."""
        params = {"labelSelector": self.selector, "allowWatchBookmarks": "true",
                  "resourceVersion": self.resource_version or ""}
        async for event in self.api.watch(self.path, params, self.watch_timeout_s):
            rv = apply_event(self.pods, event)
            if rv is not None:
                self.resource_version = rv
            if event.get("type") == "BOOKMARK":
                self.bookmarks += 1
            else:
                self.on_change()

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                if self.resource_version is None:
                    await self.relist()
                else:
                    self.resumes += 1
                began = time.monotonic()
                await self.watch_once()
                failures = 0
                if time.monotonic() - began < MIN_WATCH_S:  # a server ending watches at once: no hot loop
                    await asyncio.sleep(MIN_WATCH_S)
            except Gone:
                self.gone += 1
                self.resource_version = None  # too old: list again
                log.info("pod watch (%s): resourceVersion expired, re-listing", self.selector)
            except Exception as e:  # noqa: BLE001 - an answer of any odd shape: retry, never end the watch
                # (httpx.HTTPError, KubeApiError, a line that is not JSON or not an event, ...)
                self.errors += 1
                if self.on_error is not None:
                    self.on_error()
                if not self.synced.is_set():
                    self.on_change()  # a first list that failed must not hold back the other selectors' pods
                failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                delay = min(self.backoff_max_s, 0.2 * 2 ** min(failures, 8)) * random.uniform(0.5, 1.0)
                log.warning("pod watch (%s) failed: %s; retrying in %.1fs", self.selector, self.last_error, delay)
                await asyncio.sleep(delay)

    def status(self) -> dict[str, Any]:
        return {"selector": self.selector, "pods": len(self.pods), "resource_version": self.resource_version,
                "lists": self.lists, "gone": self.gone, "bookmarks": self.bookmarks, "resumes": self.resumes,
                "errors": self.errors, "last_error": self.last_error}


class KubernetesSource:
    name = "kubernetes"

    def __init__(self, cfg: KubernetesDiscoveryConfig, api: KubeApi | None = None,
                 on_error: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.api = api or KubeApi.from_config(cfg.api)
        self.namespace = pod_namespace(cfg.api.namespace)
        self._report: Callable[[dict[str, WorkerSpec]], None] | None = None
        self._reported = False
        self._flush_pending = False
        self._memo: dict[tuple[Role, str], tuple[str | None, WorkerSpec | Unused]] = {}
        self.unused: dict[str, Unused] = {}  # matched pods that are not workers, and why (last report)
        self.watches = [(role, PodListWatch(self.api, self.namespace, sel, self._changed, cfg.watch_timeout_s,
                                            on_error=on_error))
                        for role, sel in cfg.selectors.items()]

    def _changed(self) -> None:
        """A watch changed its cache: report (the first time at once, then coalesced: a burst of
        events, e.g. a rolling restart, costs one report per ``COALESCE_S``). A report waits until every
        watch has listed once or failed to: a selector the API refuses for good (400: it cannot parse it)
        held back every other role's pods, and the gateway had no discovered worker at all. (An unlisted
        watch's pods are simply not in the report yet; none of them was ever reported, so none is withdrawn.)"""
        if self._report is None or self._flush_pending or not all(
                w.synced.is_set() or w.errors > 0 for _, w in self.watches):
            return
        if not self._reported:
            self._flush()
            return
        self._flush_pending = True
        asyncio.get_running_loop().call_later(COALESCE_S, self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self._report is not None:
            self._reported = True
            unused: dict[str, Unused] = {}
            desired = desired_from_pods([(role, w.pods) for role, w in self.watches], self.cfg, self._memo, unused)
            self.unused = unused
            self._report(desired)

    def unused_counts(self) -> dict[str, int]:
        """Matched pods that are not workers, per reason (every reason, 0 included)."""
        counts = dict.fromkeys(UNUSED_REASONS, 0)
        for u in self.unused.values():
            counts[u.reason] = counts.get(u.reason, 0) + 1
        return counts

    async def run(self, report: Callable[[dict[str, WorkerSpec]], None]) -> None:
        self._report = report
        try:
            await asyncio.gather(*(w.run() for _, w in self.watches))
        finally:
            await self.api.aclose()

    def status(self) -> dict[str, Any]:
        shown = sorted(self.unused)[:UNUSED_SHOWN]
        return {"source": self.name, "namespace": self.namespace,
                "watches": {role.value: w.status() for role, w in self.watches},
                # why each matched pod that is not a worker is not used (the first UNUSED_SHOWN by name)
                "unused": {"count": len(self.unused), "by_reason": self.unused_counts(),
                           "pods": {n: f"{self.unused[n].reason}: {self.unused[n].detail}" for n in shown}}}
