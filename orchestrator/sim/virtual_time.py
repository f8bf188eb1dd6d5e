"""Replay a trace against a simulated fleet in virtual time: no sockets, no sleeps.

A discrete-event loop over a ``VirtualClock`` drives one engine model per worker. Routing is the
live gateway's: a ``Router`` over a ``FleetRegistry`` with the configured policy, wrapped for P/D
fleets in ``PdRoutingPolicy`` (pair selection, conditional disaggregation) exactly as
``orchestrator.disagg.install`` wraps it; ``Router.begin`` / ``first_token`` / ``finish`` keep the
books the policies read (in-flight counts, the prefill ledger). The fleet only supplies state, as
the gateway's scrape loop and KV-event index do live: each worker's engine load (running, waiting,
KV usage) and, when a prefix index is on, each worker's cached prefix of the request (read from the
engine models' caches, ``EngineCacheIndex``). It never chooses a worker. Scaling uses the live
planner (``Planner.step``) or a baseline behind the same interface. What is simulated, and how:

- **Engines** (``ModelEngine``): the simulated engine server's own pure core
  (``orchestrator/sim/engine_model.py``: vLLM-style continuous batching, chunked prefill, a block
  prefix cache with LRU eviction, the ``EngineProfile`` cost model), one per worker. One block = one
  trace prefix block (512 tokens for Mooncake), so trace hash ids are block hashes. The core plans a
  run of pure-decode steps at once and the fleet wakes up only at the run's end (a newcomer cuts
  the run at the step boundary), so cost scales with requests, not tokens: an hour of a 32-worker
  fleet takes seconds of CPU. There is one engine model for the live sim server and this simulator.
- **P/D**: the router picks the pair on arrival (as the gateway does); the prefill worker
  prefills, the KV moves to the chosen decode worker in ``profile.transfer_seconds(prompt)``, the
  decode worker produces every output token. A request pair selection keeps local (short uncached
  prompt) is prefilled by its decode worker. Aggregated workers (role both) do chunked prefill and
  decode in the same steps.
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
from orchestrator.errors import NoHealthyWorker
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.kv.tier_cost import effective_tier_weights
from orchestrator.planner.core import Action, PlanDecision, Planner, WorkerView
from orchestrator.planner.inputs import Hold, InputGate, held_decision
from orchestrator.planner.metrics_source import PEAK_WINDOW_S, Observation
from orchestrator.router.pd_selection import PdRoutingPolicy, PdSelectionSettings, threshold_from_profile
from orchestrator.router.policies import make_policy
from orchestrator.router.router import Router
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
    waking: bool = False  # activated from warm standby, not serving yet

    def bucket(self) -> str:
        """What its worker-seconds pay for (``SimResult.state_seconds``)."""
        if self.state == "standby" or (self.state == "starting" and self.to_standby):
            return "standby"
        if self.state == "starting" or (self.state == "switching" and self.waking):
            return "waking" if self.waking else "starting"
        return "serving"  # healthy, draining (finishing its work) or switching role


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
    # worker-seconds by what they paid for: "serving" (in rotation: healthy, draining, switching),
    # "starting" (cold start, not serving yet), "waking" (activated standby, not serving yet), "standby"
    # (warm, out of rotation, incl. starting into it); and, within "serving", "floor" (workers the
    # planner's burst floor kept beyond its model's sizing) and "hold" (kept beyond both by scale-in
    # hysteresis / the churn rule / a role's minimum pace of giving back). Per role: "<bucket>:<role>".
    state_seconds: dict[str, float] = field(default_factory=dict)

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


def run_sync(coro: Any) -> Any:
    """Run a coroutine that never waits on I/O (the Router over the virtual fleet's in-memory
    state) to completion, synchronously, inside the discrete-event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the router waited on I/O in virtual time (a tracker that is not in-memory?)")


