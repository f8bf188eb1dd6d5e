"""The P/D executor: runs one routed attempt across a prefill and a decode worker.

The gateway's proxy uses it whenever the routing decision names a prefill worker; like the
aggregated executor it returns the decode engine's response with headers in and body unread, so
the proxy streams it to the client unchanged.

* **vLLM** (NixlConnector / ExampleConnector): prefill step first (bounded by
  ``disagg.prefill_timeout_s``), then the decode step with the hand-off. If the prefill worker is
  down, slow, or answers without a hand-off, the decode worker prefills locally: the client sees
  no error, ``dyad_pd_requests_total{mode="fallback"}`` counts it.
* **SGLang**: dual dispatch with a fresh bootstrap room. The executor waits for whichever comes
  first — the decode's first bytes or the prefill's answer. A prefill that fails or does not answer
  within ``disagg.prefill_timeout_s`` takes the decode request down with it (it would only wait
  for its bootstrap timeout) and the pair is retried with another prefill worker (503 when none
  is left). A streamed decode that sends nothing within the same bound after its prefill finished
  (a lost bootstrap) counts as a failed decode attempt: the proxy tries another decode worker.

A decode worker that fails before answering raises ``AttemptFailed`` (or answers 5xx): the proxy
then routes again, excluding it, which picks another decode worker. Cancellation reaches both
engines: every engine call is an httpx request whose connection is closed when the client goes
away (the prefill task of a dual dispatch is tied to the decode response's lifetime).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import orjson

from adapters.base import EngineAdapter, EngineKind
from orchestrator.clock import Clock
from orchestrator.config import DisaggConfig, ResilienceConfig
from orchestrator.disagg import sglang_flow, vllm_flow
from orchestrator.errors import NoHealthyWorker, UpstreamError
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker
from orchestrator.gateway import classify
from orchestrator.gateway.classify import ACCESS_STATUSES, NOT_SERVED_STATUSES
from orchestrator.gateway.executor import AttemptFailed, UpstreamCall, engine_headers, send_to_worker
from orchestrator.gateway.resilience import stall_budget, worked_since
from orchestrator.gateway.stream_protocol import sse_fields
from orchestrator.gateway.transport import (
    AnswerTooLarge,
    MalformedAnswer,
    header,
    raw_headers,
    read_all,
    send_post,
)
from orchestrator.router.types import RouteDecision
from orchestrator.telemetry import tracing
from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger(__name__)
PREFILL_ANSWER_BYTES = 4 << 20  # a prefill step's answer is read up to this (one token + hand-off fields)
T = TypeVar("T")

# Modes counted in dyad_pd_requests_total{mode}.
MODE_DISAGGREGATED = "disaggregated"
MODE_LOCAL = "local"  # conditional disaggregation chose the decode worker's own prefill
MODE_FALLBACK = "fallback"  # a split was planned but the prefill side failed; decode prefilled locally

# Prefill answers that mean "your request is wrong", not "I am broken": the decode step would say the same.
# Not a refusal of the gateway's access (401/403/407, classify.ACCESS_STATUSES): that is about the prefill
# worker's key or set-up, which the decode worker does not share; the decode worker prefills locally. Under
# vLLM not a 404 either (classify.NOT_SERVED_STATUSES: that prefill engine does not serve the model; the decode
# engine, asked next, answers for itself); SGLang asks its other prefill workers, and a 404 from one is the answer.
_CLIENT_ERRORS = frozenset(range(400, 500)) - {408, 409, 429} - ACCESS_STATUSES
_VLLM_PREFILL_REFUSALS = _CLIENT_ERRORS - NOT_SERVED_STATUSES

SGLANG_MAX_PREFILL_TRIES = 3


class _PrefillFailed(Exception):
    """A prefill leg that gave no hand-off. ``reachable`` False: the worker cannot be reached at all (out of
    rotation at once). ``failure`` (``classify``'s kinds): what the worker did that a request can cause as well
    as a broken engine, held until another worker shows what the same request does there — it closed the
    connection after taking the request (``DROPPED``), did no work at all for the leg's stall budget
    (``STALLED``: an engine hung while its /health answers, or a request that hangs any engine), answered
    something that is no answer (``GARBAGE``) or an error status (a 5xx, or a refusal of the gateway's access).
    None: nobody's fault to judge (the leg ran out of ``prefill_timeout_s`` on a busy worker)."""

    def __init__(self, reason: str, reachable: bool = True, failure: int | str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.reachable = reachable
        self.failure = failure

    @property
    def dropped(self) -> bool:
        return self.failure in (classify.DROPPED, classify.STALLED)

    @property
    def held(self) -> bool:
        """Counted against the worker once another worker serves the same request (a 429 or 404: never)."""
        return self.failure is not None and self.failure not in classify.UNCOUNTED_STATUSES


class _PrefillRefused(Exception):
    """An SGLang prefill server refused the request itself (a 4xx the decode server would answer too)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


class _Chained(httpx.AsyncByteStream):
    """A response body that starts with bytes already read and, when closed, also closes its
    companions (the original response, a still-running prefill task)."""

    def __init__(self, head: bytes, rest: AsyncIterator[bytes], close: Callable[[], Any]) -> None:
        self._head = head
        self._rest = rest
        self._close = close

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._head:
            yield self._head
        async for chunk in self._rest:
            yield chunk

    async def aclose(self) -> None:
        await self._close()


class PdExecutor:
    """``Executor`` for decisions with a prefill worker (see the module docstring)."""

    def __init__(self, http: httpx.AsyncClient, fleet: FleetRegistry, config: DisaggConfig, metrics: DyadMetrics,
                 clock: Clock, adapter_for: Callable[[EngineKind], EngineAdapter],
                 choose_prefill: Callable[[str, set[str]], Worker | None] | None = None, *,
                 stall: ResilienceConfig | None = None, breakers: Any | None = None) -> None:
        """``stall``: the stall watchdog's settings for prefill legs (None: a leg waits its whole
        ``prefill_timeout_s``); ``breakers`` (``CircuitBreakers``): a prefill worker's breaker counts the legs it
        failed (``_prefill_fault``) and the legs it answered (a success: its count of consecutive failures starts
        again, and a half-open breaker closes after enough of them)."""
        self.stall = stall
        self.breakers = breakers
        self.http = http
        self.fleet = fleet
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.adapter_for = adapter_for
        # Another prefill worker for a model, excluding some ids (SGLang retries); None = no retry.
        self.choose_prefill = choose_prefill

    async def open(self, call: UpstreamCall, decision: RouteDecision) -> httpx.Response:
        prefill = decision.prefill_worker
        if prefill is None:  # not ours, but harmless: run it aggregated on the decode worker
            return await self._send_local(call, decision.worker)
        if decision.worker.engine == EngineKind.SGLANG:
            return await self._sglang(call, decision.worker, prefill, decision)
        return await self._vllm(call, decision.worker, prefill, decision)

    @contextlib.contextmanager
    def _prefill_leg(self, decision: RouteDecision | None) -> Iterator[None]:
        """Mark a prefill leg running on ``decision`` (the stall watchdog waits on it, not on the
        decode worker, while it runs: the leg has its own bound, ``disagg.prefill_timeout_s``)."""
        if decision is None:
            yield
            return
        decision.prefill_legs += 1
        try:
            yield
        finally:
            decision.prefill_legs -= 1
            decision.prefill_ended_at = self.clock.now()

    async def _as_prefill_leg(self, decision: RouteDecision | None, step: Awaitable[T]) -> T:
        with self._prefill_leg(decision):
            return await step

    # --- vLLM ----------------------------------------------------------------------------------

    async def _vllm(self, call: UpstreamCall, decode: Worker, prefill: Worker,
                    decision: RouteDecision | None = None) -> httpx.Response:
        connector = self.config.connector
        why_local = vllm_flow.local_only(call.endpoint, call.body, call.prompt_tokens,
                                         decode.max_model_len.get(call.model), prefill.max_model_len.get(call.model))
        if why_local is not None:  # the decode engine refuses it: no prefill leg (it would lease KV for nobody)
            log.info("request %s is not split (%s): %s answers it whole", call.request_id, why_local, decode.id)
            self.metrics.pd_requests.labels(MODE_LOCAL).inc()
            return await self._send_local(call, decode)
        body = vllm_flow.prefill_body(call.endpoint, call.body, connector)
        started = time.perf_counter()
        try:
            with tracing.span("dyad.pd.prefill", worker=prefill.id), self._prefill_leg(decision):
                answer = await self._prefill_step(call, prefill, body)
        except _PrefillFailed as e:
            log.warning("prefill on %s failed (%s); %s prefills locally", prefill.id, e.reason, decode.id)
            return await self._vllm_fallback(call, decode, prefill, decision, e)
        if isinstance(answer, httpx.Response):  # the request itself is bad: pass the engine's 4xx on
            self._prefill_ok(prefill)  # (it answered, for the request: alive)
            return answer
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
        params = vllm_flow.handoff_params(answer) if connector == "nixl" else None
        if connector == "nixl":
            given = answer.get(vllm_flow.KV_TRANSFER_PARAMS)
            if params is not None:
                problem = vllm_flow.unreachable_side_channel(params, prefill.url, decode.url)
            elif given is not None and not isinstance(given, dict):
                problem = f"kv_transfer_params is a {type(given).__name__}, not an object"
            else:
                problem = vllm_flow.handoff_problem(given) if isinstance(given, dict) \
                    and given.get("do_remote_prefill") else None
            if problem is not None:  # garbage where the hand-off goes: never passed to the decode engine
                log.warning("prefill on %s answered kv_transfer_params that are no hand-off (%s); %s prefills "
                            "locally", prefill.id, problem, decode.id)
                return await self._vllm_fallback(call, decode, prefill, decision, _PrefillFailed(
                    f"answered kv_transfer_params that are no hand-off ({problem})", failure=classify.GARBAGE))
            if params is None:
                # (no hand-off at all: not a NIXL producer, or this request's one token ended it — an end of
                # sequence or a stop string, after which vLLM keeps no blocks: nobody's fault)
                log.warning("prefill on %s answered without kv_transfer_params (is it a NIXL producer? or the "
                            "request's first token ended it); %s prefills locally", prefill.id, decode.id)
                return await self._vllm_fallback(call, decode, prefill, decision, None)
        adapter = self.adapter_for(decode.engine)
        out = adapter.shape_request(call.endpoint, vllm_flow.decode_body(call.body, params), call.request_id)
        with tracing.span("dyad.pd.decode", worker=decode.id):
            response = await send_to_worker(self.http, decode, call.endpoint, out, engine_headers(call, decode))
        status = response.status_code
        failure = f"answered HTTP {status}" if status >= 500 and status != 503 else None
        if failure is None:
            self.metrics.pd_requests.labels(MODE_DISAGGREGATED).inc()
            if status != 200 or not call.stream or b"event-stream" not in (header(response, b"content-type") or b""):
                self._prefill_ok(prefill)
                return response
            # (a stream says so in its first event: vLLM streams a generation error as an error event. Nothing is
            # relayed before that event: a decode engine that sends its headers and then nothing is pulled by the
            # stall watchdog before any byte reached the client, which then gets the stall as an error status.)
            response, error = await _peek_first_event(response)
            if error is None:
                self._prefill_ok(prefill)
                return response
            failure = f"streamed an error before any token ({error[:200]})"
        # The decode engine failed the request it got with the hand-off, before any token: a transfer it could not
        # complete (a prefill engine that lost or never kept the blocks, a side channel it cannot reach; vLLM with
        # kv_load_failure_policy "fail" answers 500, or streams an error event) fails there the same way on every
        # decode worker, so the proxy's retry (a new leg on the same prefill worker) would fail too and the request
        # be judged the culprit. The decode worker is asked again at once without the hand-off: answered, the
        # hand-off was at fault (the prefill worker's breaker counts it); failed again, the decode worker's answer
        # goes to the proxy as usual. (Not on a 503: the engine says it cannot serve now, with or without a hand-off.)
        await response.aclose()
        log.warning("decode on %s %s to the hand-off of %s; %s prefills locally", decode.id, failure, prefill.id,
                    decode.id)
        return await self._vllm_fallback(call, decode, prefill, decision, _PrefillFailed(
            f"the decode worker {decode.id} {failure} to its hand-off", failure=classify.GARBAGE), leg_failed=False,
            counted=status != 200)

    async def _vllm_fallback(self, call: UpstreamCall, decode: Worker, prefill: Worker, decision: RouteDecision | None,
                             failed: _PrefillFailed | None, *, leg_failed: bool = True,
                             counted: bool = True) -> httpx.Response:
        """The decode worker prefills locally after a prefill leg gave no hand-off (``failed``: why, when the
        worker may be at fault). A worker that cannot be reached leaves rotation at once; another failure is
        judged by what the decode worker makes of the same request (``classify``): answered, it was the prefill
        worker's (its breaker counts it; a drop or stall takes it out of rotation, a 502/503 counts against its
        health); refused or failed there as well, it may be the request's, and counts against nobody.
        ``leg_failed`` False: the leg itself answered (its hand-off is what failed): the proxy's retry, if any, may
        ask the same prefill worker again (the decode worker failed the request without the hand-off too).
        ``counted`` False: the request is in ``dyad_pd_requests_total`` already (its hand-off was taken)."""
        if decision is not None and leg_failed:
            decision.failed_prefill.append(prefill.id)
        if counted:
            self.metrics.pd_requests.labels(MODE_FALLBACK).inc()
        if failed is not None:
            self.metrics.upstream_errors.labels(prefill.id, "prefill").inc()
            if not failed.reachable:
                self._prefill_fault(prefill, failed.reason, classify.DROPPED)
        response = await self._send_local(call, decode)  # (raises: the failure was the request's as well)
        if failed is not None and failed.reachable and failed.held and response.status_code == 200:
            self._prefill_fault(prefill, failed.reason, failed.failure)
        return response

    async def _post_prefill(self, call: UpstreamCall, prefill: Worker, body: dict[str, Any]) -> httpx.Response:
        """POST a prefill body (both engines' flows), counted in the worker's inflight and bounded by
        ``disagg.prefill_timeout_s``; no answer raises ``_PrefillFailed`` (``reachable=False`` when
        the worker cannot be reached at all). Watched for a stall as a decode try is (``Attempt.watch``):
        past ``resilience.stall_timeout_s`` plus the prompt's and the worker's queued prefill at
        ``stall_prefill_tokens_per_s``, a prefill worker that did no work at all since the leg began (no
        answer to any leg, no generated tokens in its metrics) is stalled: the leg ends then
        (``stalled``), instead of holding its request for the whole ``prefill_timeout_s``."""
        prefill.inflight += 1
        # (a half-open breaker lets ``half_open_probes`` legs through at a time, as it does requests to a decode worker)
        probe = self.breakers.dispatched(prefill.id) if self.breakers is not None else False
        exchange = asyncio.ensure_future(self._exchange_prefill(call, prefill, body))
        loop = asyncio.get_running_loop()
        ends = loop.time() + self.config.prefill_timeout_s
        try:
            window = self._stall_budget(call, prefill)
            since, gen = self.clock.now(), prefill.load.generation_tokens
            while True:
                left = ends - loop.time()
                done, _ = await asyncio.wait({exchange}, timeout=left if window is None else min(window, left))
                if done:
                    return exchange.result()
                if loop.time() >= ends:
                    raise _PrefillFailed(f"no answer within disagg.prefill_timeout_s={self.config.prefill_timeout_s:g}s")
                now = self.clock.now()
                if not worked_since(prefill, since, gen):
                    raise _PrefillFailed(f"it did no work for {now - since:.1f} s (stalled)", failure=classify.STALLED)
                assert self.stall is not None
                since, gen, window = now, prefill.load.generation_tokens, self.stall.stall_timeout_s
        finally:
            if not exchange.done():
                exchange.cancel()  # (closes the connection: the engine aborts the step)
                await asyncio.gather(exchange, return_exceptions=True)
            prefill.inflight = max(0, prefill.inflight - 1)
            if probe:
                assert self.breakers is not None
                self.breakers.probe_done(prefill.id)

    def _stall_budget(self, call: UpstreamCall, prefill: Worker) -> float | None:
        return None if self.stall is None else stall_budget(self.stall, call.prompt_tokens,
                                                            prefill.queued_prefill_tokens)

    async def _exchange_prefill(self, call: UpstreamCall, prefill: Worker, body: dict[str, Any]) -> httpx.Response:
        try:
            r = await send_post(self.http, prefill.url + call.endpoint, orjson.dumps(body),
                                engine_headers(call, prefill))
            try:  # (read whole, bounded: a prefill answer is one token and the hand-off's parameters)
                content = await read_all(r, PREFILL_ANSWER_BYTES)
            finally:
                await r.aclose()
            prefill.last_progress_at = self.clock.now()  # it answered: alive (the stall watchdog's evidence)
            return httpx.Response(r.status_code, content=content, headers=raw_headers(r))
        except AnswerTooLarge as e:
            raise _PrefillFailed(f"answered more than {e.limit} bytes", failure=classify.GARBAGE) from None
        except (httpx.ConnectError, httpx.ConnectTimeout, MalformedAnswer) as e:
            raise _PrefillFailed(f"cannot reach {prefill.url}: {type(e).__name__}", reachable=False) from e
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            raise _PrefillFailed(f"{prefill.url} closed the connection without answering: {type(e).__name__}",
                                 failure=classify.DROPPED) from e
        except httpx.HTTPError as e:
            raise _PrefillFailed(f"{type(e).__name__}: {e}") from e

    def _prefill_fault(self, prefill: Worker, reason: str, failure: int | str | None = classify.DROPPED) -> None:
        """``prefill`` failed a leg that another worker served (or it cannot be reached): its breaker counts it.
        A drop or stall also takes it out of rotation (the health loop alone would bring back at once an engine
        whose /health still answers); a 502/503 counts against its health, as the aggregated path does."""
        now = self.clock.now()
        if self.breakers is not None:
            self.breakers.record_failure(prefill.id, now)
        if failure in (classify.DROPPED, classify.STALLED):
            self.fleet.mark_failed(prefill, now, reason)
        elif failure in classify.UNAVAILABLE_STATUSES:
            self.fleet.record_health(prefill, False, now, reason)

    def _prefill_ok(self, prefill: Worker) -> None:
        """``prefill`` answered a leg: its breaker's consecutive failures start again from zero (a half-open one
        counts a success towards closing)."""
        if self.breakers is not None:
            self.breakers.record_success(prefill.id, self.clock.now())

    async def _prefill_step(self, call: UpstreamCall, prefill: Worker,
                            body: dict[str, Any]) -> dict[str, Any] | httpx.Response:
        """POST the prefill step and return its JSON answer (or the engine's 4xx response as is).
        Bounded by ``disagg.prefill_timeout_s``; closing the connection on timeout or cancellation
        makes the engine abort the step."""
        r = await self._post_prefill(call, prefill, body)
        if r.status_code in _VLLM_PREFILL_REFUSALS:
            return httpx.Response(r.status_code, content=r.content,
                                  headers={"content-type": r.headers.get("content-type", "application/json")})
        return _answer_of(r, _VLLM_PREFILL_REFUSALS)

    async def _send_local(self, call: UpstreamCall, decode: Worker) -> httpx.Response:
        adapter = self.adapter_for(decode.engine)
        out = adapter.shape_request(call.endpoint, vllm_flow.local_body(call.body), call.request_id)
        return await send_to_worker(self.http, decode, call.endpoint, out, engine_headers(call, decode))

    # --- SGLang --------------------------------------------------------------------------------

    async def _sglang(self, call: UpstreamCall, decode: Worker, prefill: Worker,
                      decision: RouteDecision | None = None) -> httpx.Response:
        """Dual dispatch, with another prefill worker when one fails (up to ``SGLANG_MAX_PREFILL_TRIES``). A
        prefill refusing the request itself (4xx) is the client's answer, as it would be from the decode
        server. A prefill that drops the connection is judged by the next one: dropped there too, it was
        the request's doing (a 502 naming it, no worker taken out); served there, the dropping worker leaves
        rotation; with no other prefill worker to ask, it leaves rotation as before."""
        failed: set[str] = set()
        held: list[tuple[Worker, _PrefillFailed]] = []  # prefill failures judged by the next prefill worker
        last_reason = ""
        current: Worker | None = prefill
        for _ in range(SGLANG_MAX_PREFILL_TRIES):
            if current is None:
                break
            try:
                response = await self._sglang_pair(call, decode, current, decision)
            except _PrefillRefused as e:
                self._settle_held(held, request_caused=True)
                self._prefill_ok(current)  # (it answered, for the request: alive)
                return e.response
            except _PrefillFailed as e:
                log.warning("SGLang prefill on %s failed (%s)", current.id, e.reason)
                self.metrics.upstream_errors.labels(current.id, "prefill").inc()
                if not e.reachable:
                    self._prefill_fault(current, e.reason, classify.DROPPED)
                elif e.held and any(f.failure == e.failure or (f.dropped and e.dropped) for _, f in held):
                    # the same on a second prefill worker: the request's doing
                    self._settle_held(held, request_caused=True)
                    names = ", ".join(sorted(failed | {current.id}))
                    if e.dropped:
                        raise UpstreamError(502, f"The prefill engines ({names}) closed the connection or stalled "
                                                 "without answering this request.",
                                            code="engine_closed_connection") from None
                    status = e.failure if isinstance(e.failure, int) and e.failure >= 500 else 502
                    raise UpstreamError(status, f"The prefill engines ({names}) failed this request: {e.reason}",
                                        code="prefill_failed") from None
                elif e.held:
                    held.append((current, e))
                if decision is not None:
                    decision.failed_prefill.append(current.id)
                failed.add(current.id)
                last_reason = f"prefill worker {current.id}: {e.reason}"
                current = self.choose_prefill(call.model, failed) if self.choose_prefill else None
                continue
            self._settle_held(held, request_caused=False)  # another prefill worker served it
            self._prefill_ok(current)
            self.metrics.pd_requests.labels(MODE_DISAGGREGATED).inc()
            return response
        self._settle_held(held, request_caused=False)  # no second opinion: the workers' doing
        raise NoHealthyWorker(call.model, reason=f"no SGLang prefill worker could serve the request ({last_reason})")

    def _settle_held(self, held: list[tuple[Worker, _PrefillFailed]], *, request_caused: bool) -> None:
        """Prefill failures held for a second opinion count against their workers (``_prefill_fault``), unless
        the request caused them."""
        if not request_caused:
            for worker, e in held:
                self._prefill_fault(worker, e.reason, e.failure)
        held.clear()

    async def _sglang_pair(self, call: UpstreamCall, decode: Worker, prefill: Worker,
                           decision: RouteDecision | None = None) -> httpx.Response:
        room = sglang_flow.new_room()
        pbody, dbody = sglang_flow.dual_bodies(call.body, prefill.url, prefill.bootstrap_port, room)
        started = time.perf_counter()
        prefill_task = asyncio.ensure_future(self._as_prefill_leg(decision, self._sglang_prefill(call, prefill, pbody)))
        decode_task = asyncio.ensure_future(self._open_first_chunk(call, decode, dbody))
        try:
            done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if decode_task not in done:
                # The prefill finished first: a failure dooms the decode side (it would only wait
                # for its bootstrap timeout), so abandon it; on success the first token is near.
                await prefill_task  # raises _PrefillFailed
                self.metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
                if call.stream:
                    try:
                        async with asyncio.timeout(self.config.prefill_timeout_s):
                            await asyncio.shield(decode_task)
                    except TimeoutError:
                        raise AttemptFailed(decode, "protocol", f"{decode.url} sent no token within "
                                            f"{self.config.prefill_timeout_s:g}s of the prefill finishing "
                                            f"(bootstrap room {room} lost?)", reachable=True) from None
            response, head, rest = await decode_task
        except BaseException:
            for task in (prefill_task, decode_task):
                task.cancel()
            await asyncio.gather(prefill_task, decode_task, return_exceptions=True)
            raise

        async def close() -> None:
            prefill_task.cancel()
            with contextlib.suppress(BaseException):
                await prefill_task
            await response.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=_Chained(head, rest, close))

    async def _sglang_prefill(self, call: UpstreamCall, prefill: Worker, body: dict[str, Any]) -> None:
        """The prefill half of a pair. Its answer must be one (a JSON object that is no error): anything else
        means the half failed, and the decode half would wait for its bootstrap timeout (minutes, in SGLang)."""
        r = await self._post_prefill(call, prefill, body)
        if r.status_code in _CLIENT_ERRORS:  # the request itself is refused: the client's answer
            raise _PrefillRefused(httpx.Response(r.status_code, content=r.content, headers={
                "content-type": r.headers.get("content-type", "application/json")}))
        answer = _answer_of(r, _CLIENT_ERRORS)
        if isinstance(answer, httpx.Response):
            raise _PrefillRefused(answer)

    async def _open_first_chunk(self, call: UpstreamCall, decode: Worker,
                                body: dict[str, Any]) -> tuple[httpx.Response, bytes, AsyncIterator[bytes]]:
        """Open the decode response and read its first bytes, so that a decode that fails before
        its first token is still retryable (nothing has reached the client yet)."""
        adapter = self.adapter_for(decode.engine)
        out = adapter.shape_request(call.endpoint, body, call.request_id)
        response = await send_to_worker(self.http, decode, call.endpoint, out, engine_headers(call, decode))
        rest = response.aiter_raw()
        try:
            head = await anext(rest, b"")
        except httpx.HTTPError as e:
            await response.aclose()
            raise AttemptFailed(decode, "protocol", f"{decode.url} broke off before its first token: {e}",
                                reachable=True) from e
        except BaseException:
            await response.aclose()
            raise
        return response, head, rest


PEEK_BYTES = 1 << 20  # a stream's first event is looked for in this many bytes at most


async def _peek_first_event(response: httpx.Response) -> tuple[httpx.Response, str | None]:
    """Read a stream up to its first data event (``PEEK_BYTES`` at most) and return the stream, whole again (the
    bytes read, then the rest), and the message of that event when it is an error (``{"error": ...}``), else None.
    A stream that breaks or ends first is returned as it is: its reader sees the break or the end."""
    rest = response.aiter_raw()
    head = b""
    broke: httpx.HTTPError | None = None
    error: str | None = None
    try:
        while len(head) < PEEK_BYTES:
            try:
                piece = await anext(rest, None)
            except httpx.HTTPError as e:
                broke = e
                break
            if piece is None:
                break
            head += piece
            events = head.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n")[:-1]
            data = next((d for ev in events if (d := sse_fields(ev)[1]) is not None), None)
            if data is not None:
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    obj = None
                bad = classify.error_in_answer(obj)
                if bad is not None:
                    error = str(bad[1].get("message"))
                break
    except BaseException:
        await response.aclose()
        raise

    async def remaining() -> AsyncIterator[bytes]:
        if broke is not None:
            raise broke
        async for chunk in rest:
            yield chunk

    return httpx.Response(response.status_code, headers=response.headers,
                          stream=_Chained(head, remaining(), response.aclose)), error


def _answer_of(r: httpx.Response, refusals: frozenset[int]) -> dict[str, Any] | httpx.Response:
    """A prefill leg's answer (a 200 whose body is a JSON object), or the request's refusal (an error the engine
    gave for it: status in ``refusals``, or a 200 carrying such an error) as the response to pass on; anything
    else raises ``_PrefillFailed`` with the failure to judge (its status, or ``GARBAGE``)."""
    status = r.status_code
    if status >= 400:
        raise _PrefillFailed(f"answered HTTP {status}: {r.text[:200]}", failure=status)
    if status != 200:  # (a redirect or another 2xx is no answer to the step)
        raise _PrefillFailed(f"answered HTTP {status}, which is no answer", failure=classify.GARBAGE)
    try:
        answer = orjson.loads(r.content)
    except orjson.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        raise _PrefillFailed(f"answered a body that is not a JSON object ({r.content[:80]!r})", failure=classify.GARBAGE)
    bad = classify.error_in_answer(answer)
    if bad is not None:
        code, err = bad
        if code in refusals:
            return httpx.Response(code, content=orjson.dumps({"error": err}),
                                  headers={"content-type": "application/json"})
        raise _PrefillFailed(f"answered HTTP 200 carrying an error ({str(err.get('message'))[:200]})", failure=code)
    return answer
