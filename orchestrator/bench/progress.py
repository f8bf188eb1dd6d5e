"""Progress of a long run (``dyad bench``, ``dyad plan``): a bar on a terminal, plain lines otherwise.

On a terminal the bar is redrawn in place (``\\r``), at most ten times a second. When the stream is
not a terminal (CI, a pipe, a log file) a bar would be noise, and silence looks like a hang, so a
plain line is written every ``interval_s`` (and once at the end)::

    dyad bench: 120/500 (24%) done, 2 errors, 10.3/s, 12 s elapsed, ~37 s left

``tick()`` lets a caller print even while nothing completes (a stalled run still says so); ``update``
counts work done. The clock is injectable for tests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

DEFAULT_INTERVAL_S = 10.0


class Progress:
    """``mode``: "bar" (a terminal), "lines" (periodic plain lines), "off"; None picks bar or lines
    from ``stream.isatty()``."""

    def __init__(self, total: int, *, label: str = "progress", unit: str = "done", mode: str | None = None,
                 stream: IO[str] | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        if mode is None:
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "lines"
        if mode not in ("bar", "lines", "off"):
            raise ValueError(f"progress mode must be bar, lines or off (got {mode!r})")
        self.mode = mode
        self.total = total
        self.label = label
        self.unit = unit
        self.interval_s = interval_s
        self.clock = clock
        self.done = 0
        self.errors = 0
        self.started = clock()
        self._last_draw = -1e18
        self._last_line = self.started
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def update(self, result: Any = None, *, n: int = 1, error: bool | None = None) -> None:
        """Count ``n`` units done; an error when ``error`` or ``result.ok`` is false."""
        self.done += n
        if error is None:
            error = result is not None and not getattr(result, "ok", True)
        self.errors += n if error else 0
        self._maybe_write()

    def set(self, done: int) -> None:
        """Set the units done (a caller that knows its position, e.g. virtual time)."""
        self.done = done
        self._maybe_write()

    def tick(self) -> None:
        """Write a line if one is due, whether or not anything completed."""
        self._maybe_write()

    def line(self) -> str:
        elapsed = self.clock() - self.started
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        text = f"{self.label}: {self.done}/{self.total}{pct} {self.unit}"
        if self.errors:
            text += f", {self.errors} error{'s' if self.errors != 1 else ''}"
        if elapsed > 0 and self.done:
            per_s = self.done / elapsed
            text += f", {per_s:.3g}/s"
            text += f", {elapsed:.0f} s elapsed"
            if 0 < self.done < self.total:
                text += f", ~{(self.total - self.done) / per_s:.0f} s left"
        else:
            text += f", {elapsed:.0f} s elapsed"
        return text

    def _maybe_write(self) -> None:
        if self.mode == "off" or self._closed:
            return
        now = self.clock()
        if self.mode == "bar":
            if now - self._last_draw > 0.1 or self.done >= self.total:
                self._last_draw = now
                width = 30
                filled = int(width * min(self.done, self.total) / max(self.total, 1))
                self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.line()} ")
                self.stream.flush()
        elif now - self._last_line >= self.interval_s:
            self._last_line = now
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.mode == "bar":
            self.stream.write("\n")
        elif self.mode == "lines":
            self.stream.write(self.line() + " (finished)\n")
        else:
            return
        self.stream.flush()
