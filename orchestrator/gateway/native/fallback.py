"""The Python gateway behind the native plane: what the plane hands over, and nothing from anyone else.

In native mode the Python gateway listens on a loopback port that only the plane calls. Every request the
plane forwards carries the lane's secret (``x-dyad-native-secret``) and the client's address
(``x-dyad-native-peer``); a request without the secret is refused (403), so another local process cannot
use the loopback port to skip the plane's limits. A resume token (``x-dyad-native-resume``) names work the
lane parked (``lane.py``):

- ``handler``: a route handler that waited (admission queue, Redis, tokenizer): finished here, then served;
- ``admitted``: an admitted request the plane does not carry (prefill/decode pairs, https engines);
- ``continue``: a stream that broke after its first bytes: the Python stream relay writes what follows.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request

from orchestrator.errors import ApiError, error_body
from orchestrator.gateway.http_server import apply_forwarded
from orchestrator.gateway.native.lane import PEER, RESUME, SECRET, _finish_on_loop

if TYPE_CHECKING:
    from orchestrator.gateway.native.lane import NativeLane
    from orchestrator.gateway.native.plane import NativePlane

_PREFIX = b"x-dyad-native-"


async def _send_json(send: Any, status: int, message: str, code: str) -> None:
    body = orjson.dumps(error_body(message, "invalid_request_error" if status < 500 else "server_error", None, code))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class FallbackApp:
    """ASGI: the gateway app, reachable only through the plane (``lane`` is set once the plane runs)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lane: NativeLane | None = None
        self.plane: NativePlane | None = None  # started when the app's start-up is complete, stopped first
        self.state = app.state  # (tests and the thread runner read app.state.runtime)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" and self.plane is not None:
            await self._lifespan(scope, receive, send, self.plane)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        secret = peer = resume = None
        kept = []
        for k, v in scope["headers"]:
            if k.startswith(_PREFIX):
                if k == SECRET:
                    secret = v
                elif k == PEER:
                    peer = v
                elif k == RESUME:
                    resume = v
                continue
            kept.append((k, v))
        lane = self.lane
        if lane is None or secret is None or secret.decode("latin-1") != lane.secret:
            await _send_json(send, 403, "This port serves only the gateway's native data plane.", "forbidden")
            return
        scope = dict(scope, headers=kept)
        if peer:  # the client as the plane saw it; then the forwarded headers, judged on that client (uvicorn's
            # middleware judged them on the plane, which is loopback: trusted by default)
            host, _, port = peer.decode("latin-1").rpartition(":")
            scope["client"] = (host, int(port) if port.isdigit() else 0)
            scope["scheme"] = "http"  # (the plane terminates no TLS)
            apply_forwarded(scope, lane.trusted_proxies)
        if resume is None:
            await self.app(scope, receive, send)
            return
        work = lane.claim(resume.decode("latin-1"))
        if work is None:
            await _send_json(send, 503, "The gateway lost this request between its two halves; retry.",
                             "native_resume_expired")
            return
        if work[0] == "continue":
            _, exchange, kind, detail = work
            await exchange.continue_stream(send, kind, detail)
            return
        if work[0] == "handler":
            _, coro, yielded, body_receive = work
            watcher = asyncio.ensure_future(_watch(receive, body_receive))
            try:
                admitted = await _finish_on_loop(coro, yielded)
            except ApiError as err:
                scope["app"] = self.app  # (as Starlette sets it: the error handler reads the runtime through it)
                request = Request(scope, receive)
                handler = self.app._handler(err)
                response = await handler(request, err)
                await response(scope, receive, send)
                return
            finally:
                watcher.cancel()
        else:
            admitted = work[1]
        await admitted(scope, receive, send)


    async def _lifespan(self, scope: Any, receive: Any, send: Any, plane: NativePlane) -> None:
        """The app's start-up and shutdown, with the plane started once the runtime is up and stopped (its
        requests in flight given ``resilience.shutdown_grace_s``) before the runtime goes."""

        async def receive_() -> Any:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await asyncio.to_thread(plane.stop, plane.config.resilience.shutdown_grace_s)
            return message

        async def send_(message: Any) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    plane.start(asyncio.get_running_loop())
                except Exception as e:  # noqa: BLE001 - start-up fails with the reason
                    await send({"type": "lifespan.startup.failed", "message": f"native data plane: {e}"})
                    return
            await send(message)

        await self.app(scope, receive_, send_)


async def _watch(receive: Any, body_receive: Any) -> None:
    """Tell the parked handler (the admission queue) when its client leaves."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            body_receive.disconnected()
            return
