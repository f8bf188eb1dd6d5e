"""Router-side tokenization: the token cache (hits, keys, bounds) in front of a local tokenizer."""

from __future__ import annotations

from orchestrator.config import load_config
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.tokenization import RequestTokenizer, SimPromptTokenizer, TokenCache, Tokenized

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class CountingTokenizer(SimPromptTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def encode_prompt(self, prompt):
        self.calls += 1
        return super().encode_prompt(prompt)

    def encode_chat(self, messages, **kw):
        self.calls += 1
        return super().encode_chat(messages, **kw)


def tokenizer(cache: TokenCache | None = None) -> tuple[RequestTokenizer, CountingTokenizer]:
    cfg = load_config({"models": [{"name": "m", "tokenizer": "sim"}]}, environ={})
    rt = RequestTokenizer(cfg, cache=cache)
    counting = CountingTokenizer()
    rt._local["m"] = counting
    return rt, counting


async def test_repeated_requests_are_tokenized_once():
    rt, tok = tokenizer()
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there " * 50}]}
    first = await rt.token_ids("m", CHAT, body)
    again = await rt.token_ids("m", CHAT, {**body, "max_tokens": 5, "stream": True})  # routing-irrelevant
    assert first == again and first and tok.calls == 1
    assert rt.cache.hits == 1
    again.append(-1)  # callers get their own list
    assert await rt.token_ids("m", CHAT, body) == first


async def test_everything_the_template_reads_is_in_the_key():
    rt, tok = tokenizer()
    msgs = [{"role": "user", "content": "same words"}]
    a = await rt.token_ids("m", CHAT, {"messages": msgs})
    b = await rt.token_ids("m", CHAT, {"messages": msgs, "add_generation_prompt": False})
    assert tok.calls == 2 and a != b
    await rt.token_ids("m", CHAT, {"messages": [{"role": "user", "content": "same words!"}]})
    await rt.token_ids("m", COMPLETIONS, {"prompt": "same words"})
    assert tok.calls == 4
    # Key order inside a message does not matter.
    await rt.token_ids("m", CHAT, {"messages": [{"content": "same words", "role": "user"}]})
    assert tok.calls == 4


async def test_token_id_prompts_and_untokenizable_bodies_bypass_the_cache():
    rt, tok = tokenizer()
    assert await rt.token_ids("m", COMPLETIONS, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    batched = {"prompt": ["two", "prompts"]}  # routed by load: no single token sequence
    assert await rt.token_ids("m", COMPLETIONS, batched) is None
    assert await rt.token_ids("m", CHAT, {"messages": []}) is None
    assert len(rt.cache) == 0 and tok.calls == 0


def test_cache_is_bounded_by_entries_and_tokens():
    cache = TokenCache(max_entries=3, max_tokens=100)
    for i in range(5):
        cache.put(bytes([i]), Tokenized([i] * 10))
    assert len(cache) == 3 and cache.get(bytes([0])) is None and cache.get(bytes([4])).ids == [4] * 10
    cache.get(bytes([2]))  # recently used: survives the next eviction
    cache.put(b"big", Tokenized(list(range(90))))  # 30 + 90 > 100 tokens: the least recently used go
    assert list(cache._items) == [bytes([2]), b"big"]  # 3 and 4 evicted, 2 kept (recently used)
    cache.put(b"huge", Tokenized(list(range(101))))  # larger than the whole cache: not kept
    assert cache.get(b"huge") is None


async def test_block_hashes_are_memoized_per_hasher():
    rt, tok = tokenizer()
    body = {"prompt": " ".join(f"w{i}" for i in range(100))}
    a = await rt.tokenize("m", COMPLETIONS, body)
    h16, h32 = BlockHasher("m", 16), BlockHasher("m", 32)
    assert a.block_hashes(h16) == h16.hash_blocks(a.ids) and len(a.block_hashes(h16)) == 6
    b = await rt.tokenize("m", COMPLETIONS, dict(body))  # cache hit: the same entry, hashes reused
    assert b is a and b.block_hashes(h16) is a.block_hashes(h16)
    assert b.block_hashes(h32) == h32.hash_blocks(a.ids) and len(b.block_hashes(h32)) == 3
    assert tok.calls == 1


async def test_a_tokenizer_failure_routes_on_load_instead_of_failing_the_request():
    from orchestrator.fleet.registry import FleetRegistry
    from orchestrator.kv.memory_index import MemoryPrefixIndex
    from orchestrator.kv.tracker import PrefixTracker
    from orchestrator.router.types import RouteRequest

    cfg = load_config({"models": [{"name": "m", "tokenizer": "sim"}],
                       "workers": [{"id": "w", "url": "http://127.0.0.1:1", "models": ["m"]}]}, environ={})
    rt, tok = tokenizer()

    def broken(prompt):
        raise RuntimeError("tokenizer exploded")

    tok.encode_prompt = broken
    fleet = FleetRegistry.from_config(cfg)
    tracker = PrefixTracker(cfg, fleet, MemoryPrefixIndex(), rt)
    req = RouteRequest(request_id="r", model="m", prompt_tokens=7)
    req = await tracker.annotate(req, {"prompt": "hello", "user": "ann"}, COMPLETIONS, fleet.workers())
    assert req.overlaps == {} and req.block_hashes == [] and req.prompt_tokens == 7
    assert req.session_key == "user:ann" and tracker.annotate_failures == 1


def _tiny_hf_tokenizer_dir(path):
    """A real (tiny) byte-level BPE tokenizer with a chat template, trained here in milliseconds."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the prefix cache routes requests to workers"] * 50, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}"}))
    return tok


async def test_long_prompts_tokenized_off_the_loop_give_the_same_ids(tmp_path):
    from orchestrator.kv import tokenization

    raw = _tiny_hf_tokenizer_dir(tmp_path)
    cfg = load_config({"models": [{"name": "m", "tokenizer": str(tmp_path)}]}, environ={})
    rt = RequestTokenizer(cfg)
    long_text = "the prefix cache routes requests to workers " * (tokenization.OFFLOAD_CHARS // 40 + 10)
    assert len(long_text) > tokenization.OFFLOAD_CHARS  # takes the thread path
    ids = await rt.token_ids("m", COMPLETIONS, {"prompt": long_text})
    assert ids == raw.encode(long_text, add_special_tokens=True).ids
    chat = await rt.token_ids("m", CHAT, {"messages": [{"role": "user", "content": long_text}]})
    assert chat == raw.encode(f"<|user|>{long_text}\n<|assistant|>", add_special_tokens=False).ids
    short = await rt.token_ids("m", COMPLETIONS, {"prompt": "the cache"})  # inline path
    assert short == raw.encode("the cache", add_special_tokens=True).ids
