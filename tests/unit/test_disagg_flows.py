"""Request shaping for the vLLM and SGLang P/D exchanges (pure functions)."""

from __future__ import annotations

import random

from orchestrator.disagg import resolve_min_prefill_tokens, sglang_flow, vllm_flow
from orchestrator.sim.profiles import CPU_TINY, GPU_LIKE

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def test_vllm_prefill_step_is_one_unstreamed_token_asking_for_remote_decode():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "n": 1, "temperature": 0,
            "kv_transfer_params": {"evil": 1}}
    p = vllm_flow.prefill_body(CHAT, body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert p["stream"] is False
    for dropped in ("stream_options", "min_tokens", "n"):
        assert dropped not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}
    assert p["temperature"] == 0 and p["messages"] == body["messages"]
    assert body["max_tokens"] == 300 and body["stream"] is True  # the client's body is untouched
    # Completions have no max_completion_tokens.
    c = vllm_flow.prefill_body(COMPLETIONS, {"model": "m", "prompt": "x", "max_completion_tokens": 9})
    assert c["max_tokens"] == 1 and "max_completion_tokens" not in c


def test_vllm_example_connector_sends_no_transfer_params():
    p = vllm_flow.prefill_body(COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 5}, connector="example")
    assert "kv_transfer_params" not in p and p["max_tokens"] == 1


def test_vllm_decode_step_carries_the_prefill_handoff():
    answer = {"choices": [{"text": "a"}], "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "e", "remote_host": "localhost", "remote_port": 5600, "remote_num_tokens": 90}}
    params = vllm_flow.handoff_params(answer)
    assert params is answer["kv_transfer_params"]
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "kv_transfer_params": {"client": 1}}
    d = vllm_flow.decode_body(body, params)
    assert d["kv_transfer_params"] is params
    assert d["max_tokens"] == 50 and d["stream"] is True
    assert "kv_transfer_params" not in vllm_flow.local_body(body)
    # Answers without a usable hand-off.
    assert vllm_flow.handoff_params({"choices": []}) is None
    assert vllm_flow.handoff_params({"kv_transfer_params": None}) is None
    assert vllm_flow.handoff_params({"kv_transfer_params": {"do_remote_prefill": False}}) is None
    assert vllm_flow.handoff_params([1, 2]) is None


def test_a_prefill_answer_with_garbage_where_the_handoff_goes_is_no_handoff():
    """The decode engine's connector acts on the hand-off as it is (connects to remote_host:remote_port, reads
    remote_block_ids): garbage there from a prefill answer is never passed on."""
    good = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5],
            "remote_engine_id": "e", "remote_host": "10.0.0.5", "remote_port": 5600, "tp_size": 1}
    assert vllm_flow.handoff_problem(good) is None
    assert vllm_flow.handoff_params({"kv_transfer_params": good}) is good
    assert vllm_flow.handoff_params({"kv_transfer_params": {**good, "remote_block_ids": [[1, 2], [3]]}})
    assert vllm_flow.handoff_params({"kv_transfer_params": {**good, "remote_host": "::1"}})
    for field, bad in [("do_remote_prefill", "yes"), ("remote_block_ids", "1,2"), ("remote_block_ids", [1.5]),
                       ("remote_block_ids", [True]), ("remote_block_ids", [-1]), ("remote_block_ids", [[1, "2"]]),
                       ("remote_block_ids", None), ("remote_engine_id", 7), ("remote_engine_id", ""),
                       ("remote_host", None), ("remote_host", "a b"), ("remote_host", "evil.example/x"),
                       ("remote_host", "h" * 300), ("remote_port", "5600"), ("remote_port", 0),
                       ("remote_port", 70000), ("remote_port", True)]:
        params = {**good, field: bad}
        assert vllm_flow.handoff_problem(params), (field, bad)
        assert vllm_flow.handoff_params({"kv_transfer_params": params}) is None, (field, bad)
    missing = {k: v for k, v in good.items() if k != "remote_port"}
    assert vllm_flow.handoff_params({"kv_transfer_params": missing}) is None


