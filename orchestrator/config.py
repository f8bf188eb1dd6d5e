"""Dyad's configuration: one YAML file, validated by pydantic, with ``DYAD_*`` environment overrides.

Every section has working defaults, so an empty file (or none) is a valid in-memory setup.
Environment overrides use ``__`` for nesting: ``DYAD_GATEWAY__PORT=9000``,
``DYAD_ROUTER__POLICY=kv_aware``, ``DYAD_INDEX__BACKEND=redis``; values are parsed as YAML
scalars/lists (``DYAD_GATEWAY__API_KEYS='[k1, k2]'``). List items are addressed by index and may be
created that way (``DYAD_WORKERS__0__URL=...``, ``DYAD_WORKERS__1__URL=...``); a variable that does not
fit the shape is a ``ConfigError`` naming it. Command-line flags (``dyad serve --worker ...``) override
both the file and the environment.

An invalid file raises ``ConfigError`` whose message lists every bad field; the CLI prints it and
exits with status 2.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from adapters.base import EngineKind, Role


class ConfigError(Exception):
    """The configuration is invalid; ``str(e)`` names every bad field."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice. PyYAML keeps the last one
    silently, so a section written twice (two ``gateway:`` blocks, a worker entry with two ``role:``
    lines) lost every setting of the first without a word."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # ``<<: *anchor`` merges: keys written beside it override those, as YAML intends
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping says so
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {first + 1}): each key may appear once",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (``yaml.YAMLError`` naming the key and lines), and a
    document nested deeper than Python's recursion allows (``yaml.YAMLError``, not a ``RecursionError`` whose
    traceback ended ``dyad serve``'s start-up)."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("nested too deeply to read (lists or mappings inside one another, hundreds "
                             "of levels down): a configuration is a few levels deep") from None


class _Section(BaseModel):
    # No setting is a measure without end: ``.inf`` / ``.nan`` (YAML) or ``inf`` (an environment override)
    # would pass ``gt=0`` and then make a loop sleep forever, a deadline never fire or a comparison always
    # false. Every float field refuses them, naming the field ("Input should be a finite number").
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelConfig(_Section):
    """A served model. Workers name the models they serve; the router may tokenize locally."""

    name: str = Field(..., description="Model name clients send in `model`")
    tokenizer: str | None = Field(None, description="Directory with tokenizer files for router-side tokenization")
    block_size: int = Field(32, ge=1, description="KV block size in tokens (must match the engines)")
    aliases: list[str] = Field(default_factory=list, description="Other names clients may use for this model")


class KvEventsConfig(_Section):
    """Where a worker publishes KV-cache events (vLLM --kv-events-config)."""

    endpoint: str = Field(..., description="ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    replay_endpoint: str | None = Field(None, description="ZMQ replay endpoint for missed batches (vLLM replay_endpoint)")
    topic: str = Field("kv-events", description="ZMQ topic the engine publishes on")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        # the subscriber's connect refused anything else inside a background task: no KV events, and no word why
        if v is None or any(v.startswith(t) and len(v) > len(t) for t in ("ipc://", "inproc://")):
            return v
        if v.startswith("tcp://"):
            host, sep, port = v[len("tcp://"):].rpartition(":")
            if sep and host and port.isdigit() and 0 < int(port) < 65536:
                return v
        raise ValueError("must be tcp://HOST:PORT (as in the engine's --kv-events-config, e.g. tcp://*:5557) "
                         "or ipc://PATH")


class WorkerConfig(_Section):
    """One engine instance Dyad routes to."""

    url: str = Field(..., description="Engine base URL, http(s)://host:port")
    id: str | None = Field(None, description="Stable worker id (default w<index>)")
    engine: EngineKind = Field(EngineKind.VLLM, description="Wire dialect: vllm, sglang, or sim (simulator, vLLM dialect)")
    role: Role = Field(Role.BOTH, description="prefill, decode, or both (aggregated)")
    models: list[str] = Field(default_factory=list, description="Models served; empty = ask the engine")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels, shown by GET /admin/workers "
                                                                       "(not used for routing)")
    kv_events: KvEventsConfig | None = None
    bootstrap_port: int | None = Field(None, description="SGLang P/D bootstrap port (default 8998)")
    api_key: str | None = Field(None, description="Bearer key Dyad presents to the engine")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError("must start with http:// or https://")
        # the address must be usable: a host, a port in range, nothing a request line cannot carry
        # (a half-written workers file or a typo otherwise becomes a worker no probe can ever reach)
        if any(c.isspace() or ord(c) < 32 for c in v):
            raise ValueError("must not contain spaces or control characters")
        parts = urlsplit(v)
        if not parts.hostname:
            raise ValueError("must name a host (http://host:port)")
        # the gateway appends /v1/... to the URL: a query or fragment would swallow it, and credentials
        # in it would be shown wherever the URL is (the admin API, /ui, logs, a file worker's id)
        if "@" in parts.netloc:
            raise ValueError("must not carry credentials (user:password@): set the worker's api_key instead")
        if parts.query or parts.fragment or v.endswith(("?", "#")):
            raise ValueError("must not have a query string or fragment (?... or #...): a base URL, "
                             "http(s)://host:port[/path]")
        try:
            port = parts.port  # raises on a port that is not a number in 0..65535
        except ValueError:
            port = 0
        if port == 0:  # (port 0 is no address a probe can reach either)
            raise ValueError("has an invalid port (a number in 1..65535)")
        return v.rstrip("/")


SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where a pod's service account is mounted


