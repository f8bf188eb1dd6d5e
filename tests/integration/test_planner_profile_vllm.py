"""``dyad profile --url`` against a REAL vLLM engine (the session's default engines), and the planner
loading what it wrote. A small sweep: this is a CPU engine on a shared 2-core machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.predictors import LoadForecast
from orchestrator.planner.solver import Limits, Targets, solve
from tests.fixtures.vllm import VllmEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_profile_a_real_engine_and_plan_with_it(vllm_engine: VllmEngine, tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "orchestrator.cli", "profile", "--url", vllm_engine.url, "--out", str(out),
           "--isl", "64,2048", "--concurrency", "1,4", "--context", "256", "--decode-tokens", "16",
           "--repeats", "3", "--timeout", "120"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr
    profile = json.loads(out.read_text())
    assert profile["source"].startswith(f"HTTP sweep of {vllm_engine.url}")
    ttft = {p["isl"]: p["ttft_s"] for p in profile["prefill"]}
    # 32x the tokens costs more (median of 3 per length: one sample on a loaded 2-core machine is noise)
    assert set(ttft) == {64, 2048} and 0 < ttft[64] < ttft[2048] < 60
    itl = {p["concurrency"]: p["itl_s"] for p in profile["decode"]}
    assert set(itl) == {1, 4} and all(0 < v < 5 for v in itl.values())
    perf = PerfModel.from_dict(profile)  # the planner reads what the profiler wrote
    sizing = solve(LoadForecast(2.0, 1024, 16), perf, Targets(ttft_s=5.0, itl_s=1.0), Limits(budget=64))
    assert sizing.prefill >= 1 and sizing.decode >= 1 and not sizing.infeasible
