"""Head-first tokenization: a long prompt that no cache holds is routed on the tokens of its head.

Real (tiny) tokenizers trained here in milliseconds — a byte-level BPE (GPT-2 / Llama-3 style) and a
Metaspace BPE (SentencePiece / Llama-2 style) — on mixed text: English, code, numbers, newlines and
indentation, CJK and emoji. For both, on many texts, the head's ids without its last block are the
leading ids of the whole prompt's (completions and chat, the template included). Then the tracker:
a new long prompt is decided on its head (no token ids; its length extrapolated from the head); in
approximate mode it is tokenized whole after the send and recorded whole, so a prompt sharing its
document finds all of it; past the tokenizer's queue it keeps its head's record and the next request
with that prompt teaches the index the rest; for workers with KV events only the sampled check runs;
a tokenizer whose head does not match turns head-first off for its model and records nothing wrong.
"""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.config import load_config
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.kv import tokenization
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.kv.tokenization import RequestTokenizer, head_chars
from orchestrator.kv.tracker import PrefixTracker
from orchestrator.router.types import RouteDecision, RouteRequest
from tests.fixtures.trained_tokenizers import byte_level_bpe, corpus, metaspace_bpe

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BS = 16
@pytest.fixture(params=[byte_level_bpe, metaspace_bpe], ids=["byte-level", "metaspace"])
def model_dir(request, tmp_path):
    request.param(tmp_path)
    return tmp_path


def _tokenizer(model_dir) -> RequestTokenizer:
    cfg = load_config({"models": [{"name": "m", "tokenizer": str(model_dir), "block_size": BS}]}, environ={})
    return RequestTokenizer(cfg)


def _leading(ids, bs=BS):
    safe = len(ids) // bs - 1
    return list(ids[: safe * bs])


async def test_the_head_without_its_last_block_leads_the_whole_prompt(model_dir):
    rt = _tokenizer(model_dir)
    checked = 0
    for seed in range(12):
        text = corpus(100 + seed, 6000)
        msgs = [{"role": "system", "content": corpus(seed, 300)}, {"role": "user", "content": text}]
        for endpoint, body in ((COMPLETIONS, {"prompt": text}), (CHAT, {"messages": msgs})):
            probe = rt.head_probe("m", endpoint, body, block_size=BS)
            assert probe is not None
            whole = await rt.token_ids("m", endpoint, body)
            head = _leading(probe[0])
            assert len(head) >= BS and whole[: len(head)] == head
            assert 0.8 < probe[1] / len(whole) < 1.25  # the length extrapolated from the head's tokens per character
            checked += 1
    assert checked == 24 and rt.head_mismatches == 0


async def test_short_cached_or_unsplittable_prompts_are_tokenized_whole(model_dir):
    rt = _tokenizer(model_dir)
    assert rt.head_probe("m", COMPLETIONS, {"prompt": corpus(1, 50)}) is None  # short: cheap anyway
    long = {"prompt": corpus(2, 6000)}
    await rt.token_ids("m", COMPLETIONS, long)
    assert rt.head_probe("m", COMPLETIONS, long) is None  # in the token cache: exact and free
    assert rt.head_probe("m", COMPLETIONS, {"prompt": "模型推理缓存" * 3000}) is None  # no whitespace to cut at
    assert rt.head_probe("m", COMPLETIONS, {"prompt": [1, 2, 3] * 5000}) is None  # token ids
    assert rt.head_probe("m", COMPLETIONS, {"prompt": ["a b " * 5000, "c"]}) is None  # batched


def _tracker(model_dir):
    cfg = load_config({"models": [{"name": "m", "tokenizer": str(model_dir), "block_size": BS}],
                       "workers": [{"id": "a", "url": "http://127.0.0.1:1", "models": ["m"]},
                                   {"id": "b", "url": "http://127.0.0.1:2", "models": ["m"]}]}, environ={})
    fleet = FleetRegistry.from_config(cfg)
    return PrefixTracker(cfg, fleet, MemoryPrefixIndex(), RequestTokenizer(cfg)), fleet


