"""Annotate once: the request as routing, admission and accounting see it, built one time per request.

``annotate`` turns a validated body into a ``RouteRequest`` (an immutable value): the prompt's length (the model's tokenizer
through the router's prefix tracker when there is one; otherwise ``router.estimate``, which counts by
character class rather than chars/4), its block hashes, the prefix each worker already holds, other
gateway replicas' load, and the session key (the session header or the body's ``user``, hashed to a
fixed size: clients choose these values and the router keeps them for affinity). Admission and the
P/D split decision run on this value; each try (``attempt.py``) then only decides a worker for it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from orchestrator.router.estimate import estimate_prompt_tokens
from orchestrator.router.types import RouteRequest

if TYPE_CHECKING:
    from orchestrator.gateway.runtime import GatewayRuntime

SESSION_KEY_BYTES = 16  # affinity keys are stored as a 32-hex-digit digest, whatever the client sent


def session_key_of(header: str | None, body: dict[str, Any]) -> str | None:
    """The request's affinity key (the session header, else the body's ``user``), hashed to a fixed
    size: clients choose these values, and the router keeps them (session affinity) for a while."""
    raw = header if header else body.get("user")
    if not isinstance(raw, str) or not raw:
        return None
    kind = b"h:" if header else b"u:"
    return hashlib.blake2b(kind + raw.encode("utf-8", "surrogatepass"), digest_size=SESSION_KEY_BYTES).hexdigest()


def output_budget(body: dict[str, Any]) -> int | None:
    """The most tokens the request may generate in all: the per-choice limit (``max_completion_tokens``
    or ``max_tokens``, validated by ``request.py``) times the sequences the engine generates for it
    (``n`` choices, or ``best_of`` candidates when larger: completions). None when the client set no
    limit. Tokens-per-minute limits charge it, so ``n`` cannot multiply a request's cost unseen."""
    per_choice = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(per_choice, int):
        return None
    sequences = 1
    for name in ("n", "best_of"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > sequences:
            sequences = v
    return per_choice * sequences


def one_prompt(body: dict[str, Any]) -> bool:
    """False for a completions batch (``prompt``: several strings or token-id lists). The P/D hand-off
    carries one prompt's KV (vLLM's prefill answer to a batch holds only the first prompt's
    ``kv_transfer_params``; SGLang's bootstrap room is one per request), so a batch is never split."""
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int))


def forks(body: dict[str, Any]) -> bool:
    """True when the engine forks the request into several sequences (``n`` or ``best_of`` above 1). vLLM
    gives each child a shallow copy of the sampling parameters, so every child would read the same remote
    blocks under one transfer, which the prefill engine releases after the first read: such a request is
    prefilled on its decode worker wherever that worker can prefill (``RouteRequest.prefer_local``)."""
    for name in ("n", "best_of"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            return True
    return False


def recomputes_prompt(endpoint: str, body: dict[str, Any]) -> bool:
    """True when the request asks for its prompt's logprobs: ``prompt_logprobs``, or ``echo`` with
    ``logprobs`` (completions) or with ``top_logprobs`` not null (chat, where it defaults to 0). vLLM then
    reads no cached or transferred KV for it (``SamplingParams.skip_reading_prefix_cache``: the decode
    engine loads nothing and computes the whole prompt again), so a prefill leg elsewhere would be work
    for nothing, its blocks held by the prefill engine until they time out: it is prefilled on its decode
    worker wherever that worker can prefill (``RouteRequest.prefer_local``)."""
    if body.get("prompt_logprobs") is not None:
        return True
    if body.get("echo") is not True:
        return False
    chat = endpoint.endswith("/chat/completions")
    return body.get("top_logprobs", 0) is not None if chat else body.get("logprobs") is not None


async def annotate(rt: GatewayRuntime, headers: Any, rid: str, endpoint: str, model: str,
                   body: dict[str, Any], *, split_allowed: bool = True) -> RouteRequest:
    """The request as routing and admission see it, built once: the prompt's length (the model's
    tokenizer through the prefix tracker when there is one, else ``estimate_prompt_tokens``), block
    hashes, cached-prefix overlap per worker, other replicas' load, the hashed session key."""
    canonical = rt.config.model(model)
    max_tokens = output_budget(body)
    session_header = rt.config.router.kv_aware.session_header
    tracker = rt.router.prefix_tracker
    # With a prefix tracker the prompt is usually tokenized: the estimate (a pass over the whole prompt,
    # ~0.1 ms for 8k tokens) is made only when it was not.
    req = RouteRequest(request_id=rid, model=model,
                       prompt_tokens=estimate_prompt_tokens(endpoint, body) if tracker is None else 0,
                       max_tokens=max_tokens, block_size=canonical.block_size if canonical is not None else 32,
                       session_key=session_key_of(headers.get(session_header), body),
                       split_allowed=split_allowed and one_prompt(body),
                       prefer_local=forks(body) or recomputes_prompt(endpoint, body))
    if tracker is None:
        return req
    out = await rt.router.annotate(req, body, endpoint)
    if out.token_ids is None and not out.prompt_tokens:  # not tokenized (no worker, odd content, tokenizer
        # unavailable): estimated. (A prompt routed on its head has a count extrapolated from it: kept.)
        out = out.annotated(token_ids=None, prompt_tokens=estimate_prompt_tokens(endpoint, body),
                            block_size=out.block_size, block_hashes=out.block_hashes, overlaps=out.overlaps,
                            peer_load=out.peer_load, session_key=out.session_key)
    return out
