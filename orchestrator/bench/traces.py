"""Public serving traces turned into one request type, ``TraceRequest``.

Four formats are read (the public traces' README describes them; trace_paths.py finds the directory):

- **Mooncake JSONL** — ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one id per
  512-token block; equal ids mean an identical prefix block). There is no text, so prompts are
  synthesized: every hash id maps, deterministically, to one block of ``block_tokens`` words drawn from
  a synthetic vocabulary whose words the simulator's tokenizer counts as exactly one token each. Equal
  ids therefore give byte-identical blocks, and a prompt's token count equals its word count.
- **Azure CSV** — ``TIMESTAMP,ContextTokens,GeneratedTokens``; no prefix information, so every prompt
  gets its own (unshared) words.
- **AIBrix JSONL** — ``{"timestamp": ms, "requests": [{"Prompt Length", "Output Length", "prompt"}]}``.
- **ShareGPT** (JSONL, optionally gzip) — real multi-turn chats. Each user turn becomes one request
  whose messages are the whole conversation so far, so turns of one conversation share prefixes.
  The format has no timestamps: conversations start at a fixed rate and turns follow after a think time.

Synthesized prompts are built lazily (``TraceRequest.render_prompt``): a full Mooncake trace is
~60 M tokens, too much text to hold at once. ``synthesize_token_ids`` gives the same content as token
ids, for the virtual-time simulator (no text round trip).
"""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import math
import random
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from orchestrator.sim.tokenizer import DEFAULT_VOCAB_SIZE as DEFAULT_SIM_VOCAB
from orchestrator.sim.tokenizer import SimTokenizer

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces

# A synthetic vocabulary: two-syllable lowercase words ("bada", "kopi", ...). Plain ASCII letters, no
# punctuation, so a whitespace tokenizer sees exactly one token per word.
_CONSONANTS = "bdfghjklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 80
VOCAB_SIZE = len(_SYLLABLES) ** 2  # 6400
_WORDS = [a + b for a in _SYLLABLES for b in _SYLLABLES]


def word(token_id: int) -> str:
    """The synthetic word for a token id (ids wrap around the vocabulary)."""
    return _WORDS[token_id % VOCAB_SIZE]


def words_to_text(token_ids: Iterable[int]) -> str:
    return " ".join(_WORDS[t % VOCAB_SIZE] for t in token_ids)


class BlockSynthesizer:
    """Deterministic blocks of synthetic word indices keyed by hash id: ``block(h)`` is the same list for the same
    (seed, h, block_tokens), and different ids give (with overwhelming probability) different blocks.

    Keeps an LRU of recently built blocks because consecutive requests of a trace reuse prefixes.
    """

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS, *, seed: int = 0,
                 vocab_size: int = VOCAB_SIZE, cache_blocks: int = 8192) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self.seed = seed
        self.vocab_size = vocab_size
        self._cache: OrderedDict[int, list[int]] = OrderedDict()
        self._text_cache: OrderedDict[int, str] = OrderedDict()
        self._cap = cache_blocks

    def block(self, hash_id: int) -> list[int]:
        ids = self._cache.get(hash_id)
        if ids is not None:
            self._cache.move_to_end(hash_id)
            return ids
        rng = random.Random((self.seed << 40) ^ (hash_id * 0x9E3779B1) ^ 0x5F3759DF)
        raw = array("H", rng.randbytes(2 * self.block_tokens))
        ids = [x % self.vocab_size for x in raw]
        self._cache[hash_id] = ids
        if len(self._cache) > self._cap:
            self._cache.popitem(last=False)
        return ids

    def block_text(self, hash_id: int) -> str:
        text = self._text_cache.get(hash_id)
        if text is not None:
            self._text_cache.move_to_end(hash_id)
            return text
        text = words_to_text(self.block(hash_id))
        self._text_cache[hash_id] = text
        if len(self._text_cache) > self._cap:
            self._text_cache.popitem(last=False)
        return text

    def block_lengths(self, hash_ids: Sequence[int], input_len: int) -> list[int]:
        """Tokens taken from each block: full blocks, the last one cut so the total is ``input_len``."""
        n = len(hash_ids)
        if n == 0:
            return []
        last = input_len - (n - 1) * self.block_tokens
        last = min(max(last, 1), self.block_tokens)
        return [self.block_tokens] * (n - 1) + [last]

    def token_ids(self, hash_ids: Sequence[int], input_len: int) -> list[int]:
        out: list[int] = []
        for h, m in zip(hash_ids, self.block_lengths(hash_ids, input_len), strict=True):
            b = self.block(h)
            out.extend(b if m == len(b) else b[:m])
        return out

    def text(self, hash_ids: Sequence[int], input_len: int) -> str:
        parts: list[str] = []
        for h, m in zip(hash_ids, self.block_lengths(hash_ids, input_len), strict=True):
            parts.append(self.block_text(h) if m == self.block_tokens else words_to_text(self.block(h)[:m]))
        return " ".join(parts)


