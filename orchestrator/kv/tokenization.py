"""Router-side tokenization: the token ids an engine will compute for a request, without asking it.

Three sources, tried in this order for a model:

1. **Local tokenizer files** (``models[].tokenizer`` = a directory with ``tokenizer.json``): the
   ``tokenizers`` library plus the chat template (``chat_template.jinja`` or the ``chat_template``
   entry of ``tokenizer_config.json``) rendered with jinja2 the way transformers does for vLLM:
   sandboxed, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``raise_exception``,
   ``strftime_now``, a non-escaping ``tojson``, the special tokens as variables. Chat prompts are
   encoded without extra special tokens, completions prompts with them (vLLM's defaults).
2. **The simulator's tokenizer** (``tokenizer: sim``, or any worker of engine ``sim``): local and exact.
3. **The engine's /tokenize** through its adapter (which caches by content), for everything else.

Returns None when the request cannot be tokenized (e.g. images in a chat, engine unreachable):
routing then falls back to load only for that request. Never raises on client input.

Results are cached (``TokenCache``: bounded LRU keyed by a 128-bit hash of the model and of what
the template or tokenizer reads from the body), because clients resend the same prompts (retries,
benchmarks, fixed few-shot prompts) and rendering a chat template + tokenizing an 8k-token prompt
costs milliseconds with HF tokenizer files. A long prompt not in the cache is first tokenized only
up to its head (``RequestTokenizer.head_probe``; the tracker routes on it when no cache holds even
its first block: docs/prefix-index.md "Head first").
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import jinja2
import jinja2.ext
import jinja2.sandbox
import orjson
import xxhash
from tokenizers import Tokenizer

from adapters.base import EngineAdapter, EngineKind
from orchestrator.config import DyadConfig
from orchestrator.fleet.worker import Worker
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.message_content import Untokenizable, message_text
from orchestrator.kv.word_tokenizer import SimTokenizer
from orchestrator.loop_thread import on_loop_thread

log = logging.getLogger("dyad.kv.tokenization")

SIM_TOKENIZER = "sim"


OFFLOAD_CHARS = 16_384  # prompts longer than this are tokenized off the event loop
# Head first (``RequestTokenizer.head_probe``): a prompt of more than 4 heads is first tokenized up to about
# ``head_chars(block_size)`` characters (cut at whitespace): enough for a few blocks at any characters per
# token (~1 for CJK, ~4 for English). When no cache holds even its first block, the decision needs no more.
HEAD_CHARS_PER_BLOCK = 16
HEAD_CHARS_MIN, HEAD_CHARS_MAX = 512, 8_192


def head_chars(block_size: int) -> int:
    """How many characters of a long prompt ``head_probe`` tokenizes first."""
    return min(max(HEAD_CHARS_PER_BLOCK * block_size, HEAD_CHARS_MIN), HEAD_CHARS_MAX)


def _text_size(prompt_or_messages: Any) -> int:
    if isinstance(prompt_or_messages, str):
        return len(prompt_or_messages)
    size = 0
    for m in prompt_or_messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return size


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in the same jinja2 environment transformers uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class HfTokenizer:
    """A model's tokenizer files, loaded once: fast tokenizer + chat template."""

    def __init__(self, directory: str | Path) -> None:
        d = Path(directory).expanduser()
        self.directory = d
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = None
        if (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            template = cfg["chat_template"]
        elif isinstance(cfg.get("chat_template"), list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in cfg["chat_template"] if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.template = compile_chat_template(template) if template else None
        self.special_tokens = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if (v := _special(cfg.get(k))) is not None}

    def _encode(self, text: str, special: bool, off_loop: bool) -> list[int]:
        if off_loop:  # (on a thread: ``encode_batch`` lets go of the GIL while it works, ``encode`` does not)
            return self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def encode_prompt(self, prompt: str, *, off_loop: bool = False) -> list[int]:
        return self._encode(prompt, True, off_loop)

    def render_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Any = None, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        if self.template is None:
            raise Untokenizable("the tokenizer has no chat template")
        conv = []
        for m in messages:
            if not isinstance(m, dict):
                raise Untokenizable("a message is not an object")
            conv.append({**m, "content": message_text(m.get("content"))})
        kwargs = dict(self.special_tokens)
        kwargs.update(chat_template_kwargs or {})
        marker = "\x00DYAD_CONTINUE\x00"
        if continue_final_message and conv:
            conv[-1] = {**conv[-1], "content": conv[-1]["content"] + marker}
        try:
            text = self.template.render(messages=conv, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise Untokenizable(f"chat template: {e}") from e
        if continue_final_message and marker in text:
            text = text[: text.rindex(marker)]
        return text

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, off_loop: bool = False, **kw: Any) -> list[int]:
        return self._encode(self.render_chat(messages, **kw), False, off_loop)


class SimPromptTokenizer:
    """The simulator's word tokenizer behind the same two calls."""

    def __init__(self) -> None:
        self.sim = SimTokenizer()

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.sim.encode(prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                    **_: Any) -> list[int]:
        return self.sim.encode_chat(messages, add_generation_prompt=add_generation_prompt)


LocalTokenizer = HfTokenizer | SimPromptTokenizer


def _chat_options(body: dict[str, Any]) -> dict[str, Any]:
    cont = bool(body.get("continue_final_message", False))
    return {
        "add_generation_prompt": bool(body.get("add_generation_prompt", not cont)),
        "continue_final_message": cont,
        "tools": body.get("tools"),
        "chat_template_kwargs": body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"),
                                                                                   dict) else None,
    }


