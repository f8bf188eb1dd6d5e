"""A deadline for a whole answer from a dependency (an engine's health or metrics, Prometheus, the
Kubernetes API, a planner metrics source).

httpx's ``timeout`` bounds each read, not the answer: a server that sends a byte now and then never
trips it, and one such dependency would hold a health round, a scrape round or the planner loop for
good. ``within`` bounds the whole call and says what did not answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(seconds: float, call: Awaitable[T], what: str) -> T:
    """``await call``, complete within ``seconds`` in all; else ``TimeoutError("<what> did not answer
    within <seconds> s")``. A ``TimeoutError`` of the call's own (an inner, shorter deadline) passes as it is."""
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            return await call
    except TimeoutError:
        if not deadline.expired():
            raise
        raise TimeoutError(f"{what} did not answer within {seconds:g} s") from None
