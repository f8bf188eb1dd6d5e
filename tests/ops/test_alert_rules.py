"""Alert and recording rules: promtool validates them, its unit tests exercise the alerts, and the
real Prometheus fixture loads them (so a rule Prometheus itself rejects cannot slip through)."""

import shutil
import subprocess
from pathlib import Path

import pytest

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool not found; run scripts/setup_test_deps.sh (Debian package prometheus)"
    return subprocess.run([exe, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=60)


def test_promtool_check_rules():
    r = _promtool("check", "rules", "rules.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_unit_tests_for_alerts():
    r = _promtool("test", "rules", "rules_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.prometheus
def test_real_prometheus_loads_every_rule(prometheus_server):
    groups = {g["name"]: g for g in prometheus_server.rule_groups()}
    assert {"dyad-recording", "dyad-alerts"} <= set(groups)
    names = {r["name"] for g in groups.values() for r in g["rules"]}
    for alert in ("DyadTTFTOverSLO", "DyadNoHealthyWorker", "DyadWorkerDown", "DyadHighErrorRatio",
                  "DyadKvEventGaps", "DyadIndexNearCap", "DyadIndexOnLocalMirror", "DyadPlannerAtBudget",
                  "DyadKvHandoffLeaseExpired", "DyadLastResortRouting"):
        assert alert in names
    # Every rule evaluates without error (health "err" would mean a bad expression at runtime).
    prometheus_server.wait_until(
        lambda: all(r.get("health") == "ok" for g in prometheus_server.rule_groups() for r in g["rules"]),
        timeout_s=30, what="every rule evaluated with health ok")
