"""HTTP server around one ``EngineModel``, driven in real time, speaking vLLM's (or SGLang's) wire dialect.

A bare ASGI app (no framework: the gateway-overhead benchmark compares direct-to-sim vs through
Dyad, so the sim must add as little as possible) on uvicorn with uvloop/httptools and orjson, no
per-request logging. The core's clock is the event loop's clock: after every submit/abort and at
every step end (``loop.call_at(next_event_time)``) the server advances the core and hands each
request its new tokens.

P/D, vLLM dialect: the prefill side answers ``kv_transfer_params`` (``do_remote_prefill``,
``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``…)
and pins the blocks under a lease; the decode side "pulls" them from ``remote_host:remote_port``
(here: the prefill sim's HTTP port, ``POST /sim/kv_pull``), then pays the transfer time in the core.
A failed pull answers 500 after ``kv_pull_timeout_s`` (vLLM: ~5 s), or recomputes locally with
``kv_load_failure_policy="recompute"``.

P/D, SGLang dialect: the router sends the same request to both with ``bootstrap_host/port/room``;
the prefill side publishes the room when its prefill is done (``GET /sim/bootstrap/{room}``, served
on its main port, reported as ``disaggregation_bootstrap_port``), the decode side waits for it and
fails after ``bootstrap_timeout_s`` as SGLang does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import uvicorn

from orchestrator.kv.message_content import Untokenizable, message_text
from orchestrator.sim.engine_model import EngineModel, SimOutput, SimRequest, SimRequestError
from orchestrator.sim.kv_publisher import KvEventPublisher
from orchestrator.sim.logprobs import MAX_LOGPROBS, chat_logprobs, completion_logprobs
from orchestrator.sim.metrics_text import render_sglang, render_vllm
from orchestrator.sim.profiles import EngineProfile, load_profile
from orchestrator.sim.responses import ResponseStore
from orchestrator.sim.responses import handle_cancel as _responses_cancel
from orchestrator.sim.responses import handle_create as _responses_create
from orchestrator.sim.responses import handle_retrieve as _responses_retrieve
from orchestrator.sim.responses import set_faults as _responses_faults
from orchestrator.sim.tokenizer import SimTokenizer

VLLM_VERSION = "0.32.0"
SGLANG_VERSION = "0.5.4"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class SimServerConfig:
    model: str = "sim-model"
    profile: EngineProfile | str = "cpu-tiny"
    seed: int = 0
    dialect: str = "vllm"  # vllm | sglang
    host: str = "127.0.0.1"
    kv_events: bool = True
    kv_events_port: int | None = None  # None: a free port
    replay_port: int | None = None
    kv_topic: str = "kv-events"
    kv_buffer_steps: int = 10_000
    engine_id: str = field(default_factory=lambda: f"sim-{uuid.uuid4().hex[:8]}")
    # P/D
    disaggregation_mode: str = "null"  # SGLang: null | prefill | decode
    bootstrap_timeout_s: float = 30.0
    kv_pull_timeout_s: float = 5.0
    kv_load_failure_policy: str = "fail"  # fail | recompute
    # faults (for failure tests)
    prefill_delay_s: float = 0.0  # extra delay before a request reaches the core
    fail_next: int = 0  # the next N generation requests answer 500
    die_after_tokens: int | None = None  # crash once this many tokens were generated
    responses_fault: str | None = None  # /v1/responses only: eof | reset | garbage | hang | ... (sim/responses.py)
    responses_fault_after: int = 0  # ... after this many text deltas
    # /v1/completions and /v1/chat/completions streams only: eof | reset | garbage | hang (STREAM_FAULTS),
    # after this many tokens of content (the role chunk of chat not counted), however the engine's steps were
    # grouped into chunks (a late loop delivers several tokens in one chunk: that chunk is cut at the fault point)
    stream_fault: str | None = None
    stream_fault_after: int = 0
    healthy: bool = True  # False: GET /health answers 503 (the gateway's health loop marks the worker down)


class _HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, etype: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.etype = etype or {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                               503: "ServiceUnavailableError"}.get(status, "Error")


_DISCONNECTED = object()
_DIED = object()


class _ClientGone(Exception):
    pass


class _EngineDied(Exception):
    pass


@dataclass
class _GenParams:
    prompt_ids: list[int]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None
    bootstrap: tuple[str, int, int] | None  # SGLang (host, port, room)
    request_id: str
    n: int = 1  # choices per request (vLLM fans out n sub-requests)
    logprobs: int | None = None  # top logprobs per token (0 = only the sampled token); None = none
    output_seed: int | None = None  # sub-request i > 0 of n: a text of its own
    gone: asyncio.Event | None = None  # set when the client left (the ``hang`` stream fault waits for it)


# ----------------------------------------------------------------------------- validation helpers
def _int_field(body: dict[str, Any], name: str, minimum: int | None = None, allow_none: bool = True) -> int | None:
    v = body.get(name)
    if v is None:
        if not allow_none and name in body:
            raise _HttpError(400, f"'{name}' must be an integer", name)
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _HttpError(400, f"'{name}' must be an integer (got {type(v).__name__})", name)
    if minimum is not None and v < minimum:
        raise _HttpError(400, f"'{name}' must be at least {minimum} (got {v})", name)
    return v


def _num_field(body: dict[str, Any], name: str, lo: float | None = None, hi: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _HttpError(400, f"'{name}' must be a number (got {type(v).__name__})", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _HttpError(400, f"'{name}' must be between {lo} and {hi} (got {v})", name)
    return float(v)


def _bool_field(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _HttpError(400, f"'{name}' must be a boolean (got {type(v).__name__})", name)
    return v


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)


# ----------------------------------------------------------------------------- the core driver
def _until(outs: list[SimOutput], keep: int) -> tuple[list[SimOutput], int]:
    """The first ``keep`` tokens of one advance's outputs, in the order they were generated (by step end time;
    a request's tokens cut short are not finished)."""
    times = sorted(t for o in outs for t in o.times)
    if keep <= 0:
        return [], 0
    cutoff = times[min(keep, len(times)) - 1]
    kept: list[SimOutput] = []
    n = 0
    for o in outs:
        ts = [t for t in o.times if t <= cutoff][: keep - n]
        if not ts:
            continue
        kept.append(_head(o, len(ts)))
        n += len(ts)
    return kept, n


def _head(o: SimOutput, keep: int) -> SimOutput:
    """The output's first ``keep`` tokens (the output itself when that is all of them; else not finished)."""
    if keep >= len(o.times):
        return o
    return SimOutput(o.request_id, o.start_index, o.times[:keep], False, None, o.num_cached_tokens, o.output_seed,
                     o.prompt_tokens, o.lease_block_ids)