def _http_base_url(v: str | None) -> str | None:
    """A server the gateway calls (an API server, Prometheus): http(s)://host[:port][/path], or a ValueError saying so
    (``localhost:9090`` passed, and every call then failed in a background loop with 'unsupported protocol')."""
    if v is None:
        return v
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host (http(s)://host:port)")
    return v


class KubernetesApiConfig(_Section):
    """How discovery reaches the Kubernetes API server (the planner's actuator has its own
    ``planner.kubernetes_*`` settings).

    Empty = in-cluster: ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` with the pod's
    service-account token and CA. Set ``api_url`` (and ``token``) to point at another server."""

    api_url: str | None = Field(None, description="API server URL (None: in-cluster from KUBERNETES_SERVICE_HOST)")
    token: str | None = Field(None, description="Bearer token (overrides token_file; for tests and kubectl proxy)")
    token_file: str | None = Field(f"{SA_DIR}/token", description="Bearer token file, re-read as it rotates "
                                                                   "(None: no auth)")
    ca_file: str | None = Field(f"{SA_DIR}/ca.crt", description="CA bundle of the API server (used when the "
                                                                 "file exists; else the system CAs)")
    namespace: str | None = Field(None, description="Namespace (None: the pod's own, else default)")

    _api_url = field_validator("api_url")(_http_base_url)


class FileDiscoveryConfig(_Section):
    """``discovery.source: file``: workers listed in a YAML/JSON file (a list of worker entries, or a
    mapping with ``workers:``), re-read when it changes."""

    path: str | None = Field(None, description="The workers file (same fields as `workers` entries)")
    interval_s: float = Field(1.0, gt=0, description="Seconds between checks of the file for changes")


class KubernetesDiscoveryConfig(_Section):
    """``discovery.source: kubernetes``: engine pods found by a label selector per role (list + watch).

    Only Ready pods become workers; a pod marked ``draining_annotation`` (by the planner's actuator)
    or being deleted takes no new requests; its in-flight ones finish."""

    api: KubernetesApiConfig = Field(default_factory=KubernetesApiConfig)
    selectors: dict[Role, str] = Field(
        default_factory=dict, description="Role → pod label selector, e.g. prefill: "
                                          "'app.kubernetes.io/name=vllm,dyad.dev/pool=prefill'")
    role_label: str | None = Field("dyad.dev/role", description="Pod label whose value (prefill/decode/both) "
                                                                "overrides the selector's role; a pod whose label "
                                                                "has another value is not used")
    port: int | str = Field("http", description="Engine HTTP port: a container port name or a number")
    scheme: Literal["http", "https"] = Field("http", description="Engine URL scheme")
    engine: EngineKind = Field(EngineKind.VLLM, description="Wire dialect of the discovered engines")
    models: list[str] = Field(default_factory=list, description="Models they serve; empty = ask the engine")
    kv_events_port: str | None = Field(None, description="Container port name of the engine's ZMQ KV-event "
                                                          "PUB socket (e.g. kv-events); None = no KV events")
    kv_replay_port: str | None = Field(None, description="Container port name of its replay socket")
    bootstrap_port: int | str | None = Field(None, description="SGLang P/D: the prefill pods' bootstrap port (a "
                                                               "container port name or a number); None = 8998")
    kv_events_topic: str = Field("kv-events", description="KV-event topic")
    draining_annotation: str = Field("dyad.dev/draining", description="Pod annotation that marks a pod "
                                                                      "draining (value \"true\")")
    standby_annotation: str = Field("dyad.dev/standby", description="Pod annotation that marks a pod warm "
                                                                    "standby (value \"true\"): health-checked, "
                                                                    "not routed to (the planner's actuator sets it)")
    watch_timeout_s: int = Field(300, ge=1, description="Server-side timeout of one watch request "
                                                        "(the watch then resumes from its resourceVersion)")

    @model_validator(mode="after")
    def _port(self) -> KubernetesDiscoveryConfig:
        if isinstance(self.port, str) and self.port.isdigit():
            self.port = int(self.port)
        if isinstance(self.bootstrap_port, str) and self.bootstrap_port.isdigit():
            self.bootstrap_port = int(self.bootstrap_port)
        return self


class DiscoveryConfig(_Section):
    """Where workers come from besides the static ``workers`` list (which always stays)."""

    source: Literal["static", "file", "kubernetes"] = Field(
        "static", description="static (the `workers` list only), file, or kubernetes")
    file: FileDiscoveryConfig = Field(default_factory=FileDiscoveryConfig)
    kubernetes: KubernetesDiscoveryConfig = Field(default_factory=KubernetesDiscoveryConfig)
    remove_grace_s: float = Field(120.0, ge=0, description="A worker that left the source stops taking "
                                                           "requests at once; it leaves the registry when "
                                                           "its in-flight requests finish, or after this")

    @model_validator(mode="after")
    def _source(self) -> DiscoveryConfig:
        if self.source == "file" and not self.file.path:
            raise ValueError("file.path: required for discovery source file")
        if self.source == "kubernetes" and not self.kubernetes.selectors:
            raise ValueError("kubernetes.selectors: required for discovery source kubernetes (a selector per role)")
        return self


PolicyName = Literal["round_robin", "least_load", "power_of_two", "kv_aware", "random"]


class TierCostConfig(_Section):
    """What a block cached outside GPU memory is worth, from modelled bandwidth (``orchestrator/kv/tier_cost.py``).

    A host-tier hit is not free: the engine copies the block back into GPU memory instead of computing
    it. Its credit is ``1 - reload time / prefill time`` per token, i.e.
    ``1 - prefill_tokens_per_s * kv_bytes_per_token / reload bandwidth`` (0 when reloading is slower
    than recomputing). Set for the tiers the engines have; they override ``tier_weights`` for those.
    """

    kv_bytes_per_token: int = Field(..., gt=0, description="KV bytes per token of the model (2 × layers × "
                                    "KV heads × head dim × dtype bytes)")
    prefill_tokens_per_s: float = Field(..., gt=0, description="Engine prefill throughput, tokens/s")
    host_reload_bytes_per_s: float | None = Field(None, gt=0, description="Host → GPU copy bandwidth "
                                                  "(vLLM CPU offloading), bytes/s")
    disk_read_bytes_per_s: float | None = Field(None, gt=0, description="Disk/remote tier → GPU bandwidth, bytes/s")


TIER_WEIGHTS = {"device": 1.0, "host": 0.75, "disk": 0.25}  # router.kv_aware.tier_weights' defaults


class KvAwareConfig(_Section):
    """Parameters of the ``kv_aware`` policy (prefix overlap vs load)."""

    prefill_load_weight: float = Field(1.0, ge=0, description="Weight of uncached + queued prefill blocks in the cost")
    decode_load_weight: float = Field(0.1, ge=0, description="Weight of active decode blocks in the cost (a "
                                      "decode step reads a block far faster than a prefill computes one)")
    recompute_weight: float = Field(2.0, ge=0, description="Weight of this request's own uncached blocks relative "
                                    "to queued ones (> 1: recomputing a prefix another worker holds also costs "
                                    "the fleet, not only this request's wait)")
    temperature: float = Field(0.0, ge=0, description="0 = pick the cheapest worker; > 0 = softmax over normalized costs")
    tier_weights: dict[str, float] = Field(default_factory=lambda: dict(TIER_WEIGHTS),
                                           description="Credit per cached block by tier: device, host, disk (a tier "
                                                       "left out keeps its default)")
    tier_cost: TierCostConfig | None = Field(None, description="Derive host/disk credit from reload "
                                             "bandwidth vs prefill throughput (overrides tier_weights)")
    session_header: str = Field("x-session-id", description="Request header naming a session for affinity")
    session_ttl_s: float = Field(600.0, gt=0, description="How long a session sticks to its worker")

    @field_validator("tier_weights")
    @classmethod
    def _tier_weights(cls, v: dict[str, float]) -> dict[str, float]:
        # {host: 0.5} replaced the whole map: device hits then earned no credit at all (kv_aware blind to the GPU
        # cache), and a name like gpu/cpu (vLLM's media) was silently ignored
        unknown = sorted(set(v) - set(TIER_WEIGHTS))
        if unknown:
            raise ValueError(f"unknown tier {', '.join(unknown)}: the tiers are {', '.join(TIER_WEIGHTS)}")
        negative = sorted(k for k, w in v.items() if w < 0)
        if negative:
            raise ValueError(f"{', '.join(negative)}: a credit is >= 0")
        return {**TIER_WEIGHTS, **v}


class RouterConfig(_Section):
    """How each request picks its worker."""

    policy: PolicyName = Field("round_robin", description="round_robin, least_load, power_of_two, random or kv_aware")
    seed: int | None = Field(None, description="Seed for randomized policies (reproducible runs)")
    kv_aware: KvAwareConfig = Field(default_factory=KvAwareConfig)
    debug_headers: bool = Field(False, description="Add x-dyad-worker / x-dyad-predicted-cached-tokens to responses")


class GatewayTlsConfig(_Section):
    """TLS for clients talking to the gateway (uvicorn's ssl options). Both files set = HTTPS only."""

    cert_file: str | None = Field(None, description="PEM certificate chain the gateway presents")
    key_file: str | None = Field(None, description="PEM private key of cert_file")
    client_ca_file: str | None = Field(
        None, description="PEM CA bundle for client certificates (mutual TLS); unset = no client certificates")
    require_client_cert: bool = Field(
        True, description="With client_ca_file: refuse connections without a valid client certificate "
                          "(false = verify one when offered)")

    @model_validator(mode="after")
    def _pair(self) -> GatewayTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file: set both (HTTPS) or neither (plain HTTP)")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("client_ca_file: needs cert_file and key_file (client certificates need TLS)")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class EngineTlsConfig(_Section):
    """TLS towards ``https://`` workers: which CA to trust and the client certificate to present (mTLS)."""

    ca_file: str | None = Field(None, description="PEM CA bundle that signed the engines' certificates "
                                                  "(unset = the system's trust store)")
    cert_file: str | None = Field(None, description="PEM client certificate for engines that require one")
    key_file: str | None = Field(None, description="PEM private key of cert_file")
    verify: bool = Field(True, description="Verify engine certificates (false only for throwaway test setups)")

    @model_validator(mode="after")
    def _pair(self) -> EngineTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file: set both (client certificate) or neither")
        return self


class GatewayConfig(_Section):
    """The OpenAI-compatible HTTP front door."""

    host: str = Field("127.0.0.1", description="Listen address")
    port: int = Field(8000, ge=0, le=65535, description="Listen port (0 = any free port)")
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1, description="Larger request bodies get 413")
    max_answer_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Longest non-streamed answer read from an engine; a longer one is "
                                               "cut off and the client gets 502 naming this limit (a stream is "
                                               "relayed event by event, each event at most 1 MiB; "
                                               "what it keeps to be continued elsewhere is at most this: a longer "
                                               "stream that breaks ends with an error event)")
    api_keys: list[str] = Field(default_factory=list, description="Client keys; empty = no client auth")
    admin_token: str | None = Field(None, description="Bearer token for /admin/*; unset = admin API disabled")
    connect_timeout_s: float = Field(5.0, gt=0, description="Connecting to an engine")
    first_byte_timeout_s: float = Field(300.0, gt=0, description="Waiting for an engine's response headers")
    request_timeout_s: float = Field(600.0, gt=0, description="Whole non-streamed request")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds on 503/429 answers")
    max_attempts: int = Field(3, ge=1, description="Tries on different workers before the first byte")
    max_connections: int | None = Field(
        None, ge=1, description="Open client connections; past it a new connection gets 503 naming the limit "
                                "and is closed (None = unbounded)")
    data_plane: Literal["python", "native"] = Field(
        "python", description="What carries the bytes of the OpenAI routes: 'python' (the gateway's own HTTP "
                              "server), or 'native' (compiled code, built by scripts/build_dataplane.sh; Python "
                              "still decides every request, and serves everything else behind it on a loopback "
                              "port: docs/architecture.md, 'The native data plane'). 'native' has no TLS for clients")
    tls: GatewayTlsConfig = Field(default_factory=GatewayTlsConfig, description="HTTPS for clients")
    engine_tls: EngineTlsConfig = Field(default_factory=EngineTlsConfig,
                                        description="TLS settings for https:// workers")

    @model_validator(mode="after")
    def _native_without_tls(self) -> GatewayConfig:
        if self.data_plane == "native" and self.tls.cert_file is not None:
            raise ValueError("data_plane 'native' does not terminate TLS: use 'python' with tls, or put a TLS "
                             "terminator in front")
        return self


