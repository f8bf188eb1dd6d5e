"""Head-first tokenization through a live `kv_aware` gateway with a model's tokenizer files.

The gateway tokenizes with real HF tokenizer files (a byte-level BPE trained in the test,
``tests/fixtures/trained_tokenizers.py``) in approximate mode (engines without KV events). Checks: a long
prompt nobody sent before is routed on its head (no whole tokenization before the send) and answered;
after the send it is tokenized whole and recorded whole (approximate mode: the gateway is the index's
only source), so a prompt sharing its long document goes to the same engine and finds it cached there. Two simulated engines
(``SimEngineThread``) stand in for engines without events; the gateway, the tokenizer files, the index
and HTTP are real.
"""

from __future__ import annotations

import time

import httpx
import pytest

from orchestrator.kv.tracker import PrefixTracker
from tests.fixtures.sim_gateway import kv_aware_pair
from tests.fixtures.trained_tokenizers import byte_level_bpe, corpus

MODEL = "sim-model"
BS = 16


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tokenizer")
    byte_level_bpe(model_dir)
    with kv_aware_pair({"name": MODEL, "block_size": BS, "tokenizer": str(model_dir)}, seed=3) as running:
        yield running


def until(check, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_new_long_prompts_are_routed_on_their_head_and_the_index_learns_them_whole(fleet):
    gw, engines = fleet
    tracker: PrefixTracker = gw.runtime.prefix_tracker  # type: ignore[assignment]
    tok = tracker.tokenizer
    by_id = {f"sim-{i}": e for i, e in enumerate(engines)}

    def blocks(worker: str) -> int:
        return gw.call(tracker.index.worker_blocks(worker))

    def send(c: httpx.Client, prompt: str) -> str:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        return r.headers["x-dyad-worker"]

    with httpx.Client(base_url=gw.url, timeout=60, trust_env=False) as c:
        doc = corpus(1, 3000)  # ~15k characters: far more than four heads (the engine takes 4,096 words)
        first = doc + " and the first question"
        w1 = send(c, first)
        assert tracker._head_decisions == 1  # routed on its head
        whole = gw.call(tok.tokenize(MODEL, "/v1/completions", {"prompt": first}))
        # tokenized whole after the send (approximate mode: the gateway is the index's only source)
        until(lambda: blocks(w1) >= len(whole.ids) // BS)
        # a prompt sharing the document goes where the document is, and the engine finds it cached
        before = by_id[w1].call(lambda: by_id[w1].model.stats.prefix_cache_hits)
        assert send(c, doc + " and a second question") == w1
        assert by_id[w1].call(lambda: by_id[w1].model.stats.prefix_cache_hits) - before > len(whole.ids) // 2
        # another new prompt: routed on its head too, and learnt whole
        other = corpus(2, 3000)
        w2 = send(c, other)
        n = len(gw.call(tok.tokenize(MODEL, "/v1/completions", {"prompt": other})).ids) // BS
        until(lambda: blocks(w2) >= n)
    assert tracker._head_decisions == 2 and tracker.head_whole_dropped == 0 and tok.head_mismatches == 0
    assert gw.runtime.metrics.registry.get_sample_value("dyad_head_first_total", {"outcome": "whole"}) == 2