class _Driver:
    """Advances the core on the event loop's clock and routes outputs to per-request queues."""

    def __init__(self, model: EngineModel, publisher: KvEventPublisher | None,
                 on_tokens: Callable[[int], None] | None = None) -> None:
        self.model = model
        self.publisher = publisher
        self.loop = asyncio.get_running_loop()
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._on_tokens = on_tokens
        self.crash_at: Callable[[], int | None] | None = None  # the token count at which the engine crashes
        self.tokens_out = 0

    def submit(self, req: SimRequest) -> asyncio.Queue[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.model.submit(req, self.loop.time())
        self.queues[req.request_id] = q
        self.pump()
        return q

    def abort(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.model.abort(request_id, self.loop.time())
        self.pump()

    def pump(self, at: float | None = None) -> None:
        now = self.loop.time()
        if at is not None and at > now:
            now = at
        outs = self.model.advance(now)
        n = sum(len(o.times) for o in outs)
        crash_at = self.crash_at() if self.crash_at is not None else None
        if n and crash_at is not None and self.tokens_out + n >= crash_at:
            # A crash armed at this many tokens: what was generated up to it is delivered, nothing after, however
            # late the loop is (a late loop advances the model by many steps at once).
            outs, n = _until(outs, max(0, crash_at - self.tokens_out))
        for o in outs:
            q = self.queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)
                if o.finished:
                    del self.queues[o.request_id]
        if self.publisher is not None:
            for ts, events in self.model.drain_kv_events():
                self.publisher.publish(events, ts=time.time() - (now - ts))
        if n:
            self.tokens_out += n
            if self._on_tokens is not None:
                self._on_tokens(self.tokens_out)
        t = self.model.next_event_time()
        if t is None:
            return
        if self._timer is not None:
            if self._timer_at <= t:
                return
            self._timer.cancel()
        self._timer_at = t
        self._timer = self.loop.call_at(t, self._fire)

    def _fire(self) -> None:
        at = self._timer_at
        self._timer = None
        self.pump(at)

    def fail_all(self) -> None:
        for q in self.queues.values():
            q.put_nowait(_DIED)
        self.queues.clear()


@dataclass
class _Room:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    request_id: str | None = None
    tokens: int = 0


# ----------------------------------------------------------------------------- the app
class SimServer:
    """The ASGI app of one simulated engine. Create inside the loop that will serve it."""

    def __init__(self, config: SimServerConfig) -> None:
        self.config = config
        self.profile = load_profile(config.profile) if not isinstance(config.profile, EngineProfile) else config.profile
        if config.dialect not in ("vllm", "sglang"):
            raise ValueError(f"dialect must be 'vllm' or 'sglang' (got {config.dialect!r})")
        if config.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ValueError("disaggregation_mode must be null, prefill or decode")
        self.model = EngineModel(self.profile, seed=config.seed, engine_id=config.engine_id,
                                 record_kv_events=config.kv_events)
        self.tokenizer = SimTokenizer()
        self.publisher: KvEventPublisher | None = None
        if config.kv_events:
            self.publisher = KvEventPublisher(config.host, config.kv_events_port, config.replay_port,
                                              topic=config.kv_topic, buffer_steps=config.kv_buffer_steps)
        self.port: int = 0  # set by the runner once bound
        self.on_die: Callable[[], None] | None = None
        self._driver: _Driver | None = None
        self._client: httpx.AsyncClient | None = None
        self._ids = itertools.count()
        self._inflight = 0
        self._rooms: dict[int, _Room] = {}
        self._dead = False
        self._started = time.time()
        # headers of the last generation requests (tests check what a gateway forwards, e.g. traceparent)
        self.received_headers: collections.deque[dict[str, str]] = collections.deque(maxlen=256)
        self._routes: dict[tuple[str, str], Callable[..., Awaitable[None]]] = {}
        r = self._routes
        for m in ("GET", "POST"):
            r[(m, "/ping")] = self._h_ping
        r[("GET", "/health")] = self._h_health
        r[("GET", "/version")] = self._h_version
        r[("GET", "/v1/models")] = self._h_models
        r[("GET", "/load")] = self._h_load
        r[("GET", "/metrics")] = self._h_metrics
        r[("POST", "/tokenize")] = self._h_tokenize
        r[("POST", "/detokenize")] = self._h_detokenize
        r[("POST", "/v1/completions")] = self._h_completions
        r[("POST", "/v1/chat/completions")] = self._h_chat
        r[("POST", "/v1/completions/render")] = self._h_render_completions
        r[("POST", "/v1/chat/completions/render")] = self._h_render_chat
        r[("GET", "/kv_event_sources")] = self._h_kv_event_sources
        r[("POST", "/reset_prefix_cache")] = self._h_reset
        r[("POST", "/flush_cache")] = self._h_reset
        r[("GET", "/flush_cache")] = self._h_reset
        for path in ("/server_info", "/get_server_info"):
            r[("GET", path)] = self._h_server_info
        for path in ("/model_info", "/get_model_info"):
            r[("GET", path)] = self._h_model_info
        r[("GET", "/get_load")] = self._h_get_load
        r[("POST", "/generate")] = self._h_generate
        r[("GET", "/health_generate")] = self._h_health
        r[("POST", "/sim/kv_pull")] = self._h_kv_pull
        r[("POST", "/sim/faults")] = self._h_faults
        r[("POST", "/v1/responses")] = self._h_responses
        self.response_store = ResponseStore()  # answered responses, for GET/cancel by id (sim/responses.py)
        self._paths = {p for _, p in r}

    # ---------------------------------------------------------------- ASGI plumbing
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        typ = scope["type"]
        if typ == "lifespan":
            await self._lifespan(receive, send)
            return
        if typ != "http":
            return
        path = scope["path"]
        handler = self._routes.get((scope["method"], path))
        if handler is None and path.startswith("/sim/bootstrap/") and scope["method"] == "GET":
            handler = self._h_bootstrap
        if handler is None and path.startswith("/v1/responses/"):
            handler = self._responses_by_id(scope["method"], path)
        try:
            if handler is None:
                if path in self._paths:
                    await _send_json(send, 405, {"detail": "Method Not Allowed"})
                else:
                    await _send_json(send, 404, {"detail": "Not Found"})
                return
            await handler(scope, receive, send)
        except _HttpError as e:
            await self._send_error(send, e)
        except _EngineDied:
            raise
        except _ClientGone:
            return

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        self._driver = _Driver(self.model, self.publisher, self._check_die)
        self._driver.crash_at = lambda: None if self._dead else self.config.die_after_tokens
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(10.0), trust_env=False)
        if self.publisher is not None:
            self.publisher.start()

    async def shutdown(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None

    @property
    def driver(self) -> _Driver:
        assert self._driver is not None, "server not started"
        return self._driver

    async def _send_error(self, send: Send, e: _HttpError) -> None:
        body = {"error": {"message": e.message, "type": e.etype, "param": e.param, "code": e.status}}
        await _send_json(send, e.status, body)

    # ---------------------------------------------------------------- faults
    def _check_die(self, tokens_out: int) -> None:
        limit = self.config.die_after_tokens
        if limit is not None and tokens_out >= limit and not self._dead:
            self._dead = True
            self.driver.fail_all()
            if self.on_die is not None:
                self.on_die()

    # ---------------------------------------------------------------- small endpoints
    async def _h_ping(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_raw(send, 200, b"", b"text/plain")

    async def _h_health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.config.healthy:
            await _send_json(send, 503, {"error": "simulated unhealthy engine (POST /sim/faults healthy=false)"})
            return
        await _send_raw(send, 200, b"", b"text/plain")

    async def _h_version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, {"version": VLLM_VERSION if self.config.dialect == "vllm" else SGLANG_VERSION})

    async def _h_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = "vllm" if self.config.dialect == "vllm" else "sglang"
        m = self.config.model
        card = {"id": m, "object": "model", "created": int(self._started), "owned_by": owner, "root": m,
                "parent": None, "max_model_len": self.profile.max_model_len}
        if owner == "vllm":
            card["permission"] = [{"id": f"modelperm-{self.config.engine_id}", "object": "model_permission",
                                   "created": int(self._started), "allow_create_engine": False,
                                   "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
                                   "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                                   "group": None, "is_blocking": False}]
        await _send_json(send, 200, {"object": "list", "data": [card]})

    async def _h_load(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, {"server_load": self._inflight})

    async def _h_get_load(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.model
        await _send_json(send, 200, [{"dp_rank": 0, "num_reqs": m.num_running + m.num_waiting,
                                      "num_waiting_reqs": m.num_waiting,
                                      "num_tokens": int(m.kv_usage * self.profile.cache_tokens)}])

    async def _h_metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.driver.pump()
        if self.config.dialect == "vllm":
            text = render_vllm(self.model, self.config.model)
        else:
            text = render_sglang(self.model, self.config.model, self.config.disaggregation_mode)
        await _send_raw(send, 200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")

    async def _h_kv_event_sources(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, {"0": self.publisher.config()} if self.publisher is not None else {})

    async def _h_reset(self, scope: Scope, receive: Receive, send: Send) -> None:
        ok = self.model.reset_prefix_cache(self.driver.loop.time())
        self.driver.pump()
        if self.config.dialect == "sglang":
            await _send_raw(send, 200 if ok else 400,
                            b"Cache flushed.\n" if ok else b"Cache not flushed: requests are running.\n", b"text/plain")
        else:
            await _send_raw(send, 200, b"", b"text/plain")

    async def _h_server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        p = self.profile
        c = self.config
        if c.dialect == "vllm":
            info: dict[str, Any] = {
                "vllm_config": {"model_config": {"model": c.model, "served_model_name": c.model,
                                                 "max_model_len": p.max_model_len},
                                "cache_config": {"block_size": p.block_size, "num_gpu_blocks": p.num_gpu_blocks,
                                                 "enable_prefix_caching": True},
                                "scheduler_config": {"max_num_batched_tokens": p.max_num_batched_tokens,
                                                     "max_num_seqs": p.max_num_seqs}},
                "vllm_env": {}, "system_env": {"simulated": True, "profile": p.name},
            }
        else:
            m = self.model
            info = {
                "model_path": c.model, "tokenizer_path": c.model, "served_model_name": c.model,
                "page_size": p.block_size, "max_total_num_tokens": p.cache_tokens,
                "max_running_requests": p.max_num_seqs, "chunked_prefill_size": p.max_num_batched_tokens,
                "context_length": p.max_model_len, "disaggregation_mode": c.disaggregation_mode,
                "disaggregation_bootstrap_port": self.port, "disaggregation_transfer_backend": "sim",
                "tp_size": 1, "dp_size": 1, "version": SGLANG_VERSION,
                "internal_states": [{"last_gen_throughput": 0.0, "num_running_reqs": m.num_running,
                                     "num_queue_reqs": m.num_waiting, "token_usage": m.kv_usage}],
            }
        await _send_json(send, 200, info)

    async def _h_model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        c = self.config
        await _send_json(send, 200, {"model_path": c.model, "tokenizer_path": c.model, "is_generation": True,
                                     "preferred_sampling_params": None, "weight_version": "default",
                                     "has_image_understanding": False, "has_audio_understanding": False,
                                     "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                     "max_model_len": self.profile.max_model_len})

    async def _h_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        c = self.config
        if "fail_next" in body:
            c.fail_next = _int_field(body, "fail_next", 0) or 0
        if "prefill_delay_s" in body:
            c.prefill_delay_s = _num_field(body, "prefill_delay_s", 0.0) or 0.0
        if "die_after_tokens" in body:
            v = _int_field(body, "die_after_tokens", 0)
            c.die_after_tokens = None if v is None else self.driver.tokens_out + v
        if "stream_fault" in body:
            mode = body["stream_fault"]
            if mode is not None and mode not in STREAM_FAULTS:
                raise _HttpError(400, f"'stream_fault' must be null or one of {sorted(STREAM_FAULTS)}", "stream_fault")
            c.stream_fault = mode
        if "stream_fault_after" in body:
            c.stream_fault_after = _int_field(body, "stream_fault_after", 0) or 0
        if "healthy" in body:
            c.healthy = _bool_field(body, "healthy", True)
        await _send_json(send, 200, {"fail_next": c.fail_next, "prefill_delay_s": c.prefill_delay_s,
                                     "die_after_tokens": c.die_after_tokens, "stream_fault": c.stream_fault,
                                     "stream_fault_after": c.stream_fault_after, "healthy": c.healthy,
                                     **_responses_faults(self, body)})

    # ---------------------------------------------------------------- tokenize
    async def _h_tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        self._check_model(body)
        if "messages" in body:
            msgs = self._messages(body)
            ids = self.tokenizer.encode_chat(msgs, _bool_field(body, "add_generation_prompt", True))
        elif "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise _HttpError(400, "'prompt' must be a string", "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            raise _HttpError(400, "either 'prompt' or 'messages' is required", "prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.profile.max_model_len, "tokens": ids,
                               "token_strs": None}
        if _bool_field(body, "return_token_strs"):
            out["token_strs"] = [self.tokenizer.decode_token(i) for i in ids]
        await _send_json(send, 200, out)

    async def _h_detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        self._check_model(body)
        toks = body.get("tokens")
        if not _is_token_list(toks):
            raise _HttpError(400, "'tokens' must be a list of non-negative integers", "tokens")
        await _send_json(send, 200, {"prompt": self.tokenizer.decode(toks)})

    # ---------------------------------------------------------------- render (for other routers)
    async def _h_render_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        g = self._parse(body, chat=False, scope=scope)
        await _send_json(send, 200, [self._render(g, body)])

    async def _h_render_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        g = self._parse(body, chat=True, scope=scope)
        await _send_json(send, 200, self._render(g, body))

    def _render(self, g: _GenParams, body: dict[str, Any]) -> dict[str, Any]:
        return {"request_id": g.request_id, "token_ids": g.prompt_ids, "token_offsets": None, "features": None,
                "content_parts": None,
                "sampling_params": {"max_tokens": g.max_tokens, "temperature": body.get("temperature", 1.0),
                                    "top_p": body.get("top_p", 1.0), "ignore_eos": body.get("ignore_eos", False),
                                    "min_tokens": body.get("min_tokens", 0), "n": 1},
                "model": self.config.model, "stream": g.stream,
                "stream_options": body.get("stream_options"), "cache_salt": body.get("cache_salt"),
                "kv_transfer_params": g.kv_transfer_params}

    # ---------------------------------------------------------------- request parsing
    def _check_model(self, body: dict[str, Any]) -> None:
        m = body.get("model")
        if m is None:
            return
        if not isinstance(m, str):
            raise _HttpError(400, "'model' must be a string", "model")
        if m != self.config.model:
            raise _HttpError(404, f"The model `{m}` does not exist.", "model", "NotFoundError")

    def _messages(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _HttpError(400, "'messages' must be a non-empty list", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise _HttpError(400, f"'messages[{i}]' must be an object", f"messages[{i}]")
            if not isinstance(m.get("role"), str):
                raise _HttpError(400, f"'messages[{i}].role' is required and must be a string", f"messages[{i}].role")
            c = m.get("content")
            if c is not None and not isinstance(c, str | list):
                raise _HttpError(400, f"'messages[{i}].content' must be a string or a list of parts",
                                 f"messages[{i}].content")
            try:
                message_text(c)
            except Untokenizable:  # a text-only model, as vLLM answers for one
                raise _HttpError(400, f"'messages[{i}].content' has a non-text part; this simulated model "
                                      "takes text only", f"messages[{i}].content") from None
        return msgs

    def _parse(self, body: dict[str, Any], chat: bool, scope: Scope) -> _GenParams:
        self._check_model(body)
        if chat:
            prompt_ids = self.tokenizer.encode_chat(self._messages(body))
        else:
            if "prompt" not in body:
                raise _HttpError(400, "'prompt' is required", "prompt")
            p = body["prompt"]
            if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or _is_token_list(p[0])):
                p = p[0]
            if isinstance(p, str):
                prompt_ids = self.tokenizer.encode(p)
            elif _is_token_list(p) and p:
                prompt_ids = list(p)
            elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
                raise _HttpError(400, "batched prompts are not supported by the simulated engine; send one prompt",
                                 "prompt")
            else:
                raise _HttpError(400, "'prompt' must be a string or a list of token ids", "prompt")
            if not prompt_ids:
                raise _HttpError(400, "'prompt' must not be empty", "prompt")
        n = _int_field(body, "n", 1) or 1
        if n > MAX_N:
            raise _HttpError(400, f"'n' must be at most {MAX_N} on the simulated engine (got {n})", "n")
        logprobs = self._logprobs_param(body, chat)
        max_tokens = _int_field(body, "max_tokens", 1)
        if chat:
            mct = _int_field(body, "max_completion_tokens", 1)
            if mct is not None:
                max_tokens = mct
        _int_field(body, "min_tokens", 0)
        _num_field(body, "temperature", 0.0, 2.0)
        _num_field(body, "top_p", 0.0, 1.0)
        _bool_field(body, "ignore_eos")
        stream = _bool_field(body, "stream")
        so = body.get("stream_options")
        include_usage = continuous = False
        if so is not None:
            if not isinstance(so, dict):
                raise _HttpError(400, "'stream_options' must be an object", "stream_options")
            if not stream:
                raise _HttpError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
            include_usage = _bool_field(so, "include_usage")
            continuous = _bool_field(so, "continuous_usage_stats")
        kvp = body.get("kv_transfer_params")
        if kvp is not None and not isinstance(kvp, dict):
            raise _HttpError(400, "'kv_transfer_params' must be an object", "kv_transfer_params")
        # max_tokens None: vLLM would fill the context; the sim stops naturally instead (engine_model).
        boot = self._bootstrap(body)
        if n > 1 and (kvp is not None or boot is not None):
            raise _HttpError(400, "'n' must be 1 for a disaggregated (P/D) request", "n")
        return _GenParams(prompt_ids, max_tokens, stream, include_usage, continuous, kvp,
                          boot, self._request_id(scope), n=n, logprobs=logprobs)

    @staticmethod
    def _logprobs_param(body: dict[str, Any], chat: bool) -> int | None:
        """Chat: ``logprobs`` (bool) + ``top_logprobs`` (0..20); completions: ``logprobs`` (0..20)."""
        if chat:
            want = _bool_field(body, "logprobs")
            top = _int_field(body, "top_logprobs", 0)
            if top is not None and top > MAX_LOGPROBS:
                raise _HttpError(400, f"'top_logprobs' must be at most {MAX_LOGPROBS} (got {top})", "top_logprobs")
            if top and not want:
                raise _HttpError(400, "when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")
            return (top or 0) if want else None
        lp = body.get("logprobs")
        if lp is None:
            return None
        if isinstance(lp, bool) or not isinstance(lp, int) or lp < 0:
            raise _HttpError(400, "'logprobs' must be a non-negative integer", "logprobs")
        if lp > MAX_LOGPROBS:
            raise _HttpError(400, f"Requested sample logprobs of {lp}, which is greater than max allowed: "
                                  f"{MAX_LOGPROBS}", "logprobs")
        return lp

    def _bootstrap(self, body: dict[str, Any]) -> tuple[str, int, int] | None:
        if self.config.dialect != "sglang" or self.config.disaggregation_mode == "null":
            return None
        host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
        if room is None:
            if self.config.disaggregation_mode == "decode":
                raise _HttpError(400, "a decode-mode server needs bootstrap_host, bootstrap_port and bootstrap_room",
                                 "bootstrap_room")
            return None
        if isinstance(room, bool) or not isinstance(room, int):
            raise _HttpError(400, "'bootstrap_room' must be an integer", "bootstrap_room")
        if self.config.disaggregation_mode == "decode":
            if not isinstance(host, str) or not host:
                raise _HttpError(400, "'bootstrap_host' must be a string", "bootstrap_host")
            if isinstance(port, bool) or not isinstance(port, int):
                raise _HttpError(400, "'bootstrap_port' must be an integer", "bootstrap_port")
        return (host or "", int(port or 0), room)

    def _request_id(self, scope: Scope) -> str:
        rid = None
        for k, v in scope.get("headers", ()):
            if k == b"x-request-id":
                rid = v.decode("latin-1")
                break
        return f"{rid or uuid.uuid4().hex}-{next(self._ids)}"

    # ---------------------------------------------------------------- generation
    async def _generate_outputs(self, g: _GenParams, receive: Receive) -> AsyncIterator[SimOutput]:
        """Run one request through the core; yields its outputs; aborts it if the client leaves."""
        c = self.config
        if self._dead:
            raise _HttpError(503, "the simulated engine is dead")
        if c.fail_next > 0:
            c.fail_next -= 1
            raise _HttpError(500, "simulated engine failure (fail_next)")
        do_remote_decode = remote_prefill = False
        kvp = g.kv_transfer_params or {}
        gone = g.gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        self._inflight += 1
        rid = g.request_id
        submitted = False
        try:
            if c.prefill_delay_s > 0:
                await _wait_or_gone(asyncio.sleep(c.prefill_delay_s), gone)
            if c.dialect == "vllm":
                if kvp.get("do_remote_decode"):
                    do_remote_decode = True
                elif kvp.get("do_remote_prefill"):
                    remote_prefill = await _wait_or_gone(self._pull_kv(kvp), gone)
            elif g.bootstrap is not None:
                if c.disaggregation_mode == "prefill":
                    do_remote_decode = True
                else:
                    await _wait_or_gone(self._wait_bootstrap(g.bootstrap), gone)
                    remote_prefill = True
            req = SimRequest(rid, g.prompt_ids, 1 if do_remote_decode else g.max_tokens,
                             do_remote_decode=do_remote_decode, remote_prefill=remote_prefill,
                             output_seed=g.output_seed)
            try:
                q = self.driver.submit(req)
            except SimRequestError as e:
                raise _HttpError(400, str(e), "max_tokens" if "context length" in str(e) else None) from e
            submitted = True
            get_task: asyncio.Task[Any] | None = None
            gone_task = asyncio.create_task(gone.wait())
            try:
                while True:
                    if q.empty():
                        get_task = asyncio.create_task(q.get())
                        await asyncio.wait((get_task, gone_task), return_when=asyncio.FIRST_COMPLETED)
                        if not get_task.done():
                            get_task.cancel()
                            raise _ClientGone()
                        o = get_task.result()
                    else:
                        o = q.get_nowait()
                    if o is _DIED:
                        raise _EngineDied()
                    yield o
                    if o.finished:
                        if do_remote_decode and g.bootstrap is not None:
                            self._publish_room(g.bootstrap[2], rid, len(g.prompt_ids))
                        submitted = False
                        return
            finally:
                gone_task.cancel()
        finally:
            self._inflight -= 1
            watcher.cancel()
            if submitted:
                self.driver.abort(rid)

    async def _pull_kv(self, kvp: dict[str, Any]) -> bool:
        """vLLM decode side: fetch the prefill's KV. True = transferred; False = recompute locally."""
        host, port, remote_id = kvp.get("remote_host"), kvp.get("remote_port"), kvp.get("remote_request_id")
        deadline = time.monotonic() + self.config.kv_pull_timeout_s
        last = "no remote_host/remote_port/remote_request_id in kv_transfer_params"
        if host and port and remote_id:
            while True:
                try:
                    r = await self._client.post(f"http://{host}:{port}/sim/kv_pull",  # type: ignore[union-attr]
                                                json={"remote_request_id": remote_id},
                                                timeout=max(0.1, deadline - time.monotonic()))
                    if r.status_code == 200:
                        return True
                    last = f"remote engine answered {r.status_code}"
                    break
                except httpx.HTTPError as e:
                    last = f"{type(e).__name__}: {e}"
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        if self.config.kv_load_failure_policy == "recompute":
            return False
        remaining = deadline - time.monotonic()
        if remaining > 0:  # vLLM notices a lost transfer only when its handshake times out
            await asyncio.sleep(remaining)
        raise _HttpError(500, f"KV transfer from the prefill engine failed ({last})", None, "InternalServerError")

    async def _h_kv_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        rid = body.get("remote_request_id")
        if not isinstance(rid, str):
            raise _HttpError(400, "'remote_request_id' must be a string", "remote_request_id")
        info = self.model.lease_info(rid)
        if info is None or not self.model.release_lease(rid, self.driver.loop.time()):
            raise _HttpError(404, f"no KV lease for request {rid!r} (expired or unknown)")
        self.driver.pump()
        await _send_json(send, 200, {"num_tokens": info[0], "block_ids": info[1]})

    # SGLang bootstrap -----------------------------------------------------------------------
    def _publish_room(self, room: int, rid: str, tokens: int) -> None:
        entry = self._rooms.setdefault(room, _Room())
        entry.request_id = rid
        entry.tokens = tokens
        entry.event.set()

    async def _h_bootstrap(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            room = int(scope["path"].rsplit("/", 1)[1])
        except ValueError:
            raise _HttpError(400, "bad bootstrap room", "bootstrap_room") from None
        wait = 0.0
        for part in scope.get("query_string", b"").decode().split("&"):
            if part.startswith("wait="):
                with contextlib.suppress(ValueError):
                    wait = max(0.0, min(60.0, float(part[5:])))
        entry = self._rooms.setdefault(room, _Room())
        if not entry.event.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry.event.wait(), wait)
        if not entry.event.is_set():
            if self._rooms.get(room) is entry:
                del self._rooms[room]
            raise _HttpError(404, f"bootstrap room {room} has no finished prefill")
        del self._rooms[room]
        if entry.request_id is not None:
            self.model.release_lease(entry.request_id, self.driver.loop.time())
            self.driver.pump()
        await _send_json(send, 200, {"bootstrap_room": room, "num_tokens": entry.tokens})

    async def _wait_bootstrap(self, boot: tuple[str, int, int]) -> None:
        host, port, room = boot
        timeout = self.config.bootstrap_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                r = await self._client.get(  # type: ignore[union-attr]
                    f"http://{host}:{port}/sim/bootstrap/{room}", params={"wait": f"{min(remaining, 5.0):.3f}"},
                    timeout=min(remaining, 5.0) + 2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        raise _HttpError(500, f"KVTransferError(bootstrap_room={room}): request timed out after {timeout:g} s "
                              f"waiting for the prefill (KVPoll.Bootstrapping)", None, "InternalServerError")

    # ---------------------------------------------------------------- OpenAI endpoints
    async def _h_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        await self._openai(body, chat=False, scope=scope, receive=receive, send=send)

    async def _h_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        await self._openai(body, chat=True, scope=scope, receive=receive, send=send)

    def _kv_params_out(self, rid: str, o: SimOutput) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": o.lease_block_ids or [],
                "remote_engine_id": self.config.engine_id, "remote_request_id": rid,
                "remote_host": self.config.host, "remote_port": self.port, "remote_num_tokens": o.prompt_tokens,
                "tp_size": 1, "transfer_mode": "pull"}

    async def _openai(self, body: dict[str, Any], chat: bool, scope: Scope, receive: Receive, send: Send) -> None:
        self.received_headers.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())})
        g = self._parse(body, chat, scope)
        async with contextlib.aclosing(self._choices(g, receive)) as outputs:
            await self._openai_respond(g, chat, outputs, send)

    async def _choices(self, g: _GenParams, receive: Receive) -> AsyncIterator[tuple[int, SimOutput]]:
        """The outputs of the request's ``n`` choices as (choice index, output), interleaved as they come.
        Choice i > 0 is a sub-request of its own (``<id>-<i>``, its own text), as vLLM fans out ``n``."""
        if g.n == 1:
            async with contextlib.aclosing(self._generate_outputs(g, receive)) as one:
                async for o in one:
                    yield 0, o
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        subs = [dataclasses.replace(g, n=1, request_id=f"{g.request_id}-{i}",
                                    output_seed=None if i == 0 else hash((self.config.seed, i, len(g.prompt_ids),
                                                                           tuple(g.prompt_ids[-64:]))) & _SEED_MASK)
                for i in range(g.n)]
        # only choice 0 watches the client (one reader of receive); a client gone ends them all
        gens = [self._generate_outputs(sub, receive if i == 0 else _never_disconnects) for i, sub in enumerate(subs)]

        async def pump(i: int, gen: AsyncIterator[SimOutput]) -> None:
            try:
                async for o in gen:
                    await queue.put((i, o))
                await queue.put((i, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
        try:
            finished = 0
            while finished < g.n:
                i, o = await queue.get()
                if o is None:
                    finished += 1
                elif isinstance(o, BaseException):
                    raise o
                else:
                    yield i, o
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for gen in gens:
                await gen.aclose()  # type: ignore[attr-defined]

    def _logprobs(self, g: _GenParams, chat: bool, o: SimOutput, text_offset: int) -> dict[str, Any] | None:
        if g.logprobs is None:
            return None
        tok = self.tokenizer
        if chat:
            return chat_logprobs(o.token_ids(), o.start_index, g.logprobs, tok.decode_token, tok.vocab_size)
        return completion_logprobs(o.token_ids(), o.start_index, g.logprobs, text_offset, tok.decode_token,
                                   tok.vocab_size)

    async def _openai_respond(self, g: _GenParams, chat: bool, outputs: AsyncIterator[tuple[int, SimOutput]],
                              send: Send) -> None:
        created = int(time.time())
        model = self.config.model
        oid = ("chatcmpl-" if chat else "cmpl-") + g.request_id
        obj = "chat.completion" if chat else "text_completion"
        dec = self.tokenizer.decode
        if not g.stream:
            texts: list[list[str]] = [[] for _ in range(g.n)]
            lps: list[list[dict[str, Any]]] = [[] for _ in range(g.n)]
            lasts: list[SimOutput | None] = [None] * g.n
            async for i, o in outputs:
                at = len(" ".join(texts[i]))
                texts[i].append(dec(o.token_ids()))
                lp = self._logprobs(g, chat, o, at)
                if lp is not None:
                    lps[i].append(lp)
                lasts[i] = o
            choices: list[dict[str, Any]] = []
            n_out = 0
            for i in range(g.n):
                last = lasts[i]
                assert last is not None
                text = " ".join(w for w in texts[i] if w)
                n_out += last.start_index + len(last.times)
                logprobs = _merge_logprobs(lps[i], chat) if g.logprobs is not None else None
                if chat:
                    choices.append({
                        "index": i,
                        "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                    "audio": None, "function_call": None, "tool_calls": [], "reasoning": None},
                        "logprobs": logprobs, "finish_reason": last.finish_reason, "stop_reason": None,
                        "token_ids": None})
                else:
                    choices.append({"index": i, "text": text, "logprobs": logprobs,
                                    "finish_reason": last.finish_reason, "stop_reason": None, "token_ids": None,
                                    "prompt_logprobs": None, "prompt_token_ids": None})
            last = lasts[0]
            assert last is not None
            resp: dict[str, Any] = {"id": oid, "object": obj, "created": created, "model": model,
                                    "choices": choices, "service_tier": None, "system_fingerprint": None,
                                    "usage": _usage(len(g.prompt_ids), n_out)}
            if chat:
                resp["prompt_logprobs"] = None
                resp["prompt_token_ids"] = None
            resp["kv_transfer_params"] = (self._kv_params_out(g.request_id, last)
                                          if last.lease_block_ids is not None else None)
            await _send_json(send, 200, resp)
            return
        # streaming
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        started = False
        n_outs = [0] * g.n
        offsets = [0] * g.n  # completions: text already sent per choice (logprobs text_offset)
        fault = self.config.stream_fault
        # The fault comes after stream_fault_after tokens, counted as tokens, not chunks: a late loop (a loaded
        # machine) or a fast profile delivers many tokens in one output, and counting chunks let the whole answer
        # through in fewer chunks than the fault point (the injected fault never happened).
        fault_left = self.config.stream_fault_after
        try:
            async for i, o in outputs:
                cut = False
                if fault is not None:
                    if fault_left <= 0:
                        if not started:
                            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                        await _stream_fault(fault, g, send)
                        return
                    cut = len(o.times) > fault_left
                    o = _head(o, fault_left)
                    fault_left -= len(o.times)
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                    started = True
                    if chat:
                        for j in range(g.n):
                            first = {"id": oid, "object": chunk_obj, "created": created, "model": model,
                                     "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
                            if g.continuous_usage:
                                first["usage"] = _usage(len(g.prompt_ids), 0)
                            await _send_sse(send, first)
                text = dec(o.token_ids())
                if o.start_index > 0:
                    text = " " + text
                n_outs[i] = o.start_index + len(o.times)
                lp = self._logprobs(g, chat, o, offsets[i])
                offsets[i] += len(text)
                if chat:
                    ch: dict[str, Any] = {"index": i, "delta": {"content": text}, "logprobs": lp,
                                          "finish_reason": o.finish_reason}
                else:
                    ch = {"index": i, "text": text, "logprobs": lp, "finish_reason": o.finish_reason}
                if o.finished:
                    ch["stop_reason"] = None
                chunk: dict[str, Any] = {"id": oid, "object": chunk_obj, "created": created, "model": model,
                                         "choices": [ch]}
                if g.continuous_usage:
                    chunk["usage"] = _usage(len(g.prompt_ids), sum(n_outs))
                if o.finished and o.lease_block_ids is not None:
                    chunk["kv_transfer_params"] = self._kv_params_out(g.request_id, o)
                await _send_sse(send, chunk)
                if cut:  # the rest of this output lies past the fault point
                    assert fault is not None
                    await _stream_fault(fault, g, send)
                    return
            if g.include_usage:
                await _send_sse(send, {"id": oid, "object": chunk_obj, "created": created, "model": model,
                                       "choices": [], "usage": _usage(len(g.prompt_ids), sum(n_outs))})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except _HttpError:
            if started:
                raise _EngineDied() from None  # mid-stream failure: cut the connection
            raise

    # ---------------------------------------------------------------- OpenAI Responses API (sim/responses.py)
    async def _h_responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        self.received_headers.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())})
        await _responses_create(self, body, scope, receive, send)

    def _responses_by_id(self, method: str, path: str) -> Callable[..., Awaitable[None]] | None:
        if method == "GET" and path.count("/") == 3:
            return lambda scope, receive, send: _responses_retrieve(self, scope, send)
        if method == "POST" and path.endswith("/cancel") and path.count("/") == 4:
            return lambda scope, receive, send: _responses_cancel(self, scope, send)
        return None

    # ---------------------------------------------------------------- SGLang /generate
    async def _h_generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        if "input_ids" in body:
            ids = body["input_ids"]
            if not _is_token_list(ids) or not ids:
                raise _HttpError(400, "'input_ids' must be a non-empty list of token ids", "input_ids")
            prompt_ids = list(ids)
        elif isinstance(body.get("text"), str):
            prompt_ids = self.tokenizer.encode(body["text"])
            if not prompt_ids:
                raise _HttpError(400, "'text' must not be empty", "text")
        else:
            raise _HttpError(400, "'text' (string) or 'input_ids' is required", "text")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise _HttpError(400, "'sampling_params' must be an object", "sampling_params")
        max_new = _int_field(sp, "max_new_tokens", 1)
        if max_new is None:
            max_new = 128  # SGLang's default max_new_tokens
        _num_field(sp, "temperature", 0.0, 2.0)
        _bool_field(sp, "ignore_eos")
        stream = _bool_field(body, "stream")
        rid = body.get("rid")
        base_rid = self._request_id(scope)
        if isinstance(rid, str) and rid:
            base_rid = f"{rid}-{next(self._ids)}"
        g = _GenParams(prompt_ids, max_new, stream, False, False, None, self._bootstrap(body), base_rid)
        async with contextlib.aclosing(self._generate_outputs(g, receive)) as outputs:
            await self._generate_respond(g, outputs, send)

    async def _generate_respond(self, g: _GenParams, outputs: AsyncIterator[SimOutput], send: Send) -> None:
        prompt_ids = g.prompt_ids
        t0 = time.monotonic()
        out_ids: list[int] = []
        dec = self.tokenizer.decode

        def payload(o: SimOutput) -> dict[str, Any]:
            fr = None
            if o.finished:
                fr = {"type": o.finish_reason, "length": len(out_ids)} if o.finish_reason == "length" else \
                    {"type": "stop", "matched": None}
            return {"text": dec(out_ids), "output_ids": list(out_ids),
                    "meta_info": {"id": g.request_id, "finish_reason": fr, "prompt_tokens": len(prompt_ids),
                                  "completion_tokens": len(out_ids), "cached_tokens": o.num_cached_tokens,
                                  "e2e_latency": time.monotonic() - t0}}

        if not g.stream:
            last = None
            async for o in outputs:
                out_ids.extend(o.token_ids())
                last = o
            assert last is not None
            await _send_json(send, 200, payload(last))
            return
        started = False
        try:
            async for o in outputs:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                    started = True
                out_ids.extend(o.token_ids())
                await _send_sse(send, payload(o))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except _HttpError:
            if started:
                raise _EngineDied() from None
            raise


# ----------------------------------------------------------------------------- helpers
MAX_N = 64  # choices per request: bounds what one client request can make the simulated engine do
_SEED_MASK = 0x7FFFFFFFFFFFFFFF


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()  # a receive() for sub-requests that do not watch the client
    return {"type": "http.disconnect"}


def _merge_logprobs(parts: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """One choice's logprobs from the pieces of its outputs (in order)."""
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [x for p in parts for x in p[k]] for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}


_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None}


async def _send_raw(send: Send, status: int, body: bytes, ctype: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, obj: Any) -> None:
    await _send_raw(send, status, orjson.dumps(obj), b"application/json")


STREAM_FAULTS = frozenset({"eof", "reset", "garbage", "hang"})


async def _stream_fault(fault: str, g: _GenParams, send: Send) -> None:
    """A completions/chat stream going wrong as engines do (``POST /sim/faults {"stream_fault": ...}``):
    ``eof`` ends it cleanly without ``[DONE]``, ``reset`` cuts the connection, ``garbage`` sends bytes
    that are not server-sent events, ``hang`` sends nothing more until the client leaves."""
    if fault == "eof":
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif fault == "reset":
        raise _EngineDied()
    elif fault == "garbage":
        await send({"type": "http.response.body", "body": b"<html>simulated garbage</html>\n\n", "more_body": False})
    elif fault == "hang":
        if g.gone is not None:
            await g.gone.wait()
        raise _ClientGone()


async def _send_sse(send: Send, obj: Any) -> None:
    await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(obj) + b"\n\n", "more_body": True})


async def _read_json(receive: Receive) -> dict[str, Any]:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    raw = b"".join(chunks)
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as e:
        raise _HttpError(400, f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise _HttpError(400, "the request body must be a JSON object")
    return body


async def _watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    with contextlib.suppress(Exception):
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                gone.set()
                return


async def _wait_or_gone(aw: Awaitable[Any], gone: asyncio.Event) -> Any:
    task = asyncio.ensure_future(aw)
    gone_task = asyncio.create_task(gone.wait())
    try:
        await asyncio.wait((task, gone_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone_task.cancel()
    if not task.done():
        task.cancel()
        raise _ClientGone()
    return task.result()


# ----------------------------------------------------------------------------- running it
def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _uvicorn_config(app: SimServer, host: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, lifespan="on", log_level="warning", access_log=False,
                          loop="uvloop", http="httptools", timeout_keep_alive=30, backlog=2048)


def _config_from(model: str, profile: EngineProfile | str, seed: int, dialect: str, kv_events: bool,
                 **kw: Any) -> SimServerConfig:
    return SimServerConfig(model=model, profile=profile, seed=seed, dialect=dialect, kv_events=kv_events, **kw)


class SimEngineHandle:
    """A running simulated engine (async variant): ``url``, ``port``, ``model`` (the core), ``stop()``."""

    def __init__(self, app: SimServer, server: uvicorn.Server, task: asyncio.Task[None], sock: socket.socket) -> None:
        self.app = app
        self.server = server
        self._task = task
        self._sock = sock
        self.port = app.port
        self.host = app.config.host
        self.url = f"http://{self.host}:{self.port}"

    @property
    def model(self) -> EngineModel:
        return self.app.model

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.app.publisher.endpoint if self.app.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.app.publisher.replay_endpoint if self.app.publisher else None

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, 5.0)
        if not self._task.done():
            self.server.force_exit = True
            self._task.cancel()
        with contextlib.suppress(OSError):
            self._sock.close()


async def start_sim_engine(model: str = "sim-model", profile: EngineProfile | str = "cpu-tiny", seed: int = 0,
                           dialect: str = "vllm", kv_events: bool = True, port: int = 0,
                           **kw: Any) -> SimEngineHandle:
    """Start a simulated engine in the running event loop (use ``await handle.stop()``)."""
    cfg = _config_from(model, profile, seed, dialect, kv_events, **kw)
    app = SimServer(cfg)
    sock = _bind(cfg.host, port)
    app.port = sock.getsockname()[1]
    config = uvicorn.Config(app, host=cfg.host, lifespan="on", log_level="warning", access_log=False,
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    handle = SimEngineHandle(app, server, task, sock)
    app.on_die = lambda: setattr(server, "should_exit", True)
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    return handle


class SimEngineThread:
    """A simulated engine served from a background thread on a free port.

    >>> with SimEngineThread(model="m", profile="zero") as eng:
    ...     httpx.get(eng.url + "/health")
    """

    def __init__(self, model: str = "sim-model", profile: EngineProfile | str = "cpu-tiny", seed: int = 0,
                 dialect: str = "vllm", kv_events: bool = True, port: int = 0, **kw: Any) -> None:
        self.config = _config_from(model, profile, seed, dialect, kv_events, **kw)
        self._port = port
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.app: SimServer | None = None
        self.server: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # the same surface as SimEngineHandle
    @property
    def port(self) -> int:
        assert self.app is not None
        return self.app.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def model(self) -> EngineModel:
        assert self.app is not None
        return self.app.model

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.app.publisher.endpoint if self.app and self.app.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.app.publisher.replay_endpoint if self.app and self.app.publisher else None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine's loop thread and return its result (the core is not thread-safe)."""
        assert self.loop is not None
        fut: asyncio.Future[Any] = asyncio.run_coroutine_threadsafe(_call_async(fn), self.loop)  # type: ignore[arg-type]
        return fut.result(10)

    def start(self) -> SimEngineThread:
        self._thread = threading.Thread(target=self._main, name=f"sim-engine-{self.config.model}", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"simulated engine failed to start: {self._error}") from self._error
        if not self._ready.is_set():
            raise RuntimeError("simulated engine did not start within 30 s")
        return self

    def _main(self) -> None:
        try:
            import uvloop

            factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
        except ImportError:  # pragma: no cover
            factory = None
        try:
            # (asyncio.Runner: on the way out, the tasks still pending — uvicorn's lifespan, handlers of
            # requests in flight — are cancelled and run to their end before the loop closes, instead of
            # being destroyed pending with the loop)
            with asyncio.Runner(loop_factory=factory) as runner:
                self.loop = runner.get_loop()
                runner.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self._error = e
            self._ready.set()

    def uvicorn_config(self) -> uvicorn.Config:
        """How uvicorn serves ``self.app`` (a subclass adds TLS options, say)."""
        return _uvicorn_config(self.app, self.config.host)

    async def _serve(self) -> None:
        self.app = SimServer(self.config)
        sock = _bind(self.config.host, self._port)
        self.app.port = sock.getsockname()[1]
        self.server = uvicorn.Server(self.uvicorn_config())
        self.app.on_die = lambda: setattr(self.server, "should_exit", True)
        task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not task.done():
            await asyncio.sleep(0.005)
        self._ready.set()
        await task
        sock.close()

    def stop(self) -> None:
        if self.server is not None and self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(setattr, self.server, "should_exit", True)
        if self._thread is not None:
            self._thread.join(10)
            if self._thread.is_alive() and self.server is not None:
                self.server.force_exit = True
                self._thread.join(5)

    def __enter__(self) -> SimEngineThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _call_async(fn: Callable[[], Any]) -> Any:
    return fn()


def run_forever(config: SimServerConfig, port: int) -> None:
    """Serve in this process until interrupted (the ``dyad sim-engine`` command)."""
    app = SimServer(config)
    sock = _bind(config.host, port)
    app.port = sock.getsockname()[1]
    server = uvicorn.Server(_uvicorn_config(app, config.host))
    app.on_die = lambda: os._exit(17)  # a crash, as a real engine process would
    print(f"dyad sim-engine: listening on http://{config.host}:{app.port}", flush=True)
    server.run(sockets=[sock])