PriorityName = Literal["high", "normal", "low"]
PRIORITIES: tuple[str, ...] = ("high", "normal", "low")  # served in this order when requests queue


class ApiKeyConfig(_Section):
    """One client key, stored as the SHA-256 of the key (``dyad hash-key`` prints it), never in clear."""

    name: str = Field(..., min_length=1, description="Who holds the key (logs, metrics, errors)")
    sha256: str = Field(..., description="Lower-case hex SHA-256 of the key")
    models: list[str] = Field(default_factory=list, description="Models the key may use; empty = every model")
    rpm: int | None = Field(None, ge=1, description="Requests per minute (token bucket); None = limits.default_rpm")
    tpm: int | None = Field(None, ge=1, description="Tokens per minute, prompt + max_tokens x n (output beyond it charged after the answer); None = limits.default_tpm")
    priority: PriorityName = Field("normal", description="Default and highest priority class of the key")

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        v = v.strip().lower()
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError("must be 64 hex characters (the SHA-256 of the key; see `dyad hash-key`)")
        return v


class AuthConfig(_Section):
    """Client authentication for /v1/*. No keys here and no gateway.api_keys = open gateway."""

    keys: list[ApiKeyConfig] = Field(default_factory=list, description="Hashed client keys")

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        names: set[str] = set()
        hashes: set[str] = set()
        for i, k in enumerate(self.keys):
            if k.name in names:
                raise ValueError(f"keys.{i}.name: duplicate key name '{k.name}'")
            if k.sha256 in hashes:
                raise ValueError(f"keys.{i}.sha256: the same key is listed twice")
            names.add(k.name)
            hashes.add(k.sha256)
        return self