class EngineCacheIndex:
    """The virtual fleet's prefix tracker: what the live KV-event index would answer, read from the
    simulated engines' block caches (one simulated block = one request block id). Supplies state,
    decides nothing: the Router and its policy choose."""

    def __init__(self, fleet: VirtualFleet) -> None:
        self.fleet = fleet

    async def annotate(self, req: RouteRequest, body: dict[str, Any], endpoint: str,
                       candidates: list[Worker]) -> RouteRequest:
        if not req.block_hashes:
            return req
        host_credit = self.fleet.host_credit
        overlaps = dict(req.overlaps)
        for w in candidates:
            sw = self.fleet.workers.get(w.id)
            if sw is None:
                continue
            dev, host = sw.engine.model.cached_prefix_tiers(req.block_hashes)
            if dev or host:  # what the KV-event index holds per tier, credited as the gateway does
                overlaps[w.id] = Overlap(blocks=dev + host, weighted_blocks=dev + host_credit * host)
        return req.annotated(token_ids=req.token_ids, prompt_tokens=req.prompt_tokens, block_size=req.block_size,
                             block_hashes=req.block_hashes, overlaps=overlaps, peer_load=req.peer_load,
                             session_key=req.session_key)

    async def on_routed(self, req: RouteRequest, decision: RouteDecision, now: float) -> None:
        return None


@dataclass(eq=False)
class _Routed:
    """A dispatched request's route: the live Router's decision and the request as routed."""

    decision: RouteDecision
    rr: RouteRequest