_SIM_TABLES: dict[int, list[int]] = {}


def sim_token_table(sim_vocab_size: int = DEFAULT_SIM_VOCAB) -> list[int]:
    """Synthetic word index → the id ``SimTokenizer(sim_vocab_size)`` gives that word."""
    table = _SIM_TABLES.get(sim_vocab_size)
    if table is None:
        tok = SimTokenizer(sim_vocab_size)
        table = _SIM_TABLES[sim_vocab_size] = [tok.token_id(w) for w in _WORDS]
    return table


def synthesize_token_ids(hash_ids: Sequence[int], input_len: int, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                         seed: int = 0, sim_vocab_size: int = DEFAULT_SIM_VOCAB,
                         synthesizer: BlockSynthesizer | None = None) -> list[int]:
    """Token ids for a hash-id prompt: exactly what ``SimTokenizer(sim_vocab_size).encode`` returns for
    the synthesized prompt text, computed without building the text. Equal hash ids → equal id blocks.

    Pass a shared ``synthesizer`` when converting many requests (it caches blocks)."""
    synth = synthesizer or BlockSynthesizer(block_tokens, seed=seed)
    table = sim_token_table(sim_vocab_size)
    return [table[w] for w in synth.token_ids(hash_ids, input_len)]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, format-independent.

    ``input_len``/``output_len`` are tokens as the trace states them (after any scaling). A request has
    a literal ``prompt``, literal chat ``messages``, or ``hash_ids`` from which a prompt is synthesized.
    """

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    session_id: str | None = None
    synthesizer: BlockSynthesizer | None = field(default=None, repr=False, compare=False)

    def render_prompt(self) -> str:
        """The prompt as one string (chat messages are joined; hash ids are synthesized)."""
        if self.prompt is not None:
            return self.prompt
        if self.messages is not None:
            return "\n".join(m["content"] for m in self.messages)
        if self.synthesizer is not None:
            return self.synthesizer.text(self.hash_ids, self.input_len)
        return words_to_text(_unique_ids(self.index, self.input_len))

    def render_messages(self) -> list[dict[str, str]]:
        """The request as chat messages (a single user message unless the trace has real ones)."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.render_prompt()}]

    def token_ids(self, sim_vocab_size: int = DEFAULT_SIM_VOCAB) -> list[int]:
        """Token ids of the prompt as ``SimTokenizer`` encodes ``render_prompt()`` (no text built for
        synthesized prompts)."""
        if self.prompt is None and self.messages is None:
            table = sim_token_table(sim_vocab_size)
            words = (self.synthesizer.token_ids(self.hash_ids, self.input_len) if self.synthesizer is not None
                     else _unique_ids(self.index, self.input_len))
            return [table[w] for w in words]
        return SimTokenizer(sim_vocab_size).encode(self.render_prompt())


def _unique_ids(index: int, n: int) -> list[int]:
    """Words for a request with no prefix information: seeded by its index, not shared."""
    rng = random.Random(0xA2E ^ (index * 0x9E3779B1))
    raw = array("H", rng.randbytes(2 * max(n, 0)))
    return [x % VOCAB_SIZE for x in raw]


def open_text(path: str | Path):
    p = Path(path)
    if p.suffix == ".gz":
        return gzip.open(p, "rt", encoding="utf-8")
    return p.open("r", encoding="utf-8")


def _scaled(n: int, factor: float) -> int:
    return max(1, round(n * factor)) if n > 0 else 0


# ---------------------------------------------------------------------------------------------- loaders


