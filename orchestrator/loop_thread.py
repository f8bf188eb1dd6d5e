"""Network I/O on the request path from code that may run off the event loop's thread.

With ``gateway.data_plane: native`` the route handler, annotation and the decision run on the native plane's
thread, driven without a task (``gateway/native/lane.py``). That is right for in-process work, and wrong for
network I/O: client libraries bound their calls with ``asyncio.timeout`` (redis-py does), which needs the
current task, and there is none on that thread (``asyncio.current_task`` would even name whatever task the
loop's thread was running when the GIL changed hands). So code on the request path calls ``on_loop_thread``
before its first network call: on the loop's thread it returns at once; on another thread it waits once, the
lane parks the handler as it stands, and the event loop finishes it in a task of its own.
"""

from __future__ import annotations

import asyncio


def foreign_loop() -> asyncio.AbstractEventLoop | None:
    """The running loop when this code runs on another thread than the loop's own (the native plane's, which
    runs with the gateway's loop set: native/loop.PlaneSafeLoop); None on the loop's thread or with no loop."""
    loop = asyncio._get_running_loop()
    own = getattr(loop, "on_own_thread", None)  # (any other loop has one thread)
    return None if own is None or own() else loop


async def on_loop_thread() -> None:
    """Return on the event loop's own thread (module docstring); free there."""
    loop = foreign_loop()
    if loop is None:
        return
    moved = loop.create_future()
    loop.call_soon(moved.set_result, None)  # (from another thread: queued on the loop's, which it wakes)
    await moved
