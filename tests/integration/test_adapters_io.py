"""Adapter I/O paths without an engine: tokenize cache, error mapping, health, request shaping.

The engine side is an ``httpx.MockTransport`` handler that records what it received, so these
tests check what the adapter sends and how it reads answers and failures. The same calls against
a real vLLM are in tests/integration/test_vllm_adapter.py.
"""

from __future__ import annotations

import json

import httpx
import pytest

from adapters import AdapterError, SglangAdapter, UnsupportedByEngine, VllmAdapter
from adapters.tokenize_cache import TokenizeCache, content_key

BASE = "http://engine"


class Engine:
    """Answers /tokenize with one token per character; records every request."""

    def __init__(self, status: int = 200, body: object | None = None) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.status = status
        self.body = body

    def __call__(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content) if request.content else {}
        self.requests.append((request.url.path, payload))
        if request.url.path == "/health":
            return httpx.Response(self.status)
        if request.url.path == "/health_generate":
            return httpx.Response(200)
        if self.body is not None:
            return httpx.Response(self.status, json=self.body)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "model exploded", "code": 500}})
        text = payload.get("prompt") or json.dumps(payload.get("messages"))
        return httpx.Response(200, json={"tokens": [ord(c) for c in text], "count": len(text)})

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self))


async def test_vllm_tokenize_prompt_and_chat_bodies_and_cache():
    engine = Engine()
    adapter = VllmAdapter(cache=TokenizeCache(max_entries=8))
    async with engine.client() as c:
        assert await adapter.tokenize(c, BASE, "m", prompt="abc") == [97, 98, 99]
        again = await adapter.tokenize(c, BASE, "m", prompt="abc")
        assert again == [97, 98, 99] and len(engine.requests) == 1  # second one from the cache
        again.append(0)  # a caller mutating its copy does not poison the cache
        assert await adapter.tokenize(c, BASE, "m", prompt="abc") == [97, 98, 99]
        await adapter.tokenize(c, BASE, "other-model", prompt="abc")  # cache is per model
        assert len(engine.requests) == 2
        msgs = [{"role": "user", "content": "hi"}]
        await adapter.tokenize(c, BASE, "m", messages=msgs)
        await adapter.tokenize(c, BASE, "m", messages=[{"role": "user", "content": "hi"}])
    assert len(engine.requests) == 3
    path, body = engine.requests[0]
    assert path == "/tokenize" and body == {"model": "m", "prompt": "abc", "add_special_tokens": True}
    _, chat = engine.requests[2]
    assert chat["messages"] == msgs and chat["add_generation_prompt"] is True
    assert chat["add_special_tokens"] is False
    assert adapter.cache.hits == 3 and adapter.cache.misses == 3


async def test_token_id_prompt_is_returned_without_a_call():
    engine = Engine()
    async with engine.client() as c:
        assert await VllmAdapter().tokenize(c, BASE, "m", prompt=[5, 6, 7]) == [5, 6, 7]
    assert engine.requests == []


async def test_tokenize_needs_exactly_one_input():
    async with Engine().client() as c:
        with pytest.raises(ValueError):
            await VllmAdapter().tokenize(c, BASE, "m")
        with pytest.raises(ValueError):
            await VllmAdapter().tokenize(c, BASE, "m", prompt="a", messages=[])


async def test_engine_error_keeps_status_and_message():
    async with Engine(status=500).client() as c:
        with pytest.raises(AdapterError) as e:
            await VllmAdapter().tokenize(c, BASE, "m", prompt="x")
    assert e.value.status == 500 and "model exploded" in str(e.value)


async def test_old_error_shape_and_missing_tokens():
    body = {"object": "error", "message": "bad model name", "code": 404}
    async with Engine(status=404, body=body).client() as c:
        with pytest.raises(AdapterError, match="bad model name") as e:
            await VllmAdapter().tokenize(c, BASE, "m", prompt="x")
    assert e.value.status == 404
    async with Engine(status=200, body={"count": 3}).client() as c:
        with pytest.raises(AdapterError, match="no 'tokens'"):
            await VllmAdapter().tokenize(c, BASE, "m", prompt="x")


async def test_unreachable_engine_is_adapter_error_and_unhealthy():
    async with httpx.AsyncClient() as c:
        # Port 9 (discard) on loopback: nothing listens there, the connection is refused.
        with pytest.raises(AdapterError) as e:
            await VllmAdapter().tokenize(c, "http://127.0.0.1:9", "m", prompt="x", timeout=1.0)
        assert e.value.status is None
        assert await VllmAdapter().health(c, "http://127.0.0.1:9", timeout=1.0) is False


