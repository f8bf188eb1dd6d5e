"""The hindsight oracle of ``dyad plan --oracle`` (an upper bound, not a planner) and the first moment a
planner without foresight can see its start split outgrown (``first_overload``). Pure decisions on
hand-made fleets with a virtual ``now``; one small virtual-time replay for the CLI's stage parsing."""

from __future__ import annotations

import math

import pytest

from adapters.base import Role
from orchestrator.planner import plan_cli
from orchestrator.planner.baselines import HindsightOracle, first_overload
from orchestrator.planner.core import WorkerView


def _fleet(p: int, d: int, draining_p: int = 0) -> list[WorkerView]:
    return ([WorkerView(f"p{i}", Role.PREFILL) for i in range(p)] + [WorkerView(f"d{i}", Role.DECODE) for i in range(d)]
            + [WorkerView(f"x{i}", Role.PREFILL, "draining") for i in range(draining_p)])


def _starts(d, role: Role) -> int:
    return sum(1 for a in d.actions if a.kind == "start" and a.role is role)


def test_oracle_holds_the_start_split_until_its_stage_then_starts_what_the_target_needs():
    o = HindsightOracle([(30.0, {Role.PREFILL: 16, Role.DECODE: 1})])
    early = o.step(None, _fleet(3, 1), 0.0)
    assert early.actions == [] and early.desired == {"prefill": 3, "decode": 1}
    assert o.react(_fleet(3, 1), 28.0) is None  # a fast look before the stage: nothing
    d = o.step(None, _fleet(3, 1), 30.0)
    assert _starts(d, Role.PREFILL) == 13 and _starts(d, Role.DECODE) == 0
    assert d.desired == {"prefill": 16, "decode": 1} and o.acted == [30.0]
    # the started workers count (starting ones are in the fleet): no second round of starts
    later = o.step(None, _fleet(16, 1), 60.0)
    assert later.actions == []


def test_oracle_never_scales_in_and_counts_draining_workers_as_gone():
    o = HindsightOracle([(0.0, {Role.PREFILL: 2, Role.DECODE: 1})])
    d = o.step(None, _fleet(5, 3), 30.0)
    assert d.actions == [] and d.desired == {"prefill": 5, "decode": 3}
    d = o.step(None, _fleet(1, 1, draining_p=4), 60.0)
    assert _starts(d, Role.PREFILL) == 1


def test_oracle_stages_take_the_largest_target_due():
    o = HindsightOracle([(98.0, {Role.PREFILL: 19, Role.DECODE: 1}), (30.0, {Role.PREFILL: 7, Role.DECODE: 2})])
    assert o.target_at(10.0) is None
    assert o.target_at(30.0) == {Role.PREFILL: 7, Role.DECODE: 2}
    assert o.target_at(100.0) == {Role.PREFILL: 19, Role.DECODE: 2}
    d = o.react(_fleet(7, 2), 98.0)  # a fast look acts off the interval ticks
    assert d is not None and d.mode == "load" and _starts(d, Role.PREFILL) == 12
    with pytest.raises(ValueError):
        HindsightOracle([])
    with pytest.raises(ValueError):
        HindsightOracle([(0.0, {Role.PREFILL: -1})])


def test_first_overload_is_the_first_arrival_beyond_the_first_intervals_busiest_window():
    # first 30 s: at most 3 arrivals within any 5 s; silence; then 4 within 5 s: the 4th is the signal
    arrivals = [0.0, 1.0, 2.0, 10.0, 11.0, 90.0, 91.0, 92.0, 93.5, 120.0]
    assert first_overload(arrivals, 30.0, 5.0) == 93.5
    # the same count again is no overload; an empty trace has none
    assert first_overload([0.0, 1.0, 2.0, 60.0, 61.0, 62.0], 30.0, 5.0) is None
    assert first_overload([], 30.0, 5.0) is None
    # arrivals of the first interval itself never count as a sign beyond it
    assert first_overload([0.0, 0.1, 0.2, 0.3, 29.0], 30.0, 5.0) is None


def test_oracle_stage_spec_parses_splits_times_and_overload():
    arrivals = [0.0, 1.0, 2.0, 90.0, 90.5, 91.0, 91.5]
    st = plan_cli.oracle_stages("7:1@30,budget@overload", (16, 1), 20, 30.0, arrivals)
    assert st == [(30.0, (7, 1)), (91.5, (19, 1))]  # the 4th arrival within 5 s
    assert plan_cli.oracle_stages("static@30", (16, 1), 20, 30.0, arrivals) == [(30.0, (16, 1))]
    never = plan_cli.oracle_stages("static@overload", (16, 1), 20, 30.0, [0.0, 50.0])
    assert math.isinf(never[0][0])
    for bad in ("static", "static@soon", "x:y@30", "0:1@30"):
        with pytest.raises(ValueError):
            plan_cli.oracle_stages(bad, (16, 1), 20, 30.0, arrivals)
    with pytest.raises(ValueError, match="static row"):
        plan_cli.oracle_stages("budget@30", None, 20, 30.0, arrivals)


def test_plan_prints_an_oracle_row_after_the_dynamic_strategies(capsys, tmp_path):
    import argparse
    import json

    p = argparse.ArgumentParser()
    plan_cli.configure(p)
    out = tmp_path / "o.json"
    args = p.parse_args(["--trace", "synthetic:daily,duration=120,peak=2,trough=1,seed=1", "--budget", "6",
                         "--interval", "30", "--start-s", "20", "--static", "2:2", "--oracle", "static@30",
                         "--oracle", "3:2@45", "--json", str(out)])
    assert plan_cli.run(args) == 0
    text = capsys.readouterr().out
    assert "oracle static@30" in text and "oracle 3:2@45" in text
    rows = json.loads(out.read_text())["results"]
    assert [r.get("oracle") for r in rows[-2:]] == ["static@30", "3:2@45"]
    assert all(0.0 <= r["slo_attainment"] <= 1.0 for r in rows)


def test_oracle_only_skips_the_dynamic_strategies_and_needs_an_oracle(capsys, tmp_path):
    import argparse
    import json

    p = argparse.ArgumentParser()
    plan_cli.configure(p)
    base = ["--trace", "synthetic:daily,duration=120,peak=2,trough=1,seed=1", "--budget", "6", "--interval", "30",
            "--start-s", "20", "--no-static-search", "--oracle-only"]
    assert plan_cli.run(p.parse_args(base)) == 2
    assert "--oracle" in capsys.readouterr().err
    out = tmp_path / "o.json"
    assert plan_cli.run(p.parse_args(base + ["--oracle", "2:2@30", "--json", str(out)])) == 0
    assert "dynamic SLO planner" not in capsys.readouterr().out
    assert [r["strategy"].split(":")[0] for r in json.loads(out.read_text())["results"]] == ["oracle"]
