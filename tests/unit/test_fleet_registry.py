"""FleetRegistry: membership, candidates, and the healthy/unhealthy/draining state machine (pure)."""

from __future__ import annotations

import pytest

from adapters.base import Role
from orchestrator.config import HealthConfig, load_config
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState


def fleet(failure: int = 2, success: int = 2) -> FleetRegistry:
    return FleetRegistry(health=HealthConfig(failure_threshold=failure, success_threshold=success))


def test_config_workers_start_unhealthy_until_probed_then_flip_on_first_success():
    cfg = load_config({"workers": [{"url": "http://a:1", "models": ["m"]}, {"url": "http://b:1", "id": "bee"}]})
    reg = FleetRegistry.from_config(cfg)
    assert [w.id for w in reg.workers()] == ["w0", "bee"]
    w0 = reg.get("w0")
    assert w0.state is WorkerState.UNHEALTHY and w0.configured_models and not reg.get("bee").configured_models
    assert reg.candidates("m") == []
    reg.record_health(w0, True, now=1.0)  # first success, success_threshold irrelevant
    assert w0.state is WorkerState.HEALTHY
    assert reg.candidates("m") == [w0]


def test_failure_threshold_then_success_threshold():
    reg = fleet(failure=2, success=2)
    w = reg.add(Worker("a", "http://a", models=["m"]))
    reg.record_health(w, True, 0.0)
    reg.record_health(w, False, 1.0, "boom")
    assert w.state is WorkerState.HEALTHY and w.last_error == "boom"  # one failure is not enough
    reg.record_health(w, False, 2.0, "boom")
    assert w.state is WorkerState.UNHEALTHY
    reg.record_health(w, True, 3.0)
    assert w.state is WorkerState.UNHEALTHY  # needs two successes to come back
    reg.record_health(w, False, 4.0)
    reg.record_health(w, True, 5.0)
    assert w.state is WorkerState.UNHEALTHY  # the failure reset the success streak
    reg.record_health(w, True, 6.0)
    assert w.state is WorkerState.HEALTHY and w.last_error is None


def test_mark_failed_takes_worker_out_immediately():
    reg = fleet(failure=3)
    w = reg.add(Worker("a", "http://a", models=["m"]))
    reg.record_health(w, True, 0.0)
    reg.mark_failed(w, 1.0, "connection refused")
    assert w.state is WorkerState.UNHEALTHY and w.consecutive_failures >= 3


def test_drain_survives_health_changes_and_undrain_restores_health_state():
    reg = fleet(failure=1, success=1)
    w = reg.add(Worker("a", "http://a", models=["m"]))
    reg.record_health(w, True, 0.0)
    reg.drain("a")
    assert w.state is WorkerState.DRAINING and reg.candidates("m") == []
    reg.record_health(w, False, 1.0)
    assert w.state is WorkerState.DRAINING
    reg.undrain("a")
    assert w.state is WorkerState.UNHEALTHY  # it failed while drained
    reg.drain("a")
    reg.record_health(w, True, 2.0)
    reg.undrain("a")
    assert w.state is WorkerState.HEALTHY


def test_candidates_filter_model_and_role():
    reg = FleetRegistry()
    p = reg.add(Worker("p", "http://p", role=Role.PREFILL, models=["m"]))
    d = reg.add(Worker("d", "http://d", role=Role.DECODE, models=["m"]))
    b = reg.add(Worker("b", "http://b", role=Role.BOTH, models=["m", "other"]))
    assert reg.candidates("m") == [p, d, b]
    assert reg.candidates("m", Role.DECODE) == [d, b]
    assert reg.candidates("m", Role.PREFILL) == [p, b]
    assert reg.candidates("other") == [b]
    assert reg.candidates("nope") == []


def test_models_union_and_knows_model():
    reg = FleetRegistry([Worker("a", "http://a", models=["x"])], configured_models=["cfg"])
    reg.add(Worker("b", "http://b", models=["x", "y"]))
    assert reg.models() == ["cfg", "x", "y"]
    assert reg.knows_model("cfg") and reg.knows_model("y") and not reg.knows_model("z")


