"""least_load: send each request to the worker with the shortest queue.

A worker's queue is the larger of two views: what the engine last reported (running + waiting,
which also counts other gateways' requests but is up to one scrape interval old) and this
gateway's own in-flight count (exact and current, but blind to other gateways). Taking the larger
avoids counting our own requests twice (they are inside the engine's numbers) while still seeing
load that is not ours. Ties go to the candidate after the last one picked, so an idle fleet is
shared evenly instead of piling onto the first worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.fleet.worker import Worker
from orchestrator.router.types import RouteDecision, RouteRequest


def queue_length(worker: Worker) -> float:
    """Requests ahead of a new one on ``worker`` (see module docstring)."""
    return max(worker.load.running + worker.load.waiting, float(worker.inflight))


class LeastLoadPolicy:
    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, req: RouteRequest, candidates: Sequence[Worker], now: float) -> RouteDecision:
        n = len(candidates)
        start = self._turn % n
        self._turn += 1
        best: Worker | None = None
        best_score = float("inf")
        scores: dict[str, float] = {}
        for i in range(n):
            w = candidates[(start + i) % n]
            score = queue_length(w)
            scores[w.id] = score
            if score < best_score:
                best, best_score = w, score
        assert best is not None
        return RouteDecision(worker=best, policy=self.name, reason=f"shortest queue ({best_score:g})",
                             scores=scores)
