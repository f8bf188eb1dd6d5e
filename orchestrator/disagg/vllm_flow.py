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

from typing import Any, Literal

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

# Fields that make no sense (or are rejected) for a one-token, non-streamed prefill step.
_PREFILL_DROP = frozenset({"stream_options", "min_tokens", "n", "best_of", "logprobs", "top_logprobs", "echo"}
                         | INTERNAL_FIELDS)


def prefill_body(endpoint: str, body: dict[str, Any], connector: Connector = "nixl") -> dict[str, Any]:
    """The prefill step's body: the client's request cut to one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out["max_tokens"] = 1
    if endpoint.endswith("/chat/completions"):
        out["max_completion_tokens"] = 1
    else:
        out.pop("max_completion_tokens", None)
    out["stream"] = False
    if connector == "nixl":
        out[KV_TRANSFER_PARAMS] = dict(NIXL_PREFILL_PARAMS)
    return out


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
