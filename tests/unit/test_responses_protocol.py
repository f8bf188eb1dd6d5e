"""Pure parts of /v1/responses: the stream-ending rules by protocol, the response-owner map, validation and
the routing text (no sockets)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.errors import InvalidRequest
from orchestrator.gateway import responses_api
from orchestrator.gateway.stream_protocol import OpenAIChunks, ResponsesEvents, protocol_for


def ev(kind: str, seq: int, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n".encode()


def test_protocols_are_keyed_by_endpoint():
    assert isinstance(protocol_for("/v1/responses"), ResponsesEvents)
    assert isinstance(protocol_for("/v1/chat/completions"), OpenAIChunks)
    assert protocol_for("/v1/completions").continuable and not protocol_for("/v1/responses").continuable


@pytest.mark.parametrize("terminal", ["response.completed", "response.failed", "response.incomplete", "error"])
def test_a_terminal_event_ends_a_responses_stream(terminal):
    p = ResponsesEvents()
    assert not p.ended(ev("response.created", 0, response={"id": "resp_1"}))
    assert not p.ended(ev("response.output_text.delta", 1, delta="hi"))
    assert p.ended(ev(terminal, 2, response={"id": "resp_1"}))


def test_text_about_a_terminal_event_is_not_one():
    p = ResponsesEvents()
    assert not p.ended(ev("response.output_text.delta", 3, delta="event: response.completed\n\n"))
    assert not p.ended(b"data: [DONE]\n\n")  # the chat end means nothing here
    assert p.text_deltas == 1


def test_the_gateways_ending_continues_the_sequence_and_names_the_response():
    sent = [ev("response.created", 0, response={"id": "resp_9", "model": "m", "status": "in_progress"})
            + ev("response.output_text.delta", 1, delta="a"), ev("response.output_text.delta", 2, delta="b")]
    out = ResponsesEvents().error_ending("it broke", "upstream_stream_failed", sent)
    blocks = [b for b in out.split(b"\n\n") if b]
    assert [b.split(b"\n")[0] for b in blocks] == [b"event: error", b"event: response.failed"]
    err = json.loads(blocks[0].split(b"data: ", 1)[1])
    failed = json.loads(blocks[1].split(b"data: ", 1)[1])
    assert err == {"type": "error", "code": "upstream_stream_failed", "message": "it broke", "param": None,
                   "sequence_number": 3}
    assert failed["sequence_number"] == 4 and failed["response"]["id"] == "resp_9"
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["message"] == "it broke"
    assert ResponsesEvents().ended(out)  # and it is an end by the same rule


def test_usage_is_read_from_the_completed_response():
    class P:
        usage = None
    p = P()
    out = ev("response.completed", 5, response={"id": "r", "usage": {"input_tokens": 7, "output_tokens": 3}})
    assert ResponsesEvents().take_usage(out, p) == out and p.usage == {"input_tokens": 7, "output_tokens": 3}


def test_chat_ending_is_unchanged():
    out = OpenAIChunks().error_ending("x", "upstream_stream_failed", [])
    assert out.endswith(b"data: [DONE]\n\n") and OpenAIChunks().ended(out)


def test_owner_map_is_bounded_expiring_hashed_and_per_client():
    m = responses_api.ResponseOwners(max_entries=3, ttl_s=10)
    for i in range(5):
        m.record(f"resp_{i}", f"w{i}", "team-a", now=0.0)
    assert len(m) == 3 and m.lookup("resp_0", "team-a", 1.0) is None  # oldest out first
    assert m.lookup("resp_4", "team-a", 1.0) == "w4"
    assert m.lookup("resp_4", "team-b", 1.0) is None  # another key's response is not found
    assert m.lookup("resp_4", "team-a", 10.0) is None and len(m) == 0  # expired, and dropped
    m.record("x" * 10_000, "w1", "team-a", now=0.0)
    assert all(len(k) == responses_api.KEY_BYTES for k in m._map)  # client text is never kept verbatim


@pytest.mark.parametrize("body,param", [
    ({"model": "m"}, "input"), ({"model": "m", "input": {}}, "input"), ({"model": "m", "input": [1]}, "input[0]"),
    ({"model": "m", "input": "x", "request_id": "resp_x"}, "request_id"),
    ({"model": "m", "input": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
    ({"model": "m", "input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ({"model": "m", "input": "x", "previous_response_id": "a\nb"}, "previous_response_id"),
    ({"model": "m", "input": "x", "stream": "yes"}, "stream")])
def test_validation_names_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        responses_api.validate(body)
    assert e.value.param == param


def test_routing_text_is_what_vllm_renders():
    body = {"model": "m", "instructions": "sys", "user": "u1", "max_output_tokens": 9,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                      {"type": "function_call_output", "call_id": "c", "output": "42"},
                      {"role": "assistant", "content": "a"}]}
    rb = responses_api.routing_body(body)
    assert rb["messages"] == [{"role": "system", "content": "sys"},
                              {"role": "user", "content": [{"type": "text", "text": "q"}]},
                              {"role": "assistant", "content": "a"}]
    assert rb["user"] == "u1" and rb["max_tokens"] == 9
    assert responses_api.routing_body({"model": "m", "input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_response_id_of_answers():
    assert responses_api.response_id_in(b'{"id":"resp_1","object":"response"}', stream=False) == "resp_1"
    assert responses_api.response_id_in(b'{"id":"x","object":"chat.completion"}', stream=False) is None
    assert responses_api.response_id_in(ev("response.created", 0, response={"id": "resp_2"}), stream=True) == "resp_2"
    assert responses_api.response_id_in(b"event: response.created\ndata: {\"res", stream=True) is None


# --- what reaches the client of an engine's events (StreamProtocol.screen) --------------------------

CHUNK = b'data: {"id":"c","choices":[{"index":0,"text":"a"}]}\n\n'


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b"data: 42\n\n", b"data: \"text\"\n\n",
                                 b"hello world\n\n", b"data: {\"a\":1}\nnonsense\n\n"])
def test_an_event_that_is_not_the_protocol_cuts_the_stream_before_it(bad):
    out, problem, beyond = OpenAIChunks().screen(CHUNK + bad + CHUNK)
    assert out == CHUNK and problem is not None and not beyond


@pytest.mark.parametrize("good", [b": keep-alive\n\n", b"event: message\ndata: {\"a\": 1}\n\n", b"id: 7\n\n",
                                  b"data: {\"a\":\ndata: 1}\n\n", b"retry: 10\n\n"])
def test_every_sse_field_and_multi_line_json_data_pass(good):
    assert OpenAIChunks().screen(CHUNK + good) == (CHUNK + good, None, False)


@pytest.mark.parametrize("done", [b"data: [DONE]\n\n", b"data:[DONE]\n\n"])
def test_nothing_after_done_is_relayed(done):
    p = OpenAIChunks()
    out, problem, beyond = p.screen(CHUNK + done + CHUNK + b"junk\n\n")
    assert (out, problem, beyond) == (CHUNK + done, None, True) and p.ended(out)
    assert p.screen(CHUNK + done) == (CHUNK + done, None, False)


def test_nothing_after_a_responses_terminal_event_is_relayed():
    p = ResponsesEvents()
    head = ev("response.output_text.delta", 1, delta="hi") + ev("response.completed", 2, response={"id": "r"})
    assert p.screen(head + ev("response.output_text.delta", 3, delta="late")) == (head, None, True)
    text_about_it = ev("response.output_text.delta", 1, delta="event: response.completed")
    assert p.screen(text_about_it + text_about_it) == (text_about_it + text_about_it, None, False)


@given(st.lists(st.one_of(st.just(CHUNK), st.binary(max_size=40).map(lambda b: b.replace(b"\n\n", b"\n") + b"\n\n")),
                max_size=6))
def test_what_passes_the_screen_is_whole_json_events_only(events):
    out, problem, _ = OpenAIChunks().screen(b"".join(events))
    assert b"".join(events).startswith(out)
    for event in out.split(b"\n\n")[:-1]:
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        assert all(not line or line.startswith((b"data:", b"event:", b"id:", b"retry:", b":"))
                   for line in event.split(b"\n"))
        if data and b"\n".join(data) != b"[DONE]":
            assert isinstance(json.loads(b"\n".join(data)), dict)


EMPTY = b'data: {"id": "c", "choices": []}\n\n'


@pytest.mark.parametrize("split", [False, True])
def test_a_stream_without_any_choice_is_no_complete_answer(split):
    """choices: [] in every event, then [DONE]: the [DONE] is not relayed and the stream breaks there."""
    p = OpenAIChunks()
    if split:
        assert p.screen(EMPTY) == (EMPTY, None, False)
        out, problem, _ = p.screen(b"data: [DONE]\n\n")
    else:
        out, problem, _ = p.screen(EMPTY + EMPTY + b"data: [DONE]\n\n")
    assert b"[DONE]" not in out and "without any choice" in problem
    err = OpenAIChunks()  # the engine's own error event is an answer (it ends the stream honestly)
    error = b'data: {"error": {"message": "x"}}\n\n'
    assert err.screen(error + b"data: [DONE]\n\n") == (error + b"data: [DONE]\n\n", None, False)


@given(st.lists(st.integers(min_value=0, max_value=200), max_size=6), st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_sse_line_ends_lf_crlf_and_lone_cr_split_alike_across_any_chunking(cuts, eol):
    from orchestrator.gateway.failover import SseRecorder

    events = [CHUNK, b": keep-alive\n\n", b"event: message\ndata: {\"a\": 1}\n\n", b"data: [DONE]\n\n"]
    wire = b"".join(events).replace(b"\n", eol)
    recorder = SseRecorder()
    out = []
    start = 0
    for cut in sorted(c % (len(wire) + 1) for c in cuts) + [len(wire)]:
        out.append(recorder.split(wire[start:cut]))
        start = max(start, cut)
    assert b"".join(out) == b"".join(events) and recorder.pending == b""


def _created(rid: str, crlf: bool = False) -> bytes:
    event = (b"event: response.created\ndata: " + json.dumps({"type": "response.created", "sequence_number": 0,
                                                             "response": {"id": rid, "object": "response"}}).encode()
             + b"\n\n")
    return event.replace(b"\n", b"\r\n") if crlf else event


def test_a_streams_response_id_is_found_reading_each_byte_once():
    # (found by helper-47's probe: each chunk re-read everything seen before it, so 64 KB of tiny events from an
    # engine was ~20 000 passes over up to 64 KB; now every byte is read once)
    scan = responses_api.StreamIdScan(1 << 16)
    chunks = [b": keep-alive\n\n"] * 4000 + [_created("resp_1")[:20], _created("resp_1")[20:]]
    found = [scan.feed(c) for c in chunks]
    assert found[-1] == "resp_1" and not any(found[:-1])
    total = sum(map(len, chunks))
    assert scan.scanned <= total and scan.seen == total


@pytest.mark.parametrize("crlf", [False, True])
def test_the_id_is_found_in_any_chunking_and_line_ending(crlf):
    data = b": hello\n\n".replace(b"\n", b"\r\n" if crlf else b"\n") + _created("resp_2", crlf)
    for size in (1, 2, 3, 7, len(data)):
        scan = responses_api.StreamIdScan(1 << 16)
        ids = {scan.feed(data[i:i + size]) for i in range(0, len(data), size)} - {None}
        assert ids == {"resp_2"}, size


def test_the_scan_stops_at_its_limit():
    scan = responses_api.StreamIdScan(100)
    scan.feed(b": x\n\n" * 30)
    assert scan.exhausted
