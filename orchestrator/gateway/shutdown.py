"""Graceful shutdown: on SIGTERM stop taking work, finish what is in flight, then exit.

uvicorn's own SIGTERM handling closes the listening socket at once and gives open connections a few
seconds: a load balancer still sending traffic gets connection errors, and a long stream is cut.
``DrainingServer`` puts a drain phase in front of it:

1. the first SIGTERM (or SIGINT) flips ``ShutdownState.draining``: ``/ready`` answers 503 (load
   balancers take the replica out) and every new ``/v1/*`` request is refused with 503 +
   ``Retry-After`` (clients retry on another replica), while the listener stays open;
2. requests already taken in run to completion, for at most ``resilience.shutdown_grace_s``:
   streams, and requests still waiting in the admission queue (they are dispatched as slots free);
   a request counts from the moment it passed the draining check until its last byte;
3. if the grace period runs out, requests still queued are refused with 503 + ``Retry-After``
   (``on_give_up`` hooks: the composition root (``compose.py``) closes the admission queue) rather than cut at exit;
4. then uvicorn's normal shutdown runs (close the listener and idle keep-alive connections, the
   lifespan stops the runtime) and the process exits with status 0.

A second signal skips the wait (and a third forces uvicorn out, as usual).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from orchestrator.errors import ApiError

log = logging.getLogger(__name__)


class ShuttingDown(ApiError):
    """503 + Retry-After: this replica is draining; another one (or this one after restart) will serve."""

    status = 503
    type = "service_unavailable"

    def __init__(self, retry_after: int) -> None:
        super().__init__("The gateway is shutting down and accepts no new requests; retry (another replica).",
                         code="shutting_down", headers={"Retry-After": str(max(1, retry_after))})


class ShutdownState:
    """Whether the gateway drains, and how many client requests it is still serving."""

    def __init__(self, retry_after_s: int = 1) -> None:
        self.retry_after_s = retry_after_s
        self.draining = False
        self.draining_since: float | None = None
        self.active = 0  # client requests between the draining check and their last byte
        self._idle: asyncio.Future[None] | None = None  # a drain waiting for ``active`` to reach 0
        self._give_up_hooks: list[Callable[[], Any]] = []

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.draining_since = time.monotonic()

    def check(self) -> None:
        """Refuse new work while draining (called first thing by the OpenAI endpoints)."""
        if self.draining:
            raise ShuttingDown(self.retry_after_s)

    def started(self) -> None:
        self.active += 1

    def finished(self) -> None:
        self.active = max(0, self.active - 1)
        if self.active == 0 and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def on_give_up(self, hook: Callable[[], Any]) -> None:
        """``hook()`` runs when the drain's grace period is over with requests still in (see ``give_up``)."""
        self._give_up_hooks.append(hook)

    def give_up(self) -> None:
        """The grace period is over: refuse what has not started yet (hooks), before the server exits."""
        for hook in self._give_up_hooks:
            try:
                hook()
            except Exception:  # one hook failing must not keep the others (or the exit) from running
                log.exception("shutdown hook failed")

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when nothing is in flight within ``timeout_s``."""
        if self.active == 0:
            return True
        if self._idle is None or self._idle.done():
            self._idle = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._idle), timeout_s)
            return True
        except TimeoutError:
            return self.active == 0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first SIGTERM/SIGINT drains (see the module docstring).

    ``state`` returns the running gateway's ``ShutdownState`` (None before start-up: then there is
    nothing to drain and the signal exits at once).
    """

    def __init__(self, config: uvicorn.Config, state: Callable[[], ShutdownState | None], grace_s: float) -> None:
        super().__init__(config)
        self._state = state
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[Any] | None = None
        self._signals = 0

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        state = self._state()
        if self._signals == 1 and state is not None and self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(self._start_drain, state, signal.Signals(sig).name)
            return
        if self._signals == 2:
            self.should_exit = True  # stop waiting for in-flight requests
        else:
            self.should_exit = True
            self.force_exit = self._signals > 2

    def _start_drain(self, state: ShutdownState, signame: str) -> None:
        self._drain_task = asyncio.ensure_future(self.drain(state, signame))

    async def drain(self, state: ShutdownState, reason: str = "shutdown") -> None:
        state.begin()
        log.warning("%s: draining (%d requests in flight, grace %.0f s); new requests get 503",
                    reason, state.active, self.grace_s)
        idle = await state.wait_idle(self.grace_s)
        if not idle:
            log.warning("grace period over with %d requests still in; refusing queued ones, exiting",
                        state.active)
            state.give_up()  # their 503s are written during uvicorn's own graceful shutdown
        self.should_exit = True
