"""Load predictors: what the next interval's request count, input and output lengths will be.

Each predictor sees one series, one value per planner interval (``observe``), and forecasts the
next value (``predict``). ``AutoPredictor`` runs all of them side by side and answers with the one
whose one-step-ahead forecasts had the smallest error over a rolling backtest window, so a steady
load gets the calm constant/EWMA forecasts and a ramp or a daily cycle gets trend or Holt-Winters.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


class Predictor(Protocol):
    name: str

    def observe(self, value: float) -> None: ...

    def predict(self) -> float | None:
        """Forecast of the next value; ``None`` before the first observation."""
        ...

    def predict_ahead(self, steps: int) -> float | None:
        """Forecast of the value ``steps`` intervals ahead (1 = ``predict``)."""
        ...


class ConstantPredictor:
    """Next = last (what Dynamo's planner does by default)."""

    name = "constant"

    def __init__(self) -> None:
        self._last: float | None = None

    def observe(self, value: float) -> None:
        self._last = float(value)

    def predict(self) -> float | None:
        return self._last

    def predict_ahead(self, steps: int) -> float | None:
        return self._last


class EwmaPredictor:
    """Exponentially weighted mean: smooths noise, lags ramps."""

    name = "ewma"

    def __init__(self, alpha: float = 0.5) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._level: float | None = None

    def observe(self, value: float) -> None:
        v = float(value)
        self._level = v if self._level is None else self.alpha * v + (1 - self.alpha) * self._level

    def predict(self) -> float | None:
        return self._level

    def predict_ahead(self, steps: int) -> float | None:
        return self._level


class LinearTrendPredictor:
    """Least-squares line through the last ``window`` points, extrapolated one step (never below 0)."""

    name = "linear"

    def __init__(self, window: int = 6) -> None:
        if window < 2:
            raise ValueError("window must be at least 2")
        self._ys: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._ys.append(float(value))

    def predict(self) -> float | None:
        return self.predict_ahead(1)

    def predict_ahead(self, steps: int) -> float | None:
        n = len(self._ys)
        if n == 0:
            return None
        if n == 1:
            return self._ys[0]
        xm = (n - 1) / 2
        ym = sum(self._ys) / n
        sxx = sum((i - xm) ** 2 for i in range(n))
        sxy = sum((i - xm) * (y - ym) for i, y in enumerate(self._ys))
        slope = sxy / sxx
        return max(0.0, ym + slope * (n - 1 + steps - xm))


class HoltWintersPredictor:
    """Additive Holt-Winters (level, trend, season of ``season`` intervals).

    Until two full seasons have been seen it runs as Holt's linear method (level + trend), which is
    what a fresh planner has; the seasonal terms start from the first season's deviations.
    """

    name = "holt_winters"

    def __init__(self, season: int = 24, alpha: float = 0.5, beta: float = 0.1, gamma: float = 0.3) -> None:
        if season < 2:
            raise ValueError("season must be at least 2")
        self.season, self.alpha, self.beta, self.gamma = season, alpha, beta, gamma
        self._history: list[float] = []
        self._level: float | None = None
        self._trend = 0.0
        self._seasonal: list[float] | None = None
        self._t = 0  # observations folded into the seasonal state

    def observe(self, value: float) -> None:
        v = float(value)
        self._history.append(v)
        if len(self._history) > 3 * self.season:
            self._history = self._history[-3 * self.season:]
        if self._seasonal is None:
            if self._level is None:
                self._level = v
            else:
                prev = self._level
                self._level = self.alpha * v + (1 - self.alpha) * (self._level + self._trend)
                self._trend = self.beta * (self._level - prev) + (1 - self.beta) * self._trend
            if len(self._history) >= 2 * self.season:
                self._init_seasonal()
            return
        assert self._level is not None
        s = self._seasonal[self._t % self.season]
        prev = self._level
        self._level = self.alpha * (v - s) + (1 - self.alpha) * (self._level + self._trend)
        self._trend = self.beta * (self._level - prev) + (1 - self.beta) * self._trend
        self._seasonal[self._t % self.season] = self.gamma * (v - self._level) + (1 - self.gamma) * s
        self._t += 1

    def _init_seasonal(self) -> None:
        m = self.season
        first, second = self._history[-2 * m:-m], self._history[-m:]
        mean1, mean2 = sum(first) / m, sum(second) / m
        self._seasonal = [((a - mean1) + (b - mean2)) / 2 for a, b in zip(first, second, strict=True)]
        self._trend = (mean2 - mean1) / m
        self._level = mean2 + self._trend * (m - 1) / 2
        self._t = 0  # the next observation is season position 0

    def predict(self) -> float | None:
        return self.predict_ahead(1)

    def predict_ahead(self, steps: int) -> float | None:
        if self._level is None:
            return None
        k = max(1, steps)
        s = self._seasonal[(self._t + k - 1) % self.season] if self._seasonal is not None else 0.0
        return max(0.0, self._level + k * self._trend + s)


@dataclass
class _Scored:
    predictor: Predictor
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=12))
    pending: float | None = None  # its forecast of the value not yet observed

    def mean_error(self) -> float:
        return sum(self.errors) / len(self.errors) if self.errors else float("inf")