CACHE_ENTRIES = 4096
CACHE_TOKENS = 1_000_000  # ids are Python int lists (~36 B per token): ~40 MB at most
HASHERS_PER_ENTRY = 4


def compact_ids(ids: Sequence[int]) -> Sequence[int]:
    """Token ids as an ``array('I')`` (4 bytes each, one object the garbage collector never walks; a
    list of 8k ids is 8k references it walks at every collection while the token cache holds it);
    the list itself when an id does not fit (hashing then fails the same way and routing uses load)."""
    try:
        return array.array("I", ids)
    except (OverflowError, TypeError):
        return ids


@dataclass
class Tokenized:
    """A request's token ids plus their block hashes, memoized per hasher (namespace, block size,
    salt), so a repeated prompt is neither re-tokenized nor re-hashed. Shared: do not mutate."""

    ids: Sequence[int]
    _hashes: dict[BlockHasher, list[int]] = field(default_factory=dict)

    def block_hashes(self, hasher: BlockHasher) -> list[int]:
        hashes = self._hashes.get(hasher)
        if hashes is None:
            if len(self._hashes) >= HASHERS_PER_ENTRY:
                self._hashes.clear()
            hashes = self._hashes[hasher] = hasher.hash_blocks(self.ids)
        return hashes


class TokenCache:
    """Bounded LRU: request key → ``Tokenized``, bounded by entries and by total tokens."""

    def __init__(self, max_entries: int = CACHE_ENTRIES, max_tokens: int = CACHE_TOKENS) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._items: OrderedDict[bytes, Tokenized] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def key(model: str, chat: bool, body: dict[str, Any]) -> bytes | None:
        """A digest of everything that decides the token ids (None if the body cannot be keyed)."""
        if chat:
            parts = [model, 1, body.get("messages"), body.get("tools"), body.get("add_generation_prompt"),
                     body.get("continue_final_message"), body.get("chat_template_kwargs")]
        else:
            parts = [model, 0, body.get("prompt")]
        try:
            raw = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
        except (TypeError, orjson.JSONEncodeError):
            return None
        return xxhash.xxh3_128_digest(raw)

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def get(self, key: bytes) -> Tokenized | None:
        entry = self._items.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes, entry: Tokenized) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._tokens -= len(old.ids)
        if len(entry.ids) > self.max_tokens:
            return
        self._items[key] = entry
        self._tokens += len(entry.ids)
        while len(self._items) > self.max_entries or self._tokens > self.max_tokens:
            _k, gone = self._items.popitem(last=False)
            self._tokens -= len(gone.ids)


