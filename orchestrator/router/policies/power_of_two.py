"""power_of_two: sample two candidates at random, keep the one with the shorter queue.

Nearly as good as least_load at spreading load, and it does not herd: when every router replica
sees the same stale queue lengths, least_load sends them all to the same worker; two random
choices break that. Seeded, so a run is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from orchestrator.fleet.worker import Worker
from orchestrator.router.policies.least_load import queue_length
from orchestrator.router.types import RouteDecision, RouteRequest


class PowerOfTwoPolicy:
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, candidates: Sequence[Worker], now: float) -> RouteDecision:
        if len(candidates) == 1:
            return RouteDecision(worker=candidates[0], policy=self.name, reason="only candidate")
        a, b = self._rng.sample(range(len(candidates)), 2)
        wa, wb = candidates[a], candidates[b]
        qa, qb = queue_length(wa), queue_length(wb)
        best = wa if qa <= qb else wb
        return RouteDecision(worker=best, policy=self.name,
                             reason=f"shorter of two sampled queues ({min(qa, qb):g} vs {max(qa, qb):g})",
                             scores={wa.id: qa, wb.id: qb})
