"""``dyad plan`` pieces that need no simulation: the seeded workloads, the neutral start, the plot extra."""

from __future__ import annotations

import argparse
import sys

import pytest

from orchestrator.bench.workloads import generate, load_synthetic, parse_spec
from orchestrator.planner import plan_cli
from orchestrator.planner.perf_model import PerfModel
from tests.unit.test_planner_logic import PROFILE


def test_synthetic_daily_curve_is_seeded_and_has_its_shape():
    spec = "synthetic:daily,peak=4,trough=0.5,isl=500,osl_ratio=4,duration=1200,seed=7"
    a, b = load_synthetic(spec), load_synthetic(spec)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in a] == [(r.arrival_s, r.input_len, r.output_len) for r in b]
    other = load_synthetic(spec.replace("seed=7", "seed=8"))
    assert [r.arrival_s for r in other] != [r.arrival_s for r in a]
    mid = sum(1 for r in a if 500 <= r.arrival_s < 700) / 200
    edge = sum(1 for r in a if r.arrival_s < 100 or r.arrival_s >= 1100) / 200
    assert mid > 4 * edge  # the peak is in the middle of the day, the trough at its ends
    mean_in = sum(r.input_len for r in a) / len(a)
    mean_out = sum(r.output_len for r in a) / len(a)
    assert 3.0 < mean_out / mean_in < 5.0  # reasoning-like: outputs ~4x the inputs