class RequestTokenizer:
    """Token ids of a chat or completions body for a model, from the cheapest exact source."""

    def __init__(self, config: DyadConfig, http: httpx.AsyncClient | None = None,
                 adapter_for: Callable[[EngineKind], EngineAdapter] | None = None,
                 timeout_s: float = 5.0, cache: TokenCache | None = None) -> None:
        self.config = config
        self.http = http
        self.adapter_for = adapter_for
        self.timeout_s = timeout_s
        self.cache = cache if cache is not None else TokenCache()
        self._local: dict[str, LocalTokenizer | None] = {}
        self.engine_calls = 0
        self.failures = 0
        self.head_first: dict[str, bool] = {}  # model → False once a head tokenized differently (verify_head)
        self.head_mismatches = 0

    def local_for(self, model: str, candidates: Sequence[Worker] = ()) -> LocalTokenizer | None:
        if model in self._local:
            return self._local[model]
        mc = self.config.model(model)
        tok: LocalTokenizer | None = None
        if mc is not None and mc.tokenizer:
            if mc.tokenizer == SIM_TOKENIZER:
                tok = SimPromptTokenizer()
            else:
                try:
                    tok = HfTokenizer(mc.tokenizer)
                except (OSError, ValueError, Exception) as e:  # noqa: BLE001 - a broken dir must not break routing
                    log.warning("model %s: cannot load tokenizer from %s (%s); using the engine's /tokenize",
                                model, mc.tokenizer, e)
        elif candidates and all(w.engine is EngineKind.SIM for w in candidates):
            tok = SimPromptTokenizer()
        if tok is not None or candidates:
            self._local[model] = tok
        return tok

    def head_probe(self, model: str, endpoint: str, body: dict[str, Any], candidates: Sequence[Worker] = (),
                   block_size: int = 32) -> tuple[Sequence[int], int] | None:
        """(token ids of the prompt's head, the whole prompt's tokens extrapolated from the head's tokens
        per character) for a long prompt of a model with local HF tokenizer files that is not in the
        token cache; None otherwise (tokenize it all).

        The head is the rendered prompt (chat template included) up to the last whitespace before
        ``head_chars(block_size)``: merges of the tokenizers Dyad reads (byte-level BPE,
        SentencePiece-style BPE) do not cross whitespace, so these ids are the leading ids of the whole prompt's, except
        possibly the last word's: the caller drops the head's last block. ``verify_head`` checks
        that against the whole prompt's ids after the send, and a mismatch turns this off for the
        model. About 0.1 ms instead of milliseconds for a long prompt."""
        if not self.head_first.get(model, True):
            return None
        chat = endpoint.endswith("chat/completions")
        arg = body.get("messages") if chat else body.get("prompt")
        if not chat and isinstance(arg, list) and len(arg) == 1 and isinstance(arg[0], str):
            arg = arg[0]
        size = head_chars(block_size)
        if not (isinstance(arg, str) or (chat and isinstance(arg, list) and arg)) or _text_size(arg) <= 4 * size:
            return None
        local = self.local_for(model, candidates)
        if not isinstance(local, HfTokenizer):
            return None
        key = TokenCache.key(model, chat, body)
        if key is None or key in self.cache:
            return None
        try:
            text = local.render_chat(arg, **_chat_options(body)) if chat else arg
        except Untokenizable:
            return None
        cut = max(text.rfind(" ", 0, size), text.rfind("\n", 0, size))
        if cut < size // 2:  # no whitespace to cut at (e.g. CJK without spaces): tokenize it all
            return None
        ids = local.tokenizer.encode(text[:cut], add_special_tokens=not chat).ids
        return ids, max(len(ids), round(len(ids) * len(text) / cut))

    def verify_head(self, model: str, head: Sequence[int], whole: Sequence[int]) -> bool:
        """After the send: were ``head`` (the ids the decision used) the leading ids of the whole
        prompt's? If not, head-first tokenization is turned off for ``model`` (logged once)."""
        if len(whole) >= len(head) and list(whole[: len(head)]) == list(head):
            return True
        self.head_mismatches += 1
        if self.head_first.get(model, True):
            self.head_first[model] = False
            log.warning("model %s: the head of a prompt tokenized differently from the whole prompt; "
                        "tokenizing whole prompts before routing from now on", model)
        return False

    async def token_ids(self, model: str, endpoint: str, body: dict[str, Any],
                        candidates: Sequence[Worker] = ()) -> list[int] | None:
        """The request's token ids (a new list), or None when it cannot be tokenized."""
        tok = await self.tokenize(model, endpoint, body, candidates)
        return None if tok is None else list(tok.ids)

    async def tokenize(self, model: str, endpoint: str, body: dict[str, Any],
                       candidates: Sequence[Worker] = (), *, off_loop: bool = False) -> Tokenized | None:
        """Like ``token_ids`` but returns the cached, shared ``Tokenized`` (block hashes memoized).
        ``off_loop``: local HF tokenizer files work on a thread whatever the prompt's length (work
        done after a request was sent must not hold the event loop, i.e. its answer)."""
        chat = endpoint.endswith("chat/completions")
        if not chat and isinstance(body.get("prompt"), list) and body["prompt"] \
                and all(isinstance(t, int) for t in body["prompt"]):
            return Tokenized(compact_ids(body["prompt"]))  # already token ids
        key = TokenCache.key(model, chat, body)
        if key is not None:
            cached = self.cache.get(key)
            if cached is not None:
                return cached
        ids = await self._token_ids(model, chat, body, candidates, off_loop)
        if ids is None:
            return None
        tok = Tokenized(compact_ids(ids))
        if key is not None:
            self.cache.put(key, tok)
        return tok

    async def _token_ids(self, model: str, chat: bool, body: dict[str, Any],
                         candidates: Sequence[Worker], off_loop: bool = False) -> list[int] | None:
        prompt = body.get("prompt")
        messages = body.get("messages")
        if not chat:
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return None  # batched or malformed prompts: the gateway validates, routing uses load
        elif not isinstance(messages, list) or not messages:
            return None
        local = self.local_for(model, candidates)
        if local is not None:
            try:
                if chat:
                    encode, arg, kw = local.encode_chat, messages, _chat_options(body)
                else:
                    encode, arg, kw = local.encode_prompt, prompt, {}
                if isinstance(local, HfTokenizer) and (off_loop or _text_size(arg) > OFFLOAD_CHARS):
                    # A long prompt takes milliseconds in the Rust tokenizer: on a thread, through the call
                    # that lets go of the GIL (``HfTokenizer._encode``), so the event loop keeps serving
                    # other requests meanwhile.
                    return await asyncio.to_thread(encode, arg, off_loop=True, **kw)
                return encode(arg, **kw)
            except Untokenizable as e:
                log.debug("model %s: not tokenized locally: %s", model, e)
                return None
        return await self._engine_tokenize(model, chat, prompt, messages, candidates)

    async def _engine_tokenize(self, model: str, chat: bool, prompt: Any, messages: Any,
                               candidates: Sequence[Worker]) -> list[int] | None:
        if self.http is None or self.adapter_for is None or not candidates:
            return None
        worker = candidates[0]
        adapter = self.adapter_for(worker.engine)
        self.engine_calls += 1
        await on_loop_thread()  # (network I/O: on the loop's thread, never the native plane's)
        try:
            if chat:
                return await adapter.tokenize(self.http, worker.url, model, messages=messages,
                                              timeout=self.timeout_s)
            return await adapter.tokenize(self.http, worker.url, model, prompt=prompt, timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - unreachable engine, unsupported dialect: route by load
            self.failures += 1
            log.debug("model %s: engine tokenize on %s failed: %s", model, worker.id, e)
            return None