async def _settle(tracker) -> None:
    while tracker._background:
        await asyncio.gather(*list(tracker._background))
    tracker.approx.flush()


async def test_a_new_long_prompt_is_decided_on_its_head_and_the_sampled_one_recorded_whole(model_dir):
    tracker, fleet = _tracker(model_dir)
    body = {"prompt": corpus(7, 8000)}
    req = await tracker.annotate(RouteRequest(request_id="r1", model="m", prompt_tokens=0), body, COMPLETIONS,
                                 fleet.workers())
    assert req.token_ids is None and req.overlaps == {}  # decided on the head
    whole_ids = await tracker.tokenizer.token_ids("m", COMPLETIONS, dict(body))
    assert 0.8 < req.prompt_tokens / len(whole_ids) < 1.25  # extrapolated from the head
    head_blocks = len(req.block_hashes)
    assert 1 <= head_blocks < head_chars(BS) // BS
    a = fleet.get("a")
    await tracker.on_routed(req, RouteDecision(worker=a, policy="kv_aware", reason="test"), 1.0)
    await _settle(tracker)
    whole = await tracker.tokenizer.tokenize("m", COMPLETIONS, body)
    hashes = whole.block_hashes(tracker.hasher("m", BS, None))
    assert hashes[:head_blocks] == req.block_hashes and len(hashes) > 10 * head_blocks
    # the same prompt again: tokenized (cache hit), every block found on the worker it went to
    again = await tracker.annotate(RouteRequest(request_id="r2", model="m", prompt_tokens=0), body, COMPLETIONS,
                                   fleet.workers())
    assert again.token_ids is not None and again.overlaps["a"].blocks == len(hashes)
    assert "b" not in again.overlaps or again.overlaps["b"].blocks == 0
    # a prompt sharing only the first blocks: the whole prompt is tokenized to measure the overlap
    shared = {"prompt": body["prompt"][:head_chars(BS) * 2] + " " + corpus(8, 6000)}
    third = await tracker.annotate(RouteRequest(request_id="r3", model="m", prompt_tokens=0), shared, COMPLETIONS,
                                   fleet.workers())
    assert third.token_ids is not None and 0 < third.overlaps["a"].blocks < len(hashes)
    assert tracker.tokenizer.head_mismatches == 0 and tracker._tokenize_later == {}


async def _route(tracker, fleet, rid, body, worker="a"):
    req = await tracker.annotate(RouteRequest(request_id=rid, model="m", prompt_tokens=0), body, COMPLETIONS,
                                 fleet.workers())
    await tracker.on_routed(req, RouteDecision(worker=fleet.get(worker), policy="kv_aware", reason="test"), 1.0)
    await _settle(tracker)
    return req


async def test_in_approximate_mode_every_new_prompt_is_recorded_whole_after_the_send(model_dir):
    tracker, fleet = _tracker(model_dir)
    doc = corpus(20, 8000)
    first = await _route(tracker, fleet, "r1", {"prompt": doc + " first question"})
    assert first.token_ids is None
    second = await _route(tracker, fleet, "r2", {"prompt": corpus(21, 8000)})
    assert second.token_ids is None and tracker._head_decisions == 2 and tracker.head_whole_dropped == 0
    # a prompt sharing the first one's long document goes by the document's whole length, not its head's
    follow = await _route(tracker, fleet, "r3", {"prompt": doc + " another question"})
    assert follow.token_ids is not None
    assert follow.overlaps["a"].blocks > 10 * len(first.block_hashes)