def redis_url_problem(url: str, cluster: bool) -> str | None:
    """Why the gateway could not use this Redis URL, or None. Parsed the way the gateway parses it when it
    connects (one node: redis-py's ``parse_url``; a cluster: ``redis_clients.cluster_options``), so a URL
    that passes here does not fail the gateway's start-up. The URL is not repeated (it may hold a password)."""
    from redis.asyncio.connection import parse_url

    from orchestrator.redis_clients import cluster_options

    if not cluster and "," in urlsplit(url).netloc:
        return ("must name one Redis node (redis://host:port[/db]); a seed list host:port,host:port is for "
                "index.backend: redis_cluster")
    try:
        if cluster:
            cluster_options(url)
        else:
            parse_url(url)
    except ValueError as e:
        shape = ("redis://host:port[,host:port...] or rediss://... (TLS)" if cluster
                 else "redis://host:port[/db], rediss://host:port (TLS) or unix:///path/to/socket")
        return f"not a usable Redis URL ({e}): write {shape}"
    return None


class LimitsConfig(_Section):
    """Overload protection: per-key rate limits, priority queueing and TTFT-based admission control."""

    backend: Literal["memory", "redis"] = Field(
        "memory", description="Where rate-limit buckets live: this process, or Redis (shared by replicas; "
                              "local buckets take over while Redis is unreachable)")
    redis_url: str | None = Field(None, description="The Redis node for the buckets (None = index.redis_url; "
                                                   "required with index.backend: redis_cluster)")
    key_prefix: str = Field("dyad", description="Prefix of the Redis bucket keys")
    default_rpm: int | None = Field(None, ge=1, description="Requests per minute for keys without rpm "
                                                            "(and for anonymous clients); None = unlimited")
    default_tpm: int | None = Field(None, ge=1, description="Tokens per minute for keys without tpm; None = unlimited")
    priority_header: str = Field("x-dyad-priority", description="Header a client uses to pick a priority "
                                                                "class at or below its key's")
    max_inflight_per_worker: int | None = Field(
        None, ge=1, description="Requests the gateway dispatches per healthy worker before it queues "
                                "(None = never queue)")
    queue_size: int = Field(256, ge=0, description="Requests that may wait for a slot, all priorities together")
    queue_timeout_s: float = Field(30.0, gt=0, description="Longest wait in the queue before a 503")
    ttft_slo_s: float | None = Field(
        None, gt=0, description="Admission control: refuse a request when its predicted time to first token "
                                "exceeds this on every candidate worker (None = off)")
    prefill_tokens_per_s: float | None = Field(
        None, gt=0, description="Prefill throughput per worker for the TTFT prediction (None = learn it "
                                "from the engines' TTFT and prompt-length histograms)")
    reject_status: Literal[429, 503] = Field(503, description="Status for admission and queue refusals")
    max_concurrent_per_client: int | None = Field(
        None, ge=1, description="Requests one client (API key; the client address when the gateway is open) may "
                                "have in the gateway at once, queued or served; past it 429 naming the limit")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("backend") == "redis":
            problem = redis_url_problem(v, cluster=False)
            if problem:
                raise ValueError(problem)
        return v


class HealthConfig(_Section):
    """Background health probes; a worker leaves rotation after failure_threshold misses in a row, unless it served traffic within failure_threshold x (interval_s + timeout_s), the time the loop takes to mark down an engine whose probes time out (a completed request, a stream delivering tokens, or its engine's generated-token counter rising)."""

    interval_s: float = Field(2.0, gt=0, description="Seconds between health probes of each worker")
    timeout_s: float = Field(2.0, gt=0, description="Probe timeout")
    failure_threshold: int = Field(2, ge=1, description="Consecutive failures before a worker is unhealthy")
    success_threshold: int = Field(1, ge=1, description="Consecutive successes before it is healthy again")
    last_resort: bool = Field(
        True, description="When no worker that can decode a model is healthy, send its requests to the workers "
                          "out of rotation only because their probes timed out (an engine too busy to answer "
                          "/health in time still accepts connections) instead of answering 503; a worker that "
                          "refused a connection, answered a probe with an error or was never up stays out, and "
                          "the stall watchdog pulls a try on an engine that does no work")


class ScrapeConfig(_Section):
    """Background /metrics scrapes that feed each worker's load snapshot."""

    interval_s: float = Field(1.0, gt=0, description="Seconds between /metrics scrapes of each worker")
    timeout_s: float = Field(2.0, gt=0, description="Scrape timeout")


class IndexConfig(_Section):
    """The global prefix index: in memory (default), or in Redis / a Redis Cluster when router replicas share it."""

    backend: Literal["memory", "redis", "redis_cluster"] = Field(
        "memory", description="memory (one router), redis (replicas share one node) or redis_cluster "
                              "(replicas share a Redis/Valkey cluster; docs/prefix-index.md)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis server for the shared index and load "
                           "(redis_cluster: redis://host:port[,host:port...], any nodes as seeds)")
    key_prefix: str = Field("dyad", description="Prefix of every Redis key Dyad writes")
    max_blocks: int = Field(1_000_000, ge=1, description="Cap on indexed (worker, block) entries; LRU beyond")
    approximate_ttl_s: float = Field(120.0, gt=0, description="TTL of routing-decision entries (no KV events)")
    ingest_events: bool = Field(True, description="Subscribe to the engines' KV events and write them into "
                                "the index; false on replicas that only read a shared index another replica "
                                "fills (each writer multiplies the index's write load)")
    ingest_shard: bool = Field(False, description="With redis / redis_cluster: replicas split the engines' KV "
                               "event streams (each engine written by one live replica, rendezvous hashing; "
                               "hand-over replays the engine's buffer) instead of every replica writing all")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str, info: ValidationInfo) -> str:
        backend = info.data.get("backend")
        if backend in ("redis", "redis_cluster"):
            problem = redis_url_problem(v, cluster=backend == "redis_cluster")
            if problem:
                raise ValueError(problem)
        return v


