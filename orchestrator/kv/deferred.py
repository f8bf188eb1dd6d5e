"""Writes applied at the event loop's next turn (after the request that caused them was sent), or at
once when a reader needs them first: every reader sees the same state as if they had been applied
when queued. Used by the in-memory prefix index (``store_later``) and the approximate recorder."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Deferred:
    """Calls to ``apply`` queued by ``add`` and applied in order by ``flush``: at the loop's next turn,
    or earlier when a reader calls ``flush`` (check ``pending`` first: the cheap test on a read path)."""

    __slots__ = ("_apply", "pending", "_handle")

    def __init__(self, apply: Callable[..., None]) -> None:
        self._apply = apply
        self.pending: list[tuple[Any, ...]] = []
        self._handle: asyncio.Handle | None = None

    def add(self, *args: Any) -> None:
        self.pending.append(args)
        if self._handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): now
                self.flush()
                return
            self._handle = loop.call_soon(self._soon)

    def _soon(self) -> None:
        self._handle = None
        self.flush()

    def flush(self) -> None:
        apply = self._apply
        while self.pending:
            batch, self.pending = self.pending, []
            for args in batch:
                apply(*args)