async def test_past_the_tokenizer_queue_a_new_prompt_keeps_its_heads_record_and_the_next_one_learns_the_rest(
        model_dir):
    from orchestrator.kv.tracker import HEAD_WHOLE_WAITING

    tracker, fleet = _tracker(model_dir)
    await _route(tracker, fleet, "first", {"prompt": corpus(22, 8000)})
    body = {"prompt": corpus(23, 8000)}
    tracker._whole_waiting = HEAD_WHOLE_WAITING  # the tokenizer's queue is full: routing goes on, learning waits
    req = await _route(tracker, fleet, "r1", body)
    tracker._whole_waiting = 0
    assert req.token_ids is None and tracker.head_whole_dropped == 1
    again = await _route(tracker, fleet, "r2", body)  # its head is known: tokenized whole, credited the head
    assert again.token_ids is not None and again.overlaps["a"].blocks == len(req.block_hashes)
    third = await _route(tracker, fleet, "r3", body)  # the second one's record holds every block
    assert third.overlaps["a"].blocks == len(again.block_hashes) > len(req.block_hashes)


async def test_workers_with_kv_events_get_no_whole_tokenization_but_the_sampled_check(model_dir):
    tracker, fleet = _tracker(model_dir)
    tracker.subscribers["a"] = object()  # (as if subscribed to a's KV events: it reports every block itself)
    await _route(tracker, fleet, "first", {"prompt": corpus(24, 8000)})  # the first: checked
    body = {"prompt": corpus(25, 8000)}
    req = await tracker.annotate(RouteRequest(request_id="r1", model="m", prompt_tokens=0), body, COMPLETIONS,
                                 fleet.workers())
    await tracker.on_routed(req, RouteDecision(worker=fleet.get("a"), policy="kv_aware", reason="test"), 1.0)
    assert req.token_ids is None and not tracker._background  # nothing tokenized after the send
    assert tracker.tokenizer.cache.key("m", False, body) not in tracker.tokenizer.cache
    tracker.subscribers.clear()


async def test_a_head_that_tokenizes_differently_turns_head_first_off_and_records_nothing_from_it(model_dir):
    tracker, fleet = _tracker(model_dir)
    rt = tracker.tokenizer
    real = rt.head_probe

    def wrong_head(*a, **k):
        found = real(*a, **k)
        return None if found is None else ([i + 1 for i in found[0]], found[1])  # not the prompt's ids

    rt.head_probe = wrong_head
    body = {"prompt": corpus(9, 8000)}
    req = await tracker.annotate(RouteRequest(request_id="r1", model="m", prompt_tokens=0), body, COMPLETIONS,
                                 fleet.workers())
    assert req.token_ids is None
    await tracker.on_routed(req, RouteDecision(worker=fleet.get("a"), policy="kv_aware", reason="test"), 1.0)
    await _settle(tracker)
    assert rt.head_mismatches == 1 and rt.head_first == {"m": False}
    rt.head_probe = real
    assert rt.head_probe("m", COMPLETIONS, {"prompt": corpus(10, 8000)}) is None  # off for this model
    whole = await rt.tokenize("m", COMPLETIONS, body)
    first = BlockHasher("m", BS).hash_blocks(list(whole.ids[:BS]))
    overlaps = await tracker.index.overlaps(first, tracker.tier_weights, ["a"])
    assert not any(o.blocks for o in overlaps.values())  # the wrong head's blocks are not the prompt's


def test_entries_for_requests_never_routed_are_bounded(model_dir, monkeypatch):
    from orchestrator.kv import tracker as tracker_mod

    tracker, _ = _tracker(model_dir)
    monkeypatch.setattr(tracker_mod, "MAX_TOKENIZE_LATER", 3)
    monkeypatch.setattr(tracker_mod, "MAX_TOKENIZE_LATER_TOKENS", 25)
    for i in range(5):
        tracker._later_put(f"r{i}", ("e", {}, (), [], []), 10)
    assert list(tracker._tokenize_later) == ["r3", "r4"] and tracker._later_tokens == 20
    assert tokenization.head_chars(16) == 512 and tokenization.head_chars(64) == 1024