class DisaggConfig(_Section):
    """Prefill/decode disaggregation (used when the fleet has prefill and decode workers)."""

    enabled: bool = Field(True, description="Split prefill from decode when the fleet has prefill and decode workers")
    min_prefill_tokens: int | None = Field(
        None, ge=0, description="Uncached prompt tokens below which decode prefills locally (None = from profile)")
    prefill_timeout_s: float = Field(30.0, gt=0, description="Bound on the prefill step; past it decode prefills locally")
    connector: Literal["nixl", "example"] = Field("nixl", description="vLLM KV connector the engines run")


class PlannerConfig(_Section):
    """The SLO planner: how many prefill and decode workers to run (``orchestrator/planner``).

    Recommend-only unless an actuator is configured. ``actuator: role_change`` keeps the fleet's size
    and only moves workers between the prefill and decode pools (no restart); ``local`` starts/stops
    engine processes from ``local_commands`` (and switches roles instead when ``role_change_s`` is
    set and shorter than ``start_s``); ``kubernetes`` scales one workload per role.
    """

    enabled: bool = Field(False, description="Run the planner loop inside the gateway")
    interval_s: float = Field(60.0, gt=0, description="Seconds between planning steps")
    ttft_target_s: float = Field(0.5, gt=0, description="Time-to-first-token target (a tail target, seconds)")
    itl_target_s: float = Field(0.05, gt=0, description="Inter-token latency target (seconds)")
    max_workers: int = Field(8, ge=2, description="Worker budget: most prefill + decode workers")
    min_prefill: int = Field(1, ge=0, description="Fewest prefill workers")
    max_prefill: int | None = Field(None, ge=0, description="Most prefill workers (None: budget bound only)")
    min_decode: int = Field(1, ge=1, description="Fewest decode workers")
    max_decode: int | None = Field(None, ge=1, description="Most decode workers (None: budget bound only)")
    profile: str | None = Field(
        None, description="Performance profile JSON from `dyad profile`; None = the shipped profile of a "
                          "simulated GPU-like engine (replace it with a profile of your engines)")
    predictor: Literal["constant", "ewma", "linear", "holt_winters", "auto"] = Field(
        "auto", description="Load predictor; auto = lowest rolling backtest error")
    season: int = Field(24, ge=2, description="Holt-Winters season length, in intervals")
    headroom: float = Field(0.0, ge=0, description="Plan for (1 + headroom) x the forecast request rate")
    burst_window_s: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        0.0, description="Burst floor (0 = off): size prefill for the arrival peak over seconds and keep "
                         "the largest prefill sizing of this window; set it well above an engine's start time. "
                         "auto = start_s + interval_s, the time a worker given back takes to return")
    scale_in_margin: float = Field(0.15, ge=0, description="Headroom kept before giving a worker back")
    scale_in_intervals: int = Field(2, ge=1, description="Intervals below capacity before scaling in")
    scale_in_step: int = Field(1, ge=0, description="Most workers of one role given back per interval (drained "
                                                     "first); 0 = all above the need plus scale_in_margin")
    decode_headroom: float = Field(
        0.25, ge=0, description="Decode sized for (1 + this) x the peak streams in flight within an interval")
    fast_interval_s: float = Field(
        0.0, ge=0, description="Load-reactive mode (0 = off): every this many seconds between intervals, scale a "
                               "role out at once when its queue is beyond what its workers clear within target")
    fast_lookahead: bool = Field(
        True, description="Load-reactive mode: wake warm decode standby for the streams in flight extrapolated to "
                          "when a worker woken at the next look would serve (fast_interval_s + standby_wake_s "
                          "ahead, from their growth over that span), not for the streams now; cold starts stay on "
                          "the load now")
    prefill_cost: float = Field(1.0, ge=0, description="Price of one prefill worker-hour (any currency)")
    decode_cost: float = Field(1.0, ge=0, description="Price of one decode worker-hour")
    cost_budget: float | None = Field(
        None, gt=0, description="Most spent per hour on prefill + decode workers (None: only max_workers)")
    decode_profile: str | None = Field(
        None, description="Performance profile JSON of the decode workers when they run on other hardware "
                          "(None: profile)")
    cooldown_s: float = Field(0.0, ge=0, description="No scale-in of a role for this long after it changed")
    start_s: float = Field(60.0, ge=0, description="Seconds an engine takes to start (for the actuator choice)")
    role_change_s: float | None = Field(
        None, ge=0, description="Seconds a role change takes; set it to let the planner move workers between "
                                "roles (always on for actuator role_change)")
    correct_from_latency: bool = Field(True, description="Correct the profile from observed TTFT/ITL")
    standby_prefill: int = Field(
        0, ge=0, description="Warm standby prefill workers to keep started but out of rotation (actuator local or "
                             "kubernetes); growth activates them in well under a second before starting cold "
                             "ones. They count against max_workers")
    standby_decode: int = Field(0, ge=0, description="Warm standby decode workers (as standby_prefill)")
    standby_auto: bool = Field(
        False, description="Keep more warm standby than standby_prefill/standby_decode when recent bursts need it "
                           "(sized from observed burst factors; opt-in, docs/benchmarks.md Issue 14)")
    standby_net_of_spare: bool = Field(
        True, description="Count serving workers kept beyond the model's sizing (burst floor, scale-in "
                          "hysteresis) against the standby pool: they are warm capacity already")
    standby_shared: bool = Field(
        True, description="One warm standby pool for both roles, sized for their joint shortfall measured over the "
                           "load's history (not the sum of per-role pools), woken into the role that needs it by a "
                           "role change; applies only with role_change_s set and both roles on the same profile "
                           "and price")
    standby_confirm: bool = Field(
        True, description="A want of the warm standby pool that comes without growth (no role grew this interval or "
                           "in the load mode since the last one, and the load rose no further than its measured rise) cold-starts a worker only once it held over the last "
                           "scale_in_intervals intervals (a want born of one interval's rounding wobble is gone before "
                           "the worker is ready); parking a worker given back is not held back")
    scale_in_insured: bool = Field(
        True, description="A confirmed decline keeps giving back: after a step down, while every interval stays below "
                           "capacity, one more worker goes back the next interval (without the confirmation and "
                           "cooldown again) when the pool without it still holds the capacity proportional insurance "
                           "measured for the re-start horizon and the scale-in margin")
    rise_quantile: float = Field(
        0.0, ge=0, lt=1, description="Size prefill for the lead forecast times this quantile of how far arrivals "
                                     "recently outran it (0 = off; opt-in)")
    cold_backlog: Literal["off", "observed", "forecast"] = Field(
        "observed", description="Load mode: start cold prefill workers only for a backlog that outlasts the start-up, "
                           "judged on arrivals seen now (observed) or the forecast; off = every confirmed "
                           "shortfall starts cold workers")
    insurance: Literal["fixed", "proportional"] = Field(
        "proportional", description="Capacity beyond the model's sizing: fixed (burst_window_s floor, standby_* warm "
                             "workers) or proportional (once the load's rise within start_s + interval_s is "
                             "measured, keep only what that rise needs, with those as bounds)")
    standby_wake_s: float = Field(
        1.0, ge=0, description="Seconds an activated standby worker takes to serve (a registry state change: "
                               "about one health interval)")
    input_max_age_s: float | None = Field(
        None, gt=0, description="Plan only on inputs measured this recently: ISL/OSL/latency older than this "
                                "(default: 3 x interval_s) make the planner hold its sizes and say why")
    prometheus_url: str | None = Field(
        None, description="Read inputs from this Prometheus (HTTP API); None = scrape the gateway's own metrics")
    prometheus_window_s: float | None = Field(
        None, gt=0, description="PromQL rate window (default: interval_s, at least 2 scrape intervals)")
    model: str | None = Field(None, description="Plan for this model only (Prometheus label filter)")
    actuator: Literal["recommend", "local", "kubernetes", "role_change"] = Field(
        "recommend", description="How decisions are carried out: recommend only, local processes, Kubernetes, role changes")
    local_commands: dict[Role, str] = Field(
        default_factory=dict, description="actuator local: command template per role; {port} (required), "
                                          "{role} and {worker_id} are filled in, all else (JSON braces too) "
                                          "is passed as written")
    local_engine: EngineKind = Field(EngineKind.VLLM, description="actuator local: engine kind of started workers")
    local_models: list[str] = Field(default_factory=list, description="actuator local: models they serve")
    kubernetes_api: str = Field("https://kubernetes.default.svc", description="actuator kubernetes: API server")
    kubernetes_namespace: str = Field("default", description="Namespace of the scaled workloads")
    kubernetes_workloads: dict[Role, str] = Field(
        default_factory=dict, description="actuator kubernetes: role → deployments/<name> or statefulsets/<name>")
    kubernetes_token_file: str | None = Field(
        "/var/run/secrets/kubernetes.io/serviceaccount/token", description="Bearer token file (None: no auth)")
    kubernetes_token: str | None = Field(None, description="actuator kubernetes: bearer token (overrides the file)")
    kubernetes_ca_file: str | None = Field(f"{SA_DIR}/ca.crt", description="actuator kubernetes: API server CA "
                                                                            "(used when the file exists)")
    kubernetes_drain_settle_s: float = Field(
        5.0, ge=0, description="Scale-in: after marking a pod draining, wait this long for every gateway's watch "
                               "to see the mark before trusting the engine's idle reading")
    kubernetes_drain_timeout_s: float = Field(
        600.0, ge=0, description="Scale-in: reduce replicas after this long even if the engine is not idle")

    _urls = field_validator("prometheus_url", "kubernetes_api")(_http_base_url)

    @model_validator(mode="after")
    def _limits(self) -> PlannerConfig:
        if self.min_prefill + self.min_decode > self.max_workers:
            raise ValueError(f"max_workers {self.max_workers} is below min_prefill + min_decode")
        if self.actuator == "local" and not self.local_commands:
            raise ValueError("local_commands: required for actuator local (a command template per role)")
        for role, command in self.local_commands.items() if self.actuator == "local" else ():
            if "{port}" not in command:  # the engine would listen where the gateway never looks
                raise ValueError(f"local_commands.{role.value}: has no {{port}}: each engine the planner starts "
                                 "must listen on the port the actuator picks for it")
        if self.actuator == "kubernetes" and not self.kubernetes_workloads:
            raise ValueError("kubernetes_workloads: required for actuator kubernetes (a workload per role)")
        return self


