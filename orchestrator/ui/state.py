"""What the fleet page shows, as plain JSON: built from the gateway runtime, no I/O.

Kept apart from the HTTP route so it can be tested with a runtime-shaped object and so the page
and any other consumer (a CLI ``top``, a test) read the same snapshot.
"""

from __future__ import annotations

import dataclasses
import math
import time
from enum import Enum
from typing import Any

MAX_DECISIONS = 50


def jsonable(value: Any) -> Any:
    """Enums → value, dataclasses → dict, non-finite floats → None (JSON has no NaN/inf)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int | bool):
        return value
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return jsonable(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(jsonable(k)): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    return str(value)


def _health(worker: Any) -> str:
    ok = getattr(worker, "health_ok", None)
    return "unknown" if ok is None else ("ok" if ok else "failing")


def worker_view(worker: Any, now: float) -> dict[str, Any]:
    load = worker.load
    target = getattr(worker, "target_role", None)
    scraped_at = getattr(load, "scraped_at", 0.0) or 0.0
    return {
        "id": worker.id,
        "url": worker.url,
        "engine": jsonable(worker.engine),
        "role": jsonable(worker.role),
        "target_role": jsonable(target),
        "state": jsonable(worker.state),
        "health": _health(worker),
        "models": list(worker.models),
        "inflight": worker.inflight,
        "inflight_prefill_tokens": worker.inflight_prefill_tokens,
        "running": jsonable(float(load.running)),
        "waiting": jsonable(float(load.waiting)),
        "kv_usage": jsonable(float(load.kv_usage)),
        "cache_hit_ratio": jsonable(load.cache_hit_ratio),
        "scrape_age_s": jsonable(now - scraped_at) if scraped_at else None,
        "last_error": worker.last_error,
    }


def decision_view(decision: dict[str, Any], now: float) -> dict[str, Any]:
    view = {k: jsonable(v) for k, v in decision.items() if k != "time"}
    t = decision.get("time")
    view["age_s"] = jsonable(max(0.0, now - t)) if isinstance(t, int | float) else None
    return view


MAX_PLANS = 8


def plan_summary(entry: Any) -> dict[str, Any]:
    """One planner decision as the page's card shows it: when, observed vs forecast load, desired vs
    current workers per role, actions, reasons."""
    e = jsonable(entry) if not isinstance(entry, dict) else {k: jsonable(v) for k, v in entry.items()}
    obs = e.get("observation") or {}
    fc = e.get("forecast") or {}
    return {
        "at": e.get("at"),
        "desired": e.get("desired") or {},
        "current": e.get("current") or {},
        "actions": e.get("actions") or [],
        "reasons": e.get("reasons") or [],
        "applied": e.get("applied"),
        "standby": e.get("standby") or {},
        "observed": {"request_rate": obs.get("request_rate"), "ttft_p99_s": obs.get("ttft_p99"),
                     "itl_mean_s": obs.get("itl_mean"), "mean_isl": obs.get("mean_isl"),
                     "mean_osl": obs.get("mean_osl")},
        "forecast": {"request_rate": fc.get("request_rate"), "isl": fc.get("isl"), "osl": fc.get("osl")},
    }


def planner_view(planner: Any, now: float | None = None) -> dict[str, Any]:
    """The planner's latest decision: ``last_recommendation`` if it keeps one, else its newest
    history entry (``PlannerService.history``); its targets and limits; its last decisions, newest first."""
    if planner is None:
        return {"enabled": False, "recommendation": None}
    rec = getattr(planner, "last_recommendation", None)
    history = list(getattr(planner, "history", None) or ())
    if rec is None and history:
        rec = history[-1]
    settings = getattr(getattr(planner, "planner", None), "settings", None)
    targets = getattr(settings, "targets", None)
    limits = getattr(settings, "limits", None)
    recent = []
    for entry in reversed(history[-MAX_PLANS:]):
        summary = plan_summary(entry)
        at = summary.pop("at")
        summary["age_s"] = jsonable(max(0.0, now - at)) if now is not None and isinstance(at, int | float) else None
        recent.append(summary)
    return {
        "enabled": True,
        "actuator": getattr(getattr(planner, "actuator", None), "name", None),
        "last_error": getattr(planner, "last_error", None),
        "recommendation": jsonable(rec),
        "interval_s": jsonable(getattr(settings, "interval_s", None)),
        "targets": {"ttft_s": jsonable(getattr(targets, "ttft_s", None)),
                    "itl_s": jsonable(getattr(targets, "itl_s", None))} if targets is not None else None,
        "budget": jsonable(getattr(limits, "budget", None)),
        "recent": recent,
    }


def fleet_state(runtime: Any) -> dict[str, Any]:
    """The snapshot behind ``GET /ui/api/state``."""
    now = runtime.clock.now()
    workers = sorted(runtime.fleet.workers(), key=lambda w: (jsonable(w.role), w.id))
    router = runtime.router
    decisions = list(getattr(router, "recent_decisions", ()))[-MAX_DECISIONS:]
    planner = getattr(runtime, "planner", None)
    views = [worker_view(w, now) for w in workers]
    history = getattr(runtime, "ui_history", None)
    cfg = getattr(runtime, "config", None)
    slo = {"ttft_s": cfg.planner.ttft_target_s, "itl_s": cfg.planner.itl_target_s} if cfg is not None else None
    return {
        "generated_at": time.time(),
        "gateway": {
            "policy": getattr(getattr(router, "policy", None), "name", None),
            "models": sorted(runtime.fleet.models()),
            "workers": len(views),
            "healthy": sum(1 for v in views if v["health"] == "ok" and v["state"] == "healthy"),
            "inflight": sum(v["inflight"] for v in views),
        },
        "workers": views,
        "traffic": jsonable(history.latest()) if history is not None else None,  # over history.window_s
        "traffic_window_s": history.window * history.interval_s if history is not None else None,
        "slo": slo,
        "planner": planner_view(planner, now),
        "decisions": [decision_view(d, now) for d in reversed(decisions)],  # newest first
    }