def test_sglang_dual_dispatch_shares_one_room_and_points_at_the_prefill_server():
    body = {"model": "m", "prompt": "x", "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}
    room = sglang_flow.new_room(random.Random(7))
    p, d = sglang_flow.dual_bodies(body, "http://10.0.0.5:30000", None, room)
    for b in (p, d):
        assert b["bootstrap_host"] == "10.0.0.5"
        assert b["bootstrap_port"] == 8998
        assert b["bootstrap_room"] == room
    assert d["stream"] is True and d["stream_options"] == {"include_usage": True}
    assert p["stream"] is False and "stream_options" not in p
    assert p["max_tokens"] == 20  # the same request on both sides
    p2, _ = sglang_flow.dual_bodies(body, "http://h:1", 9000, 5)
    assert p2["bootstrap_port"] == 9000 and p2["bootstrap_host"] == "h"
    assert "bootstrap_room" not in body


def test_sglang_rooms_are_63_bit_and_distinct():
    rooms = {sglang_flow.new_room() for _ in range(1000)}
    assert len(rooms) == 1000
    assert all(0 <= r < 2**63 for r in rooms)
    assert max(rooms) > 2**60  # spread over the whole range, not a small counter


def test_min_prefill_tokens_default_comes_from_the_engine_profile():
    assert resolve_min_prefill_tokens(500) == 500
    assert resolve_min_prefill_tokens(0) == 0
    gpu = resolve_min_prefill_tokens(None)
    assert gpu == resolve_min_prefill_tokens(None, GPU_LIKE)
    assert 50 < gpu < 1000
    assert resolve_min_prefill_tokens(None, CPU_TINY) != gpu


def test_the_prefill_step_leaves_out_only_what_the_engine_would_accept():
    """A field the one-token, unstreamed prefill step cannot carry is left out only when its value is one vLLM
    accepts; any other value goes to the prefill engine, which refuses the request as the decode engine would
    (a refusal after the prefill would leave its KV leased for nobody). Fields only the generated tokens use
    (logprobs, top_logprobs) always go: the engine judges them, and for one token they cost nothing."""
    base = {"model": "m", "prompt": "x", "max_tokens": 10}
    p = vllm_flow.prefill_body(COMPLETIONS, {**base, "logprobs": 50, "echo": False, "n": 1, "best_of": 1,
                                             "min_tokens": 4})
    assert p["logprobs"] == 50
    assert not {"echo", "n", "best_of", "min_tokens"} & set(p)
    chat = vllm_flow.prefill_body(CHAT, {"model": "m", "messages": [], "logprobs": True, "top_logprobs": 30})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 30
    # stream_options: left out of a streamed request's step; an unstreamed request's goes (refused there too)
    assert "stream_options" not in vllm_flow.prefill_body(COMPLETIONS, {**base, "stream": True,
                                                                       "stream_options": {"include_usage": True}})
    assert vllm_flow.prefill_body(COMPLETIONS, {**base, "stream_options": {}})["stream_options"] == {}
    for field, value in [("echo", "yes"), ("n", 0), ("best_of", 0), ("best_of", "2"), ("min_tokens", -1),
                         ("min_tokens", 1.5)]:
        assert vllm_flow.prefill_body(COMPLETIONS, {**base, field: value})[field] == value, (field, value)
    assert "kv_transfer_params" not in {k for k in vllm_flow.prefill_body(COMPLETIONS, base, connector="example")}


def test_requests_the_decode_engine_refuses_for_a_field_the_step_cannot_carry_are_not_split():
    assert vllm_flow.local_only(COMPLETIONS, {"max_tokens": 10, "min_tokens": 11}, 5, None)
    assert vllm_flow.local_only(COMPLETIONS, {"max_tokens": 10, "min_tokens": 10}, 5, None) is None
    assert vllm_flow.local_only(CHAT, {"max_completion_tokens": 3, "max_tokens": 50, "min_tokens": 4}, 5, None)
    assert vllm_flow.local_only(COMPLETIONS, {"max_tokens": 100}, 4000, 4096)
    assert vllm_flow.local_only(COMPLETIONS, {"max_tokens": 96}, 4000, 4096) is None
    assert vllm_flow.local_only(COMPLETIONS, {}, 5000, 4096) is None  # (no limit: the prefill engine judges)
    assert vllm_flow.local_only(COMPLETIONS, {"max_tokens": 10**6}, 5, None) is None  # (context unknown)


def test_a_loopback_side_channel_is_a_handoff_only_on_the_prefill_workers_own_machine():
    good = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e", "remote_port": 5600}
    far = "http://10.0.0.2:8000"
    for host in ("localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]", "0.0.0.0", "LOCALHOST.", "x.localhost"):
        assert vllm_flow.unreachable_side_channel({**good, "remote_host": host}, "http://10.0.0.1:8000", far), host
        assert vllm_flow.unreachable_side_channel({**good, "remote_host": host}, far, far) is None, host
        assert vllm_flow.unreachable_side_channel({**good, "remote_host": host}, "http://127.0.0.1:1",
                                                  "http://localhost:2") is None, host
    for host in ("10.0.0.1", "10.9.9.9", "prefill-0.rdma.internal", "fe80::1"):
        assert vllm_flow.unreachable_side_channel({**good, "remote_host": host}, "http://10.0.0.1:8000", far) \
            is None, host


def test_a_prompt_only_the_decode_engines_context_holds_is_not_split():
    assert vllm_flow.local_only(COMPLETIONS, {"max_tokens": 10}, 5000, 131072, 4096)
    assert vllm_flow.local_only(COMPLETIONS, {}, 5000, None, 4096)
    assert vllm_flow.local_only(COMPLETIONS, {"max_tokens": 10}, 4000, 131072, 4096) is None
    assert vllm_flow.local_only(COMPLETIONS, {}, 200000, 131072, 4096) is None  # (fits nowhere: the engine says so)
