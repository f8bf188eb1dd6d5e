"""Replay a trace against a simulated fleet in virtual time: no sockets, no sleeps.

A discrete-event loop over a ``VirtualClock`` drives one engine model per worker. Routing uses the
live gateway's policies (``make_policy`` on ``Worker`` objects whose load and in-flight counts the
loop keeps current); scaling uses the live planner (``Planner.step``) or a baseline behind the same
interface. What is simulated, and how:

- **Engines** (``ModelEngine``): the simulated engine server's own pure core
  (``orchestrator/sim/engine_model.py``: vLLM-style continuous batching, chunked prefill, a block
  prefix cache with LRU eviction, the ``EngineProfile`` cost model), one per worker. One block = one
  trace prefix block (512 tokens for Mooncake), so trace hash ids are block hashes. The core plans a
  run of pure-decode steps at once and the fleet wakes up only at the run's end (a newcomer cuts
  the run at the step boundary), so cost scales with requests, not tokens: an hour of a 32-worker
  fleet takes seconds of CPU. There is one engine model for the live sim server and this simulator.
- **P/D**: a prefill worker prefills, the KV moves to a decode worker in
  ``profile.transfer_seconds(prompt)``, the decode worker produces every output token. Aggregated
  workers (role both) do chunked prefill and decode in the same steps.
- **Scaling**: started workers serve after ``start_s``; a role change takes ``role_change_s``; a
  drained worker takes no new requests and is stopped (or switched) once idle. Worker-hours count
  every worker from its start request to its stop, including start-up and draining.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from adapters.base import EngineKind, Role
from orchestrator.clock import VirtualClock
from orchestrator.config import KvAwareConfig, RouterConfig
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.kv.tier_cost import effective_tier_weights
from orchestrator.planner.core import Action, PlanDecision, WorkerView
from orchestrator.planner.metrics_source import PEAK_WINDOW_S, Observation
from orchestrator.router.inflight import InflightLedger
from orchestrator.router.policies import make_policy
from orchestrator.router.types import Overlap, RouteDecision, RouteRequest
from orchestrator.sim.engine_model import EngineModel
from orchestrator.sim.engine_model import SimRequest as ModelRequest
from orchestrator.sim.profiles import EngineProfile
from orchestrator.stats import percentile

INF = math.inf


# ------------------------------------------------------------------------------------------ requests

@dataclass(eq=False)
class SimRequest:
    id: int
    arrival: float
    isl: int
    osl: int
    blocks: tuple[int, ...] = ()  # prefix block ids (equal id = identical block)
    block_tokens: int = 512
    # progress, filled in by the fleet and the engines
    cached: int = 0
    prefill_left: int = 0
    decode_left: int = 0
    context: int = 0
    first_token: float | None = None
    finish: float | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency of this request (None with one output token)."""
        if self.finish is None or self.first_token is None or self.osl <= 1:
            return None
        return (self.finish - self.first_token) / (self.osl - 1)


# ------------------------------------------------------------------------------------------ engine

class _ModelCacheView:
    """``PrefixCache.match`` over an ``EngineModel``'s block cache (for kv_aware routing)."""

    def __init__(self, model: EngineModel) -> None:
        self.model = model

    def match(self, blocks: Sequence[int], touch: bool = False) -> int:
        return self.model.cached_prefix_blocks(blocks)


