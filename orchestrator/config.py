"""Dyad's configuration: one YAML file, validated by pydantic, with ``DYAD_*`` environment overrides.

Every section has working defaults, so an empty file (or none) is a valid in-memory setup.
Environment overrides use ``__`` for nesting: ``DYAD_GATEWAY__PORT=9000``,
``DYAD_ROUTER__POLICY=kv_aware``, ``DYAD_INDEX__BACKEND=redis``; values are parsed as YAML
scalars/lists (``DYAD_GATEWAY__API_KEYS='[k1, k2]'``).

An invalid file raises ``ConfigError`` whose message lists every bad field; the CLI prints it and
exits with status 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from adapters.base import EngineKind, Role


class ConfigError(Exception):
    """The configuration is invalid; ``str(e)`` names every bad field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    """A served model. Workers name the models they serve; the router may tokenize locally."""

    name: str
    tokenizer: str | None = Field(None, description="Directory with tokenizer files for router-side tokenization")
    block_size: int = Field(32, ge=1, description="KV block size in tokens (must match the engines)")
    aliases: list[str] = Field(default_factory=list)


class KvEventsConfig(_Section):
    """Where a worker publishes KV-cache events (vLLM --kv-events-config)."""

    endpoint: str = Field(..., description="ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    replay_endpoint: str | None = None
    topic: str = "kv-events"


class WorkerConfig(_Section):
    url: str
    id: str | None = None
    engine: EngineKind = EngineKind.VLLM
    role: Role = Role.BOTH
    models: list[str] = Field(default_factory=list, description="Models served; empty = ask the engine")
    labels: dict[str, str] = Field(default_factory=dict)
    kv_events: KvEventsConfig | None = None
    bootstrap_port: int | None = Field(None, description="SGLang P/D bootstrap port (default 8998)")
    api_key: str | None = Field(None, description="Bearer key Dyad presents to the engine")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


PolicyName = Literal["round_robin", "least_load", "power_of_two", "kv_aware", "random"]


class KvAwareConfig(_Section):
    """Parameters of the ``kv_aware`` policy (prefix overlap vs load)."""

    prefill_load_weight: float = Field(1.0, ge=0)
    decode_load_weight: float = Field(1.0, ge=0)
    temperature: float = Field(0.0, ge=0)
    tier_weights: dict[str, float] = Field(default_factory=lambda: {"device": 1.0, "host": 0.75, "disk": 0.25})
    session_header: str = "x-session-id"
    session_ttl_s: float = Field(600.0, gt=0)


class RouterConfig(_Section):
    policy: PolicyName = "round_robin"
    seed: int | None = None
    kv_aware: KvAwareConfig = Field(default_factory=KvAwareConfig)
    debug_headers: bool = Field(False, description="Add x-dyad-worker / x-dyad-predicted-cached-tokens to responses")


class GatewayConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1)
    api_keys: list[str] = Field(default_factory=list, description="Client keys; empty = no client auth")
    admin_token: str | None = Field(None, description="Bearer token for /admin/*; unset = admin API disabled")
    connect_timeout_s: float = Field(5.0, gt=0)
    first_byte_timeout_s: float = Field(300.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    retry_after_s: int = Field(1, ge=0)
    max_attempts: int = Field(3, ge=1, description="Tries on different workers before the first byte")


class HealthConfig(_Section):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    failure_threshold: int = Field(2, ge=1)
    success_threshold: int = Field(1, ge=1)


class ScrapeConfig(_Section):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)


class IndexConfig(_Section):
    """The global prefix index: in memory (default) or in Redis when router replicas share it."""

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "dyad"
    max_blocks: int = Field(1_000_000, ge=1, description="Cap on indexed (worker, block) entries; LRU beyond")
    approximate_ttl_s: float = Field(120.0, gt=0, description="TTL of routing-decision entries (no KV events)")


class DisaggConfig(_Section):
    """Prefill/decode disaggregation (used when the fleet has prefill and decode workers)."""

    enabled: bool = True
    min_prefill_tokens: int | None = Field(
        None, ge=0, description="Uncached prompt tokens below which decode prefills locally (None = from profile)")
    prefill_timeout_s: float = Field(30.0, gt=0)
    connector: Literal["nixl", "example"] = "nixl"


class PlannerConfig(_Section):
    """The SLO planner (recommend-only unless an actuator is configured)."""

    enabled: bool = False
    interval_s: float = Field(60.0, gt=0)
    ttft_target_s: float = Field(0.5, gt=0)
    itl_target_s: float = Field(0.05, gt=0)
    max_workers: int = Field(8, ge=1)
    prometheus_url: str | None = None
    actuator: Literal["recommend", "local", "kubernetes", "role_change"] = "recommend"


class DyadConfig(_Section):
    models: list[ModelConfig] = Field(default_factory=list)
    workers: list[WorkerConfig] = Field(default_factory=list)
    router: RouterConfig = Field(default_factory=RouterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    disagg: DisaggConfig = Field(default_factory=DisaggConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)

    @model_validator(mode="after")
    def _unique_ids(self) -> DyadConfig:
        seen: set[str] = set()
        for i, w in enumerate(self.workers):
            if w.id is None:
                w.id = f"w{i}"
            if w.id in seen:
                raise ValueError(f"workers.{i}.id: duplicate worker id '{w.id}'")
            seen.add(w.id)
        return self

    def model(self, name: str) -> ModelConfig | None:
        for m in self.models:
            if m.name == name or name in m.aliases:
                return m
        return None


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = tree
    for key in path[:-1]:
        if isinstance(node, list):
            node = node[int(key)]
            continue
        node = node.setdefault(key, {})
    last = path[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def apply_env_overrides(raw: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, Any]:
    """``DYAD_A__B=v`` sets ``raw['a']['b'] = yaml(v)``; list items by index (``DYAD_WORKERS__0__URL``)."""
    env = os.environ if environ is None else environ
    for name, value in sorted(env.items()):
        if not name.startswith("DYAD_") or "__" not in name[5:] and name[5:].lower() not in DyadConfig.model_fields:
            continue
        path = [p.lower() for p in name[5:].split("__") if p]
        if not path or path[0] not in DyadConfig.model_fields:
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        _set_path(raw, path, parsed)
    return raw


def format_validation_error(err: ValidationError) -> str:
    lines = [f"invalid configuration ({err.error_count()} problem{'s' if err.error_count() != 1 else ''}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def load_config(source: str | Path | dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> DyadConfig:
    """Load from a YAML path (or an already-parsed dict, or nothing), apply env overrides, validate."""
    if source is None:
        raw: Any = {}
    elif isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read configuration file {path}: {e.strerror}") from e
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError("invalid configuration: the top level must be a mapping of sections")
    raw = apply_env_overrides(raw, environ)
    try:
        return DyadConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from e