class AutoPredictor:
    """Runs every predictor and answers with the one with the lowest rolling mean absolute error.

    Ties (and the cold start, when no one has an error yet) go to the first predictor listed,
    ``constant`` by default.
    """

    name = "auto"

    def __init__(self, predictors: list[Predictor] | None = None, window: int = 12) -> None:
        ps = predictors or default_predictors()
        self._scored = [_Scored(p, deque(maxlen=window)) for p in ps]

    def observe(self, value: float) -> None:
        for s in self._scored:
            if s.pending is not None:
                s.errors.append(abs(s.pending - value))
            s.predictor.observe(value)
            s.pending = s.predictor.predict()

    @property
    def chosen(self) -> Predictor:
        return min(self._scored, key=lambda s: s.mean_error()).predictor

    def predict(self) -> float | None:
        return self.chosen.predict()

    def predict_ahead(self, steps: int) -> float | None:
        return self.chosen.predict_ahead(steps)

    def errors(self) -> dict[str, float]:
        """Rolling mean absolute error per predictor (inf before it has been scored)."""
        return {s.predictor.name: s.mean_error() for s in self._scored}


def default_predictors(season: int = 24) -> list[Predictor]:
    return [ConstantPredictor(), EwmaPredictor(0.5), LinearTrendPredictor(6), HoltWintersPredictor(season)]


def make_predictor(name: str, season: int = 24) -> Predictor:
    """By name, as in config and on the command line: constant, ewma, linear, holt_winters, auto."""
    match name:
        case "constant":
            return ConstantPredictor()
        case "ewma":
            return EwmaPredictor()
        case "linear":
            return LinearTrendPredictor()
        case "holt_winters":
            return HoltWintersPredictor(season)
        case "auto":
            return AutoPredictor(default_predictors(season))
    raise ValueError(f"unknown predictor '{name}' (choose from constant, ewma, linear, holt_winters, auto)")


@dataclass
class LoadForecast:
    """The planner's forecast for the next interval."""

    request_rate: float  # requests per second
    isl: float  # mean input tokens
    osl: float  # mean output tokens


class LoadPredictor:
    """Three series (rate, ISL, OSL), one predictor each, same kind."""

    def __init__(self, kind: str = "auto", season: int = 24) -> None:
        self.kind = kind
        self.rate = make_predictor(kind, season)
        self.isl = make_predictor(kind, season)
        self.osl = make_predictor(kind, season)

    def observe(self, request_rate: float, isl: float | None, osl: float | None) -> None:
        self.rate.observe(request_rate)
        if isl is not None:
            self.isl.observe(isl)
        if osl is not None:
            self.osl.observe(osl)

    def forecast(self) -> LoadForecast | None:
        r, i, o = self.rate.predict(), self.isl.predict(), self.osl.predict()
        if r is None:
            return None
        return LoadForecast(request_rate=max(0.0, r), isl=max(1.0, i or 1.0), osl=max(1.0, o or 1.0))

    def peak_ahead(self, steps: int) -> float | None:
        """The highest forecast request rate over the next ``steps`` intervals (the lead-time horizon:
        a worker started now serves only after its start-up, so it is sized for what comes then)."""
        rates = [self.rate.predict_ahead(k) for k in range(1, max(1, steps) + 1)]
        known = [r for r in rates if r is not None]
        return max(known) if known else None

    def chosen(self) -> dict[str, str]:
        out = {}
        for q, p in (("rate", self.rate), ("isl", self.isl), ("osl", self.osl)):
            out[q] = p.chosen.name if isinstance(p, AutoPredictor) else p.name
        return out