def load_mooncake(path: str | Path, *, scale_len: float = 1.0, scale_output: float | None = None,
                  time_scale: float = 1.0, limit: int | None = None, seed: int = 0,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Mooncake JSONL. ``scale_len`` shrinks every hash block to ``round(block_tokens * scale_len)`` words
    (input lengths scale with it, block sharing is preserved exactly); ``scale_output`` scales output
    lengths (default: same as ``scale_len``); ``time_scale`` multiplies arrival times (0.5 = twice as fast).
    """
    if scale_len <= 0 or time_scale <= 0:
        raise ValueError("scale_len and time_scale must be > 0")
    out_factor = scale_len if scale_output is None else scale_output
    block = max(1, round(block_tokens * scale_len))
    synth = BlockSynthesizer(block, seed=seed)
    reqs: list[TraceRequest] = []
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            row = _json_row(path, lineno, line, ("timestamp", "input_length", "output_length"))
            # (without hash_ids — a length-only trace — every prompt is its own: no prefix is shared)
            hash_ids = tuple(int(h) for h in row.get("hash_ids") or ())
            in_len = int(row["input_length"])
            if scale_len != 1.0:
                # Scale the last (partial) block in proportion, keep full blocks full.
                n = len(hash_ids)
                tail = in_len - (n - 1) * block_tokens if n else 0
                in_len = (n - 1) * block + max(1, round(tail * block / block_tokens)) if n else _scaled(in_len, scale_len)
            reqs.append(TraceRequest(
                index=len(reqs), arrival_s=float(row["timestamp"]) / 1000.0 * time_scale, input_len=in_len,
                output_len=max(1, _scaled(int(row["output_length"]), out_factor)), hash_ids=hash_ids,
                synthesizer=synth if hash_ids else None))
            if limit is not None and len(reqs) >= limit:
                break
    return _sorted(reqs)


def _json_row(path: str | Path, lineno: int, line: str, required: Sequence[str]) -> dict[str, Any]:
    """One JSONL row, or a ValueError naming the file, the line and what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {lineno}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}, line {lineno}: a JSON object per line expected")
    missing = [k for k in required if k not in row]
    if missing:
        raise ValueError(f"{path}, line {lineno}: no {', '.join(missing)} (has {', '.join(sorted(row)) or 'nothing'})")
    return row


def _parse_azure_time(s: str) -> float:
    """Seconds of a CSV timestamp: a number of seconds (BurstGPT) or a date and time (Azure, with or
    without fractional seconds beyond microseconds and a UTC offset)."""
    s = s.strip()
    try:
        return float(s)
    except ValueError:
        pass
    if "." in s:
        head, frac = s.split(".", 1)
        digits = len(frac) - len(frac.lstrip("0123456789"))
        s = f"{head}.{frac[:min(digits, 6)]}{frac[digits:]}"
    return datetime.fromisoformat(s).timestamp()


# Column names of the CSV traces (compared without case, spaces or underscores): Azure's LLM inference
# traces (2023, 2024), BurstGPT, and plain names.
CSV_TIME = ("timestamp", "time", "arrivaltime", "arrival")
CSV_INPUT = ("contexttokens", "requesttokens", "inputlength", "inputtokens", "prompttokens", "promptlength")
CSV_OUTPUT = ("generatedtokens", "responsetokens", "outputlength", "outputtokens", "completiontokens")


def _csv_columns(path: str | Path, header: Sequence[str]) -> tuple[str, str, str]:
    norm = {h.lower().replace(" ", "").replace("_", ""): h for h in header}
    picked = []
    for what, names in (("arrival time", CSV_TIME), ("prompt length", CSV_INPUT), ("output length", CSV_OUTPUT)):
        col = next((norm[n] for n in names if n in norm), None)
        if col is None:
            raise ValueError(f"{path}: no {what} column (one of {', '.join(names)}; the header has "
                             f"{', '.join(header)})")
        picked.append(col)
    return picked[0], picked[1], picked[2]


def load_azure(path: str | Path, *, scale_len: float = 1.0, scale_output: float | None = None,
               time_scale: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """A CSV trace: Azure LLM inference (``TIMESTAMP,ContextTokens,GeneratedTokens``), BurstGPT
    (``Timestamp`` in seconds, ``Request tokens``, ``Response tokens``) or the same under plain names
    (``CSV_TIME``/``CSV_INPUT``/``CSV_OUTPUT``). Arrivals are relative to the earliest row. Prompts get
    unshared words (these traces carry no prefix information)."""
    out_factor = scale_len if scale_output is None else scale_output
    reqs: list[TraceRequest] = []
    with open_text(path) as f:
        reader = csv.DictReader(f)
        t_col, in_col, out_col = _csv_columns(path, reader.fieldnames or [])
        for lineno, row in enumerate(reader, 2):
            try:
                t = _parse_azure_time(row[t_col])
                in_len, out_len = int(float(row[in_col])), int(float(row[out_col]))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}, line {lineno}: {e}") from None
            reqs.append(TraceRequest(index=len(reqs), arrival_s=t, input_len=_scaled(in_len, scale_len),
                                     output_len=max(1, _scaled(out_len, out_factor))))
            if limit is not None and len(reqs) >= limit:
                break
    t0 = min((r.arrival_s for r in reqs), default=0.0)
    return _sorted([replace(r, arrival_s=(r.arrival_s - t0) * time_scale) for r in reqs])