def test_max_model_len_is_the_smallest_reported_by_the_workers_serving_the_model():
    reg = FleetRegistry([Worker("a", "http://a", models=["x"], max_model_len={"x": 8192})])
    reg.add(Worker("b", "http://b", models=["x", "y"], max_model_len={"x": 4096}))  # y: not reported
    assert reg.max_model_len("x") == 4096  # a request that fits must fit wherever it is routed
    assert reg.max_model_len("y") is None
    assert reg.max_model_len("unknown") is None


def test_add_remove_and_listeners():
    reg = FleetRegistry()
    events: list[tuple[str, str]] = []
    reg.subscribe(lambda event, w: events.append((event, w.id)))
    reg.add(Worker("a", "http://a", models=["m"]))
    with pytest.raises(ValueError, match="already exists"):
        reg.add(Worker("a", "http://a2"))
    reg.drain("a")
    reg.remove("a")
    with pytest.raises(KeyError):
        reg.remove("a")
    assert events == [("added", "a"), ("state", "a"), ("removed", "a")]
    assert reg.get("a") is None and len(reg) == 0


def test_missed_probes_do_not_evict_a_worker_that_is_serving_traffic():
    """Passive health: on an overloaded machine a /health probe can time out while the engine keeps
    answering real requests; those answers outrank the probe. Once traffic stops, probes decide again."""
    reg = fleet(failure=2, success=1)  # interval 2 s, timeout 2 s → a success counts for 2 x (2 + 2) = 8 s
    assert reg.serving_window_s == 8.0
    w = reg.add(Worker("a", "http://a", models=["m"]))
    reg.record_health(w, True, 0.0)
    w.last_served_at = 9.0
    # probes that time out: a round every interval + timeout = 4 s
    reg.record_health(w, False, 10.0, "ReadTimeout")
    reg.record_health(w, False, 14.0, "ReadTimeout")
    assert w.state is WorkerState.HEALTHY and w.consecutive_failures == 0 and w.last_error == "ReadTimeout"
    reg.record_health(w, False, 18.0, "ReadTimeout")  # 9 s since the last served request: probes count
    reg.record_health(w, False, 22.0, "ReadTimeout")
    assert w.state is WorkerState.UNHEALTHY
    w.last_served_at = 22.5  # a worker already out of rotation is not brought back by stale traffic
    reg.record_health(w, False, 23.0, "ReadTimeout")
    assert w.state is WorkerState.UNHEALTHY


def test_missed_probes_do_not_evict_a_worker_whose_streams_deliver_or_whose_engine_generates():
    """Traffic that has not completed is evidence too: a stream on the worker that delivered a data event
    ``quiet_for`` seconds ago, or a scrape that found the engine's generated-token counter risen
    (``generating_at``), within the window in which the probes would take it out."""
    reg = fleet(failure=2, success=1)  # a window of 8 s
    w = reg.add(Worker("a", "http://a", models=["m"]))
    reg.record_health(w, True, 0.0)
    for now in (10.0, 14.0, 18.0):  # long streams, none completed, the last event 0.1 s ago at each probe
        reg.record_health(w, False, now, "ReadTimeout", quiet_for=0.1)
    assert w.state is WorkerState.HEALTHY and w.consecutive_failures == 0
    reg.record_health(w, False, 22.0, "ReadTimeout", quiet_for=9.0)  # quiet for longer than the window
    reg.record_health(w, False, 26.0, "ReadTimeout", quiet_for=13.0)
    assert w.state is WorkerState.UNHEALTHY
    reg.record_health(w, False, 27.0, "ReadTimeout", quiet_for=0.1)  # (out of rotation: evidence does not bring it back)
    assert w.state is WorkerState.UNHEALTHY

    g = reg.add(Worker("g", "http://g", models=["m"]))
    reg.record_health(g, True, 0.0)
    g.generating_at = 9.5
    reg.record_health(g, False, 10.0, "ReadTimeout")
    reg.record_health(g, False, 14.0, "ReadTimeout")
    assert g.state is WorkerState.HEALTHY
    reg.record_health(g, False, 18.0, "ReadTimeout")  # the counter stopped rising 8.5 s ago
    reg.record_health(g, False, 22.0, "ReadTimeout")
    assert g.state is WorkerState.UNHEALTHY