async def test_a_probe_the_engine_takes_but_does_not_answer_in_time_is_a_timeout_not_a_refusal():
    """A socket that takes the connection and never answers (an engine too busy to answer /health): the probe
    raises ``TimeoutError`` (busy, not gone: the health loop keeps such a worker as its last resort); a
    refused connection is plain False."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # never accepted: the kernel completes the handshake, nobody answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        async with httpx.AsyncClient() as c:
            for adapter in (VllmAdapter(), SglangAdapter()):
                with pytest.raises(TimeoutError, match="did not answer within 0.2 s"):
                    await adapter.health(c, url, 0.2)
            assert await VllmAdapter().health(c, "http://127.0.0.1:9", timeout=1.0) is False


async def test_health_status_codes():
    async with Engine(status=200).client() as c:
        assert await VllmAdapter().health(c, BASE, 1.0) is True
    async with Engine(status=503).client() as c:
        assert await VllmAdapter().health(c, BASE, 1.0) is False
        assert await SglangAdapter().health(c, BASE, 1.0) is False
        assert await SglangAdapter(deep_health=True).health(c, BASE, 1.0) is True  # /health_generate


async def test_sglang_tokenize_text_only():
    engine = Engine()
    adapter = SglangAdapter()
    async with engine.client() as c:
        assert await adapter.tokenize(c, BASE, "m", prompt="hi") == [104, 105]
        with pytest.raises(UnsupportedByEngine):
            await adapter.tokenize(c, BASE, "m", messages=[{"role": "user", "content": "hi"}])
    assert engine.requests == [("/tokenize", {"model": "m", "prompt": "hi", "add_special_tokens": True})]


def test_shape_request():
    body = {"model": "m", "prompt": "hi", "max_tokens": 3}
    assert VllmAdapter().shape_request("/v1/completions", body, "req-1") is body
    shaped = SglangAdapter().shape_request("/v1/completions", body, "req-1")
    assert shaped["rid"].startswith("req-1-") and "rid" not in body  # the client's body is not mutated
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert SglangAdapter().shape_request("/v1/chat/completions", chat, "r2")["rid"].startswith("r2-")
    batch = {"model": "m", "prompt": ["a", "b"]}
    assert "rid" not in SglangAdapter().shape_request("/v1/completions", batch, "r3")
    own = {"model": "m", "prompt": "a", "rid": "client-rid"}
    # rid is Dyad's (adapters.sglang.INTERNAL_FIELDS): intake refuses a client's, and the adapter always sets its own
    assert SglangAdapter().shape_request("/v1/completions", own, "r4")["rid"].startswith("r4-")
    assert "rid" in SglangAdapter.internal_fields


def test_cache_is_bounded_lru():
    cache = TokenizeCache(max_entries=2)
    k = [content_key("m", "prompt", s) for s in ("a", "b", "c")]
    cache.put(k[0], [1])
    cache.put(k[1], [2])
    assert cache.get(k[0]) == [1]  # touch a: b is now least recent
    cache.put(k[2], [3])
    assert len(cache) == 2 and cache.get(k[1]) is None and cache.get(k[0]) == [1]
    with pytest.raises(ValueError):
        TokenizeCache(max_entries=0)


def test_content_key_is_canonical():
    a = content_key("m", "chat", [{"role": "user", "content": "x"}])
    b = content_key("m", "chat", [{"content": "x", "role": "user"}])
    assert a == b and len(a) == 16
    assert a != content_key("m2", "chat", [{"role": "user", "content": "x"}])
    assert content_key("m", "prompt", "x") != content_key("m", "chat", "x")


async def test_chat_options_pass_template_fields_and_key_the_cache():
    engine = Engine()
    adapter = VllmAdapter()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "partial"}]
    client_body = {"model": "m", "messages": msgs, "continue_final_message": True, "temperature": 0.3,
                   "chat_template_kwargs": {"enable_thinking": False}}
    async with engine.client() as c:
        await adapter.tokenize(c, BASE, "m", messages=msgs, chat_options=client_body)
        await adapter.tokenize(c, BASE, "m", messages=msgs)  # other options: another cache entry
        await adapter.tokenize(c, BASE, "m", messages=msgs, chat_options=client_body)  # cached
    assert len(engine.requests) == 2
    sent = engine.requests[0][1]
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert "temperature" not in sent and sent["model"] == "m"
    assert engine.requests[1][1]["add_generation_prompt"] is True


async def test_scrape_failures_are_adapter_errors():
    async with httpx.AsyncClient() as c:
        with pytest.raises(AdapterError):
            await VllmAdapter().scrape(c, "http://127.0.0.1:9", timeout=1.0, now=0.0)
    async with Engine(status=404, body={"detail": "Not Found"}).client() as c:
        with pytest.raises(AdapterError) as e:
            await SglangAdapter().scrape(c, BASE, timeout=1.0, now=0.0)
    assert e.value.status == 404
