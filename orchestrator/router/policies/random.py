"""random: a uniformly random candidate (seeded). The baseline every other policy must beat."""

from __future__ import annotations

import random
from collections.abc import Sequence

from orchestrator.fleet.worker import Worker
from orchestrator.router.types import RouteDecision, RouteRequest


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, candidates: Sequence[Worker], now: float) -> RouteDecision:
        return RouteDecision(worker=self._rng.choice(candidates), policy=self.name, reason="random pick")