class VirtualFleet:
    """The event loop. ``run(requests)`` replays them and returns a ``SimResult``.

    ``policy`` is ``router.policy``; ``prefix_index`` plugs in ``EngineCacheIndex`` (default: on
    for ``kv_aware``, as a live gateway runs kv_aware with its KV-event index). P/D fleets route with
    ``PdRoutingPolicy``; ``pd_settings`` defaults to what ``disagg.install`` derives from the engine
    profile (``threshold_from_profile``). ``route_log`` keeps every routing decision:
    ``(request id, decode-or-serving worker, prefill worker or None, reason)``.
    """

    def __init__(self, profile: EngineProfile, spec: FleetSpec, *, policy: str = "least_load",
                 scaler: Scaler | None = None, interval_s: float = 30.0, start_s: float = 60.0,
                 role_change_s: float = 5.0, block_tokens: int = 512, seed: int = 0,
                 on_decision: Callable[[PlanDecision], None] | None = None,
                 kv_aware: KvAwareConfig | None = None,
                 role_profiles: dict[Role, EngineProfile] | None = None,
                 pd_settings: PdSelectionSettings | None = None, prefix_index: bool | None = None,
                 model: str = "sim") -> None:
        self.profile = profile
        self.role_profiles = role_profiles or {}  # per-role hardware (a worker keeps its engine on a role change)
        self.clock = VirtualClock()
        self.block_tokens = block_tokens
        self.model = model
        self.router_config = RouterConfig(policy=policy, seed=seed, kv_aware=kv_aware or KvAwareConfig())
        self.registry = FleetRegistry(configured_models=[model])
        self.pd = spec.prefill > 0 or spec.decode > 0
        self.pd_settings = pd_settings or PdSelectionSettings(min_prefill_tokens=threshold_from_profile(profile))
        route_policy: Any = make_policy(self.router_config)
        if self.pd:
            registry = self.registry

            def prefill_pool(model: str) -> list[Worker]:  # as disagg.install
                return [w for w in registry.candidates(model, Role.PREFILL) if w.role == Role.PREFILL]

            route_policy = PdRoutingPolicy(route_policy, self.pd_settings, prefill_pool)
        self.host_credit = effective_tier_weights(self.router_config.kv_aware).get("host", 0.0)
        self.prefix_index = policy == "kv_aware" if prefix_index is None else prefix_index
        self.router = Router(route_policy, self.registry, self.clock,
                             prefix_tracker=EngineCacheIndex(self) if self.prefix_index else None)
        self.scaler = scaler
        # the live planner's input check (the same gate PlannerService uses); baselines take raw inputs
        self.gate = (InputGate(3 * interval_s, need_latency=scaler.settings.correct_from_latency)
                     if isinstance(scaler, Planner) else None)
        self.interval_s = interval_s
        self.start_s = start_s
        self.role_change_s = role_change_s
        self.on_decision = on_decision
        # planner hooks: the fast load-reactive loop (``scaler.react``) and warm standby wake-up time
        self.fast_interval_s = float(getattr(getattr(scaler, "settings", None), "fast_interval_s", 0.0) or 0.0)
        self.standby_wake_s = float(getattr(getattr(scaler, "settings", None), "standby_wake_s", 5.0))
        self._role_seconds: dict[str, float] = {}
        self._roles: dict[str, int] | None = None  # workers per role, for role_seconds
        # "<bucket>:<role>" → workers, for state_seconds; integrated lazily: flushed when the fleet's states
        # change (``_rebucket``), not on every event
        self._buckets: dict[str, int] | None = None
        self._bucket_t = 0.0  # since when ``_buckets`` holds
        self._state_seconds: dict[str, float] = {}
        self._held: dict[str, tuple[int, int]] = {}  # role → (model's sizing, after the burst floor), last tick
        self.workers: dict[str, SimWorker] = {}
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._version: dict[str, int] = {}
        self._next_id = 0
        self._routes: dict[int, _Routed] = {}
        self._pending: deque[SimRequest] = deque()  # arrivals no worker could take yet
        self._pending_decode: deque[SimRequest] = deque()  # prefilled, their decode worker gone
        self.route_log: list[tuple[int, str, str | None, str]] = []
        self._worker_seconds = 0.0
        self._last_t = 0.0
        self._window: list[SimRequest] = []  # arrivals since the last planner tick
        self._finished_window: list[SimRequest] = []
        self.decisions: list[PlanDecision] = []
        self.timeline: list[tuple[float, int, int, int]] = []
        for role, n in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode), (Role.BOTH, spec.aggregated)):
            for _ in range(n):
                self._add_worker(role, 0.0, ready=True)

    @property
    def inflight(self) -> Any:
        """The Router's prefill ledger (``router.inflight``)."""
        return self.router.inflight

    # -- bookkeeping
    def _push(self, t: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _add_worker(self, role: Role, now: float, ready: bool = False) -> SimWorker:
        wid = f"{role.value[0]}{self._next_id}"
        self._next_id += 1
        w = Worker(id=wid, url=f"sim://{wid}", engine=EngineKind.SIM, role=role, models=[self.model])
        sw = SimWorker(w, ModelEngine(self.role_profiles.get(role, self.profile), role, self.block_tokens), now,
                       now if ready else now + self.start_s, "healthy" if ready else "starting")
        w.load.num_blocks = sw.engine.p.num_gpu_blocks  # what a live scrape reads from cache_config_info
        if ready:
            w.health_ok = True
        else:
            w.state = WorkerState.UNHEALTHY
            self._push(sw.ready_at, "ready", wid)
        self.workers[wid] = sw
        self._roles = None
        self._rebucket()
        self.registry.add(w)
        return sw

    def _remove_worker(self, wid: str) -> SimWorker:
        sw = self.workers.pop(wid)
        self._roles = None
        self._rebucket()
        self.registry.remove(wid)
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
            if self._buckets is None:
                self._buckets, self._bucket_t = self._count_buckets(), self._last_t
            self._last_t = now

    def _rebucket(self) -> None:
        """The workers' states changed (at ``_last_t``, up to which time is accrued): book the seconds of the
        states that held until now."""
        if self._buckets is not None:
            dt = self._last_t - self._bucket_t
            if dt > 0:
                for key, n in self._buckets.items():
                    self._state_seconds[key] = self._state_seconds.get(key, 0.0) + n * dt
            self._buckets = None

    def _count_buckets(self) -> dict[str, int]:
        out: dict[tuple[str, str], int] = {}
        serving: dict[str, int] = {}
        for sw in self.workers.values():
            k = (sw.bucket(), sw.worker.role.value)
            out[k] = out.get(k, 0) + 1
            if k[0] == "serving":
                serving[k[1]] = serving.get(k[1], 0) + 1
        for role, (sized, floored) in self._held.items():
            n = serving.get(role, 0)
            floor = min(max(0, n - sized), max(0, floored - sized))
            hold = max(0, n - max(sized, floored))
            if floor:
                out[("floor", role)] = floor
            if hold:
                out[("hold", role)] = hold
        return {f"{b}:{r}": n for (b, r), n in out.items()}

    def counts(self) -> tuple[int, int, int]:
        c = {Role.PREFILL: 0, Role.DECODE: 0, Role.BOTH: 0}
        for sw in self.workers.values():
            c[sw.worker.role] += 1
        return c[Role.PREFILL], c[Role.DECODE], c[Role.BOTH]

    # -- routing: the live Router decides; the fleet supplies state and carries the decision out
    def _scrape(self) -> None:
        """What the gateway's scrape loop keeps current: each serving engine's load."""
        for sw in self.workers.values():
            if sw.state != "healthy":
                continue
            w, e = sw.worker, sw.engine
            w.load.running = float(e.num_running)
            w.load.waiting = float(e.waiting)
            w.load.kv_usage = e.kv_usage

    def _route(self, req: SimRequest, now: float) -> _Routed | None:
        rr = RouteRequest(request_id=str(req.id), model=self.model, prompt_tokens=req.isl, max_tokens=req.osl,
                          block_size=req.block_tokens,  # block hashes: the tokenizer's work, done by the trace
                          block_hashes=list(req.blocks) if self.prefix_index and req.blocks else [])
        self._scrape()
        try:
            decision = run_sync(self.router.route(rr, {}, "completions"))
        except NoHealthyWorker:
            return None
        self.router.begin(decision, rr)
        routed = _Routed(decision, rr)
        self._routes[req.id] = routed
        pw = decision.prefill_worker
        self.route_log.append((req.id, decision.worker.id, pw.id if pw is not None else None, decision.reason))
        return routed

    def _dispatch(self, req: SimRequest, now: float) -> None:
        routed = self._route(req, now)
        if routed is None:
            self._pending.append(req)
            return
        d = routed.decision
        if d.prefill_worker is None:  # aggregated, or a local prefill on the decode worker
            sw = self.workers[d.worker.id]
            req.prefill_worker = sw.worker.id
            req.decode_worker = None if sw.worker.role is Role.BOTH else sw.worker.id
        else:
            sw = self.workers[d.prefill_worker.id]
            sw.worker.inflight += 1  # as the P/D executor counts its prefill call
            req.prefill_worker, req.decode_worker = sw.worker.id, d.worker.id
        sw.engine.submit_prefill(req, now)
        self._schedule_engine(sw)

    def _handoff(self, req: SimRequest, now: float) -> None:
        """The KV arrived: the decode worker chosen on arrival decodes (a new one if it was stopped)."""
        sw = self.workers.get(req.decode_worker or "")
        if sw is None:
            routed = self._routes.get(req.id)
            if routed is not None:
                self.router.finish(routed.decision, routed.rr, ok=False)
            routed = self._route(req, now)
            if routed is None:
                self._pending_decode.append(req)
                return
            sw = self.workers[routed.decision.worker.id]
            req.decode_worker = sw.worker.id
        sw.engine.submit_decode(req, now)
        self._schedule_engine(sw)

    def _drain_pending(self, now: float) -> None:
        while self._pending_decode and self.registry.candidates(self.model, Role.DECODE):
            self._handoff(self._pending_decode.popleft(), now)
        while self._pending:
            req = self._pending.popleft()
            n = len(self._pending)
            self._dispatch(req, now)
            if len(self._pending) > n:  # still no worker: keep the order, try again later
                self._pending.appendleft(self._pending.pop())
                return

    def _first_token(self, req: SimRequest) -> None:
        routed = self._routes.get(req.id)
        if routed is not None:
            self.router.first_token(routed.decision, routed.rr)

    def _finished(self, req: SimRequest) -> None:
        routed = self._routes.pop(req.id, None)
        if routed is not None:
            self.router.finish(routed.decision, routed.rr, ok=True)

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
        queue = sum(sw.engine.waiting for sw in self.workers.values()) + len(self._pending) + len(self._pending_decode)
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
                self._accrue(now)
                if sw.state == "standby":
                    sw.state, sw.waking = "starting", True
                    self._push(now + self.standby_wake_s, "ready", a.worker_id)
                sw.to_standby = False
                self._rebucket()
            elif a.kind == "park" and sw is not None:  # idle → warm standby (out of rotation)
                self._accrue(now)
                sw.state, sw.to_standby = "standby", False
                self._rebucket()
                sw.worker.state = WorkerState.DRAINING
            elif a.kind == "drain" and sw is not None:
                sw.state = "draining"
                self.registry.drain(sw.worker.id)
            elif a.kind == "stop" and sw is not None:
                self._accrue(now)
                self._remove_worker(sw.worker.id)
                for r in sw.engine.abort_all(now):  # a stopped busy worker: its requests are retried
                    routed = self._routes.pop(r.id, None)
                    if routed is not None:
                        self.router.finish(routed.decision, routed.rr, ok=False)
                    self._dispatch(r, now)
            elif a.kind == "set_role" and sw is not None:
                woken = sw.state == "standby"  # a shared warm standby woken into the other role
                if woken:
                    self._accrue(now)
                    sw.waking = True  # paid, not serving yet ("waking" in the breakdown)
                sw.state, sw.switch_to = "switching", a.role
                if woken:
                    self._rebucket()
                self.registry.drain(sw.worker.id)
                self._push(now + self.role_change_s, "switched", a.worker_id)

    def _tick(self, now: float) -> None:
        assert self.scaler is not None
        obs = self._observe(now)
        views = self._views()
        checked = self.gate.check(obs, now) if self.gate is not None else obs
        if isinstance(checked, Hold):  # inputs or no action, as the live PlannerService
            assert isinstance(self.scaler, Planner)
            d = held_decision(self.scaler, checked, obs, views, now)
        else:
            d = self.scaler.step(checked, views, now)
        self.decisions.append(d)
        if self.on_decision:
            self.on_decision(d)
        self._held = {r: (d.sized[r], d.floored.get(r, d.sized[r])) for r in getattr(d, "sized", {}) or {}}
        self._rebucket()
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
                        self._push(et + self.profile.transfer_seconds(r.isl), "handoff", r)
                    elif ev == "first_token":
                        self._first_token(r)
                    elif ev == "finished":
                        self._finished(r)
                        self._finished_window.append(r)
                        remaining -= 1
                        if stop is not None and stop(r):
                            remaining = 0
                self._schedule_engine(sw)
                if sw.state == "draining":
                    self._released(sw, t)
            elif kind == "arrival":
                self._window.append(payload)
                self._dispatch(payload, t)
            elif kind == "handoff":
                self._handoff(payload, t)
            elif kind == "ready":
                sw = self.workers.get(payload)
                self._rebucket()
                if sw is not None and sw.state == "starting" and sw.to_standby:
                    sw.state, sw.to_standby = "standby", False  # warm, out of rotation
                elif sw is not None and sw.state == "starting":  # (a parked worker is DRAINING: set, not probed)
                    sw.state, sw.waking = "healthy", False
                    sw.worker.health_ok, sw.worker.state = True, WorkerState.HEALTHY
                    self._drain_pending(t)
            elif kind == "switched":
                sw = self.workers.get(payload)
                if sw is not None and sw.switch_to is not None:
                    self._accrue(t)
                    sw.worker.role = sw.engine.role = sw.switch_to
                    self._roles = None
                    self._rebucket()
                    sw.switch_to, sw.state = None, "healthy"
                    self.registry.undrain(sw.worker.id)
                    if sw.waking:  # from warm standby (never probed into rotation if it was started into it)
                        sw.waking = False
                        sw.worker.health_ok, sw.worker.state = True, WorkerState.HEALTHY
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
        self._rebucket()
        return SimResult(list(requests), end, self._worker_seconds, time.perf_counter() - wall0,
                         self.decisions, self.timeline, dict(self._role_seconds), dict(self._state_seconds))


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