class ModelEngine:
    """One simulated engine of the fleet: the sim server's own core (``EngineModel``) in virtual time.

    ``submit_prefill`` / ``submit_decode`` / ``advance(now) -> [(kind, request, t)]`` with kinds
    ``first_token``, ``prefilled`` (prefill-only worker done: the fleet moves the KV) and ``finished``.

    One simulated block = one trace prefix block (``block_tokens``, 512 for Mooncake), so trace hash
    ids are the engine's block hashes and no token ids are materialized (the prompt is a ``range``).
    The KV transfer is charged by the fleet (``handoff``), so the engine's own transfer cost is 0.
    """

    def __init__(self, profile: EngineProfile, role: Role, block_tokens: int = 512) -> None:
        blocks = max(1, profile.cache_tokens // block_tokens)
        # a trace request longer than the profile's context still runs (the trace is the ground truth)
        self.p = replace(profile, block_size=block_tokens, num_gpu_blocks=blocks, max_model_len=1 << 30,
                         transfer_bandwidth_bytes_s=0.0, transfer_fixed_s=0.0, kv_lease_s=0.0)
        self.role = role
        self.model = EngineModel(self.p, record_kv_events=False, track_histograms=False)
        self.cache = _ModelCacheView(self.model)
        self.reqs: dict[str, SimRequest] = {}

    def next_event_time(self) -> float:
        """When the fleet must look again: the end of the core's planned run of decode steps, not of
        each step (the core plans per-step ends for streaming; nothing here needs them one by one,
        and a submit cuts the run anyway). This is what keeps an hour of 32 engines at seconds of CPU."""
        t = self.model.run_end_time()
        if t is not None:
            return t
        t = self.model.next_event_time()
        return INF if t is None else t

    @property
    def idle(self) -> bool:
        return not self.reqs

    @property
    def waiting(self) -> int:
        return self.model.num_waiting

    @property
    def num_running(self) -> int:
        return self.model.num_running

    @property
    def kv_usage(self) -> float:
        return self.model.kv_usage

    def in_flight(self) -> list[SimRequest]:
        return list(self.reqs.values())

    def submit_prefill(self, req: SimRequest, now: float) -> None:
        hit = sum(self.model.cached_prefix_tiers(req.blocks))  # GPU prefix + its host-tier continuation
        req.cached = min(req.isl - 1, hit * req.block_tokens) if req.isl > 1 else 0
        req.prefill_left = max(1, req.isl - req.cached)
        remote = self.role is Role.PREFILL
        self._submit(req, ModelRequest(str(req.id), range(req.isl), 1 if remote else req.osl,
                                       do_remote_decode=remote, output_seed=req.id, block_hashes=req.blocks), now)

    def submit_decode(self, req: SimRequest, now: float) -> None:
        self._submit(req, ModelRequest(str(req.id), range(req.isl), req.osl, remote_prefill=True,
                                       output_seed=req.id, block_hashes=req.blocks), now)

    def _submit(self, req: SimRequest, mreq: ModelRequest, now: float) -> None:
        self.reqs[mreq.request_id] = req
        self.model.submit(mreq, now)

    def abort_all(self, now: float) -> list[SimRequest]:
        out = list(self.reqs.values())
        for rid in list(self.reqs):
            self.model.abort(rid, now)
        self.reqs.clear()
        return out

    def advance(self, now: float) -> list[tuple[str, SimRequest, float]]:
        events: list[tuple[str, SimRequest, float]] = []
        prefill_only = self.role is Role.PREFILL
        for o in self.model.advance(now):
            r = self.reqs.get(o.request_id)
            if r is None:
                continue
            t0, t1 = o.times[0], o.times[-1]
            if prefill_only:
                if o.finished:
                    self.model.release_lease(o.request_id, t1)  # the fleet moves the KV
                    del self.reqs[o.request_id]
                    events.append(("prefilled", r, t1))
                continue
            if r.first_token is None:
                r.first_token = t0
                events.append(("first_token", r, t0))
            if o.finished:
                r.finish = t1
                del self.reqs[o.request_id]
                events.append(("finished", r, t1))
        return events


# ------------------------------------------------------------------------------------------ fleet

class Scaler(Protocol):
    """The planner (``orchestrator.planner.core.Planner``) or a baseline with the same call."""

    def step(self, obs: Observation | None, fleet: Sequence[WorkerView], now: float) -> PlanDecision: ...


@dataclass(eq=False)
class SimWorker:
    worker: Worker
    engine: ModelEngine
    started_at: float  # when it was asked for (worker-hours count from here)
    ready_at: float
    state: str = "starting"  # starting | healthy | draining | switching | standby
    switch_to: Role | None = None
    to_standby: bool = False  # planner hook: started into the warm standby pool (out of rotation)


@dataclass
class FleetSpec:
    prefill: int = 0
    decode: int = 0
    aggregated: int = 0


@dataclass
class SimResult:
    requests: list[SimRequest]
    duration_s: float  # virtual seconds simulated (until the last request finished)
    worker_seconds: float
    wall_s: float
    decisions: list[PlanDecision] = field(default_factory=list)
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, prefill, decode, both)
    role_seconds: dict[str, float] = field(default_factory=dict)  # worker-seconds per role (costs)

    def summary(self, ttft_s: float, itl_s: float) -> dict[str, Any]:
        done = [r for r in self.requests if r.finish is not None]
        ok = [r for r in done if r.ttft is not None and r.ttft <= ttft_s and (r.itl is None or r.itl <= itl_s)]
        ttfts = sorted(r.ttft for r in done if r.ttft is not None)
        itls = sorted(r.itl for r in done if r.itl is not None)

        hours = self.worker_seconds / 3600.0
        mean_workers = self.worker_seconds / self.duration_s if self.duration_s > 0 else 0.0
        return {
            "requests": len(self.requests), "finished": len(done),
            "slo_attainment": len(ok) / len(self.requests) if self.requests else 1.0,
            "worker_hours": hours, "mean_workers": mean_workers,
            "goodput_per_worker": (len(ok) / self.duration_s / mean_workers) if mean_workers > 0 else 0.0,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(itls, 50), "itl_p90_s": percentile(itls, 90),
            "virtual_s": self.duration_s, "wall_s": self.wall_s,
            "speedup": self.duration_s / self.wall_s if self.wall_s > 0 else None,
        }


