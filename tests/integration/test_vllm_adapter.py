"""The vLLM adapter against a real vLLM 0.32 engine (tiny local Llama, eager, CPU).

What is checked: health and model listing; tokenization equals the token ids the engine itself
used for a real completion/chat (``return_token_ids``), with the second call served from the
cache; a scrape after real traffic gives a LoadSnapshot whose counters, histograms and cache
geometry match what was sent.
"""

from __future__ import annotations

import httpx
import pytest

from adapters import VllmAdapter
from tests.fixtures.vllm import VllmEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# ~170 tokens with this tokenizer: several full 32-token blocks, so a repeat is a prefix-cache hit.
LONG_PROMPT = " ".join(f"the cache {i} holds the prefix of request number {i}." for i in range(20))


async def test_health_and_models(vllm_engine: VllmEngine):
    adapter = VllmAdapter()
    async with httpx.AsyncClient() as c:
        assert await adapter.health(c, vllm_engine.url, timeout=5) is True
        assert await adapter.list_models(c, vllm_engine.url, timeout=5) == [vllm_engine.model]
        cards = await adapter.model_cards(c, vllm_engine.url, timeout=5)
        assert isinstance(cards[vllm_engine.model], int) and cards[vllm_engine.model] > 0  # vLLM's max_model_len


async def test_tokenize_matches_tokens_the_engine_used(vllm_engine: VllmEngine):
    adapter = VllmAdapter()
    url, model = vllm_engine.url, vllm_engine.model
    messages = [{"role": "system", "content": "You route requests."}, {"role": "user", "content": "hello world"}]
    async with httpx.AsyncClient(timeout=60) as c:
        chat_ids = await adapter.tokenize(c, url, model, messages=messages)
        prompt_ids = await adapter.tokenize(c, url, model, prompt=LONG_PROMPT)
        r = await c.post(f"{url}/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": 2, "return_token_ids": True})
        r.raise_for_status()
        chat = r.json()
        r = await c.post(f"{url}/v1/completions", json={
            "model": model, "prompt": LONG_PROMPT, "max_tokens": 2, "return_token_ids": True})
        r.raise_for_status()
        completion = r.json()
        # The cache answers the repeat without asking the engine (a dead URL would fail otherwise).
        assert await adapter.tokenize(c, "http://127.0.0.1:9", model, prompt=LONG_PROMPT) == prompt_ids
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    assert chat["prompt_token_ids"] == chat_ids
    assert completion["usage"]["prompt_tokens"] == len(prompt_ids) > 64
    assert completion["choices"][0]["prompt_token_ids"] == prompt_ids
    assert adapter.cache.hits == 1


async def test_tokenize_follows_the_clients_chat_template_options(vllm_engine: VllmEngine):
    adapter = VllmAdapter()
    url, model = vllm_engine.url, vllm_engine.model
    body = {"model": model, "max_tokens": 1, "return_token_ids": True, "continue_final_message": True,
            "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer is"}]}
    async with httpx.AsyncClient(timeout=60) as c:
        ids = await adapter.tokenize(c, url, model, messages=body["messages"], chat_options=body)
        default_ids = await adapter.tokenize(c, url, model, messages=body["messages"])
        r = await c.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()
    assert r.json()["prompt_token_ids"] == ids
    assert ids != default_ids  # the options really change the rendered prompt


async def test_scrape_after_traffic(vllm_engine: VllmEngine):
    adapter = VllmAdapter()
    url, model = vllm_engine.url, vllm_engine.model
    async with httpx.AsyncClient(timeout=60) as c:
        before = await adapter.scrape(c, url, timeout=5, now=1.0, model=model)
        prompt_tokens = 0
        for _ in range(3):  # same long prompt: the 2nd and 3rd reuse its cached blocks
            r = await c.post(f"{url}/v1/completions", json={
                "model": model, "prompt": LONG_PROMPT, "max_tokens": 4, "ignore_eos": True})
            r.raise_for_status()
            assert r.json()["usage"]["completion_tokens"] == 4
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
        after = await adapter.scrape(c, url, timeout=5, now=2.0, model=model)
    assert after.scraped_at == 2.0
    assert after.running == 0 and after.waiting == 0
    assert 0.0 <= after.kv_usage <= 1.0
    assert after.block_size == 32 and after.num_blocks and after.num_blocks > 0
    assert after.prompt_tokens - before.prompt_tokens == prompt_tokens
    assert after.generation_tokens - before.generation_tokens == 12
    assert after.requests_finished - before.requests_finished == 3
    assert after.prefix_cache_queries - before.prefix_cache_queries == prompt_tokens
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 2 * 32 * (prompt_tokens // 3 // 32 - 1)  # at least all full blocks but the last, twice
    by_source = after.prompt_tokens_by_source
    assert by_source["local_cache_hit"] - before.prompt_tokens_by_source["local_cache_hit"] == hits
    new = after.ttft.minus(before.ttft)
    assert new.count == 3 and 0 < new.quantile(0.5) < 30
    assert after.itl.minus(before.itl).count == 9  # 3 requests x (4 tokens - 1)
    assert after.e2e.minus(before.e2e).count == 3
    assert after.queue_time is not None and after.prompt_len is not None and after.generation_len is not None