def load_aibrix(path: str | Path, *, time_scale: float = 1.0, limit: int | None = None,
                scale_output: float = 1.0) -> list[TraceRequest]:
    """AIBrix workload JSONL: several requests per timestamp, with real prompt text."""
    reqs: list[TraceRequest] = []
    t0: float | None = None
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            row = _json_row(path, lineno, line, ("timestamp", "requests"))
            t = float(row["timestamp"]) / 1000.0
            t0 = t if t0 is None else t0
            for r in row["requests"]:
                reqs.append(TraceRequest(
                    index=len(reqs), arrival_s=(t - t0) * time_scale, input_len=int(r["Prompt Length"]),
                    output_len=max(1, _scaled(int(r["Output Length"]), scale_output)), prompt=r["prompt"]))
                if limit is not None and len(reqs) >= limit:
                    return _sorted(reqs)
    return _sorted(reqs)


_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "assistant": "assistant", "system": "system"}


def load_sharegpt(path: str | Path, *, session_rate: float = 1.0, think_time_s: float = 5.0,
                  time_scale: float = 1.0, limit: int | None = None, max_conversations: int | None = None,
                  max_turns: int | None = None, max_output: int = 1024, seed: int = 0) -> list[TraceRequest]:
    """ShareGPT multi-turn chats. Conversation ``c`` starts at ``c / session_rate`` seconds; its turn
    ``k`` arrives ``k * think_time_s`` later. Turn ``k``'s messages are every message before the
    (k+1)-th assistant reply (the recorded replies stand in for the model's), so consecutive turns
    share their whole history as a prefix. Lengths are word counts (the simulator's token count).
    """
    if session_rate <= 0:
        raise ValueError("session_rate must be > 0")
    if max_conversations is None and limit is not None:
        max_conversations = limit  # every conversation yields >= 1 request
    reqs: list[TraceRequest] = []
    conv = 0
    with open_text(path) as f:
        for lineno, row in _sharegpt_rows(path, f):
            if not isinstance(row, dict):
                raise ValueError(f"{path}, {lineno}: a conversation object expected")
            turns = [(_ROLE.get(str(m.get("from", "")).lower()), str(m.get("value", "")))
                     for m in row.get("conversations", [])]
            turns = [(r, v) for r, v in turns if r is not None and v.strip()]
            history: list[dict[str, str]] = []
            made = 0
            start = conv / session_rate
            for i, (role, text) in enumerate(turns):
                if role == "user":
                    reply = next((v for r, v in turns[i + 1:i + 2] if r == "assistant"), None)
                    msgs = tuple(history + [{"role": "user", "content": text}])
                    in_len = sum(len(m["content"].split()) for m in msgs)
                    out_len = min(max(1, len(reply.split())) if reply else 128, max_output)
                    reqs.append(TraceRequest(
                        index=0, arrival_s=(start + made * think_time_s) * time_scale, input_len=in_len,
                        output_len=out_len, messages=msgs, session_id=str(row.get("id", conv))))
                    made += 1
                    if max_turns is not None and made >= max_turns:
                        break
                history.append({"role": role, "content": text})
            if made:
                conv += 1
            if max_conversations is not None and conv >= max_conversations:
                break
    out = _sorted(reqs)
    return out[:limit] if limit is not None else out


def _sharegpt_rows(path: str | Path, f: Any) -> Iterable[tuple[str, Any]]:
    """ShareGPT conversations from JSONL (one per line) or from one JSON array (the dataset's own
    ``.json`` files), each with where it is (for errors)."""
    head = f.read(1)
    while head and head.isspace():
        head = f.read(1)
    if head == "[":
        try:
            rows = json.loads(head + f.read())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
        yield from ((f"item {i}", row) for i, row in enumerate(rows))
        return
    for lineno, line in enumerate(itertools.chain([head + f.readline()], f), 1):
        line = line.strip()
        if line:
            try:
                yield f"line {lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not JSON ({e.msg})") from None