class VirtualFleet:
    """The event loop. ``run(requests)`` replays them and returns a ``SimResult``."""

    def __init__(self, profile: EngineProfile, spec: FleetSpec, *, policy: str = "least_load",
                 scaler: Scaler | None = None, interval_s: float = 30.0, start_s: float = 60.0,
                 role_change_s: float = 5.0, block_tokens: int = 512, seed: int = 0,
                 on_decision: Callable[[PlanDecision], None] | None = None,
                 kv_aware: KvAwareConfig | None = None,
                 role_profiles: dict[Role, EngineProfile] | None = None) -> None:
        self.profile = profile
        self.role_profiles = role_profiles or {}  # per-role hardware (a worker keeps its engine on a role change)
        self.clock = VirtualClock()
        self.block_tokens = block_tokens
        self.router_config = RouterConfig(policy=policy, seed=seed, kv_aware=kv_aware or KvAwareConfig())
        self.prefill_policy = make_policy(self.router_config)
        self.decode_policy = make_policy(self.router_config)
        self.kv_aware = policy == "kv_aware"
        self.host_credit = effective_tier_weights(self.router_config.kv_aware).get("host", 0.0)
        self.scaler = scaler
        self.interval_s = interval_s
        self.start_s = start_s
        self.role_change_s = role_change_s
        self.on_decision = on_decision
        # planner hooks: the fast load-reactive loop (``scaler.react``) and warm standby wake-up time
        self.fast_interval_s = float(getattr(getattr(scaler, "settings", None), "fast_interval_s", 0.0) or 0.0)
        self.standby_wake_s = float(getattr(getattr(scaler, "settings", None), "standby_wake_s", 5.0))
        self._role_seconds: dict[str, float] = {}
        self._roles: dict[str, int] | None = None  # workers per role, for role_seconds
        self.workers: dict[str, SimWorker] = {}
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._version: dict[str, int] = {}
        self._next_id = 0
        self.inflight = InflightLedger()  # the live Router's books of dispatched prefill
        self._pending: dict[Role, deque[SimRequest]] = {Role.PREFILL: deque(), Role.DECODE: deque(),
                                                         Role.BOTH: deque()}
        self.pd = spec.prefill > 0 or spec.decode > 0
        self._worker_seconds = 0.0
        self._last_t = 0.0
        self._window: list[SimRequest] = []  # arrivals since the last planner tick
        self._finished_window: list[SimRequest] = []
        self.decisions: list[PlanDecision] = []
        self.timeline: list[tuple[float, int, int, int]] = []
        for role, n in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode), (Role.BOTH, spec.aggregated)):
            for _ in range(n):
                self._add_worker(role, 0.0, ready=True)

    # -- bookkeeping
    def _push(self, t: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _add_worker(self, role: Role, now: float, ready: bool = False) -> SimWorker:
        wid = f"{role.value[0]}{self._next_id}"
        self._next_id += 1
        w = Worker(id=wid, url=f"sim://{wid}", engine=EngineKind.SIM, role=role, models=["sim"])
        sw = SimWorker(w, ModelEngine(self.role_profiles.get(role, self.profile), role, self.block_tokens), now,
                       now if ready else now + self.start_s, "healthy" if ready else "starting")
        if not ready:
            w.state = WorkerState.UNHEALTHY
            self._push(sw.ready_at, "ready", wid)
        self.workers[wid] = sw
        self._roles = None
        return sw

    def _schedule_engine(self, sw: SimWorker) -> None:
        t = sw.engine.next_event_time()
        v = self._version.get(sw.worker.id, 0) + 1
        self._version[sw.worker.id] = v
        if t < INF:
            self._push(t, "engine", (sw.worker.id, v))

    def _accrue(self, now: float) -> None:
        if now > self._last_t:
            dt = now - self._last_t
            self._worker_seconds += len(self.workers) * dt
            if self._roles is None:  # recounted only after the fleet changed
                self._roles = {}
                for sw in self.workers.values():
                    k = sw.worker.role.value
                    self._roles[k] = self._roles.get(k, 0) + 1
            for k, n in self._roles.items():
                self._role_seconds[k] = self._role_seconds.get(k, 0.0) + n * dt
            self._last_t = now

    def counts(self) -> tuple[int, int, int]:
        c = {Role.PREFILL: 0, Role.DECODE: 0, Role.BOTH: 0}
        for sw in self.workers.values():
            c[sw.worker.role] += 1
        return c[Role.PREFILL], c[Role.DECODE], c[Role.BOTH]

    # -- routing (the live policies)
    def _candidates(self, role: Role) -> list[Worker]:
        out = []
        for sw in self.workers.values():
            if sw.state != "healthy" or sw.worker.role is not role:
                continue
            w, e = sw.worker, sw.engine
            w.load.running = float(e.num_running)
            w.load.waiting = float(e.waiting)
            w.load.kv_usage = e.kv_usage
            w.load.num_blocks = e.p.num_gpu_blocks  # what a live scrape reads from cache_config_info
            out.append(w)
        return out

    def _route_request(self, req: SimRequest, cands: list[Worker], with_overlaps: bool, now: float) -> RouteRequest:
        """The request as the live Router hands it to a policy: block hashes, each candidate's
        cached prefix (read from the engines, what the KV-event index holds live) and the prefixes
        this fleet's own dispatched prefills are still computing; the candidates' prefill backlog
        brought up to ``now``."""
        self.inflight.refresh(cands, now)
        rr = RouteRequest(request_id=str(req.id), model="sim", prompt_tokens=req.isl, max_tokens=req.osl,
                          block_size=req.block_tokens)
        if with_overlaps and req.blocks:
            rr.block_hashes = list(req.blocks)
            host_credit = self.host_credit
            for w in cands:
                dev, host = self.workers[w.id].engine.model.cached_prefix_tiers(req.blocks)
                if dev or host:  # what the KV-event index holds per tier, credited as the gateway does
                    rr.overlaps[w.id] = Overlap(blocks=dev + host, weighted_blocks=dev + host_credit * host)
            rr.inflight_overlaps = self.inflight.covered_by_worker(cands, rr.block_hashes)
        return rr

    def _route(self, req: SimRequest, role: Role, now: float) -> tuple[SimWorker, RouteDecision] | None:
        cands = self._candidates(role)
        if not cands:
            return None
        rr = self._route_request(req, cands, self.kv_aware and role is not Role.DECODE, now)
        policy = self.decode_policy if role is Role.DECODE else self.prefill_policy
        decision = policy.choose(rr, cands, now)
        return self.workers[decision.worker.id], decision

    def _charge_prefill(self, req: SimRequest, role: Role, sw: SimWorker, predicted_cached_tokens: int,
                        now: float) -> None:
        """As the live Router's ``begin``: the uncached prompt tokens the router predicted, and the
        prompt's blocks, are in flight on ``sw`` until its first token (or hand-off)."""
        self.inflight.charge((req.id, role), sw.worker, req.isl - predicted_cached_tokens,
                             req.blocks if self.kv_aware else (), now)

    def _dispatch(self, req: SimRequest, role: Role, now: float) -> None:
        routed = self._route(req, role, now)
        if routed is None:
            self._pending[role].append(req)
            return
        sw, decision = routed
        sw.worker.inflight += 1
        if role is Role.DECODE:
            req.decode_worker = sw.worker.id
            sw.engine.submit_decode(req, now)
        else:
            req.prefill_worker = sw.worker.id
            sw.engine.submit_prefill(req, now)
            self._charge_prefill(req, role, sw, decision.predicted_cached_tokens, now)
        self._schedule_engine(sw)

    def _drain_pending(self, now: float) -> None:
        for role, q in self._pending.items():
            while q and self._candidates(role):
                self._dispatch(q.popleft(), role, now)

    # -- scaling
    def _views(self) -> list[WorkerView]:
        views = []
        for sw in self.workers.values():
            role = sw.switch_to or sw.worker.role
            state = {"switching": "starting"}.get(sw.state, sw.state)
            views.append(WorkerView(sw.worker.id, role, state, sw.worker.inflight,
                                    waiting=sw.engine.waiting, standby=sw.to_standby and state == "starting"))
        return views

    def _observe(self, now: float) -> Observation:
        arr, fin = self._window, self._finished_window
        self._window, self._finished_window = [], []
        ttfts = [r.ttft for r in fin if r.ttft is not None]
        itls = [r.itl for r in fin if r.itl is not None]
        queue = sum(sw.engine.waiting for sw in self.workers.values()) + sum(len(q) for q in self._pending.values())
        hits = sum(r.cached for r in arr if r.prefill_worker)
        isl_sum = sum(r.isl for r in arr)
        p90 = sorted(ttfts)[int(0.9 * (len(ttfts) - 1))] if ttfts else None
        bins: dict[int, int] = {}
        for r in arr:
            k = int(r.arrival // PEAK_WINDOW_S)
            bins[k] = bins.get(k, 0) + 1
        return Observation(
            at=now, window_s=self.interval_s, request_rate=len(arr) / self.interval_s,
            peak_rate=max(bins.values(), default=0) / PEAK_WINDOW_S,
            mean_isl=isl_sum / len(arr) if arr else None,
            mean_osl=sum(r.osl for r in fin) / len(fin) if fin else None,
            ttft_mean=sum(ttfts) / len(ttfts) if ttfts else None, ttft_p90=p90,
            itl_mean=sum(itls) / len(itls) if itls else None, queue_len=float(queue),
            prefix_hit_ratio=hits / isl_sum if isl_sum else None)

    def apply(self, actions: Sequence[Action], now: float) -> None:
        """Carry out planner actions on the simulated fleet (the virtual-time actuator)."""
        for a in actions:
            sw = self.workers.get(a.worker_id) if a.worker_id else None
            if a.kind == "start":
                self._add_worker(a.role, now).to_standby = a.then == "standby"
            elif a.kind == "activate" and sw is not None:  # warm standby → rotation
                if sw.state == "standby":
                    sw.state = "starting"
                    self._push(now + self.standby_wake_s, "ready", a.worker_id)
                sw.to_standby = False
            elif a.kind == "park" and sw is not None:  # idle → warm standby (out of rotation)
                sw.state, sw.to_standby = "standby", False
                sw.worker.state = WorkerState.DRAINING
            elif a.kind == "drain" and sw is not None:
                sw.state = "draining"
                sw.worker.state = WorkerState.DRAINING
            elif a.kind == "stop" and sw is not None:
                self._accrue(now)
                del self.workers[a.worker_id]
                self._roles = None
                for r in sw.engine.abort_all(now):
                    self.inflight.release((r.id, sw.worker.role), now, prefilled=False)
                    self._dispatch(r, sw.worker.role, now)  # a stopped busy worker: its work moves
            elif a.kind == "set_role" and sw is not None:
                sw.state, sw.switch_to = "switching", a.role
                sw.worker.state = WorkerState.DRAINING
                self._push(now + self.role_change_s, "switched", a.worker_id)

    def _tick(self, now: float) -> None:
        assert self.scaler is not None
        obs = self._observe(now)
        d = self.scaler.step(obs, self._views(), now)
        self.decisions.append(d)
        if self.on_decision:
            self.on_decision(d)
        self.apply(d.actions, now)

    def _react(self, now: float) -> None:
        react = getattr(self.scaler, "react", None)
        d = react(self._views(), now) if react is not None else None
        if d is not None:
            self.decisions.append(d)
            if self.on_decision:
                self.on_decision(d)
            self.apply(d.actions, now)

    def _released(self, sw: SimWorker, now: float) -> None:
        """A draining worker went idle: let the planner stop/switch it now, not at the next tick."""
        complete = getattr(self.scaler, "complete_drains", None)
        if complete is not None and sw.state == "draining" and sw.engine.idle and sw.worker.inflight == 0:
            self.apply(complete(self._views()), now)

    # -- the loop
    def run(self, requests: Sequence[SimRequest], horizon_s: float | None = None,
            stop: Callable[[SimRequest], bool] | None = None) -> SimResult:
        """Replay ``requests``; ``stop`` (planner hook, for searches) sees each finished request and
        ends the replay early by answering True (the result then covers only what ran)."""
        wall0 = time.perf_counter()
        for r in requests:
            self._push(r.arrival, "arrival", r)
        end_arrivals = max((r.arrival for r in requests), default=0.0)
        if self.scaler is not None:
            self._push(self.interval_s, "tick", None)
            if self.fast_interval_s > 0:
                self._push(self.fast_interval_s, "react", None)
        remaining = len(requests)
        while self._heap and remaining > 0:
            t, _, kind, payload = heapq.heappop(self._heap)
            self._accrue(t)
            self.clock.set(t)
            if kind == "engine":
                wid, v = payload
                if self._version.get(wid) != v or wid not in self.workers:
                    continue
                sw = self.workers[wid]
                for ev, r, et in sw.engine.advance(t):
                    if ev == "prefilled":
                        sw.worker.inflight -= 1
                        self.inflight.release((r.id, Role.PREFILL), et)
                        self._push(et + self.profile.transfer_seconds(r.isl), "handoff", r)
                    elif ev == "first_token" and sw.worker.role is Role.BOTH:
                        self.inflight.release((r.id, Role.BOTH), et)
                    elif ev == "finished":
                        sw.worker.inflight -= 1
                        self._finished_window.append(r)
                        remaining -= 1
                        if stop is not None and stop(r):
                            remaining = 0
                self._schedule_engine(sw)
                if sw.state == "draining":
                    self._released(sw, t)
            elif kind == "arrival":
                self._window.append(payload)
                self._dispatch(payload, Role.PREFILL if self.pd else Role.BOTH, t)
            elif kind == "handoff":
                self._dispatch(payload, Role.DECODE, t)
            elif kind == "ready":
                sw = self.workers.get(payload)
                if sw is not None and sw.state == "starting" and sw.to_standby:
                    sw.state, sw.to_standby = "standby", False  # warm, out of rotation
                elif sw is not None and sw.state == "starting":
                    sw.state, sw.worker.state = "healthy", WorkerState.HEALTHY
                    self._drain_pending(t)
            elif kind == "switched":
                sw = self.workers.get(payload)
                if sw is not None and sw.switch_to is not None:
                    self._accrue(t)
                    sw.worker.role = sw.engine.role = sw.switch_to
                    self._roles = None
                    sw.switch_to, sw.state, sw.worker.state = None, "healthy", WorkerState.HEALTHY
                    self._drain_pending(t)
            elif kind == "react":
                if t % self.interval_s > 1e-9:  # the interval tick samples on its own
                    self._react(t)
                if remaining > 0:
                    self._push(t + self.fast_interval_s, "react", None)
            elif kind == "tick":
                p, d, b = self.counts()
                self.timeline.append((t, p, d, b))
                self._tick(t)
                if t < (horizon_s or INF) and (t <= end_arrivals + 10 * self.interval_s or remaining > 0):
                    self._push(t + self.interval_s, "tick", None)
        end = self.clock.now()
        self._accrue(end)
        return SimResult(list(requests), end, self._worker_seconds, time.perf_counter() - wall0,
                         self.decisions, self.timeline, dict(self._role_seconds))


# ------------------------------------------------------------------------------------------ helpers

def requests_from_trace(trace: Sequence[Any], block_tokens: int | None = None) -> list[SimRequest]:
    """``orchestrator.bench.traces.TraceRequest`` → ``SimRequest`` (prefix blocks = Mooncake hash ids)."""
    out = []
    for i, r in enumerate(trace):
        bt = block_tokens or (r.synthesizer.block_tokens if getattr(r, "synthesizer", None) else 512)
        out.append(SimRequest(id=i, arrival=r.arrival_s, isl=max(1, r.input_len), osl=max(1, r.output_len),
                              blocks=tuple(r.hash_ids), block_tokens=bt))
    return out


def sweep_profile(profile: EngineProfile, isls: Sequence[int] = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768),
                  concurrencies: Sequence[int] = (1, 4, 16, 32, 64, 128, 256),
                  contexts: Sequence[int] = (512, 2048, 8192, 32768), decode_tokens: int = 32) -> dict[str, Any]:
    """Measure an engine model the way ``dyad profile`` measures a live engine, in virtual time.

    Prefill: one request alone, TTFT. Decode: ``c`` requests of context ``ctx`` decoding together,
    mean ITL. Returns a planner performance profile (``PerfModel.from_dict``).
    """
    prefill = []
    for n in isls:
        if n > profile.max_model_len:
            continue
        e = ModelEngine(profile, Role.BOTH)
        r = SimRequest(id=0, arrival=0.0, isl=n, osl=2)
        e.submit_prefill(r, 0.0)
        while r.first_token is None:
            e.advance(e.next_event_time())
        prefill.append({"isl": n, "ttft_s": r.first_token})
    decode = []
    for ctx in contexts:
        for c in concurrencies:
            if c > profile.max_num_seqs or c * (ctx + decode_tokens) > profile.cache_tokens:
                continue
            e = ModelEngine(profile, Role.DECODE)
            reqs = [SimRequest(id=i, arrival=0.0, isl=ctx, osl=decode_tokens) for i in range(c)]
            for r in reqs:
                e.submit_decode(r, 0.0)
            while any(r.finish is None for r in reqs):
                e.advance(e.next_event_time())
            itl = sum(r.itl or 0.0 for r in reqs) / c
            decode.append({"concurrency": c, "context": ctx, "itl_s": itl})
    return {"version": 1, "source": f"virtual sweep of engine profile {profile.name}",
            "kv_capacity_tokens": profile.cache_tokens, "max_concurrency": profile.max_num_seqs,
            "prefill": prefill, "decode": decode}
