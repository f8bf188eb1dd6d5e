"""The gateway's event loop in native mode: one that the plane's thread may schedule work on.

With ``gateway.data_plane: native`` Dyad's Python runs on two threads (lane.py): the event loop's and the
plane's. The plane's thread runs the same code as the Python gateway (the route handler, ``Router.decide``, an
``Attempt``'s bookkeeping, ``ProxyResponse``'s judgments), and that code sometimes starts loop work without
waiting for it: a background task (the prefix tracker refreshing a prefix's recency, a shared-load update),
a queued request woken when a dispatch slot is given back (a future resolved), a drain told that the last
request ended (an ``asyncio.Event``), a worker marked down cancelling the Python plane's attempts (a task
cancelled), a timer. Each of those ends in ``loop.call_soon`` / ``call_later`` / ``call_at``, which are not
thread-safe: asyncio's do not wake the loop (the work waits until something else does), and uvloop's start
libuv handles, which only the loop's thread may touch.

``PlaneSafeLoop`` is the loop class (uvloop's when installed, else asyncio's) with those three methods
checking the calling thread once the plane runs (``adopt``, on the loop's thread): from any other thread,
``call_soon`` becomes ``call_soon_threadsafe`` (queued, and the loop woken), and a timer is armed on the loop
(``_ForeignTimer``: cancellable from either thread). Futures, tasks and events resolve through
``call_soon``, so all of them are covered without changing the code that uses them. On the loop's own
thread the cost is one thread-id comparison per scheduled callback.

What does not go through these methods (closing a transport, say) must not be done from the plane's
thread: the lane hands it to the loop itself (``lane.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

try:
    import uvloop

    _Base: Any = uvloop.Loop
except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
    _Base = asyncio.SelectorEventLoop

_ident = threading.get_ident


class PlaneSafeLoop(_Base):  # type: ignore[misc]
    """An event loop that other threads may schedule on once ``adopt`` was called (module docstring)."""

    _owner: int | None = None  # the loop's thread, once another thread may call in

    def adopt(self) -> None:
        """From now on, calls from other threads are handed over (call on the loop's own thread)."""
        self._owner = _ident()

    def call_soon(self, callback: Any, *args: Any, context: contextvars.Context | None = None) -> Any:
        owner = self._owner
        if owner is not None and _ident() != owner:
            return self.call_soon_threadsafe(callback, *args, context=context)
        return super().call_soon(callback, *args, context=context)

    def call_later(self, delay: float, callback: Any, *args: Any, context: contextvars.Context | None = None) -> Any:
        owner = self._owner
        if owner is not None and _ident() != owner:
            return _ForeignTimer(self, self.time() + delay, callback, args, context)
        return super().call_later(delay, callback, *args, context=context)

    def call_at(self, when: float, callback: Any, *args: Any, context: contextvars.Context | None = None) -> Any:
        owner = self._owner
        if owner is not None and _ident() != owner:
            return _ForeignTimer(self, when, callback, args, context)
        return super().call_at(when, callback, *args, context=context)

    def on_own_thread(self) -> bool:
        owner = self._owner
        return owner is None or _ident() == owner


class _ForeignTimer:
    """A timer asked for from another thread: armed on the loop's thread; ``cancel`` works from either."""

    __slots__ = ("_loop", "_when", "_handle", "_cancelled")

    def __init__(self, loop: PlaneSafeLoop, when: float, callback: Any, args: tuple[Any, ...],
                 context: contextvars.Context | None) -> None:
        self._loop = loop
        self._when = when
        self._handle: Any = None
        self._cancelled = False
        loop.call_soon_threadsafe(self._arm, callback, args, context)

    def _arm(self, callback: Any, args: tuple[Any, ...], context: contextvars.Context | None) -> None:
        if not self._cancelled:
            self._handle = self._loop.call_at(self._when, callback, *args, context=context)

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        handle = self._handle
        if handle is not None:
            if self._loop.on_own_thread():
                handle.cancel()
            else:
                self._loop.call_soon_threadsafe(handle.cancel)

    def cancelled(self) -> bool:
        return self._cancelled

    def when(self) -> float:
        return self._when
