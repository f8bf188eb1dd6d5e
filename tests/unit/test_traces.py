"""Trace loaders: synthesized Mooncake blocks, the four formats, slicing, ideal hit ratio."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from orchestrator.bench.trace_paths import find_trace
from orchestrator.bench.traces import (
    BlockSynthesizer,
    TraceRequest,
    ideal_prefix_hit_ratio,
    ideal_prefix_hit_ratio_tokens,
    load_aibrix,
    load_azure,
    load_mooncake,
    load_sharegpt,
    load_trace,
    synthesize_token_ids,
    time_window,
)
from orchestrator.sim.tokenizer import SimTokenizer


@pytest.fixture
def mooncake_file(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1300, "output_length": 20, "hash_ids": [0, 1, 3]},
        {"timestamp": 250, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
    ]
    p = tmp_path / "mc.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_mooncake_equal_ids_give_identical_blocks_and_exact_lengths(mooncake_file: Path) -> None:
    reqs = load_mooncake(mooncake_file)
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.5]  # sorted by arrival
    a, b = reqs[0], reqs[2]
    wa, wb = a.render_prompt().split(" "), b.render_prompt().split(" ")
    assert len(wa) == 1100 and len(wb) == 1300  # one word per token
    assert wa[:1024] == wb[:1024]  # hash ids 0, 1 shared
    assert wa[1024:1100] != wb[1024:1100]  # hash 2 vs 3 differ
    # every word is plain letters (one token for a whitespace tokenizer)
    assert all(w.isalpha() and w.islower() for w in wa)


def test_synthesize_token_ids_matches_rendered_words(mooncake_file: Path) -> None:
    reqs = load_mooncake(mooncake_file)
    r = reqs[2]
    ids = synthesize_token_ids(r.hash_ids, r.input_len)
    assert len(ids) == r.input_len
    assert ids == SimTokenizer().encode(r.render_prompt())  # what a simulated engine computes
    assert ids == r.token_ids()
    assert synthesize_token_ids(r.hash_ids, r.input_len, sim_vocab_size=1000) == SimTokenizer(1000).encode(
        r.render_prompt())
    # deterministic across synthesizers; seed changes content
    assert BlockSynthesizer(512).block(5) == BlockSynthesizer(512).block(5)
    assert BlockSynthesizer(512, seed=1).block(5) != BlockSynthesizer(512).block(5)


def test_mooncake_length_and_time_scaling(mooncake_file: Path) -> None:
    reqs = load_mooncake(mooncake_file, scale_len=0.125, time_scale=2.0)
    r = reqs[0]
    # blocks of 64 words; last block 76/512 of a block -> round(9.5)
    assert r.input_len == 2 * 64 + round(76 * 64 / 512)
    assert len(r.render_prompt().split()) == r.input_len
    assert [x.arrival_s for x in reqs] == [0.0, 0.5, 1.0]
    assert reqs[2].output_len == round(20 * 0.125)
    w0, w2 = reqs[0].render_prompt().split(), reqs[2].render_prompt().split()
    assert w0[:128] == w2[:128] and w0[128:] != w2[128:len(w0)]


def test_ideal_hit_ratio_small(mooncake_file: Path) -> None:
    reqs = load_mooncake(mooncake_file)
    # third request (by arrival) reuses 2 blocks of 512 out of 1300 tokens
    assert ideal_prefix_hit_ratio(reqs) == pytest.approx(1024 / (1100 + 600 + 1300))


def test_ideal_hit_ratio_of_real_mooncake_trace_is_about_65_percent() -> None:
    path = find_trace("mooncake_synthetic_trace.jsonl")
    if path is None:
        pytest.skip("shared traces not present")
    reqs = load_mooncake(path)
    assert len(reqs) == 3993
    assert ideal_prefix_hit_ratio(reqs) == pytest.approx(0.651, abs=0.005)
    # length scaling keeps the sharing structure
    assert ideal_prefix_hit_ratio(load_mooncake(path, scale_len=1 / 16)) == pytest.approx(0.651, abs=0.01)


def test_ideal_hit_ratio_tokens_counts_only_leading_full_blocks() -> None:
    seqs = [list(range(10)), list(range(8)) + [99, 98], [5, 6, 7, 8]]
    # block 4: seq2 shares blocks [0..3],[4..7] with seq1 -> 8 tokens; seq3 shares nothing
    assert ideal_prefix_hit_ratio_tokens(seqs, 4) == pytest.approx(8 / 24)


def test_azure_csv(tmp_path: Path) -> None:
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.4799600,300,8\n")
    reqs = load_azure(p)
    assert [r.input_len for r in reqs] == [4808, 300]
    assert reqs[1].arrival_s == pytest.approx(1.5)
    assert len(reqs[1].render_prompt().split()) == 300
    assert reqs[0].render_prompt().split()[:300] != reqs[1].render_prompt().split()  # nothing shared


def test_aibrix_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "ab.jsonl"
    rows = [{"timestamp": 1000, "requests": [{"Prompt Length": 3, "Output Length": 4, "prompt": "a b c"},
                                             {"Prompt Length": 1, "Output Length": 2, "prompt": "hi"}]},
            {"timestamp": 3000, "requests": [{"Prompt Length": 2, "Output Length": 1, "prompt": "x y"}]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    reqs = load_aibrix(p)
    assert [(r.arrival_s, r.prompt, r.output_len) for r in reqs] == [(0.0, "a b c", 4), (0.0, "hi", 2), (2.0, "x y", 1)]
    assert load_aibrix(p, limit=2)[-1].prompt == "hi"


def test_sharegpt_turns_share_history(tmp_path: Path) -> None:
    p = tmp_path / "sg.jsonl.gz"
    conv = {"id": "c1", "conversations": [
        {"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi how can I help"},
        {"from": "human", "value": "tell a joke"}, {"from": "gpt", "value": "no"}]}
    conv2 = {"id": "c2", "conversations": [{"from": "human", "value": "one"}]}
    with gzip.open(p, "wt") as f:
        f.write(json.dumps(conv) + "\n" + json.dumps(conv2) + "\n")
    reqs = load_sharegpt(p, session_rate=0.5, think_time_s=3.0)
    assert [(r.session_id, r.arrival_s) for r in reqs] == [("c1", 0.0), ("c2", 2.0), ("c1", 3.0)]
    t1, t2 = reqs[0], reqs[2]
    assert t2.messages[: len(t1.messages)] == t1.messages
    assert [m["role"] for m in t2.messages] == ["user", "assistant", "user"]
    assert t1.output_len == 5 and t2.input_len == 2 + 5 + 3
    assert t2.render_messages()[-1] == {"role": "user", "content": "tell a joke"}


def test_time_window_rebases_and_load_trace_rejects_unknown(mooncake_file: Path) -> None:
    reqs = load_trace(mooncake_file, "mooncake")
    win = time_window(reqs, 0.2, 0.6)
    assert [(r.index, r.arrival_s) for r in win] == [(0, pytest.approx(0.05)), (1, pytest.approx(0.3))]
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(mooncake_file, "csv")


def test_ideal_hit_ratio_with_finite_pooled_cache_evicts_lru() -> None:
    reqs = [TraceRequest(index=i, arrival_s=float(i), input_len=1024, output_len=1, hash_ids=h)
            for i, h in enumerate([(1, 2), (3, 4), (1, 2)])]
    assert ideal_prefix_hit_ratio(reqs) == pytest.approx(1024 / 3072)
    assert ideal_prefix_hit_ratio(reqs, capacity_blocks=4) == pytest.approx(1024 / 3072)
    assert ideal_prefix_hit_ratio(reqs, capacity_blocks=2) == 0.0  # (1, 2) evicted by (3, 4)


# --- traces the project was not built on: other public CSVs, length-only JSONL, the ShareGPT array ---

def test_burstgpt_and_azure_2024_csvs_load_by_their_column_names(tmp_path: Path) -> None:
    burst = tmp_path / "BurstGPT_1.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5.0,ChatGPT,472,18,490,Conversation log\n3.5,GPT-4,1200,0,1200,API log\n")
    reqs = load_azure(burst)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in reqs] == [(0.0, 1200, 1), (1.5, 472, 18)]
    az24 = tmp_path / "AzureLLMInferenceTrace_conv_1week.csv"
    az24.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2024-05-10 00:00:00.009930+00:00,2162,5\n2024-05-10 00:00:02.509930+00:00,1190,96\n")
    assert [r.arrival_s for r in load_azure(az24)] == pytest.approx([0.0, 2.5])


def test_a_csv_without_a_length_column_is_refused_naming_what_it_has(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("when,tokens\n1,2\n")
    with pytest.raises(ValueError, match=r"no arrival time column .* the header has when, tokens"):
        load_azure(p)
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,12,x\n")
    with pytest.raises(ValueError, match="line 2"):
        load_azure(p)


def test_a_length_only_jsonl_loads_as_mooncake_with_nothing_shared(tmp_path: Path) -> None:
    from orchestrator.sim.virtual_cli import detect_format, load_requests

    p = tmp_path / "mine.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 100, "output_length": 10}\n'
                 '{"timestamp": 500, "input_length": 100, "output_length": 3}\n')
    assert detect_format(str(p)) == "mooncake"
    reqs = load_requests(str(p))
    assert [(r.arrival, r.isl, r.osl) for r in reqs] == [(0.0, 100, 10), (0.5, 100, 3)]
    a, b = load_trace(p, "mooncake")
    assert a.render_prompt() != b.render_prompt() and len(a.render_prompt().split()) == 100
    p.write_text('{"timestamp": 0, "input_length": 100, "output_length": 10}\n{"timestamp": 5}\n')
    with pytest.raises(ValueError, match="line 2: no input_length, output_length"):
        load_trace(p, "mooncake")


def test_sharegpt_as_one_json_array_like_the_datasets_own_files(tmp_path: Path) -> None:
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "hello there"},
                                                  {"from": "gpt", "value": "hi you"}]} for i in range(3)]
    p = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    p.write_text(json.dumps(convs, indent=2))
    lines = tmp_path / "sg.jsonl"
    lines.write_text("\n".join(json.dumps(c) for c in convs))
    assert [(r.arrival_s, r.messages) for r in load_sharegpt(p)] == \
        [(r.arrival_s, r.messages) for r in load_sharegpt(lines)]
    assert len(load_sharegpt(p)) == 3
