"""The fleet registry: which workers exist and whether they may receive requests.

Workers come from the configuration, the admin API and discovery sources (``fleet/discovery``). The registry owns the state machine
(healthy / unhealthy / draining / standby): the health loop and the gateway report probe results and failed
attempts here, and the thresholds in ``HealthConfig`` decide when a worker flips. It does no I/O,
so the same registry runs live and in the virtual-time simulator.

Draining is an operator decision and sits above health: a draining worker keeps being probed (so
``undrain`` knows whether to return it as healthy or unhealthy) but receives nothing new.
Standby (warm capacity the planner holds out of rotation) is the same kind of decision: a standby
worker is probed and scraped, never routed to, and ``activate`` puts it in rotation at once (a state
change, no I/O) when its last probe passed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from adapters.base import Role
from orchestrator.config import DyadConfig, HealthConfig, WorkerConfig
from orchestrator.fleet.worker import Worker, WorkerState

# Called with (event, worker) where event is "added", "removed", "state" or "role".
FleetListener = Callable[[str, Worker], None]


def url_key(url: str) -> str:
    """One engine address however it is spelled: scheme and host in lower case, the default port made
    explicit, no trailing slash (``http://Host/`` and ``http://host:80`` are the same engine)."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = None
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def worker_from_config(wc: WorkerConfig) -> Worker:
    """A worker as declared in the config; it starts unhealthy until its first successful probe."""
    return Worker(
        id=wc.id or wc.url,
        url=wc.url.rstrip("/"),
        engine=wc.engine,
        role=wc.role,
        models=list(wc.models),
        labels=dict(wc.labels),
        state=WorkerState.UNHEALTHY,
        api_key=wc.api_key,
        bootstrap_port=wc.bootstrap_port,
        configured_models=bool(wc.models),
        kv_events=wc.kv_events,
    )


def _serves(w: Worker, model: str, role: Role | None) -> bool:
    """``w`` serves ``model`` and can take ``role``'s part (None or ``Role.BOTH``: any)."""
    if model not in w.models:
        return False
    if role is Role.DECODE:
        return w.can_decode()
    if role is Role.PREFILL:
        return w.can_prefill()
    return True


class FleetRegistry:
    def __init__(self, workers: Iterable[Worker] = (), health: HealthConfig | None = None,
                 configured_models: Iterable[str] = ()) -> None:
        self.health = health or HealthConfig()
        self._workers: dict[str, Worker] = {}
        self._listeners: list[FleetListener] = []
        self._configured_models = list(configured_models)
        self._snapshot: list[Worker] = []
        for w in workers:
            self.add(w)

    @classmethod
    def from_config(cls, config: DyadConfig) -> FleetRegistry:
        return cls((worker_from_config(wc) for wc in config.workers), health=config.health,
                   configured_models=[m.name for m in config.models])

    # --- membership ---------------------------------------------------------------------------

    def subscribe(self, listener: FleetListener) -> None:
        """Be told about added/removed workers and state changes (e.g. the prefix index drops a worker)."""
        self._listeners.append(listener)

    def _notify(self, event: str, worker: Worker) -> None:
        for listener in self._listeners:
            listener(event, worker)

    def add(self, worker: Worker) -> Worker:
        if worker.id in self._workers:
            raise ValueError(f"worker id '{worker.id}' already exists")
        self._workers[worker.id] = worker
        self._snapshot = list(self._workers.values())
        self._notify("added", worker)
        return worker

    def remove(self, worker_id: str) -> Worker:
        worker = self._workers.pop(worker_id)  # KeyError when unknown
        self._snapshot = list(self._workers.values())
        self._notify("removed", worker)
        return worker

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def by_url(self, url: str) -> Worker | None:
        """The registered worker for the engine at ``url`` (``url_key``), if any."""
        key = url_key(url)
        return next((w for w in self._snapshot if url_key(w.url) == key), None)

    def workers(self) -> list[Worker]:
        """Every worker in insertion order (a copy: callers may keep it)."""
        return list(self._snapshot)

    def __len__(self) -> int:
        return len(self._workers)

    # --- what routing reads ------------------------------------------------------------------

    def candidates(self, model: str, role: Role | None = None) -> list[Worker]:
        """Workers that may take a new request for ``model`` now; ``role`` filters by capability
        (``Role.DECODE``: can decode, ``Role.PREFILL``: can prefill, ``Role.BOTH``/None: any)."""
        return [w for w in self._snapshot if w.state is WorkerState.HEALTHY and _serves(w, model, role)]

    def last_resort(self, model: str, role: Role | None = None) -> list[Worker]:
        """Workers out of rotation for ``model`` only because their probes timed out (``Worker.out_by_timeouts``)
        and that were up before: where requests go when ``candidates`` is empty and ``health.last_resort`` is
        on. An engine too busy to answer /health within ``timeout_s`` is slow, not gone: sending to it beats a
        certain 503, and a try on one that does no work is pulled by the stall watchdog. Never a worker that
        refused a connection or answered a probe with an error, a draining or standby one, or one never up."""
        return [w for w in self._snapshot if w.state is WorkerState.UNHEALTHY and w.out_by_timeouts
                and w.ready_at is not None and _serves(w, model, role)]

    def models(self) -> list[str]:
        """Models the fleet knows: configured ones plus every model a registered worker serves."""
        seen = dict.fromkeys(self._configured_models)
        for w in self._snapshot:
            seen.update(dict.fromkeys(w.models))
        return list(seen)

    def max_model_len(self, model: str) -> int | None:
        """The context length every worker serving ``model`` accepts (the smallest one reported), or None
        when no worker has reported one."""
        lengths = [w.max_model_len[model] for w in self._snapshot if model in w.max_model_len]
        return min(lengths) if lengths else None

    def knows_model(self, model: str) -> bool:
        return model in self._configured_models or any(model in w.models for w in self._snapshot)

    # --- state machine -----------------------------------------------------------------------

    def _set_state(self, worker: Worker, state: WorkerState) -> None:
        if worker.state is not state:
            worker.state = state
            self._notify("state", worker)

    def record_health(self, worker: Worker, ok: bool, now: float, error: str | None = None,
                      quiet_for: float | None = None, timed_out: bool = False) -> None:
        """One probe result. ``failure_threshold`` consecutive failures make a worker unhealthy;
        ``success_threshold`` consecutive successes make it healthy again. A worker never probed
        before becomes healthy at its first success (nothing to distrust yet). A failure is not held
        against a healthy worker that is serving traffic (``serving_window_s``): one that completed a
        request, whose generated-token counter rose at its last scrape (``generating_at``), or whose streams
        delivered a data event ``quiet_for`` seconds ago. ``timed_out``: the engine took the probe but did not
        answer it in time (``out_by_timeouts`` while every failure since the last success was one)."""
        first = worker.last_health_at is None
        worker.last_health_at = now
        if ok:
            worker.consecutive_successes += 1
            worker.consecutive_failures = 0
            worker.last_error = None
            worker.out_by_timeouts = False
            if first or worker.consecutive_successes >= self.health.success_threshold:
                worker.health_ok = True
                if worker.ready_at is None:
                    worker.ready_at = now
        elif self._recently_served(worker, now, quiet_for):
            # Real traffic outranks a missed probe: an engine that just answered a request is up, even if
            # its /health probe timed out on an overloaded machine. Requests that fail mark it at once.
            worker.last_error = error
            return
        else:
            worker.consecutive_failures += 1
            worker.consecutive_successes = 0
            worker.last_error = error
            worker.out_by_timeouts = timed_out and (worker.consecutive_failures == 1 or worker.out_by_timeouts)
            if first or worker.consecutive_failures >= self.health.failure_threshold:
                worker.health_ok = False
        self._apply_health(worker)

    @property
    def serving_window_s(self) -> float:
        """How recent traffic must be to outrank missed probes: the time the health loop takes to mark down
        a worker whose probes time out, ``failure_threshold * (interval_s + timeout_s)`` (a round waits for
        its slowest probe, then sleeps ``interval_s``). With ``interval_s`` alone, a loaded engine that
        finished a request every 1.4 s was marked down by 1-s probe timeouts every 1.5 s (window 1 s)."""
        return self.health.failure_threshold * (self.health.interval_s + self.health.timeout_s)

    def _recently_served(self, worker: Worker, now: float, quiet_for: float | None = None) -> bool:
        if worker.health_ok is not True:
            return False
        window = self.serving_window_s
        if quiet_for is not None and quiet_for < window:  # a stream on it is delivering tokens right now
            return True
        return any(t is not None and now - t < window for t in (worker.last_served_at, worker.generating_at))

    def mark_failed(self, worker: Worker, now: float, error: str) -> None:
        """The gateway could not reach the worker (connection refused/reset): take it out at once
        rather than waiting for the health loop; the loop brings it back when it answers again."""
        worker.consecutive_failures = max(worker.consecutive_failures + 1, self.health.failure_threshold)
        worker.consecutive_successes = 0
        worker.last_error = error
        worker.health_ok = False
        worker.out_by_timeouts = False  # (unreachable: no last resort)
        self._apply_health(worker)

    def _apply_health(self, worker: Worker) -> None:
        if worker.state in (WorkerState.DRAINING, WorkerState.STANDBY):
            return
        self._set_state(worker, WorkerState.HEALTHY if worker.health_ok else WorkerState.UNHEALTHY)

    def set_role(self, worker_id: str, role: Role) -> Worker:
        """Change a worker's role in place (a discovery source reports the engine now serves ``role``);
        listeners hear ``"role"``. Requests in flight finish as they started."""
        worker = self._workers[worker_id]
        if worker.role is not role:
            worker.role = role
            self._notify("role", worker)
        return worker

    def drain(self, worker_id: str) -> Worker:
        worker = self._workers[worker_id]
        self._set_state(worker, WorkerState.DRAINING)
        return worker

    def undrain(self, worker_id: str) -> Worker:
        worker = self._workers[worker_id]
        if worker.state is WorkerState.DRAINING:
            self._set_state(worker, WorkerState.HEALTHY if worker.health_ok else WorkerState.UNHEALTHY)
        return worker

    def park(self, worker_id: str) -> Worker:
        """Hold a worker out of rotation as warm standby (still probed). Callers drain it first: a
        worker parked with requests in flight finishes them, but gets nothing new."""
        worker = self._workers[worker_id]
        self._set_state(worker, WorkerState.STANDBY)
        return worker

    def activate(self, worker_id: str) -> Worker:
        """Put a standby (or draining) worker back in rotation: healthy at once when its last probe
        passed, else unhealthy until the health loop sees it up."""
        worker = self._workers[worker_id]
        if worker.state in (WorkerState.STANDBY, WorkerState.DRAINING):
            self._set_state(worker, WorkerState.HEALTHY if worker.health_ok else WorkerState.UNHEALTHY)
        return worker
