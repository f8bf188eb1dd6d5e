"""Configuration from the command line.

- ``dyad check-config FILE [FILE ...]``: validate each file (with the ``DYAD_*`` environment applied,
  as ``dyad serve`` would) and print every bad field; exit 2 when any file is invalid. A Kubernetes ConfigMap
  (``deploy/kubernetes/40-gateway-config.yaml``) is checked by the configurations in its ``data``.
- ``add_serve_flags(parser)`` / ``flag_overrides(args)``: the fleet flags of ``dyad serve`` (``--worker``,
  ``--prefill``, ``--decode``, ``--policy``, ``--redis``, ``--model``, ``--host``, ``--port``) and the
  config overrides they stand for, so a gateway starts without a file:

      dyad serve --worker http://10.0.0.5:8000 --worker http://10.0.0.6:8000 --policy kv_aware
      dyad serve --prefill http://p0:30000 8998 --decode http://d0:30001 --engine sglang

  Flags override the file and the environment (``load_config(..., overrides=...)``). ``--worker``,
  ``--prefill`` and ``--decode`` together replace the file's ``workers`` list.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import ValidationError

from orchestrator.config import (
    ConfigError,
    PolicyName,
    WorkerConfig,
    load_config,
    load_yaml,
    redis_url_problem,
)

POLICIES: tuple[str, ...] = get_args(PolicyName)
ENGINES = ("vllm", "sglang", "sim")


# --- dyad check-config ------------------------------------------------------------------------------

def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="+", help="YAML configuration file(s); each is checked on its own")


def _configmap_files(path: str) -> list[tuple[str, Any]] | None:
    """A Kubernetes ConfigMap (``deploy/kubernetes/40-gateway-config.yaml``): its ``data`` entries named ``*.yaml``
    or ``*.yml``, as (label, parsed YAML) to check; None for anything else (checked as a configuration)."""
    try:
        doc = load_yaml(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # (load_config says what is wrong with it)
    if not (isinstance(doc, dict) and doc.get("kind") == "ConfigMap" and isinstance(doc.get("data"), dict)):
        return None
    out = []
    for key, text in doc["data"].items():
        if isinstance(key, str) and key.endswith((".yaml", ".yml")) and isinstance(text, str):
            try:
                out.append((f"{path} (data.{key})", load_yaml(text) or {}))
            except yaml.YAMLError as e:
                out.append((f"{path} (data.{key})", ConfigError(f"not valid YAML: {e}")))
    return out or None


def run(args: argparse.Namespace) -> int:
    bad = 0
    targets: list[tuple[str, Any]] = []
    for path in args.config:  # a ConfigMap holding the configuration: each configuration in it
        targets += _configmap_files(path) or [(path, path)]
    for path, source in targets:
        try:
            if isinstance(source, ConfigError):
                raise source
            cfg = load_config(source)
        except ConfigError as e:
            bad += 1
            msg = str(e)  # (some messages start with the file's name already)
            print(msg if msg.startswith(f"{path}: ") else f"{path}: {msg}", file=sys.stderr)
            continue
        try:
            extra = _discovered(cfg)
        except ConfigError as e:
            bad += 1
            print(f"{path}: {e}", file=sys.stderr)
            continue
        print(f"{path}: ok: {len(cfg.workers)} worker(s){extra}, policy {cfg.router.policy}, "
              f"index {cfg.index.backend}")
    if len(targets) > 1:
        print(f"{len(targets) - bad} of {len(targets)} configuration(s) valid",
              file=sys.stderr if bad else sys.stdout)
    return 2 if bad else 0


def _discovered(cfg: Any) -> str:
    """What ``discovery`` adds to the static workers, for the summary line. A workers file is
    checked too (a typo there would otherwise surface only at run time)."""
    if cfg.discovery.source == "file":
        from orchestrator.fleet.discovery.file import WorkersFileError, parse_workers_file
        path = cfg.discovery.file.path
        try:
            n = len(parse_workers_file(Path(path).read_bytes().decode(errors="replace"), path))
        except OSError as e:
            raise ConfigError(f"discovery.file.path: cannot read {path}: {e.strerror}") from e
        except WorkersFileError as e:
            raise ConfigError(f"discovery.file.path: {e}") from e
        return f" + {n} from {path}"
    if cfg.discovery.source == "kubernetes":
        sel = ", ".join(f"{r.value}: {s}" for r, s in cfg.discovery.kubernetes.selectors.items())
        return f" + Kubernetes pods ({sel})"
    return ""


# --- dyad serve flags -------------------------------------------------------------------------------

def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """The fleet and listener flags of ``dyad serve`` (each overrides the file and the environment)."""
    g = p.add_argument_group("fleet (no config file needed; these override the file and DYAD_* variables; "
                             "--worker/--prefill/--decode together replace its workers list)")
    g.add_argument("--worker", action="append", metavar="URL", default=[],
                   help="an aggregated engine (prefill and decode); repeat for more")
    g.add_argument("--prefill", action="append", nargs="+", metavar=("URL", "BOOTSTRAP_PORT"), default=[],
                   help="a prefill engine, with SGLang's bootstrap port after the URL when it is not 8998 "
                        "(as sglang-router takes it); repeat for more")
    g.add_argument("--decode", action="append", metavar="URL", default=[], help="a decode engine; repeat for more")
    g.add_argument("--engine", choices=ENGINES, help="wire dialect of the engines given by flags (default vllm)")
    g.add_argument("--model", metavar="NAME",
                   help="model the flag engines serve (default: learned from each engine's /v1/models)")
    g.add_argument("--policy", choices=POLICIES, help="routing policy (overrides router.policy)")
    g.add_argument("--redis", metavar="URL",
                   help="share the prefix index through this Redis (redis:// or rediss://); sets index.backend")
    p.add_argument("--host", help="listen address (overrides gateway.host)")
    p.add_argument("--port", type=int, help="listen port (overrides gateway.port)")


def _bootstrap_port(url: str, extra: list[str]) -> int | None:
    if not extra:
        return None
    if len(extra) > 1:
        raise ConfigError(f"--prefill {url}: takes a URL and at most one bootstrap port, got {' '.join(extra)}")
    try:
        port = int(extra[0])
    except ValueError:
        raise ConfigError(f"--prefill {url}: bootstrap port '{extra[0]}' is not a number") from None
    if not 0 < port < 65536:
        raise ConfigError(f"--prefill {url}: bootstrap port {port} is out of range (1-65535)")
    return port


def _check_flag_url(worker: dict[str, Any]) -> None:
    flag = {"both": "--worker", "prefill": "--prefill", "decode": "--decode"}[worker["role"]]
    try:
        WorkerConfig.model_validate({"url": worker["url"]})
    except ValidationError as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{flag} {worker['url']}: the URL {msg}") from None


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config overrides the flags stand for (a nested dict for ``load_config(overrides=...)``).
    Raises ``ConfigError`` naming the flag for a malformed ``--prefill``, an engine URL the gateway cannot
    use or a ``--redis`` URL it could not connect with."""
    out: dict[str, Any] = {}
    workers: list[dict[str, Any]] = []
    for url in getattr(args, "worker", None) or []:
        workers.append({"url": url, "role": "both"})
    for item in getattr(args, "prefill", None) or []:
        url, *extra = item
        w: dict[str, Any] = {"url": url, "role": "prefill"}
        port = _bootstrap_port(url, extra)
        if port is not None:
            w["bootstrap_port"] = port
        workers.append(w)
    for url in getattr(args, "decode", None) or []:
        workers.append({"url": url, "role": "decode"})
    for w in workers:  # a bad URL is named by the flag that gave it (not as workers.N.url)
        _check_flag_url(w)
    if workers:
        engine = getattr(args, "engine", None)
        model = getattr(args, "model", None)
        for w in workers:
            if engine:
                w["engine"] = engine
            if model:
                w["models"] = [model]
        out["workers"] = workers
    elif getattr(args, "engine", None) or getattr(args, "model", None):
        raise ConfigError("--engine and --model describe engines given with --worker, --prefill or --decode")
    if getattr(args, "policy", None):
        out.setdefault("router", {})["policy"] = args.policy
    if getattr(args, "redis", None):
        problem = redis_url_problem(args.redis, cluster=False)
        if problem:
            raise ConfigError(f"--redis: {problem}")
        out["index"] = {"backend": "redis", "redis_url": args.redis}
    if getattr(args, "host", None):
        out.setdefault("gateway", {})["host"] = args.host
    if getattr(args, "port", None) is not None:
        out.setdefault("gateway", {})["port"] = args.port
    return out
