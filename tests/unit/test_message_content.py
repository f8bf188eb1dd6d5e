"""One rule for chat message content → text, shared by the router's HF tokenizer path and the simulated
engines' word tokenizer (orchestrator/kv/message_content.py)."""

from __future__ import annotations

import pytest

from orchestrator.config import load_config
from orchestrator.kv.message_content import Untokenizable, message_text
from orchestrator.kv.tokenization import RequestTokenizer
from orchestrator.kv.word_tokenizer import SimTokenizer


def test_text_parts_join_by_newline_and_other_parts_are_untokenizable():
    assert message_text(None) == "" and message_text("a b") == "a b"
    assert message_text([{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"}]) == "a\nb\nc"
    with pytest.raises(Untokenizable):
        message_text([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(Untokenizable):
        message_text(42)


def test_sim_tokenizer_follows_the_rule():
    tok = SimTokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "x y"}, {"type": "input_text", "text": "z"}]}]
    assert tok.encode_chat(parts) == tok.encode_chat([{"role": "user", "content": "x y z"}])
    with pytest.raises(Untokenizable):
        tok.encode_chat([{"role": "user", "content": [{"type": "image_url"}]}])


async def test_router_routes_image_requests_without_local_tokens():
    rt = RequestTokenizer(load_config({"models": [{"name": "m", "tokenizer": "sim"}]}, environ={}))
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                     {"type": "image_url"}]}]}
    assert await rt.token_ids("m", "/v1/chat/completions", body) is None
