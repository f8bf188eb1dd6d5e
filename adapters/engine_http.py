"""The few HTTP calls adapters make to an engine, with failures turned into ``AdapterError``.

Both engines answer errors in one of two shapes — OpenAI's ``{"error": {"message": ...}}`` or the
older ``{"object": "error", "message": ...}`` — so the message is pulled out of either.
"""

from __future__ import annotations

from typing import Any

import httpx

from adapters.base import AdapterError
from adapters.tokenize_cache import TokenizeCache


def error_message(response: httpx.Response) -> str:
    """The engine's own error message, else the start of its body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or f"HTTP {response.status_code}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:500]


MAX_PROBE_BODY = 64 * 1024


async def probe_ok(client: httpx.AsyncClient, url: str, timeout: float) -> bool:
    """GET ``url``: True on a 2xx answer, False on any other answer or no connection. Raises ``TimeoutError``
    when the engine took the connection but did not answer within ``timeout`` (busy, not gone: the health
    loop tells the two apart, ``FleetRegistry.last_resort``); a connection that could not be made in time is
    no connection (False)."""
    try:
        async with client.stream("GET", url, timeout=timeout) as r:
            # the body says nothing the status does not: read only a short one (to keep the connection), never a
            # long one (an engine's health answer of any size was read whole, into memory, every probe)
            read = 0
            async for chunk in r.aiter_bytes():
                read += len(chunk)
                if read > MAX_PROBE_BODY:
                    break
            return r.is_success
    except httpx.ConnectTimeout:
        return False
    except httpx.TimeoutException:
        raise TimeoutError(f"{url} did not answer within {timeout:g} s") from None
    except httpx.HTTPError:
        return False


async def post_json(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float) -> Any:
    """POST a JSON body and return the decoded JSON answer, or raise ``AdapterError``."""
    try:
        r = await client.post(url, json=body, timeout=timeout)
    except httpx.HTTPError as e:
        raise AdapterError(f"{url}: {type(e).__name__}: {e}") from e
    if not r.is_success:
        raise AdapterError(f"{url}: HTTP {r.status_code}: {error_message(r)}", status=r.status_code)
    try:
        return r.json()
    except ValueError as e:
        raise AdapterError(f"{url}: answer is not JSON: {r.text[:200]!r}", status=r.status_code) from e


async def fetch_tokens(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    timeout: float,
    cache: TokenizeCache,
    key: bytes,
    *,
    batch_answer: bool = False,
) -> list[int]:
    """Token ids from an engine's ``/tokenize`` answer (``{"tokens": [...]}``), memoized under ``key``.

    ``batch_answer`` accepts a one-prompt batch answer (``{"tokens": [[...]]}``, SGLang).
    """
    cached = cache.get(key)
    if cached is not None:
        return cached
    answer = await post_json(client, url, body, timeout)
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if batch_answer and isinstance(tokens, list) and tokens and isinstance(tokens[0], list):
        tokens = tokens[0]
    if not isinstance(tokens, list):
        raise AdapterError(f"{url}: no 'tokens' list in answer")
    cache.put(key, tokens)
    return list(tokens)
