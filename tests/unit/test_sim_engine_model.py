"""The simulated engine's pure core: cost-model consequences, cache behaviour, events, P/D, determinism."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from orchestrator.sim.engine_model import EngineModel, SimRequest, SimRequestError, chain_block_hashes
from orchestrator.sim.profiles import CPU_TINY, GPU_LIKE, load_profile
from orchestrator.sim.tokenizer import SimTokenizer, output_token_ids


def drive(m: EngineModel, reqs, step_by_step: bool = True):
    """Submit (request, at) pairs in time order; return {id: [token times]}, {id: finish reason}."""
    times: dict[str, list[float]] = {}
    reasons: dict[str, str] = {}

    def take(outs):
        for o in outs:
            times.setdefault(o.request_id, []).extend(o.times)
            if o.finished:
                reasons[o.request_id] = o.finish_reason

    for req, at in reqs:
        take(m.advance(at))
        m.submit(req, at)
    if step_by_step:
        while (t := m.next_event_time()) is not None:
            take(m.advance(t))
    else:
        take(m.advance(1e9))
    return times, reasons


def test_prefix_hit_lowers_ttft_to_calibrated_values():
    m = EngineModel(CPU_TINY, seed=1)
    prompt = list(range(2000))
    t, _ = drive(m, [(SimRequest("cold", prompt, 4), 0.0), (SimRequest("hit", prompt, 4), 10.0)])
    cold, hit = t["cold"][0], t["hit"][0] - 10.0
    assert 0.50 < cold < 0.60  # docs/engines.md §1: 548 ms
    assert 0.02 < hit < 0.05  # docs/engines.md §1: 33 ms
    assert m.stats.prefix_cache_hits == 62 * 32
    assert m.stats.prompt_tokens_by_source["local_cache_hit"] == 62 * 32
    assert m.stats.prompt_tokens_by_source["local_compute"] == 4000 - 62 * 32


def test_more_load_raises_itl():
    def itl(n):
        m = EngineModel(CPU_TINY, seed=1)
        t, _ = drive(m, [(SimRequest(f"r{i}", [i + 1] * 40, 20), 0.0) for i in range(n)])
        return t["r0"][10] - t["r0"][9]

    one, many = itl(1), itl(16)
    assert one == pytest.approx(0.0117, rel=1e-6)
    assert many > 2 * one


def test_context_length_raises_decode_step_with_gpu_profile():
    def itl(prompt_len):
        m = EngineModel(GPU_LIKE, seed=1)
        t, _ = drive(m, [(SimRequest(f"r{i}", [i + 1] * prompt_len, 10), 0.0) for i in range(8)])
        return t["r0"][5] - t["r0"][4]

    assert itl(8000) > itl(100)


def test_eviction_when_cache_is_full_emits_block_removed_and_loses_hits():
    prof = replace(CPU_TINY, num_gpu_blocks=8, block_size=4, max_model_len=64)
    m = EngineModel(prof, seed=0)
    a, b = list(range(1, 17)), list(range(100, 116))  # 4 blocks each
    drive(m, [(SimRequest("a", a, 1), 0.0), (SimRequest("b", b, 1), 1.0), (SimRequest("c", list(range(200, 216)), 1), 2.0)])
    events = [e for _, batch in m.drain_kv_events() for e in batch]
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert set(chain_block_hashes(a, 4)[:3]) <= set(removed)  # a was least recently used
    assert m.num_cached_blocks <= 8
    assert m.cached_prefix_tokens(a) == 0
    assert m.cached_prefix_tokens(b) > 0


def test_kv_events_have_vllm_shape_and_chain():
    prof = replace(CPU_TINY, block_size=4)
    m = EngineModel(prof, seed=0)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    drive(m, [(SimRequest("a", prompt, 1), 0.0)])
    batches = m.drain_kv_events()
    stored = [e for _, b in batches for e in b if e["type"] == "BlockStored"]
    assert len(stored) == 1
    ev = stored[0]
    assert set(ev) >= {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name"}
    assert ev["token_ids"] == prompt[:8] and ev["block_size"] == 4 and ev["medium"] == "GPU"
    assert ev["parent_block_hash"] is None and ev["block_hashes"] == chain_block_hashes(prompt, 4)
    assert all(0 <= h < 2**64 for h in ev["block_hashes"])
    # the same prompt again: a hit, no new BlockStored
    drive(m, [(SimRequest("b", prompt, 1), 1.0)])
    assert not [e for _, b in m.drain_kv_events() for e in b if e["type"] == "BlockStored"]
    # an extension: only the new block, parented on the last shared one
    drive(m, [(SimRequest("c", prompt[:8] + [7, 7, 7, 7, 1], 1), 2.0)])
    new = [e for _, b in m.drain_kv_events() for e in b if e["type"] == "BlockStored"]
    assert len(new) == 1 and new[0]["parent_block_hash"] == chain_block_hashes(prompt, 4)[1]
    assert new[0]["token_ids"] == [7, 7, 7, 7]


def test_reset_prefix_cache_clears_and_emits_all_blocks_cleared():
    m = EngineModel(replace(CPU_TINY, block_size=4), seed=0)
    drive(m, [(SimRequest("a", list(range(12)), 1), 0.0)])
    m.drain_kv_events()
    assert m.reset_prefix_cache(5.0)
    assert m.num_cached_blocks == 0
    assert [e["type"] for _, b in m.drain_kv_events() for e in b] == ["AllBlocksCleared"]


def test_deterministic_under_seed_and_step_granularity():
    reqs = [(SimRequest(f"r{i}", [i % 3 + 1] * (50 + 30 * i), 5 + i, ), 0.01 * i) for i in range(12)]
    t1, _ = drive(EngineModel(CPU_TINY, seed=3), reqs, step_by_step=True)
    t2, _ = drive(EngineModel(CPU_TINY, seed=3), reqs, step_by_step=False)
    assert t1 == t2
    assert all(len(t1[f"r{i}"]) == 5 + i for i in range(12))
    for a, b in zip(t1["r5"], t1["r5"][1:], strict=False):
        assert b > a


def test_output_tokens_depend_on_seed_and_prompt_only():
    m1, m2, m3 = EngineModel(CPU_TINY, seed=1), EngineModel(CPU_TINY, seed=1), EngineModel(CPU_TINY, seed=2)
    outs = []
    for m in (m1, m2, m3):
        m.submit(SimRequest("x", [5, 6, 7], 8), 0.0)
        ids = []
        for o in m.advance(100.0):
            ids.extend(o.token_ids())
        outs.append(ids)
    assert outs[0] == outs[1] != outs[2]
    assert len(outs[0]) == 8


def test_natural_stop_without_max_tokens():
    m = EngineModel(CPU_TINY, seed=1)
    t, r = drive(m, [(SimRequest("x", [1, 2, 3], None), 0.0)])
    assert r["x"] == "stop" and 16 <= len(t["x"]) <= 128


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    prof = replace(CPU_TINY, max_num_batched_tokens=256)
    m = EngineModel(prof, seed=0)
    t, _ = drive(m, [(SimRequest("x", list(range(1000)), 2), 0.0)])
    steps = math.ceil(1000 / 256)
    expect = prof.request_overhead_s + steps * (prof.step_fixed_s + prof.per_running_seq_s) + 1000 * prof.per_prefill_token_s
    assert t["x"][0] == pytest.approx(expect)


def test_request_arriving_mid_prefill_hits_the_blocks_already_scheduled():
    """As vLLM's allocate_slots: a step's full prompt blocks are cached when scheduled, so a copy
    of the prompt admitted behind it (the last chunk's leftover budget) hits all of them — it does
    not recompute the prefix still being prefilled. BlockStored is emitted at scheduling time."""
    prof = replace(CPU_TINY, max_num_batched_tokens=256)
    m = EngineModel(prof, seed=0)
    prompt = list(range(1000))  # 31 full blocks of 32; 4 chunks: 256, 256, 256, 232
    times, _ = drive(m, [(SimRequest("a", prompt, 2), 0.0), (SimRequest("b", prompt, 2), 0.01)])
    assert m.stats.prefix_cache_queries == 2000
    # b is admitted in a's last step with 24 tokens of budget left; all 31 full blocks are cached
    # by then (the last one by that very step), capped at prompt - 1 like the engine.
    assert m.stats.prefix_cache_hits == 31 * 32
    assert times["b"][0] < times["a"][0] + 0.2  # b's remaining 8 tokens, not a second 1,000
    stored_at = [t for t, evs in m.drain_kv_events() for ev in evs if ev["type"] == "BlockStored"]
    assert stored_at[0] < times["a"][0]  # the first chunk's blocks were announced before a finished


def test_decode_interleaves_with_a_new_prefill():
    m = EngineModel(CPU_TINY, seed=0)
    t, _ = drive(m, [(SimRequest("long", [1] * 10, 50), 0.0), (SimRequest("big", list(range(2000)), 1), 0.2)])
    gaps = [b - a for a, b in zip(t["long"], t["long"][1:], strict=False)]
    assert max(gaps) > 0.5  # the step that carried the 2k-token prefill
    assert len(t["long"]) == 50


def test_abort_frees_blocks_and_counts():
    m = EngineModel(CPU_TINY, seed=0)
    m.submit(SimRequest("x", list(range(500)), 1000), 0.0)
    m.advance(1.0)
    assert m.num_running == 1 and m.kv_usage > 0
    assert m.abort("x", 1.0)
    assert m.num_running == 0 and m.kv_usage == 0
    assert m.stats.request_success["abort"] == 1
    assert m.next_event_time() is None or m.advance(m.next_event_time()) == []


def test_preemption_when_decode_cannot_grow():
    prof = replace(CPU_TINY, num_gpu_blocks=6, block_size=4, max_model_len=64)
    m = EngineModel(prof, seed=0)
    t, r = drive(m, [(SimRequest("a", [1] * 4, 12), 0.0), (SimRequest("b", [2] * 4, 12), 0.0)])
    assert r == {"a": "length", "b": "length"}
    assert len(t["a"]) == 12 and len(t["b"]) == 12
    assert m.stats.num_preemptions >= 1


def test_request_errors():
    m = EngineModel(CPU_TINY, seed=0)
    with pytest.raises(SimRequestError, match="maximum context length"):
        m.submit(SimRequest("x", [1] * 4000, 200), 0.0)
    with pytest.raises(SimRequestError):
        m.submit(SimRequest("y", [], 2), 0.0)
    m.submit(SimRequest("z", [1], 2), 0.0)
    with pytest.raises(SimRequestError, match="already"):
        m.submit(SimRequest("z", [1], 2), 0.0)


def test_pd_prefill_lease_and_remote_decode_transfer():
    prefill = EngineModel(CPU_TINY, seed=0, engine_id="p")
    decode = EngineModel(CPU_TINY, seed=0, engine_id="d")
    prompt = list(range(1000))
    prefill.submit(SimRequest("r", prompt, 1, do_remote_decode=True), 0.0)
    outs = prefill.advance(10.0)
    assert outs[-1].finished and outs[-1].lease_block_ids
    assert prefill.lease_info("r")[0] == 1000
    assert prefill.kv_usage > 0  # pinned for the decode side
    decode.submit(SimRequest("r", prompt, 20, remote_prefill=True), 10.0)
    t, _ = drive(decode, [])
    ttft = t["r"][0] - 10.0
    transfer = CPU_TINY.transfer_seconds(1000)
    assert ttft >= transfer
    assert ttft < CPU_TINY.prefill_seconds(1000) / 4  # no local prefill compute
    assert decode.stats.prompt_tokens_by_source["external_kv_transfer"] == 1000
    assert len(t["r"]) == 20
    assert prefill.release_lease("r", 11.0)
    assert prefill.kv_usage == 0


def test_lease_expires():
    prof = replace(CPU_TINY, kv_lease_s=2.0)
    m = EngineModel(prof, seed=0)
    m.submit(SimRequest("r", list(range(100)), 1, do_remote_decode=True), 0.0)
    m.advance(1.0)
    assert m.kv_usage > 0
    m.advance(5.0)
    assert m.kv_usage == 0 and m.lease_info("r") is None


def test_generated_text_fed_back_hits_cache():
    tok = SimTokenizer()
    prof = replace(CPU_TINY, block_size=4)
    m = EngineModel(prof, seed=0)
    prompt = tok.encode("one two three four five six seven")
    m.submit(SimRequest("t1", prompt, 9), 0.0)
    outs = m.advance(100.0)
    seed = outs[0].output_seed
    answer = output_token_ids(seed, 0, 9)
    turn2 = prompt + tok.encode(tok.decode(answer)) + tok.encode("and more words here")
    assert m.cached_prefix_tokens(turn2) == ((len(prompt) + 9 - 1) // 4) * 4


def test_load_profile_from_json(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('{"base": "gpu-like", "num_gpu_blocks": 100}')
    p = load_profile(str(f))
    assert p.num_gpu_blocks == 100 and p.block_size == GPU_LIKE.block_size
    f.write_text('{"base": "gpu-like", "bogus": 1}')
    with pytest.raises(ValueError, match="bogus"):
        load_profile(str(f))
    with pytest.raises(ValueError, match="unknown engine profile"):
        load_profile("nope")


def test_public_views_for_drivers_run_end_and_cached_prefix_blocks():
    """What the virtual-time fleet reads: the end of the planned run, and the cached prefix of a chain."""
    m = EngineModel(CPU_TINY, seed=1)
    assert m.run_end_time() is None
    prompt = list(range(300))
    m.submit(SimRequest("a", prompt, 16), 0.0)
    assert m.run_end_time() is None  # queued, nothing planned yet
    ends = []
    while (t := m.next_event_time()) is not None and len(ends) < 4:
        ends.append((t, m.run_end_time()))
        m.advance(t)
    planned = [(t, end) for t, end in ends if end is not None]
    assert planned and all(end >= t for t, end in planned)
    assert any(end > t for t, end in planned)  # decode steps planned in one go: the run ends later
    end = max(end for _, end in planned)
    m.advance(end)
    assert m.run_end_time() is None and m.next_event_time() is None  # 16 tokens done: idle
    hashes = chain_block_hashes(prompt, CPU_TINY.block_size)
    full = len(prompt) // CPU_TINY.block_size
    assert m.cached_prefix_blocks(hashes) == full
    assert m.cached_prefix_blocks(hashes[:3]) == 3
    assert m.cached_prefix_blocks([hashes[0], 12345, hashes[2]]) == 1  # a prefix, not a count
    assert m.cached_prefix_blocks([]) == 0
    assert m.cached_prefix_tokens(prompt) == full * CPU_TINY.block_size