def test_synthetic_spec_errors_name_the_key():
    with pytest.raises(ValueError, match="unknown key 'peek'"):
        parse_spec("synthetic:daily,peek=3")
    with pytest.raises(ValueError, match="unknown shape"):
        parse_spec("synthetic:weekly")
    with pytest.raises(ValueError, match="seed must be a number"):
        parse_spec("synthetic:daily,seed=x")
    assert generate(parse_spec("synthetic:twopeak,duration=600,seed=1"))


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    plan_cli.configure(p)
    argv = ["--trace", "synthetic:daily,duration=300,peak=2,trough=1,seed=1", "--budget", "8"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_neutral_start_is_the_profile_sizing_of_the_first_interval_not_a_search():
    args = _args(interval=30)
    reqs = plan_cli.requests_for(args)
    (p, d), why = plan_cli.neutral_split(args, PerfModel.from_dict(PROFILE), None, reqs, 8)
    assert p >= 1 and d >= 1 and p + d <= 8 and why.startswith("auto")
    assert plan_cli.neutral_split(_args(start="2:3"), PerfModel.from_dict(PROFILE), None, reqs, 8)[0] == (2, 3)
    with pytest.raises(ValueError, match="--start"):
        plan_cli.neutral_split(_args(start="9:9"), PerfModel.from_dict(PROFILE), None, reqs, 8)


def test_plot_without_matplotlib_prints_one_line_naming_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    assert not plan_cli.plot_available()
    rc = plan_cli.run(_args(plot=tmp_path / "x.png"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "matplotlib" in err[0] and plan_cli.PLOT_EXTRA in err[0] and "Traceback" not in err[0]


async def test_service_timeline_holds_interval_and_load_mode_rows():
    from adapters.base import Role
    from orchestrator.clock import VirtualClock
    from orchestrator.planner.actuators import RecommendOnly
    from orchestrator.planner.core import Planner, PlannerSettings, WorkerView
    from orchestrator.planner.metrics_source import Observation
    from orchestrator.planner.service import PlannerService
    from orchestrator.planner.solver import Limits, Targets

    class Source:
        async def observe(self, now: float) -> Observation:
            return Observation(at=now, window_s=60, request_rate=1.0, mean_isl=4096, mean_osl=50,
                               ttft_p90=0.3, itl_mean=0.02)

    fleet = [WorkerView("p0", Role.PREFILL), WorkerView("d0", Role.DECODE)]
    clock = VirtualClock()
    planner = Planner(PerfModel.from_dict(PROFILE), PlannerSettings(
        targets=Targets(1.0, 0.05), limits=Limits(budget=10), predictor="constant", fast_interval_s=5,
        fast_confirm_cold=1, start_s=2))  # engines start in 2 s: the queue below is worth a cold start
    service = PlannerService(planner, Source(), RecommendOnly(), lambda: fleet, clock)
    clock.set(60.0)
    await service.run_once()
    fleet[0].inflight = 20  # a prefill queue builds up between intervals
    clock.set(65.0)
    assert await service.react_once() is not None
    rows = service.status()["timeline"]
    assert [r["mode"] for r in rows] == ["interval", "load"]
    assert rows[0]["rate_observed"] == 1.0 and rows[0]["ttft_p90_s"] == 0.3
    assert rows[1]["changes"]["prefill"].startswith("grow 1->")


def test_plot_draws_load_workers_and_latency_against_the_slo(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"t": 30.0 * i, "rate": 1.0 + i, "prefill": 1 + i // 2, "decode": 2, "ttft_p90_s": 0.2 * (i + 1),
             "itl_p90_s": 0.01} for i in range(6)]
    args = _args(ttft=1.0, itl=0.05)
    out = tmp_path / "plan.png"
    plan_cli.plot(str(out), {"static P=3 D=2 (best in hindsight)": [dict(r, prefill=3) for r in rows],
                             "dynamic SLO planner": rows}, args)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_spiky_and_decline_shapes_are_seeded_and_follow_their_curves():
    from orchestrator.bench.workloads import generate, parse_spec

    spiky = parse_spec("synthetic:spiky,peak=10,trough=1,duration=1800,seed=11")
    rates = [spiky.rate_at(t) for t in range(0, 1800, 5)]
    assert max(rates) > 9.5 and min(rates) < 1.2  # spikes reach the peak; the base stays low
    assert sum(r > 5 for r in rates) < 0.15 * len(rates)  # spikes are short
    other = parse_spec("synthetic:spiky,peak=10,trough=1,duration=1800,seed=12")
    assert [other.rate_at(t) for t in range(0, 1800, 5)] != rates  # the seed moves the spikes
    decline = parse_spec("synthetic:decline,peak=10,trough=1,duration=1800,seed=1")
    d = [decline.rate_at(t) for t in range(0, 1800, 60)]
    assert d[0] == 10 and all(a >= b for a, b in zip(d, d[1:], strict=False)) and d[-1] < 1.2
    assert [r.arrival_s for r in generate(decline)][:50] == [r.arrival_s for r in generate(decline)][:50]


def test_steps_shape_is_a_seeded_staircase_up_and_down():
    from orchestrator.bench.workloads import generate, parse_spec

    spec = parse_spec("synthetic:steps,peak=12,trough=1.5,duration=1800,seed=303")
    rates = [spec.rate_at(t) for t in range(0, 1800)]
    levels = sorted({round(r, 6) for r in rates})
    assert levels == [1.5, 5.0, 8.5, 12.0]  # trough, two intermediate levels, peak
    jumps = [(a, b) for a, b in zip(rates, rates[1:], strict=False) if a != b]
    assert len(jumps) == 6 and all(b > a for a, b in jumps[:3]) and all(b < a for a, b in jumps[3:])
    assert rates[0] == rates[-1] == 1.5
    edges = [t for t in range(1, 1800) if rates[t] != rates[t - 1]]
    assert all(abs(e / 1800 - (k + 1) / 7) <= 1 / 28 + 1e-3 for k, e in enumerate(edges))
    other = parse_spec("synthetic:steps,peak=12,trough=1.5,duration=1800,seed=304")
    assert [other.rate_at(t) for t in range(0, 1800)] != rates  # the seed moves the steps
    reqs = generate(spec)
    assert [r.arrival_s for r in reqs][:50] == [r.arrival_s for r in generate(spec)][:50]
    peak_n = sum(1 for r in reqs if spec.rate_at(r.arrival_s) == 12.0)
    trough_n = sum(1 for r in reqs if spec.rate_at(r.arrival_s) == 1.5)
    assert peak_n > 2 * trough_n  # arrivals follow the staircase (8x the rate over half the time)


def test_on_off_flags_reach_the_settings_and_their_absence_keeps_the_defaults():
    from orchestrator.planner.core import PlannerSettings
    from orchestrator.sim.profiles import load_profile

    parser = argparse.ArgumentParser()
    plan_cli.configure(parser)
    defaults = PlannerSettings()
    base = ["--trace", "x", "--budget", "8"]
    plain = plan_cli.make_planner(parser.parse_args(base), load_profile("gpu-like"), 8).settings
    for name in plan_cli.ON_OFF_SETTINGS:
        default = getattr(defaults, name)
        assert getattr(plain, name) == default, name
        flag = ("--no-" if default else "--") + name.replace("_", "-")  # the flag that turns it the other way
        flipped = plan_cli.make_planner(parser.parse_args([*base, flag]), load_profile("gpu-like"), 8).settings
        assert getattr(flipped, name) is (not default), (name, flag)


def test_jump_quantile_and_cold_backlog_flags_reach_the_settings():
    from orchestrator.planner.core import PlannerSettings
    from orchestrator.sim.profiles import load_profile

    parser = argparse.ArgumentParser()
    plan_cli.configure(parser)
    base = ["--trace", "x", "--budget", "8"]
    plain = plan_cli.make_planner(parser.parse_args(base), load_profile("gpu-like"), 8).settings
    assert (plain.jump_quantile, plain.cold_backlog) == (PlannerSettings().jump_quantile, PlannerSettings().cold_backlog)
    set_ = plan_cli.make_planner(parser.parse_args([*base, "--jump-quantile", "0.99", "--cold-backlog", "off"]),
                                 load_profile("gpu-like"), 8).settings
    assert (set_.jump_quantile, set_.cold_backlog) == (0.99, "off")
    for bad in ("90", "0", "-0.5", "half"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--jump-quantile", bad])
