"""The OpenAI Responses API (``/v1/responses``) at the gateway: what differs from chat completions.

``POST /v1/responses`` takes the same path as chat (``openai_routes``: validate → annotate → admit →
``ProxyResponse``); this module supplies the parts that are this API's own:

* **validation** (``validate``): ``model``, ``input`` (a string or an array of items),
  ``instructions``, ``max_output_tokens``, ``stream``, ``previous_response_id``, ``user``; internal
  fields refused as for every path (``request.check_internal_fields``) plus ``request_id``, which on
  this route names the response an engine stores: a client choosing it could overwrite another
  client's stored response;
* **routing text** (``routing_body``): the request as the chat messages vLLM builds from it
  (``instructions`` → a system message, a string ``input`` → a user message, message items → their
  role and text), so prefix-aware routing tokenizes and hashes it like the engine's own prompt;
* **where a response lives** (``ResponseOwners``): vLLM keeps a response (``store``, background
  mode) only on the engine that created it, so ``GET /v1/responses/{id}``, ``POST
  /v1/responses/{id}/cancel`` and a new request naming ``previous_response_id`` must reach that
  engine. The gateway remembers response id → (worker, client key) in a bounded, expiring map with
  hashed keys (client-chosen text never grows memory or sits in it verbatim), shared between gateway
  replicas through Redis (one node or Redis Cluster) when the prefix index is there; an id it does not know — or one created by
  another client key — is a 404 naming the id, never a guess at a worker;
* **the stream's ending rules** are ``stream_protocol.ResponsesEvents`` (a terminal ``response.*``
  event, else ``event: error`` + ``response.failed``).

vLLM 0.32 serves ``POST /v1/responses``, ``GET /v1/responses/{id}`` (``?stream=true&starting_after=N``
replays a background response's events) and ``POST /v1/responses/{id}/cancel``; it has no DELETE
(docs/engines.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from orchestrator.errors import ApiError, InvalidRequest, NotFound
from orchestrator.gateway import request as rq
from orchestrator.gateway.failover import MAX_PENDING_EVENT, SseRecorder
from orchestrator.gateway.stream_protocol import ResponsesEvents, sse_fields
from orchestrator.redis_clients import ColdConnection, OffPathClient, close_quietly, cluster_client

if TYPE_CHECKING:
    from starlette.requests import Request

    from orchestrator.fleet.worker import Worker
    from orchestrator.gateway.runtime import GatewayRuntime

log = logging.getLogger(__name__)

RESPONSES = "/v1/responses"
# Fields of this route that steer an engine beyond the adapters' internal fields (module docstring).
RESPONSES_INTERNAL = frozenset({"request_id"})
MAX_RESPONSE_ID = 256  # longer ids are refused (vLLM's are "resp_" + 32 hex digits)
OWNERS_MAX_ENTRIES = 100_000  # ~100 bytes each: about 10 MB at most
OWNERS_TTL_S = 24 * 3600.0  # a response older than this is not routed to (its engine may have restarted anyway)
KEY_BYTES = 16
REDIS_TIMEOUT_S = 0.5  # a shared-map read or write waits at most this long
REDIS_RETRY_S = 5.0  # after a Redis failure the map is local-only this long
CONNECT_TIMEOUT_S = 5.0  # the start-up connection (``SharedOwners.connect``) waits at most this long
# A cluster call may first read the topology (CLUSTER SLOTS) and follow a MOVED: bounded as a whole.
CLUSTER_CALL_TIMEOUT_S = 2 * REDIS_TIMEOUT_S


# --- validation ------------------------------------------------------------------------------------

def validate(body: dict[str, Any]) -> str:
    """Check the fields Dyad relies on; returns the requested model name."""
    rq.check_internal_fields(body)
    if not RESPONSES_INTERNAL.isdisjoint(body):
        name = min(RESPONSES_INTERNAL.intersection(body))
        raise InvalidRequest(f"'{name}' is set by the engine on /v1/responses (it names the stored response); "
                             "a request must not carry it.", param=name, code="internal_field")
    model = rq._check_model(body)
    inp = body.get("input")
    if inp is None:
        raise rq._missing("input")
    if not isinstance(inp, (str, list)):
        raise rq._wrong("input", "a string or an array of input items", inp)
    if isinstance(inp, list):
        for i, item in enumerate(inp):
            _check_item(i, item)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise rq._wrong("instructions", "a string", instructions)
    mot = body.get("max_output_tokens")
    if mot is not None:
        if not rq._is_int(mot):
            raise rq._wrong("max_output_tokens", "an integer", mot)
        if mot < 1:
            raise InvalidRequest(f"'max_output_tokens' must be at least 1, got {mot}.", param="max_output_tokens",
                                 code="invalid_value")
    for name in ("stream", "background", "store"):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise rq._wrong(name, "a boolean", v)
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and not rq._is_number(v):
            raise rq._wrong(name, "a number", v)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise rq._wrong("user", "a string", user)
    prev = body.get("previous_response_id")
    if prev is not None:
        check_response_id(prev, "previous_response_id")
    return model


def _check_item(i: int, item: Any) -> None:
    """One ``input`` item's shape (not its vocabulary: item and part types are the engine's to know). A
    message (``type`` absent or ``"message"``) has a string ``role`` and ``content`` that is a string or an
    array of content-part objects; any item's ``type``, and a part's, is a string. (Before, a message whose
    content was a number or an object went to the engine, and one that answered 500 to it was retried on
    every worker.)"""
    if not isinstance(item, dict):
        raise rq._wrong(f"input[{i}]", "an object", item)
    kind = item.get("type")
    if kind is not None and not isinstance(kind, str):
        raise rq._wrong(f"input[{i}].type", "a string", kind)
    if kind not in (None, "message"):
        return
    role = item.get("role")
    if role is None:
        raise rq._missing(f"input[{i}].role")
    if not isinstance(role, str):
        raise rq._wrong(f"input[{i}].role", "a string", role)
    content = item.get("content")
    if content is None:
        raise rq._missing(f"input[{i}].content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise rq._wrong(f"input[{i}].content", "a string or an array of content parts", content)
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise rq._wrong(f"input[{i}].content[{j}]", "a content part object", part)
        if not isinstance(part.get("type", ""), str):
            raise rq._wrong(f"input[{i}].content[{j}].type", "a string", part["type"])


def check_response_id(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise rq._wrong(param, "a string", value)
    if not value or len(value) > MAX_RESPONSE_ID or not value.isprintable():
        raise InvalidRequest(f"'{param}' must be a response id (1 to {MAX_RESPONSE_ID} printable characters).",
                             param=param, code="invalid_value")
    return value


MAX_STARTING_AFTER = 2**53  # (a sequence number: JSON's exact integers)
_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def stored_query(query: Any, method: str) -> tuple[bool, dict[str, str]]:
    """``GET /v1/responses/{id}``'s query: (replay as a stream?, the parameters for the engine). ``stream`` is
    true/false/1/0 (any case) and ``starting_after`` an integer >= 0, else a 400 naming it; the engine gets
    them in canonical form, never the client's text (an engine that read ``stream=yes`` as true while the
    gateway read it as false sent a stream the gateway then judged a bad JSON answer: a 502). Other
    parameters are not forwarded; a cancel (POST) forwards none."""
    if method != "GET":
        return False, {}
    params: dict[str, str] = {}
    stream = False
    raw = query.get("stream")
    if raw is not None:
        value = _BOOLEANS.get(raw.strip().lower())
        if value is None:
            raise InvalidRequest(f"Query parameter 'stream' must be true or false, got {raw[:40]!r}.", param="stream",
                                 code="invalid_value")
        stream = value
        params["stream"] = "true" if value else "false"
    raw = query.get("starting_after")
    if raw is not None:
        text = raw.strip()
        if not text.isdigit() or not text.isascii() or int(text) > MAX_STARTING_AFTER:
            raise InvalidRequest(f"Query parameter 'starting_after' must be an event sequence number (an integer from "
                                 f"0 to {MAX_STARTING_AFTER}), got {raw[:40]!r}.", param="starting_after",
                                 code="invalid_value")
        params["starting_after"] = str(int(text))
    return stream, params


# --- routing text ----------------------------------------------------------------------------------

def _text_parts(content: Any) -> Any:
    """Message content as chat content: a string stays; input_text/output_text parts become text parts."""
    if isinstance(content, str) or not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
    return parts


def routing_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for this request (instructions, then the input), as far as routing
    needs them: items other than messages (tool calls, their outputs, reasoning) are left out."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:
            if isinstance(item, dict) and isinstance(item.get("role"), str) and item.get("type", "message") == "message":
                messages.append({"role": item["role"], "content": _text_parts(item.get("content"))})
    return messages


def routing_body(body: dict[str, Any]) -> dict[str, Any]:
    """A chat-shaped body for annotation (prompt length, block hashes, session key, token budget)."""
    out: dict[str, Any] = {"model": body.get("model"), "messages": routing_messages(body) or
                           [{"role": "user", "content": ""}]}
    for key in ("user", "chat_template_kwargs", "cache_salt"):
        if key in body:
            out[key] = body[key]
    if rq._is_int(body.get("max_output_tokens")):
        out["max_tokens"] = body["max_output_tokens"]
    return out


# --- where a response lives ------------------------------------------------------------------------

def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES).digest()


@dataclass(frozen=True)
class Owner:
    worker_id: str
    client: bytes  # hashed client key name
    expires: float


class ResponseOwners:
    """Response id → (worker, client) for the ids this gateway saw created; bounded (oldest out first)
    and expiring. Pure data: the caller passes ``now``. With ``shared`` (a ``SharedOwners``: Redis, when
    the prefix index is on Redis) entries are also written there, and ``find`` asks it for an id this
    replica did not see, so every gateway replica routes every response id."""

    def __init__(self, max_entries: int = OWNERS_MAX_ENTRIES, ttl_s: float = OWNERS_TTL_S,
                 shared: SharedOwners | None = None) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.shared = shared
        self._map: OrderedDict[bytes, Owner] = OrderedDict()
        self._writes: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        return len(self._map)

    def record(self, response_id: str, worker_id: str, client: str, now: float) -> asyncio.Future[None] | None:
        """Remember the id locally; with ``shared``, also write it there in the background and return
        that write (``RecordOwner`` lets the answer end only once it is through, bounded)."""
        key = _key(response_id)
        self._map.pop(key, None)
        owner = self._map[key] = Owner(worker_id, _key(client), now + self.ttl_s)
        while len(self._map) > self.max_entries:
            self._map.popitem(last=False)
        self._expire(now)
        if self.shared is None:
            return None
        task = asyncio.ensure_future(self.shared.put(key, owner, self.ttl_s))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

    async def find(self, response_id: str, client: str, now: float) -> str | None:
        """``lookup``, then the shared map for an id this replica did not see created."""
        found = self.lookup(response_id, client, now)
        if found is not None or self.shared is None:
            return found
        owner = await self.shared.get(_key(response_id))
        if owner is None or owner.client != _key(client):
            return None
        return owner.worker_id

    def lookup(self, response_id: str, client: str, now: float) -> str | None:
        """The worker that holds ``response_id`` for this client, or None (unknown, expired, another client's)."""
        self._expire(now)
        owner = self._map.get(_key(response_id))
        if owner is None or owner.expires <= now or owner.client != _key(client):
            return None
        return owner.worker_id

    def _expire(self, now: float) -> None:
        m = self._map
        while m:
            key, owner = next(iter(m.items()))
            if owner.expires > now:
                break
            del m[key]


class SharedOwners:
    """The owner map in Redis: ``<key_prefix>:resp:<digest>`` → ``<worker id> <client digest>``, expiring
    with the local entries. Best effort: while Redis fails, each replica knows what it saw itself.

    With ``cluster`` (``index.backend: redis_cluster``; ``url`` lists seed nodes) the key is
    ``<key_prefix>:resp:{<digest>}``: the digest is the hash tag, so one id is one key in one slot and
    ids spread over the nodes; every call is bounded by ``CLUSTER_CALL_TIMEOUT_S`` (redis-py would
    otherwise retry a dead node's slot with backoff while a request waits)."""

    def __init__(self, url: str, key_prefix: str, *, cluster: bool = False) -> None:
        self.url = url
        self.key_prefix = key_prefix
        self.cluster = cluster
        self._redis: Any = None
        self._off: OffPathClient | None = None  # (a single node: connections opened off the request path)
        self._down_until = 0.0

    def _client(self) -> Any:
        if self._redis is None:
            if self.cluster:  # seeds "rediss://h1:p1,h2:p2?ssl_ca_certs=..." (orchestrator/redis_clients.py)
                self._redis = cluster_client(self.url, REDIS_TIMEOUT_S)
            else:  # (connections opened off the request path: a call waits only on an open one)
                self._off = OffPathClient(self.url, call_timeout_s=REDIS_TIMEOUT_S, retry_s=REDIS_RETRY_S,
                                          name="response owners")
                self._redis = self._off.redis
        return self._redis

    async def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Open the connections before a request needs them (the composition root awaits it at start). A
        client connects on its first call: a cluster client first learns the nodes, then opens a connection
        (TLS too, with ``rediss://``) to the node of the key. On a loaded machine that can outlast one call's
        bound (``CLUSTER_CALL_TIMEOUT_S``), and the map would then count Redis as down for
        ``REDIS_RETRY_S``: the first ids created after start would be known to this replica only. Best
        effort: a Redis that does not answer here is tried again by the first call. (On a single node every
        later connection is opened off the request path too: ``redis_clients.OffPathClient``.)"""
        client = self._client()
        if self._off is not None:
            await self._off.connect(timeout_s)
            return
        try:
            await asyncio.wait_for(client.ping(target_nodes=client.PRIMARIES), timeout_s)
        except Exception as e:  # noqa: BLE001 - best effort (see the class docstring)
            log.warning("response owners: Redis did not answer at start (%s: %s); tried again on first use",
                        type(e).__name__, e)

    def _name(self, key: bytes) -> str:
        if self.cluster:
            return f"{self.key_prefix}:resp:{{{key.hex()}}}"
        return f"{self.key_prefix}:resp:{key.hex()}"

    async def _bounded(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._off is not None:
            return await self._off.call(fn, *args, **kwargs)
        return await asyncio.wait_for(fn(*args, **kwargs), CLUSTER_CALL_TIMEOUT_S)

    def _failed(self, e: Exception) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() >= self._down_until:
            log.warning("response owners: Redis unreachable (%s: %s); this replica routes the ids it saw itself",
                        type(e).__name__, e)
        self._down_until = loop.time() + REDIS_RETRY_S

    async def put(self, key: bytes, owner: Owner, ttl_s: float) -> None:
        if asyncio.get_running_loop().time() < self._down_until:
            return
        try:
            await self._bounded(self._client().set, self._name(key), f"{owner.worker_id} {owner.client.hex()}",
                                ex=max(1, int(ttl_s)))
        except ColdConnection:
            pass  # (no open connection yet: one is being opened off the path; this id stays local)
        except Exception as e:  # noqa: BLE001 - best effort (see the class docstring)
            self._failed(e)

    async def get(self, key: bytes) -> Owner | None:
        if asyncio.get_running_loop().time() < self._down_until:
            return None
        try:
            raw = await self._bounded(self._client().get, self._name(key))
        except ColdConnection:
            return None
        except Exception as e:  # noqa: BLE001 - best effort
            self._failed(e)
            return None
        if raw is None:
            return None
        # (the client digest is hex, the worker id any text: split at the last space - a worker id may hold spaces)
        worker_id, _, client = (raw.decode() if isinstance(raw, bytes) else str(raw)).rpartition(" ")
        try:
            return Owner(worker_id, bytes.fromhex(client), float("inf"))
        except ValueError:
            return None

    async def close(self) -> None:
        client, self._redis = self._redis, None
        off, self._off = self._off, None
        if off is not None:
            await off.aclose()
        else:
            await close_quietly(client)


def build_owners(config: Any) -> ResponseOwners:
    """The gateway's response-owner map (the composition root calls this): shared through Redis when the
    prefix index lives there (``index.backend: redis`` or ``redis_cluster``), else local to this process."""
    index = config.index
    shared = None
    if index.backend in ("redis", "redis_cluster"):
        shared = SharedOwners(index.redis_url, index.key_prefix, cluster=index.backend == "redis_cluster")
    return ResponseOwners(shared=shared)


async def connect_owners(rt: Any) -> None:
    """Connect the shared owner map, when there is one, before the gateway takes requests."""
    owners = getattr(rt, "response_owners", None)
    if owners is not None and owners.shared is not None:
        await owners.shared.connect()


async def close_owners(rt: Any) -> None:
    owners = getattr(rt, "response_owners", None)
    if owners is not None and owners.shared is not None:
        await owners.shared.close()


def owners_of(rt: GatewayRuntime) -> ResponseOwners:
    """The runtime's map (built by the composition root; made here for a runtime built otherwise)."""
    owners = getattr(rt, "response_owners", None)
    if owners is None:
        owners = build_owners(rt.config)
        rt.response_owners = owners  # type: ignore[attr-defined]
    return owners


def not_found(response_id: str, param: str = "response_id") -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found (this gateway routes a response id only to the "
                    "engine that created it, for the client key that created it).", param=param,
                    code="response_not_found")


async def owner_worker(rt: GatewayRuntime, response_id: str, client: str, param: str = "response_id") -> Worker:
    """The worker holding ``response_id`` (404 naming the id when unknown, or when that worker is gone)."""
    wid = await owners_of(rt).find(response_id, client, rt.clock.now())
    worker = rt.fleet.get(wid) if wid is not None else None
    if worker is None:
        raise not_found(response_id, param)
    return worker


async def continuation_worker(rt: GatewayRuntime, response_id: str, client: str, model: str) -> Worker:
    """The worker a request naming ``previous_response_id`` must go to (``owner_worker``); a 503 naming the
    field when that worker takes no new requests now (draining, unhealthy, not serving ``model``): only it has
    the response, and the router's own refusal ("no worker can serve model ...") would send the client to retry
    what may never work again."""
    worker = await owner_worker(rt, response_id, client, "previous_response_id")
    if all(w.id != worker.id for w in rt.router.candidates(model)):
        retry = rt.config.gateway.retry_after_s
        raise ApiError(f"The engine holding response '{response_id}' ({worker.id}) takes no new requests now "
                       f"(it is {worker.state.value}); no other engine has that response. Retry later, or start the "
                       "conversation again without previous_response_id.", status=503, type="service_unavailable",
                       param="previous_response_id", code="response_engine_unavailable",
                       headers={"Retry-After": str(max(1, retry))})
    return worker


def response_id_in(body: bytes, stream: bool) -> str | None:
    """The response id of an answer: the JSON object's ``id``, or a stream's first event carrying
    ``response.id`` (``response.created``)."""
    if not stream:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        rid = obj.get("id") if isinstance(obj, dict) and obj.get("object") == "response" else None
        return rid if isinstance(rid, str) else None
    for event in body.split(b"\n\n"):
        _, data = sse_fields(event)
        if not data or b'"response"' not in data:
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        resp = obj.get("response") if isinstance(obj, dict) else None
        if isinstance(resp, dict) and isinstance(resp.get("id"), str):
            return str(resp["id"])
    return None


class StreamIdScan:
    """A stream's response id, found as its bytes pass: each whole event is read once (``response_id_in`` on the
    events completed since the last call), at most ``limit`` bytes in all. (Reading everything seen so far on
    every chunk cost the square of the preamble: 64 KB of 3-byte comment events from an engine was ~20 000
    passes over up to 64 KB, seconds of the event loop.) ``scanned``: bytes handed to ``response_id_in``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen = 0
        self.scanned = 0
        self._tail = bytearray()  # the incomplete last event

    @property
    def exhausted(self) -> bool:
        return self.seen >= self.limit

    def feed(self, data: bytes) -> str | None:
        self.seen += len(data)
        start = max(0, len(self._tail) - 1)  # (a boundary ends in what is new: the rest was searched)
        # (CR LF line ends as LF: JSON data holds no raw CR, and a CR LF split between chunks is one CR less)
        self._tail.extend(data.replace(b"\r", b"") if b"\r" in data else data)
        end = self._tail.rfind(b"\n\n", start)
        if end < 0:
            return None
        events = bytes(self._tail[:end + 2])
        del self._tail[:end + 2]
        self.scanned += len(events)
        return response_id_in(events, True)


class RecordOwner:
    """Wraps a ``ProxyResponse`` for ``POST /v1/responses``: the response id in its answer is recorded
    with the worker that produced it (``ResponseOwners``). Reads only: the bytes pass unchanged. The
    shared write starts as soon as the id is seen; the answer's last message waits for it (one Redis
    round trip, bounded by the shared map's timeouts; no wait while Redis is known down), so a client
    that sends ``GET /v1/responses/{id}`` to another replica right after the answer finds the id."""

    SCAN_LIMIT = 1 << 16  # a stream's id is in its first event; stop looking after this many bytes

    def __init__(self, proxy: Any, client: str) -> None:
        self.proxy = proxy
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.proxy, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        proxy = self.proxy
        scan = StreamIdScan(self.SCAN_LIMIT)
        state = {"status": 0, "found": False}
        pending: list[asyncio.Future[None]] = []

        async def watching_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif (message["type"] == "http.response.body" and state["status"] == 200 and not state["found"]
                  and not scan.exhausted):
                body = message.get("body", b"")
                stream = proxy.call.stream
                rid = scan.feed(body) if stream else response_id_in(body, False)
                if rid is not None or not stream:
                    state["found"] = True
                    attempt = proxy.attempt
                    if rid is not None and attempt is not None:
                        write = owners_of(proxy.rt).record(rid, attempt.worker_id, self.client, proxy.rt.clock.now())
                        if write is not None:
                            pending.append(write)
            if pending and message["type"] == "http.response.body" and not message.get("more_body", False):
                await asyncio.wait(pending)  # never raises; put() is best effort and bounded
                pending.clear()
            await send(message)

        await proxy(scope, receive, watching_send)


# --- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel ----------------------------------------

def limited(handler: Callable[[Request], Awaitable[Any]], endpoint: str) -> Callable[[Request], Awaitable[Any]]:
    """``handler`` (a stored-response route) behind the intake every other ``/v1`` request passes: refused
    while the gateway drains (503 + Retry-After, ``shutdown.py``; taken in, it is one the drain waits
    for), then the client's limits: one request from its key's requests-per-minute bucket
    (``RateLimiter.check`` with no token cost: nothing is generated) and a place in
    ``limits.max_concurrent_per_client``, held until the answer's last byte (a replayed stream
    included). A refusal is the OpenAI-style error with ``Retry-After``, in the access log, before the
    owner map or an engine is asked; an answer carries the ``x-ratelimit-*`` headers."""

    async def route(request: Request) -> Any:
        rt: GatewayRuntime = request.app.state.runtime
        intake = rt.intake
        key = client = None
        try:
            rt.shutdown.check()
            identity = intake.authenticate(request)
            client = identity.name
            entering = intake.client_key(identity, request)
            intake.enter(entering)  # (raises without taking a place)
            key = entering
            headers = await intake.limiter.check(identity, None)
        except BaseException as err:
            intake.leave(key)
            if isinstance(err, ApiError):
                _refused(rt, request, endpoint, err, client)
            raise
        rt.shutdown.started()

        def done() -> None:
            intake.leave(key)
            rt.shutdown.finished()

        try:
            response = await handler(request)
        except BaseException:
            done()
            raise
        return _Counted(response, headers, done)

    route.__name__ = route.__qualname__ = getattr(handler, "__name__", "stored_response")
    route.__doc__ = handler.__doc__
    return route


def _refused(rt: GatewayRuntime, request: Request, endpoint: str, err: ApiError, client: str | None) -> None:
    from orchestrator.gateway.openai_routes import request_id_of
    from orchestrator.telemetry.access_log import AccessRecord

    record = AccessRecord(request_id=request_id_of(request), endpoint=endpoint, status=err.status,
                          error_class=err.code if isinstance(err.code, str) else type(err).__name__,
                          client_key_id=client)
    rt.access_log.emit(record)


class _Counted:
    """An answer (any ASGI response) with the ``x-ratelimit-*`` headers added, that ends the client's
    concurrent count when it is over, however it ends."""

    def __init__(self, inner: Any, headers: list[tuple[bytes, bytes]], done: Callable[[], None]) -> None:
        self.inner, self.headers, self.done = inner, headers, done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start" and self.headers:
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        try:
            await self.inner(scope, receive, send_with_headers)
        finally:
            self.done()


async def relay_stream(send: Any, upstream: httpx.Response, extra_headers: list[tuple[bytes, bytes]]) -> bool:
    """Relay a replayed Responses stream (``GET ...?stream=true``) with the same ending rule as any
    Responses stream: a terminal event, else ``event: error`` + ``response.failed``. True when complete."""
    protocol = ResponsesEvents()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), *extra_headers]})
    # (whole events, any of SSE's line ends; of what was sent it keeps only what an error ending reads — the first
    # chunk, with the response object, and the latest with data, with the last sequence number: limit 0, so a
    # stored stream of any length holds two chunks)
    recorder = SseRecorder(protocol, limit=0)
    failure = None
    try:
        async for chunk in upstream.aiter_raw():
            out = recorder.split(chunk)
            if not out:
                if len(recorder.pending) > MAX_PENDING_EVENT:
                    failure = f"the engine sent {len(recorder.pending)} bytes without an SSE event end"
                    break
                continue
            if out[:1] not in (b"e", b"d", b":", b"i", b"r"):
                failure = "the engine sent bytes that are not server-sent events"
                break
            recorder.record(out)
            await send({"type": "http.response.body", "body": out, "more_body": True})
            if protocol.ended(out):
                break
        else:
            failure = f"the engine ended the stream without {protocol.end_marker}"
    except httpx.HTTPError as e:
        failure = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:  # the gateway's shutdown (a client that leaves is not a cancellation)
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        failure = "the gateway stopped serving this request (it is shutting down)"
    ending = b""
    if failure is not None:
        ending = protocol.error_ending(f"the engine stream broke ({failure})", "upstream_stream_failed",
                                       recorder.sent)
    await send({"type": "http.response.body", "body": ending, "more_body": False})
    return failure is None