def test_a_loaded_engine_answering_slower_than_the_probe_interval_stays_in_rotation():
    """The window is the loop's real period when probes time out (a round waits for its slowest probe, then
    sleeps): with interval 0.5 s, timeout 1 s and two misses, an engine whose /health always times out but
    which finishes a request every 1.4 s stays in rotation (a window of interval x threshold, 1 s, took it
    out, as it did in CI under a load average of ~20); once its requests stop, it is out within the window."""
    reg = FleetRegistry(health=HealthConfig(interval_s=0.5, timeout_s=1.0, failure_threshold=2))
    w = reg.add(Worker("a", "http://a", models=["m"]))
    reg.record_health(w, True, 0.0)
    completions = [0.6 + 1.4 * i for i in range(17)]  # until 23.0 s
    now = 0.0
    while now < 30.0:
        now += 0.5 + 1.0  # sleep, then a probe that times out
        served = [t for t in completions if t <= now]
        w.last_served_at = served[-1] if served else None
        reg.record_health(w, False, now, "ReadTimeout")
        if now < 24.0:
            assert w.state is WorkerState.HEALTHY, now
    assert w.state is WorkerState.UNHEALTHY


def _out_by(reg: FleetRegistry, w: Worker, *timeouts: bool) -> None:
    """Probe results after a first success at t=0: False = a failed probe (timed out or not, as given)."""
    reg.record_health(w, True, 0.0)
    for i, timed_out in enumerate(timeouts, 1):
        reg.record_health(w, False, 10.0 * i, "x", timed_out=timed_out)


def test_last_resort_holds_workers_out_only_for_probes_that_timed_out():
    """A worker whose every failed probe since its last success timed out (it took the connection, answered
    late: busy) is the last resort; one whose streak holds any other failure (refused, an error answer), one
    a request found unreachable, one never up, a draining or standby one, or one of another model is not."""
    reg = fleet(failure=2, success=1)
    slow = reg.add(Worker("slow", "http://slow", models=["m"]))
    mixed = reg.add(Worker("mixed", "http://mixed", models=["m"]))
    refused = reg.add(Worker("refused", "http://refused", models=["m"]))
    unreachable = reg.add(Worker("unreach", "http://u", models=["m"]))
    other = reg.add(Worker("other", "http://o", models=["n"]))
    prefill = reg.add(Worker("pre", "http://p", models=["m"], role=Role.PREFILL))
    _out_by(reg, slow, True, True)
    _out_by(reg, mixed, True, False, True)  # a refused probe in the streak: no last resort until a success
    _out_by(reg, refused, False, False)
    _out_by(reg, unreachable, True, True)
    reg.mark_failed(unreachable, 30.0, "cannot connect")  # a request could not connect: unreachable
    _out_by(reg, other, True, True)
    _out_by(reg, prefill, True, True)
    assert all(w.state is WorkerState.UNHEALTHY for w in reg.workers())
    assert reg.candidates("m") == []
    assert reg.last_resort("m", Role.DECODE) == [slow]
    assert reg.last_resort("m", Role.PREFILL) == [slow, prefill]
    never = reg.add(Worker("never", "http://n", models=["m"], state=WorkerState.UNHEALTHY))
    reg.record_health(never, False, 1.0, "x", timed_out=True)  # timed out, but never up: no last resort
    reg.drain("slow")
    assert reg.last_resort("m", Role.DECODE) == []
    reg.undrain("slow")
    assert reg.last_resort("m", Role.DECODE) == [slow]
    reg.record_health(slow, True, 50.0)  # a probe answered: in rotation again, no longer a last resort
    assert reg.candidates("m") == [slow] and not slow.out_by_timeouts
    reg.record_health(mixed, True, 50.0)
    _out_by(reg, mixed, True, True)
    assert mixed in reg.last_resort("m")
