"""A metric's labelled child, looked up once per label values instead of on every request."""

from __future__ import annotations

from typing import Any


def child(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, remembered on the metric: ``labels`` takes a lock and rebuilds the
    label tuple on every call. For request metrics whose label values are bounded (model names,
    endpoints, statuses, policies, index backends) and never removed."""
    try:
        cache = metric._dyad_children
    except AttributeError:
        cache = metric._dyad_children = {}
    found = cache.get(values)
    if found is None:
        found = cache[values] = metric.labels(*values)
    return found
