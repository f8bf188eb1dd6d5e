"""The gateway's hot-path machinery (orchestrator/gateway/fastpath.py): dispatch ahead of FastAPI with the
app's own error handlers, and the small per-request helpers."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.errors import ApiError, InvalidRequest
from orchestrator.gateway.fastpath import GatewayApp, child, new_request_id, usage_of

# --- GatewayApp ----------------------------------------------------------------------------------


def make_app(endpoint):
    app = GatewayApp(openapi_url="/openapi.json")
    app.add_hot_route("/v1/hot", endpoint)
    calls = []

    async def api_error(request: Request, exc: Exception) -> Response:
        calls.append(("api", type(exc).__name__))
        assert isinstance(exc, ApiError)
        return Response(orjson.dumps(exc.body()), status_code=exc.status, media_type="application/json")

    async def unexpected(request: Request, exc: Exception) -> Response:
        calls.append(("unexpected", type(exc).__name__))
        return Response(b'{"error":{"message":"internal"}}', status_code=500, media_type="application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        calls.append(("http", type(exc).__name__))
        assert isinstance(exc, HTTPException)
        return Response(b'{"error":{"message":"http"}}', status_code=exc.status_code)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    return app, calls


async def call(app, method="POST", path="/v1/hot", raise_app_exceptions=True):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        return await c.request(method, path, content=b"{}")


async def test_hot_route_is_served_and_still_declared():
    async def endpoint(request: Request) -> Response:
        return Response(b"hot:" + await request.body(), media_type="text/plain")

    app, _ = make_app(endpoint)
    r = await call(app)
    assert (r.status_code, r.content) == (200, b"hot:{}")
    assert [r.path for r in app.routes if getattr(r, "path", None) == "/v1/hot"] == ["/v1/hot"]  # declared
    assert (await call(app, "GET")).status_code == 405  # other methods still go through FastAPI
    assert (await call(app, "POST", "/v1/other")).status_code == 404


async def test_api_errors_use_the_registered_handler():
    async def endpoint(request: Request) -> Response:
        raise InvalidRequest("bad field", param="model")

    app, calls = make_app(endpoint)
    r = await call(app)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert calls == [("api", "InvalidRequest")]


async def test_unexpected_error_is_a_500_then_reraised_like_starlette():
    async def endpoint(request: Request) -> Response:
        raise KeyError("boom")

    app, calls = make_app(endpoint)
    with pytest.raises(KeyError):  # the server sees it too (and logs it), as with ServerErrorMiddleware
        await call(app)
    r = await call(app, raise_app_exceptions=False)
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal"
    assert calls[-1] == ("unexpected", "KeyError")


async def test_error_inside_the_response_after_start_is_not_rendered_twice():
    class Broken:
        async def __call__(self, scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise InvalidRequest("too late")

    async def endpoint(request: Request):
        return Broken()

    app, calls = make_app(endpoint)
    with pytest.raises(InvalidRequest):
        await call(app)
    assert calls == []


# --- helpers -------------------------------------------------------------------------------------

def test_request_ids_are_unique_hex_of_uuid_length():
    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_child_returns_the_same_labelled_child():
    c = Counter("x_total", "x", ["model"], registry=CollectorRegistry())
    a = child(c, "m")
    assert child(c, "m") is a and a.metric is c.labels("m")
    child(c, "m").inc(2)
    child(c, "n").inc()
    assert c.labels("m")._value.get() == 2 and c.labels("n")._value.get() == 1


@pytest.mark.parametrize("body, usage", [
    ({"choices": [{"text": 'say "usage": {"prompt_tokens": 99}'}], "usage": {"prompt_tokens": 3}}, {"prompt_tokens": 3}),
    ({"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}, "completion_tokens": 1}, "x": 1},
     {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}, "completion_tokens": 1}),
    ({"usage": None}, None),
    ({"id": "no usage"}, None),
    ({"choices": [], "usage": {"a": {"b": {"c": 1}}}}, {"a": {"b": {"c": 1}}}),
])
def test_usage_of_finds_the_usage_object(body, usage):
    raw = orjson.dumps(body)
    assert usage_of(raw) == usage
    assert usage_of(orjson.dumps(body, option=orjson.OPT_INDENT_2)) == usage


def test_usage_of_survives_malformed_answers():
    assert usage_of(b'{"usage": {"prompt_tokens": ') is None
    assert usage_of(b'not json "usage"') is None
    assert usage_of(b'["usage"]') is None


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("orchestrator").setLevel(logging.CRITICAL)