class ResilienceConfig(_Section):
    """Failure handling on the request path (``orchestrator/gateway/resilience.py``, ``failover.py``,
    ``shutdown.py``). Timeouts: ``gateway.connect_timeout_s`` bounds connecting to an engine,
    ``gateway.first_byte_timeout_s`` the wait for its first byte (and, for a stream, for its first
    chunk), ``gateway.request_timeout_s`` a whole non-streamed request; a stream is bounded by
    ``stream_idle_timeout_s`` between data events and, only if set, by ``stream_timeout_s`` in total."""

    backoff_base_s: float = Field(0.05, ge=0, description="First retry waits 0.5-1x this; doubles per retry "
                                                          "(0 = retry at once)")
    backoff_max_s: float = Field(1.0, ge=0, description="Cap on one retry's backoff")
    breaker_failure_threshold: int = Field(
        5, ge=0, description="Consecutive worker-caused failures (connect errors, broken streams, and a reset, stall, "
                             "5xx or garbage answer the same request does not get elsewhere) that open a worker's "
                             "circuit breaker; request-caused ones never count; 0 = no breakers")
    breaker_open_s: float = Field(10.0, gt=0, description="Seconds an open breaker keeps the worker out "
                                                           "before letting probe requests through (half-open)")
    breaker_success_threshold: int = Field(2, ge=1, description="Successful probes that close a half-open breaker")
    breaker_half_open_probes: int = Field(1, ge=1, description="Requests at a time on a half-open worker")
    stream_idle_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait between two data events of a stream before it counts as failed "
                                "(bytes that never finish an event, and comments alone, are no progress)")
    stream_timeout_s: float | None = Field(
        None, gt=0, description="Cap on a whole stream (None = none: long generations are fine while chunks flow)")
    stream_failover: bool = Field(
        True, description="When a worker dies mid-stream, continue the stream on another worker (prompt + text "
                          "sent so far); when impossible, end it with an SSE error event")
    max_failovers: int = Field(2, ge=0, description="Continuations per stream before giving up with an error event")
    stall_timeout_s: float = Field(
        15.0, gt=0, description="A request waiting for its first byte on a worker that did no work at all "
                                "(no first token or answer for any request, no generated tokens in its "
                                "metrics) for this long, plus the prompt's and queue's prefill time at "
                                "stall_prefill_tokens_per_s, is moved to another worker; the breaker counts it "
                                "unless the request stalls on that worker too while it was answering others "
                                "shortly before (then it is the request's doing). P/D prefill legs are "
                                "watched the same way (then the decode worker prefills locally)")
    stall_prefill_tokens_per_s: float = Field(
        500.0, gt=0, description="Slowest prefill rate assumed when sizing the stall budget (CPU-class: "
                                 "GPU engines are 10-100x faster, so the budget is generous there)")
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM: longest wait for in-flight requests before exiting")
    header_timeout_s: float = Field(
        10.0, gt=0, description="A client must send its request headers within this (slowloris guard)")
    body_timeout_s: float = Field(
        30.0, gt=0, description="A client must send its whole request body within this after the headers")
    client_write_timeout_s: float = Field(
        120.0, gt=0, description="A client that takes no byte of its answer for this long (it stopped reading) is "
                                 "disconnected and its request cancelled, the engine's with it")


