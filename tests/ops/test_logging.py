"""Structured JSON logs carry the request id bound at the edge, through awaits and spawned tasks."""

import asyncio
import io
import json
import logging

import pytest

from orchestrator.telemetry.logging import configure_logging, get_request_id, request_context

log = logging.getLogger("dyad.test")


@pytest.fixture
def captured():
    buf = io.StringIO()
    root = logging.getLogger()
    old_level, old_handlers = root.level, list(root.handlers)
    handler = configure_logging(json=True, level="DEBUG", stream=buf)
    yield lambda: [json.loads(line) for line in buf.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(old_level)
    assert root.handlers == old_handlers


def test_lines_are_json_with_request_id_and_extra_fields(captured):
    log.info("before")
    with request_context("req-1", model="tiny"):
        log.info("routed to %s", "w0", extra={"worker": "w0", "predicted_cached_tokens": 96})
    log.warning("after")
    before, routed, after = captured()
    assert "request_id" not in before and "request_id" not in after
    assert routed["msg"] == "routed to w0"
    assert routed["request_id"] == "req-1"
    assert routed["model"] == "tiny" and routed["worker"] == "w0" and routed["predicted_cached_tokens"] == 96
    assert routed["level"] == "info" and routed["logger"] == "dyad.test" and routed["ts"].endswith("+00:00")
    assert after["level"] == "warning"


def test_nested_contexts_restore_the_outer_id(captured):
    with request_context("outer"):
        with request_context("inner", worker="w1"):
            log.info("a")
        log.info("b")
    a, b = captured()
    assert (a["request_id"], a["worker"]) == ("inner", "w1")
    assert b["request_id"] == "outer" and "worker" not in b


async def test_request_id_follows_tasks_and_does_not_leak_between_requests(captured):
    async def handle(rid: str) -> None:
        with request_context(rid):
            await asyncio.sleep(0.01)
            await asyncio.create_task(child())

    async def child() -> None:
        await asyncio.sleep(0)
        log.info("in child", extra={"seen": get_request_id()})

    await asyncio.gather(*(handle(f"r{i}") for i in range(5)))
    lines = [line for line in captured() if line["logger"] == "dyad.test"]  # not asyncio's debug lines
    assert sorted(line["request_id"] for line in lines) == [f"r{i}" for i in range(5)]
    assert all(line["request_id"] == line["seen"] for line in lines)


def test_exceptions_are_one_json_line(captured):
    with request_context("req-x"):
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("upstream failed")
    (line,) = captured()
    assert line["request_id"] == "req-x" and "ValueError: boom" in line["exc"]


def test_configure_is_idempotent_and_text_mode_shows_the_id():
    buf = io.StringIO()
    root = logging.getLogger()
    old_level, old_handlers = root.level, list(root.handlers)
    try:
        configure_logging(json=True, stream=io.StringIO())
        handler = configure_logging(json=False, level="INFO", stream=buf)
        assert sum(h.get_name() == "dyad" for h in root.handlers) == 1
        with request_context("req-7"):
            log.info("hello")
        log.debug("hidden at INFO")
        assert buf.getvalue().count("\n") == 1
        assert "[req-7]" in buf.getvalue() and "hello" in buf.getvalue()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert root.handlers == old_handlers


def test_uvicorn_lines_are_clean_json_without_color_message():
    """A real uvicorn server started and stopped through Dyad's own config: its lines are Dyad's JSON,
    with the plain message and without uvicorn's ANSI-coloured ``color_message`` copy."""
    import threading
    import time

    import uvicorn

    from orchestrator.gateway.serve import bind_socket, uvicorn_config

    async def app(scope, receive, send):  # a bare ASGI app: only the server's own lines matter here
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    buf = io.StringIO()
    root = logging.getLogger()
    old_level, old_handlers = root.level, list(root.handlers)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", sock.getsockname()[1], log_level="info"))
    handler = configure_logging(json=True, level="INFO", stream=buf)  # as `dyad serve` does
    try:
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        server.should_exit = True
        thread.join(10)
    finally:
        sock.close()
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert root.handlers == old_handlers
    raw = buf.getvalue().splitlines()
    lines = [json.loads(line) for line in raw]  # every line is one JSON object
    for line in lines:  # every line, whichever server wrote it (session fixtures may run others)
        assert "color_message" not in line, line
        assert "\x1b[" not in json.dumps(line), line
        assert line["logger"] != "uvicorn.error", line  # its lifecycle lines read "uvicorn"
    lines = [line for line in lines if line["logger"] == "uvicorn"]
    messages = [line["msg"] for line in lines]
    assert any("Application startup complete" in m for m in messages), messages
    assert any("Started server process" in m for m in messages), messages
    for line in lines:
        assert set(line) <= {"ts", "level", "logger", "msg", "request_id", "exc"}, line
