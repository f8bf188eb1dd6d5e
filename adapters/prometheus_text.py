"""A small, fast reader of the Prometheus text exposition format, and the queries adapters need.

Engines are scraped every second or so, each scrape is ~600 lines of which an adapter wants ~40
series; so the parser skips lines by name prefix before touching labels, and the ``MetricSet``
answers the handful of questions a load snapshot needs (sum of a gauge across data-parallel ranks,
a merged histogram, the labels of an ``*_info`` series). ``prometheus_client.parser`` builds full
metric families for every line and is ~10x slower on a real vLLM 0.32 scrape (644 lines: ~1 ms
here vs ~11 ms, measured on this 2-core machine).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from adapters.base import Histogram

# name="value" pairs; the value may contain escaped quotes/backslashes/newlines.
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = re.compile(r"\\(.)")


def _unescape(value: str) -> str:
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


@dataclass(slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str, prefixes: tuple[str, ...] = ()) -> list[Sample]:
    """Every sample line of ``text`` (comments skipped), optionally only names starting with ``prefixes``.

    Malformed lines are skipped rather than raised: one odd line from an engine must not blind the
    router to the rest of its load.
    """
    out: list[Sample] = []
    append = out.append
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if prefixes and not line.startswith(prefixes):
            continue
        brace = line.find("{")
        if brace >= 0:
            end = line.rfind("}")
            if end < brace:
                continue
            name = line[:brace].strip()
            body = line[brace + 1 : end]
            labels = {}
            if body:
                for k, v in _LABEL.findall(body):
                    labels[k] = _unescape(v) if "\\" in v else v
            rest = line[end + 1 :].split()
        else:
            parts = line.split()
            if len(parts) < 2:
                continue
            name, rest, labels = parts[0], parts[1:], {}
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        append(Sample(name, labels, value))
    return out


LabelFilter = Callable[[dict[str, str]], bool]


class MetricSet:
    """Samples indexed by name, with the aggregate queries adapters use."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self._by_name: dict[str, list[Sample]] = {}
        for s in samples:
            self._by_name.setdefault(s.name, []).append(s)

    @classmethod
    def parse(cls, text: str, prefixes: tuple[str, ...] = ()) -> MetricSet:
        return cls(parse_samples(text, prefixes))

    def names(self) -> set[str]:
        return set(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def samples(self, name: str) -> list[Sample]:
        return self._by_name.get(name, [])

    def where(self, keep: LabelFilter) -> MetricSet:
        """A view with only the samples whose labels pass ``keep``."""
        return MetricSet(s for ss in self._by_name.values() for s in ss if keep(s.labels))

    def label_values(self, label: str) -> list[str]:
        """Distinct values of ``label`` in order of first appearance."""
        seen: dict[str, None] = {}
        for ss in self._by_name.values():
            for s in ss:
                v = s.labels.get(label)
                if v is not None:
                    seen.setdefault(v)
        return list(seen)

    def first_name(self, *names: str) -> str | None:
        """The first of ``names`` present (new metric name first, then older ones)."""
        for n in names:
            if n in self._by_name:
                return n
        return None

    def sum(self, *names: str) -> float | None:
        """Sum over all series of the first present name (``None`` if none is exported).

        NaN samples (e.g. a gauge with nothing to report yet) are ignored.
        """
        n = self.first_name(*names)
        if n is None:
            return None
        return sum(s.value for s in self._by_name[n] if not math.isnan(s.value))

    def mean(self, *names: str) -> float | None:
        n = self.first_name(*names)
        if n is None:
            return None
        vals = [s.value for s in self._by_name[n] if not math.isnan(s.value)]
        return sum(vals) / len(vals) if vals else None

    def sum_by(self, label: str, *names: str) -> dict[str, float]:
        """Sum over series of the first present name, grouped by one label."""
        n = self.first_name(*names)
        out: dict[str, float] = {}
        if n is None:
            return out
        for s in self._by_name[n]:
            if math.isnan(s.value):
                continue
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0.0) + s.value
        return out

    def info_labels(self, *names: str) -> dict[str, str] | None:
        """Labels of the first series of an ``*_info`` gauge."""
        n = self.first_name(*names)
        if n is None:
            return None
        return dict(self._by_name[n][0].labels)

    def histogram(self, *bases: str) -> Histogram | None:
        """The histogram ``base`` (``base_bucket``/``_sum``/``_count``), merged across all its series.

        Buckets with the same ``le`` are added, which is exact when every series uses the same
        bucket bounds (the case for data-parallel ranks of one engine).
        """
        for base in bases:
            buckets = self._by_name.get(base + "_bucket")
            if not buckets:
                continue
            by_le: dict[float, float] = {}
            for s in buckets:
                le = s.labels.get("le")
                if le is None:
                    continue
                try:
                    bound = float(le)
                except ValueError:
                    continue
                by_le[bound] = by_le.get(bound, 0.0) + s.value
            total = sum(s.value for s in self._by_name.get(base + "_sum", []))
            count_samples = self._by_name.get(base + "_count")
            if count_samples:
                count = sum(s.value for s in count_samples)
            else:
                count = by_le.get(math.inf, 0.0)
            return Histogram(buckets=sorted(by_le.items()), sum=total, count=count)
        return None