class AccessLogConfig(_Section):
    """The per-request access log (``orchestrator/telemetry/access_log.py``): one line per client
    request, whatever way it ended. The client's key never appears, only its id."""

    enabled: bool = Field(False, description="Write one line per request")
    format: Literal["json", "kv"] = Field("json", description="json (one object per line) or kv (key=value pairs)")
    output: str = Field("stdout", description="stdout, stderr, logger (INFO records on the `dyad.access` "
                                              "logger, through the process's log handler) or a file path (appended)")
    sample_rate: float = Field(1.0, ge=0, le=1, description="Fraction of answered requests logged (decided "
                                                            "from the request id, so replicas agree)")
    always_log_errors: bool = Field(True, description="Log every refused or failed request (status >= 400 "
                                                      "or an error class) whatever sample_rate says")


class TracingConfig(_Section):
    """OpenTelemetry tracing (``orchestrator/telemetry/tracing.py``), off by default; needs the
    ``tracing`` extra (``pip install 'dyad-serve[tracing]'``)."""

    enabled: bool = Field(False, description="Export a trace per request over OTLP/HTTP")
    endpoint: str = Field("http://127.0.0.1:4318/v1/traces", description="OTLP/HTTP traces endpoint (a collector)")
    service_name: str = Field("dyad-gateway", description="Resource attribute service.name of the gateway's spans")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="Fraction of new traces sampled; a client's "
                                                             "traceparent decides for its own trace")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra HTTP headers sent to the endpoint")
    resource_attributes: dict[str, str] = Field(default_factory=dict, description="Extra resource attributes "
                                                                                  "(e.g. deployment.environment)")
    batch_delay_s: float = Field(1.0, gt=0, description="Longest wait before a batch of spans is exported")
    export_timeout_s: float = Field(10.0, gt=0, description="Timeout of one export request")
    max_queue_size: int = Field(2048, ge=1, description="Finished spans waiting for export; beyond it new spans "
                                                        "are dropped (never blocks a request)")

    @model_validator(mode="after")
    def _sdk_installed(self) -> TracingConfig:
        if self.enabled:
            import importlib.util

            for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
                try:
                    found = importlib.util.find_spec(module) is not None
                except ModuleNotFoundError:
                    found = False
                if not found:
                    raise ValueError(f"tracing needs the OpenTelemetry SDK and OTLP exporter ({module} is not "
                                     "installed): pip install 'dyad-serve[tracing]'")
        return self

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP/HTTP), e.g. http://collector:4318/v1/traces")
        return v



class UiConfig(_Section):
    """The fleet page's history (``/ui``, ``orchestrator/ui/history.py``): kept in memory, no external service."""

    history_interval_s: float = Field(5.0, ge=0.1, description="Seconds between two samples of the gateway's metrics")
    history_window_s: float = Field(30.0, gt=0, description="Each chart point summarises this many seconds "
                                                            "(rates, ratios, latency quantiles)")
    history_span_s: float = Field(3600.0, gt=0, le=86400, description="How far back the charts go")

