"""Reading and validating a client request: only what routing and forwarding need, by hand.

The body is read once (counting bytes against ``gateway.max_body_bytes`` even when the client
sends no Content-Length), parsed once with orjson, and checked field by field. Everything the
gateway does not look at is forwarded to the engine untouched, so new OpenAI/vLLM fields work
without a Dyad release. Each failure names the offending field in ``param``.

Four classes of body are refused although they parse:

* **internal fields** — a field some adapter declares as Dyad's own (``EngineAdapter.internal_fields``:
  vLLM's ``kv_transfer_params``, SGLang's ``bootstrap_host/port/room`` and ``rid``) steers an
  engine or a P/D hand-off (which host the engine pulls KV from). They are refused with a 400 naming
  the field rather than silently stripped: a client that sends one expects it to act, and a quiet
  drop would hide that it does not. So is one inside a field the engine merges into where it keeps
  them (``EngineAdapter.internal_field_carriers``: vLLM's ``vllm_xargs``). The check runs once here,
  so every path (aggregated, split, local prefill, retries, failover continuations, all built from
  this body) is covered;
* **scheduling fields** — a field the engine orders its requests by (``EngineAdapter.scheduling_fields``:
  vLLM's and SGLang's ``priority``): the order between clients is Dyad's (a key's priority class is its
  ceiling), so only the engine's default (absent, null, 0) is accepted;
* **bodies that do not re-serialize** — orjson reads 1024 levels of nesting but writes only
  254; the gateway writes every body again for the engine, so deeper nesting is refused here
  (400 naming the limit) instead of failing later as a 500;
* anything orjson itself rejects (lone surrogates, numbers out of double range) is invalid JSON.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from adapters import internal_field_carriers, internal_fields, scheduling_fields
from orchestrator.errors import InvalidRequest, PayloadTooLarge

INTERNAL_FIELDS = internal_fields()
INTERNAL_FIELD_CARRIERS = internal_field_carriers()
SCHEDULING_FIELDS = tuple(sorted(scheduling_fields()))
# orjson.dumps refuses deeper nesting than this (the body object itself is level 1).
MAX_NESTING = 254

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _named(setting: str | None) -> str:
    return f" ({setting})" if setting else ""


async def read_body(request: Request, limit: int, setting: str | None = None) -> bytes:
    """The raw body, refusing more than ``limit`` bytes (declared or actually sent); the refusal names
    ``setting``, the configuration key that sets ``limit``, when there is one."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequest("Content-Length header is not a number", param="content-length") from None
        if size > limit:
            raise PayloadTooLarge(f"Request body of {size} bytes exceeds the limit of {limit} bytes{_named(setting)}.",
                                  code="payload_too_large")
    # ``request.stream()``'s loop, without an async generator (its creation and finalizer hooks cost
    # more than the rest of this function for a one-message body)
    if getattr(request, "_stream_consumed", False) or hasattr(request, "_body"):
        raise RuntimeError("the request body was read already")
    receive = request.receive
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect: the client left while sending
            request._is_disconnected = True
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if chunk:
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes{_named(setting)}.",
                                      code="payload_too_large")
            chunks.append(chunk)
        if not more:
            request._stream_consumed = True
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_json_object(request: Request, limit: int, setting: str | None = None) -> dict[str, Any]:
    """The body as a JSON object (``read_body`` + ``parse_json_object``). A body the client compressed
    (``Content-Encoding``: the gateway forwards JSON as it reads it, so it decodes none) is refused with a
    415 naming the header, not taken for broken JSON (checked only when the body does not parse)."""
    raw = await read_body(request, limit, setting)
    try:
        return parse_json_object(raw)
    except InvalidRequest:
        encoding = request.headers.get("content-encoding")
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            raise InvalidRequest(f"Content-Encoding {encoding.strip()[:40]!r} is not supported: send the JSON body "
                                 "uncompressed.", param="content-encoding", code="unsupported_content_encoding",
                                 status=415) from None
        raise


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("Request body is empty; expected a JSON object.", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"Request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object.", code="invalid_json")
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING:  # (cheap: only such bodies can be too deep)
        try:
            orjson.dumps(body)
        except TypeError:
            raise InvalidRequest(f"Request body nests JSON deeper than {MAX_NESTING} levels, the most the "
                                 "gateway can forward.", code="nesting_too_deep") from None
    return body


def check_internal_fields(body: dict[str, Any]) -> None:
    """Refuse a body that carries a field only Dyad may set (see the module docstring)."""
    if not INTERNAL_FIELDS.isdisjoint(body):
        name = min(INTERNAL_FIELDS.intersection(body))
        raise InvalidRequest(f"'{name}' is set by the gateway (it steers engines and prefill/decode hand-offs); "
                             "a request must not carry it.", param=name, code="internal_field")
    for carrier in INTERNAL_FIELD_CARRIERS:  # (an engine merges these where it keeps the internal fields)
        inner = body.get(carrier)
        if isinstance(inner, dict) and not INTERNAL_FIELDS.isdisjoint(inner):
            name = f"{carrier}.{min(INTERNAL_FIELDS.intersection(inner))}"
            raise InvalidRequest(f"'{name}' is set by the gateway (the engine reads '{carrier}' as its own "
                                 "internal parameters, where it keeps the prefill/decode hand-off); a request "
                                 "must not carry it.", param=name, code="internal_field")
    for name in SCHEDULING_FIELDS:  # (the engine's order among requests: Dyad's, by the key's class)
        v = body.get(name)
        if v is not None and not (type(v) is int and v == 0):
            raise InvalidRequest(f"'{name}' sets the engine's scheduling order, which the gateway decides (a key's "
                                 "priority class, lowered per request with the priority header); a request may "
                                 f"send only the engine's default (0 or null), got {_short(v)}.", param=name,
                                 code="internal_field")


