"""Plotting helpers shared by ``dyad bench --plot`` and ``dyad plan --plot`` (matplotlib, headless).

matplotlib is the ``plots`` extra (``pip install 'dyad-serve[plots]'``; ``make demo``/``make test``
install it with the test extra). ``require_pyplot()`` returns pyplot on the Agg backend or raises
``PlotUnavailable`` whose message is the one line a CLI prints; call it before a long run, not after.

Conventions every Dyad plot follows: a title, axis labels with units, latencies in milliseconds,
SLO targets as dashed red lines labelled with their value, integer ticks on counts (workers,
requests), and a light grid. ``rolling_quantile`` gives the p50/p99 lines drawn over latency scatter.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

INSTALL_HINT = "pip install 'dyad-serve[plots]'"
SLO_COLOR = "#d64545"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; ``str(e)`` is a one-line message naming the extra."""


def require_pyplot(what: str = "--plot") -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"{what} needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def integer_ticks(ax: Any, axis: str = "y") -> None:
    """Whole-number ticks only (worker and request counts)."""
    from matplotlib.ticker import MaxNLocator

    (ax.yaxis if axis == "y" else ax.xaxis).set_major_locator(MaxNLocator(integer=True))


def slo_line(ax: Any, value: float | None, label: str, *, vertical: bool = False) -> None:
    """A dashed red target line labelled with its value (``value`` in the axis' own unit)."""
    if value is None:
        return
    if vertical:
        ax.axvline(value, color=SLO_COLOR, linestyle="--", linewidth=1.2, label=label)
    else:
        ax.axhline(value, color=SLO_COLOR, linestyle="--", linewidth=1.2, label=label)


def ms_label(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def rolling_quantile(times: Sequence[float], values: Sequence[float], q: float, window_s: float,
                     points: int = 200) -> tuple[list[float], list[float]]:
    """The q-quantile of ``values`` over a trailing ``window_s`` at up to ``points`` evenly spaced
    times (empty windows are skipped). ``times`` need not be sorted."""
    pairs = sorted(zip(times, values, strict=True))
    if not pairs:
        return [], []
    ts = [t for t, _ in pairs]
    lo, hi = ts[0], ts[-1]
    n = max(1, min(points, len(pairs)))
    xs_out, ys_out = [], []
    for i in range(n):
        at = lo + (hi - lo) * (i + 1) / n if n > 1 else hi
        a = bisect.bisect_left(ts, at - window_s)
        b = bisect.bisect_right(ts, at)
        window = sorted(v for _, v in pairs[a:b])
        if not window:
            continue
        k = min(len(window) - 1, max(0, math.ceil(q * len(window)) - 1))
        xs_out.append(at)
        ys_out.append(window[k])
    return xs_out, ys_out


def latency_over_time(ax: Any, times_s: Sequence[float], values_s: Sequence[float], *, title: str,
                      what: str, slo_s: float | None = None, window_s: float | None = None,
                      xlabel: str = "time since start (s)") -> None:
    """Scatter of one latency per request (ms) over time, trailing p50/p99 lines and the SLO line."""
    ys = [v * 1000 for v in values_s]
    ax.scatter(list(times_s), ys, s=5, alpha=0.35, color="#7ba7ea", label=f"{what} per request")
    if times_s:
        span = max(times_s) - min(times_s)
        window = window_s or max(1.0, span / 20)
        for q, color in ((0.5, "#2a6fdb"), (0.99, "#12366e")):
            xs, qs = rolling_quantile(times_s, ys, q, window)
            ax.plot(xs, qs, color=color, linewidth=1.6, label=f"p{round(q * 100)} over {window:.0f} s")
    if slo_s is not None:
        slo_line(ax, slo_s * 1000, f"SLO {ms_label(slo_s)}")
    style(ax, title, xlabel, f"{what} (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")


def cdf(ax: Any, values_s: Sequence[float], *, title: str, what: str, slo_s: float | None = None) -> None:
    """Share of requests at or below each latency (ms), with the SLO as a vertical line."""
    xs = sorted(v * 1000 for v in values_s)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], color="#2a6fdb", label=what)
    if slo_s is not None:
        within = sum(1 for x in xs if x <= slo_s * 1000) / len(xs) if xs else 0.0
        slo_line(ax, slo_s * 1000, f"SLO {ms_label(slo_s)} ({within:.0%} within)", vertical=True)
    style(ax, title, f"{what} (ms)", "share of requests")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")


def counts_over_time(ax: Any, times_s: Sequence[float], series: dict[str, Sequence[float]], *, title: str,
                     ylabel: str = "workers", xlabel: str = "time (s)", budget: float | None = None) -> None:
    """Step lines of counts (workers per role, say) on integer ticks, with an optional budget line."""
    for label, values in series.items():
        ax.step(list(times_s), list(values), where="post", linewidth=1.6, label=label)
    if budget is not None:
        ax.axhline(budget, color="#6b7588", linestyle=":", linewidth=1.2, label=f"budget {budget:g}")
    style(ax, title, xlabel, ylabel)
    integer_ticks(ax)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")


def save(fig: Any, path: str, *, suptitle: str | None = None) -> None:
    plt = require_pyplot()
    if suptitle:
        fig.suptitle(suptitle, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