class DyadConfig(_Section):
    models: list[ModelConfig] = Field(default_factory=list)
    workers: list[WorkerConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    disagg: DisaggConfig = Field(default_factory=DisaggConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    access_log: AccessLogConfig = Field(default_factory=AccessLogConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    ui: UiConfig = Field(default_factory=UiConfig)

    @model_validator(mode="after")
    def _unique_ids(self) -> DyadConfig:
        from orchestrator.fleet.registry import url_key

        seen: set[str] = set()
        urls: dict[str, int] = {}  # url_key → the entry that has it
        for i, w in enumerate(self.workers):
            if w.id is None:
                w.id = f"w{i}"
            if w.id in seen:
                raise ValueError(f"workers.{i}.id: duplicate worker id '{w.id}'")
            seen.add(w.id)
            # one engine as two workers gets twice its share of requests and counts twice as capacity
            # (the workers file and POST /admin/workers refuse it too)
            key = url_key(w.url)
            if key in urls:
                raise ValueError(f"workers.{i}.url: the engine at {w.url} is already workers.{urls[key]}")
            urls[key] = i
        return self

    @model_validator(mode="after")
    def _unique_model_names(self) -> DyadConfig:
        # a name given twice: the second entry (its block_size, tokenizer) was never read; an alias equal to another
        # model's name: that model's requests resolved to the first (``DyadConfig.model`` takes the first match)
        seen: dict[str, str] = {}
        for i, m in enumerate(self.models):
            for j, name in enumerate([m.name, *m.aliases]):
                where = f"models.{i}.name" if j == 0 else f"models.{i}.aliases.{j - 1}"
                if name in seen:
                    raise ValueError(f"{where}: '{name}' is already {seen[name]}: a model name or alias names one model")
                seen[name] = where
        return self

    @model_validator(mode="after")
    def _limits_redis(self) -> DyadConfig:
        # limits.redis_url unset: the buckets use index.redis_url, which must then name one Redis node
        if self.limits.backend != "redis" or self.limits.redis_url is not None:
            return self
        if self.index.backend == "redis_cluster":
            raise ValueError("limits.redis_url: limits.backend: redis keeps its buckets on one Redis node, and "
                             "index.redis_url names a cluster (index.backend: redis_cluster): set limits.redis_url")
        problem = redis_url_problem(self.index.redis_url, cluster=False)
        if problem:
            raise ValueError(f"limits.redis_url is unset, so the buckets use index.redis_url: {problem}")
        return self

    def model(self, name: str) -> ModelConfig | None:
        for m in self.models:
            if m.name == name or name in m.aliases:
                return m
        return None


class _EnvPathError(Exception):
    """A ``DYAD_*`` variable whose path does not fit the configuration's shape."""


def _index(key: str) -> int | None:
    return int(key) if key.isdigit() else None


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """``tree[path[0]][path[1]]... = value``. A numeric key addresses a list item: the list is created
    when missing, and an index one past the end appends; a gap or a key that does not fit the shape
    already there raises ``_EnvPathError`` saying what is wrong."""
    node: Any = tree
    for depth, key in enumerate(path):
        last = depth == len(path) - 1
        where = ".".join(path[:depth]) or "(top level)"
        i = _index(key)
        if isinstance(node, list):
            if i is None:
                raise _EnvPathError(f"{where} is a list: address its items by index (…__0__…), not '{key}'")
            if i > len(node):
                raise _EnvPathError(f"index {i} of {where} leaves a gap: {where} has {len(node)} item(s), "
                                    f"set index {len(node)} first")
            if i == len(node):
                node.append(value if last else {})
            elif last:
                node[i] = value
            if last:
                return
            nxt = _index(path[depth + 1]) is not None
            if node[i] is None:
                node[i] = [] if nxt else {}
            node = node[i]
        elif isinstance(node, dict):
            if last:
                node[key] = value
                return
            nxt = _index(path[depth + 1]) is not None
            if node.get(key) is None:
                node[key] = [] if nxt else {}
            node = node[key]
        else:
            raise _EnvPathError(f"{where} is a single value ({type(node).__name__}), it has no key '{key}'")
        if not isinstance(node, dict | list):
            rest = path[depth + 1]
            raise _EnvPathError(f"{'.'.join(path[:depth + 1])} is a single value, it has no key '{rest}'")


def _env_sort_key(path: list[str]) -> list[tuple[int, int | str]]:
    # numeric parts as numbers, so that __2__ comes before __10__ (list items are appended in order)
    return [(0, int(p)) if p.isdigit() else (1, p) for p in path]


def env_overrides(environ: dict[str, str] | None = None) -> list[tuple[str, list[str], Any]]:
    """``(variable, path, value)`` for every ``DYAD_<SECTION>[__<KEY>...]`` variable, in the order they
    are applied; the value is parsed as YAML (a plain string when it is not YAML)."""
    env = os.environ if environ is None else environ
    found = []
    for name, value in env.items():
        if not name.startswith("DYAD_"):
            continue
        path = [p.lower() for p in name[5:].split("__")]
        if path[0] not in DyadConfig.model_fields:
            continue  # DYAD_* variables that are not configuration (e.g. the vLLM venv path)
        if any(p == "" for p in path):
            raise ConfigError(f"{name}: empty key in the name (use exactly two underscores between levels)")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        found.append((name, path, parsed))
    found.sort(key=lambda item: _env_sort_key(item[1]))
    return found


def apply_env_overrides(raw: dict[str, Any], environ: dict[str, str] | None = None,
                        sources: dict[str, str] | None = None) -> dict[str, Any]:
    """``DYAD_A__B=v`` sets ``raw['a']['b'] = yaml(v)``; list items by index (``DYAD_WORKERS__0__URL``),
    creating the list and appending at its end. A variable that does not fit raises ``ConfigError``
    naming it. ``sources`` (when given) maps each dotted path set to the variable that set it."""
    for name, path, value in env_overrides(environ):
        try:
            _set_path(raw, path, value)
        except _EnvPathError as e:
            raise ConfigError(f"{name}: {e}") from None
        if sources is not None:
            sources[".".join(path)] = name
    return raw


def merge_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` (e.g. from command-line flags) into ``raw``: mappings merge key by key,
    anything else (lists included) replaces what was there."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            merge_overrides(raw[key], value)
        else:
            raw[key] = value
    return raw


def format_validation_error(err: ValidationError, sources: dict[str, str] | None = None) -> str:
    """Every problem on its own line, by dotted field path; a field set by an environment variable
    also names the variable (``sources``: dotted path → variable)."""
    lines = [f"invalid configuration ({err.error_count()} problem{'s' if err.error_count() != 1 else ''}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        var = None
        for path, name in (sources or {}).items():  # a variable that set this field, or a key inside it
            related = loc == path or loc.startswith(path + ".") or path.startswith(loc + ".")
            if related and (var is None or len(path) > len(var[0])):
                var = (path, name)
        lines.append(f"  {loc}: {msg}" + (f" (set by {var[1]})" if var else ""))
    return "\n".join(lines)


def load_config(source: str | Path | dict[str, Any] | None = None, environ: dict[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> DyadConfig:
    """Load from a YAML path (or an already-parsed dict, or nothing), apply env overrides, then
    ``overrides`` (command-line flags: ``config_cli.flag_overrides``), validate. Precedence: flags over
    environment over file over defaults."""
    if source is None:
        raw: Any = {}
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)  # env overrides and flags must not change the caller's dict
    else:
        path = Path(source)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read configuration file {path}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a text file (byte {e.start} is not UTF-8): a YAML configuration "
                              "is UTF-8 text") from e
        try:
            raw = load_yaml(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError("invalid configuration: the top level must be a mapping of sections")
    sources: dict[str, str] = {}
    raw = apply_env_overrides(raw, environ, sources)
    if overrides:
        raw = merge_overrides(raw, overrides)
    try:
        return DyadConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, sources)) from e
