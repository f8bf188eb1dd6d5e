"""One deadline at a time on one event-loop timer that is moved only when the deadline comes earlier.

A connection sets a deadline for every wait (the request's headers, each body chunk, keep-alive): with a
timer pushed and cancelled per wait that is two heap operations each time. Here a later deadline leaves
the timer where it is; when it fires early it re-arms for the rest, so most waits cost no timer
operation at all. Used by the client connection protocol (``http_server.py``) and the engine
connections (``transport.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class LazyDeadline:
    """``set(seconds)``: call ``fire`` that many seconds from now unless ``clear``/``set`` comes first."""

    __slots__ = ("_loop", "_fire", "when", "_timer", "_timer_at")

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[], None]) -> None:
        self._loop = loop
        self._fire = fire
        self.when: float | None = None  # loop time of the deadline; None: none
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def set(self, seconds: float) -> None:
        loop = self._loop
        when = self.when = loop.time() + seconds
        timer = self._timer
        if timer is None or when < self._timer_at:  # (a later deadline waits for the timer to fire early)
            if timer is not None:
                timer.cancel()
            self._timer_at = when
            self._timer = loop.call_at(when, self._on_timer)

    def clear(self) -> None:
        self.when = None

    def cancel(self) -> None:
        """No deadline, and no timer left on the loop (the connection is closing). The callback is let go:
        it is usually a method of the deadline's owner, which holds the deadline (a reference cycle)."""
        self.when = None
        self._fire = _nothing
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        when = self.when
        if when is None:
            return
        if self._loop.time() < when:  # moved since: wait for the rest
            self._timer_at = when
            self._timer = self._loop.call_at(when, self._on_timer)
            return
        self.when = None
        self._fire()


def _nothing() -> None:
    pass
