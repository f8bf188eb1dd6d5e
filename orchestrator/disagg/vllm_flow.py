"""vLLM's prefill/decode exchange, as request bodies (pure functions, no I/O).

NixlConnector (engines.md §2), two steps with one ``X-Request-Id``:

1. the prefill engine gets the client's request cut to one token — ``max_tokens: 1`` (chat also
   ``max_completion_tokens: 1``), not streamed — plus ``kv_transfer_params`` asking it to keep the
   KV for a remote decode (``do_remote_decode: true``);
2. its JSON answer carries a top-level ``kv_transfer_params`` (block ids, engine id, host, side
   channel port); the decode engine gets the client's original request with that object, pulls
   the KV over NIXL and generates from there.

ExampleConnector (a shared folder): the same two steps without any parameters; the decode engine
finds the prefill's KV in the folder by the prompt's hash.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal
from urllib.parse import urlsplit

from adapters.vllm import INTERNAL_FIELDS, KV_TRANSFER_PARAMS

Connector = Literal["nixl", "example"]

# What the prefill step asks of a NIXL producer: keep the blocks for a remote decode.
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Fields the prefill step cannot carry as the client sent them: it is unstreamed and one token long. Every other
# field goes to the prefill engine as it is, so that it refuses what the decode engine would refuse (below).
_PREFILL_DROP = frozenset({"stream_options", "min_tokens", "n", "best_of", "echo"} | INTERNAL_FIELDS)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _client_limit(endpoint: str, body: dict[str, Any]) -> Any:
    """The per-choice token limit the client set (chat: ``max_completion_tokens`` first), or None."""
    if endpoint.endswith("/chat/completions") and body.get("max_completion_tokens") is not None:
        return body.get("max_completion_tokens")
    return body.get("max_tokens")


def _drop_is_harmless(endpoint: str, body: dict[str, Any], name: str) -> bool:
    """Whether leaving ``name`` out of the prefill step changes nothing the engine would judge: its value is one
    vLLM accepts. A value it may refuse stays in the prefill body, so that the prefill engine refuses the request
    itself. (A refusal by the decode engine comes after the prefill engine has computed the prompt and leased its
    KV blocks for the hand-off, which vLLM frees only when a decode reads them or after
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s by default: refused requests would pin the prefill pool's cache.)"""
    v = body.get(name)
    if v is None:
        return True
    if name == "stream_options":  # (an unstreamed request's stream_options are refused: by the prefill step too)
        return body.get("stream") is True
    if name in ("n", "best_of"):  # (above 1: prefilled by the decode worker itself, RouteRequest.prefer_local)
        return _is_int(v) and v >= 1
    if name == "echo":
        return isinstance(v, bool)
    if name == "min_tokens":  # (above the client's limit: local_only says so, the decode engine answers)
        return _is_int(v) and v >= 0
    return False


def prefill_body(endpoint: str, body: dict[str, Any], connector: Connector = "nixl") -> dict[str, Any]:
    """The prefill step's body: the client's request cut to one token, not streamed. Fields the step cannot carry
    (``_PREFILL_DROP``) are left out only when their value is one the engine accepts (``_drop_is_harmless``);
    sampling fields that only the generated tokens use (``logprobs``, ``top_logprobs``, ...) stay, so the prefill
    engine judges them as the decode engine would (for one token they cost nothing)."""
    out = {k: v for k, v in body.items()
           if k not in _PREFILL_DROP or (k not in INTERNAL_FIELDS and not _drop_is_harmless(endpoint, body, k))}
    out["max_tokens"] = 1
    if endpoint.endswith("/chat/completions"):
        out["max_completion_tokens"] = 1
    else:
        out.pop("max_completion_tokens", None)
    out["stream"] = False
    if connector == "nixl":
        out[KV_TRANSFER_PARAMS] = dict(NIXL_PREFILL_PARAMS)
    return out


def local_only(endpoint: str, body: dict[str, Any], prompt_tokens: int, max_model_len: int | None,
               prefill_max_model_len: int | None = None) -> str | None:
    """Why the decode worker must answer this request by itself, without a prefill step (None: split it).

    - The decode engine would refuse it because of a field the one-token prefill step cannot carry as it is: a
      ``min_tokens`` above the client's limit, or a prompt plus ``max_tokens`` beyond the decode engine's context
      (``max_model_len`` from its model card; ``prompt_tokens`` as annotated). The prefill engine would accept
      such a request, compute it and lease its KV for a hand-off nobody reads (``_drop_is_harmless``); the decode
      engine refuses it with its own message instead.
    - The prompt fits the decode engine's context but not the prefill engine's (``prefill_max_model_len``: a
      fleet whose engines were started with different ``--max-model-len``): the prefill engine would refuse a
      request the decode engine can serve."""
    limit = _client_limit(endpoint, body)
    if _is_int(limit):
        low = body.get("min_tokens")
        if _is_int(low) and low > limit:
            return f"min_tokens {low} > the request's limit {limit}"
        if max_model_len is not None and prompt_tokens + limit > max_model_len:
            return f"{prompt_tokens} prompt tokens + {limit} to generate > the decode engine's context ({max_model_len})"
    if prefill_max_model_len is not None and prompt_tokens + 1 > prefill_max_model_len \
            and (max_model_len is None or prompt_tokens < max_model_len):
        return (f"{prompt_tokens} prompt tokens do not fit the prefill engine's context ({prefill_max_model_len}); "
                "the decode engine's is larger")
    return None


def handoff_params(prefill_response: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a NIXL prefill answer hands to the decode step, or ``None`` when
    the answer has none (the engine has no connector, or refused to keep the blocks), or when they are
    not a hand-off a decode engine can act on (``handoff_problem``)."""
    if not isinstance(prefill_response, dict):
        return None
    params = prefill_response.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict) or not params.get("do_remote_prefill") or handoff_problem(params):
        return None
    return params


def _block_id(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**63


def handoff_problem(params: dict[str, Any]) -> str | None:
    """What makes ``params`` no NIXL hand-off (None when it is one). The decode engine's connector acts on
    these fields as they are — it connects to ``remote_host:remote_port`` and reads ``remote_block_ids`` from
    ``remote_engine_id`` — so a prefill answer that is garbage there (an engine bug, something else answering
    on the worker's port) is never passed on: the decode worker prefills locally instead. Other keys
    (connector-version specific) are passed on as they are."""
    if params.get("do_remote_prefill") is not True:
        return "do_remote_prefill is not true"
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not all(
            _block_id(b) or (isinstance(b, list) and all(_block_id(i) for i in b)) for b in blocks):
        return "remote_block_ids is not a list of block ids (or of lists of them)"
    engine_id = params.get("remote_engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        return "remote_engine_id is not a non-empty string"
    host = params.get("remote_host")
    if not isinstance(host, str) or not host or len(host) > 255 or any(c.isspace() or c in "/@?#" for c in host):
        return "remote_host is not a host name or address"
    port = params.get("remote_port")
    if type(port) is not int or not 0 < port < 65536:
        return "remote_port is not a TCP port"
    return None


def _loopback(host: str) -> bool:
    """A name or address that means "this machine" wherever it is used (or no machine: 0.0.0.0, ::)."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def unreachable_side_channel(params: dict[str, Any], prefill_url: str, decode_url: str) -> str | None:
    """Why ``params`` (a well-formed hand-off: ``handoff_problem``) cannot reach the decode worker, or None.

    Dyad does not require ``remote_host:remote_port`` to be the prefill worker's own address: the side channel
    is the engine's own listener (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``), often on another interface or name
    than its HTTP API (an RDMA network, a pod IP behind a service name), and Dyad is told neither. It passes on
    what the engine it asked says, as the engine's HTTP answers are passed on (only the operator's engine writes
    them: a client's ``kv_transfer_params`` never gets there, docs/security.md). The one inconsistency it can see
    is a loopback side channel (vLLM's default host is ``localhost``) named by a prefill worker on another host
    than the decode worker: the decode engine would connect to its own machine, fail the hand-shake (or reach
    another engine there), and recompute the prompt while the prefill engine keeps the blocks leased for a read
    that never comes."""
    host = params.get("remote_host")
    if not isinstance(host, str) or not _loopback(host):
        return None
    p_host = urlsplit(prefill_url).hostname or ""
    d_host = urlsplit(decode_url).hostname or ""
    if p_host == d_host or (_loopback(p_host) and _loopback(d_host)):
        return None  # (one machine: its loopback is the decode engine's too)
    return (f"remote_host {host!r} is the prefill engine's own machine, which the decode worker on another host "
            "cannot reach (set VLLM_NIXL_SIDE_CHANNEL_HOST on the prefill engine to an address the decode engines "
            "reach)")


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode step's body: the client's request, plus the prefill's hand-off when there is one.
    (Client bodies never carry internal fields — intake refuses them — but a body built here only
    ever holds Dyad's own.)"""
    out = {k: v for k, v in body.items() if k not in INTERNAL_FIELDS}
    if params is not None:
        out[KV_TRANSFER_PARAMS] = params
    return out


def local_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body for a decode worker that prefills locally (no transfer parameters from the client)."""
    return decode_body(body, None)