def _short(v: Any) -> str:
    """A scalar as JSON, at most 40 characters (for an error message); a container by its type."""
    text = repr(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else (
        orjson.dumps(v).decode() if isinstance(v, (str, bool)) else _type_name(v))
    return text if len(text) <= 40 else text[:40] + "..."


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


def _wrong(param: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"'{param}' must be {expected}, got {_type_name(value)}.", param=param,
                          code="invalid_type")


def _missing(param: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' is a required field.", param=param, code="missing_required_field")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Optional fields the gateway checks because routing or accounting reads them, or because a wrong
# type would otherwise surface as a less helpful engine error. None (JSON null) is always allowed.
_OPTIONAL_INT_MIN1 = ("max_tokens", "max_completion_tokens", "n")
_OPTIONAL_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


def _check_common(body: dict[str, Any], scoring: bool = False) -> None:
    """``scoring``: a completions request with ``echo`` (vLLM scores the prompt; ``max_tokens`` 0 = no output)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _wrong("stream", "a boolean", stream)
    for name in _OPTIONAL_INT_MIN1:
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v):
            raise _wrong(name, "an integer", v)
        if v < 1 and not (scoring and v == 0 and name == "max_tokens"):
            raise InvalidRequest(f"'{name}' must be at least 1, got {v}.", param=name, code="invalid_value")
    for name in _OPTIONAL_NUMBERS:
        v = body.get(name)
        if v is not None and not _is_number(v):
            raise _wrong(name, "a number", v)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _wrong("stream_options", "an object", so)
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _wrong("stream_options.include_usage", "a boolean", iu)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _wrong("user", "a string", user)


def _check_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise _missing("model")
    if not isinstance(model, str):
        raise _wrong("model", "a string", model)
    if not model:
        raise InvalidRequest("'model' must not be empty.", param="model", code="invalid_value")
    return model


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise _missing("messages")
    if not isinstance(messages, list):
        raise _wrong("messages", "an array", messages)
    if not messages:
        raise InvalidRequest("'messages' must contain at least one message.", param="messages",
                             code="invalid_value")
    for i, m in enumerate(messages):  # (the field's name is built only for an error)
        if not isinstance(m, dict):
            raise _wrong(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if role is None:
            raise _missing(f"messages[{i}].role")
        if not isinstance(role, str):
            raise _wrong(f"messages[{i}].role", "a string", role)
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _wrong(f"messages[{i}].content", "a string or an array of content parts", content)


_INT = frozenset((int,))


def _all_ints(items: list[Any]) -> bool:
    """Every item a JSON integer (an ``int``, not a ``bool``): one C-level pass over the items' types
    instead of a Python call per token (an 8k-token prompt: ~0.5 → ~0.1 ms)."""
    return set(map(type, items)) <= _INT


def _check_prompt(body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise _missing("prompt")
    if isinstance(prompt, str):
        return
    expected = "a string, an array of strings, an array of token ids or an array of token-id arrays"
    if not isinstance(prompt, list) or not prompt:
        raise _wrong("prompt", expected, prompt) if not isinstance(prompt, list) else InvalidRequest(
            "'prompt' must not be an empty array.", param="prompt", code="invalid_value")
    first = prompt[0]
    if isinstance(first, str):
        ok = all(isinstance(p, str) for p in prompt)
    elif _is_int(first):
        ok = _all_ints(prompt)
    elif isinstance(first, list):
        ok = all(isinstance(p, list) and _all_ints(p) for p in prompt)
    else:
        ok = False
    if not ok:
        raise InvalidRequest(f"'prompt' must be {expected} (mixed or invalid items found).", param="prompt",
                             code="invalid_type")


def validate(endpoint: str, body: dict[str, Any]) -> str:
    """Check the fields Dyad relies on; returns the requested model name."""
    check_internal_fields(body)
    model = _check_model(body)
    if endpoint == CHAT:
        _check_messages(body)
        _check_common(body)
    else:
        _check_prompt(body)
        _check_common(body, scoring=body.get("echo") is True)
    return model


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a stream end with the engine's usage chunk (``stream_options.include_usage``), so its
    tokens are counted; True when the client did not ask for it (then it is not relayed)."""
    so = body.get("stream_options")
    if isinstance(so, dict) and so.get("include_usage") is True:
        return False
    body["stream_options"] = {**so, "include_usage": True} if isinstance(so, dict) else {"include_usage": True}
    return True


def validate_model_only(body: dict[str, Any]) -> str:
    """The checks for the pass-through endpoints (embeddings, tokenize, detokenize): the model, and no
    internal fields; everything else is the engine's to judge."""
    check_internal_fields(body)
    return _check_model(body)
