"""Bench plots (titles, units, SLO lines, integer ticks), the missing-matplotlib message, and progress
as a bar on a terminal or periodic plain lines elsewhere."""

from __future__ import annotations

import builtins
import io

import pytest

from orchestrator.bench import cli as bench_cli
from orchestrator.bench import plots
from orchestrator.bench.progress import Progress
from orchestrator.bench.runner import (
    BenchOptions,
    BenchResult,
    RequestResult,
    bench_figure,
    summarize_results,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_every_interval_when_not_a_terminal():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(10, label="dyad bench", unit="requests done", stream=out, interval_s=5, clock=clock)
    assert p.mode == "lines"  # StringIO is not a tty
    for i in range(10):
        clock.t += 2
        p.update(error=(i == 1))
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "dyad bench: 3/10 (30%) requests done, 1 error, 0.5/s, 6 s elapsed, ~14 s left"
    assert len(lines) == 1 + 10 * 2 // 6 and "\r" not in out.getvalue()  # one every 5 s of run, then the end
    assert lines[-1].startswith("dyad bench: 10/10 (100%) requests done, 1 error") and lines[-1].endswith("(finished)")


def test_a_stalled_run_still_prints_on_tick():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(5, label="dyad plan", stream=out, interval_s=10, clock=clock)
    clock.t += 11
    p.tick()
    assert out.getvalue() == "dyad plan: 0/5 (0%) done, 11 s elapsed\n"


def test_bar_on_a_terminal_and_nothing_when_off():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    p = Progress(4, stream=out, clock=FakeClock())
    assert p.mode == "bar"
    p.update()
    p.close()
    assert out.getvalue().startswith("\r[#######") and out.getvalue().endswith("\n")
    off = io.StringIO()
    q = Progress(4, mode="off", stream=off)
    q.update()
    q.close()
    assert off.getvalue() == ""


def test_rolling_quantile():
    times = list(range(100))
    values = [float(t % 10) for t in times]  # 0..9 repeating
    xs, p50 = plots.rolling_quantile(times, values, 0.5, window_s=9.99, points=10)
    assert len(xs) == 10 and all(v == 4.0 for v in p50)
    _, p99 = plots.rolling_quantile(times, values, 0.99, window_s=9.99, points=10)
    assert all(v == 9.0 for v in p99)
    assert plots.rolling_quantile([], [], 0.5, 1.0) == ([], [])


def _result(slo_ttft=0.2, slo_itl=0.03):
    rs = []
    for i in range(40):
        r = RequestResult(index=i, scheduled_s=i * 0.25, sent_s=i * 0.25, input_len=100, max_tokens=8, ok=i != 7,
                          status=200 if i != 7 else 503, ttft_s=0.05 + 0.01 * (i % 5), e2e_s=0.4,
                          itl_s=[0.02] * 7, output_tokens=8)
        rs.append(r)
    opts = BenchOptions(url="http://127.0.0.1:1", model="m", slo_ttft_s=slo_ttft, slo_itl_s=slo_itl)
    return BenchResult(opts, rs, summarize_results(rs, 10.0, slo_ttft_s=slo_ttft, slo_itl_s=slo_itl))


def test_bench_figure_has_titles_units_slo_lines_and_integer_count_ticks():
    fig = bench_figure(_result())
    axes = fig.get_axes()
    assert len(axes) == 6
    assert all(ax.get_title() for ax in axes)
    assert fig._suptitle.get_text().startswith("dyad bench against http://127.0.0.1:1 (m): 39/40 answered")
    ttft, itl = axes[0], axes[1]
    assert ttft.get_ylabel() == "TTFT (ms)" and itl.get_ylabel() == "ITL (ms)"
    for ax, ms in ((ttft, 200.0), (itl, 30.0), (axes[2], 200.0), (axes[3], 30.0)):
        slo = [line for line in ax.get_lines() if line.get_label().startswith("SLO")]
        assert slo, ax.get_title()
        xy = slo[0].get_xydata()
        assert ms in (xy[0][0], xy[0][1])
    assert "(ms)" in axes[2].get_xlabel() and axes[4].get_ylabel() == "requests"
    fig.canvas.draw()
    ticks = [t for t in axes[4].get_yticks() if axes[4].get_ylim()[0] <= t <= axes[4].get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_no_slo_no_slo_lines():
    fig = bench_figure(_result(None, None))
    assert not any(line.get_label().startswith("SLO") for ax in fig.get_axes() for line in ax.get_lines())


def test_without_matplotlib_plot_is_one_line_naming_the_extra(monkeypatch, tmp_path, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(plots.PlotUnavailable, match=r"pip install 'dyad-serve\[plots\]'"):
        plots.require_pyplot()
    parser = __import__("argparse").ArgumentParser()
    bench_cli.configure(parser)
    args = parser.parse_args(["--url", "http://127.0.0.1:1", "--model", "m", "--trace", str(tmp_path / "t"),
                              "--format", "mooncake", "--plot", str(tmp_path / "p.png")])
    assert bench_cli.run(args) == 2  # before reading the trace or sending anything
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dyad bench: dyad bench --plot needs matplotlib, which is not installed: "
                   "pip install 'dyad-serve[plots]'"]


def test_counts_over_time_for_plan_plots_uses_integer_ticks():
    plt = plots.require_pyplot()
    fig, ax = plt.subplots()
    plots.counts_over_time(ax, [0, 60, 120, 180], {"prefill": [1, 2, 3, 2], "decode": [2, 2, 4, 5]},
                           title="Workers by role", budget=8)
    plots.latency_over_time(ax.twinx(), [1.0, 2.0], [0.1, 0.2], title="x", what="TTFT", slo_s=0.5)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    assert all(float(t).is_integer() for t in ax.get_yticks() if lo <= t <= hi)
    assert ax.get_title() == "Workers by role" and ax.get_ylabel() == "workers"
    assert any(line.get_label() == "budget 8" for line in ax.get_lines())
    plt.close(fig)
