"""Fixtures shared by the integration tests (a test module's own fixture of the same name wins)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.sim.profiles import load_profile
from orchestrator.sim.server import SimEngineThread


@pytest.fixture
def engines() -> Iterator[Any]:
    """``engines(n, profile="cpu-tiny")`` starts ``n`` simulated engines serving model ``m`` (no KV events); all
    are stopped after the test. ``profile``: a profile name, or a dict (``orchestrator/sim/profiles``)."""
    started: list[SimEngineThread] = []

    def start(n: int, profile: Any = "cpu-tiny") -> list[SimEngineThread]:
        for _ in range(n):
            started.append(SimEngineThread(model="m", profile=load_profile(profile) if isinstance(profile, dict)
                                           else profile, kv_events=False).start())
        return started

    yield start
    for e in started:
        e.stop()
