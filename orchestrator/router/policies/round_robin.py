"""round_robin: each request goes to the next candidate in turn. Ignores load and cache."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.fleet.worker import Worker
from orchestrator.router.types import RouteDecision, RouteRequest


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, req: RouteRequest, candidates: Sequence[Worker], now: float) -> RouteDecision:
        worker = candidates[self._turn % len(candidates)]
        self._turn += 1
        return RouteDecision(worker=worker, policy=self.name, reason="next in turn")
