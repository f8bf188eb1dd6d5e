"""The SGLang adapter against the project's simulator speaking SGLang's dialect.

SGLang cannot run on this machine (its PyPI build needs CUDA), so this is the end-to-end check of
the SGLang adapter: real HTTP to an in-process simulated engine whose ``/metrics`` uses SGLang's
metric names. The vLLM adapter is checked against the same simulator in the vLLM dialect, so a
difference between the two snapshots would be the adapters' doing.
"""

from __future__ import annotations

import httpx
import pytest

from adapters import SglangAdapter, UnsupportedByEngine, VllmAdapter
from orchestrator.sim.server import start_sim_engine

PROMPT = " ".join(f"block {i} of the shared prefix." for i in range(40))


async def drive(url: str, model: str, client: httpx.AsyncClient) -> int:
    """Three identical completions (the 2nd and 3rd hit the prefix cache); returns prompt tokens sent."""
    sent = 0
    for _ in range(3):
        r = await client.post(f"{url}/v1/completions",
                              json={"model": model, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        r.raise_for_status()
        sent += r.json()["usage"]["prompt_tokens"]
    return sent


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
async def test_adapter_scrapes_and_tokenizes_sim_engine(dialect: str):
    engine = await start_sim_engine(model="m", profile="zero", dialect=dialect, kv_events=False)
    adapter = SglangAdapter() if dialect == "sglang" else VllmAdapter()
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            assert await adapter.health(c, engine.url, timeout=2) is True
            ids = await adapter.tokenize(c, engine.url, "m", prompt=PROMPT)
            sent = await drive(engine.url, "m", c)
            snap = await adapter.scrape(c, engine.url, timeout=2, now=5.0, model="m")
            if dialect == "sglang":
                with pytest.raises(UnsupportedByEngine):
                    await adapter.tokenize(c, engine.url, "m", messages=[{"role": "user", "content": "x"}])
    finally:
        await engine.stop()
    assert sent == 3 * len(ids)
    assert snap.running == 0 and snap.waiting == 0 and snap.scraped_at == 5.0
    assert snap.prompt_tokens == sent and snap.generation_tokens == 9
    assert snap.requests_finished == 3
    assert snap.prefix_cache_queries == sent
    assert snap.prefix_cache_hits > 0 and snap.cache_hit_ratio > 0.5  # two of three prompts were cached
    assert snap.block_size and snap.num_blocks
    assert snap.ttft.count == 3 and snap.e2e.count == 3 and snap.itl.count == 6