def _sorted(reqs: list[TraceRequest]) -> list[TraceRequest]:
    reqs = sorted(reqs, key=lambda r: (r.arrival_s, r.index))
    return [replace(r, index=i) if r.index != i else r for i, r in enumerate(reqs)]


FORMATS = ("mooncake", "azure", "aibrix", "sharegpt")


def load_trace(path: str | Path, fmt: str, *, scale_len: float = 1.0, time_scale: float = 1.0,
               limit: int | None = None, **kwargs: Any) -> list[TraceRequest]:
    """Load any supported format by name (``mooncake|azure|aibrix|sharegpt``)."""
    if fmt == "mooncake":
        return load_mooncake(path, scale_len=scale_len, time_scale=time_scale, limit=limit, **kwargs)
    if fmt == "azure":
        return load_azure(path, scale_len=scale_len, time_scale=time_scale, limit=limit, **kwargs)
    if fmt == "aibrix":
        return load_aibrix(path, time_scale=time_scale, limit=limit, **kwargs)
    if fmt == "sharegpt":
        return load_sharegpt(path, time_scale=time_scale, limit=limit, **kwargs)
    raise ValueError(f"unknown trace format '{fmt}' (choose from {', '.join(FORMATS)})")


# ---------------------------------------------------------------------------------------------- slicing


def time_window(reqs: Sequence[TraceRequest], start_s: float, end_s: float) -> list[TraceRequest]:
    """Requests arriving in [start_s, end_s), re-based so the window starts at 0."""
    kept = [r for r in reqs if start_s <= r.arrival_s < end_s]
    return [replace(r, index=i, arrival_s=r.arrival_s - start_s) for i, r in enumerate(kept)]


def rescale_time(reqs: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply every arrival time by ``factor`` (0.5 = the same trace twice as fast)."""
    return [replace(r, arrival_s=r.arrival_s * factor) for r in reqs]


# ---------------------------------------------------------------------------------------------- analysis


def ideal_prefix_hit_ratio(reqs: Sequence[TraceRequest], capacity_blocks: int | None = None) -> float:
    """Share of prompt tokens an ideal prefix cache would serve from cache, replaying in order.

    Hash-id traces count each request's leading blocks already seen (a block is reusable only if
    every block before it matched too). ``capacity_blocks=None``: an infinite cache. Otherwise one
    pooled LRU cache of that many trace blocks — what a whole fleet's caches could hold if routing
    placed every block perfectly, so the upper bound any router can reach with finite memory.
    Traces with text use ``ideal_prefix_hit_ratio_tokens``.
    """
    seen: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in reqs:
        total += r.input_len
        if not r.hash_ids:
            continue
        lengths = (r.synthesizer.block_lengths(r.hash_ids, r.input_len) if r.synthesizer
                   else BlockSynthesizer().block_lengths(r.hash_ids, r.input_len))
        for h, m in zip(r.hash_ids, lengths, strict=True):
            if h not in seen:
                break
            hit += m
        for h in r.hash_ids:
            seen[h] = None
            seen.move_to_end(h)
        if capacity_blocks is not None:
            while len(seen) > capacity_blocks:
                seen.popitem(last=False)
    return hit / total if total else 0.0


def ideal_prefix_hit_ratio_tokens(token_seqs: Iterable[Sequence[Any]], block_size: int) -> float:
    """The same for literal token (or word) sequences: full blocks, chained, infinite cache."""
    seen: set[int] = set()
    hit = total = 0
    for seq in token_seqs:
        total += len(seq)
        prev = 0
        matching = True
        for start in range(0, len(seq) - block_size + 1, block_size):
            prev = hash((prev, tuple(seq[start:start + block_size])))
            if matching and prev in seen:
                hit += block_size
            else:
                matching = False
            seen.add(prev)
    return hit / total if total else 0.0


def summarize(reqs: Sequence[TraceRequest]) -> dict[str, float]:
    """Counts, duration, mean lengths and arrival rate of a trace (for reports)."""
    if not reqs:
        return {"requests": 0}
    dur = reqs[-1].arrival_s - reqs[0].arrival_s
    return {
        "requests": len(reqs),
        "duration_s": dur,
        "rate_rps": len(reqs) / dur if dur > 0 else math.inf,
        "input_mean": sum(r.input_len for r in reqs) / len(reqs),
        "output_mean": sum(r.output_len for r in reqs) / len(reqs),
        "input_max": max(r.input_len for r in reqs),
    }
