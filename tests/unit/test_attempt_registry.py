"""AttemptRegistry: which tries a worker marked down pulls, and which it leaves running (pure)."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.gateway.attempt import Attempt, AttemptRegistry


class Quiet:
    """A stream's idle timer, as ``Attempt.quiet_for`` reads it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def quiet_for(self) -> float:
        return self.seconds


class Task:
    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        self.cancelled = True


def attempt(worker: Worker, quiet: float | None, first: bool = True) -> Attempt:
    """A try on ``worker`` whose stream was last heard from ``quiet`` s ago (None: no stream relayed)."""
    a = Attempt.__new__(Attempt)
    a.decision = SimpleNamespace(worker=worker)
    a.task, a.outcome, a.aborted, a.abortable, a.spared, a.deadline = Task(), None, None, True, None, None
    a._first = first
    a.progress = Quiet(quiet) if quiet is not None else None
    return a


def test_a_worker_marked_down_leaves_its_delivering_streams_running_and_pulls_them_once_quiet():
    w = Worker("w", "http://w", state=WorkerState.UNHEALTHY)
    reg = AttemptRegistry()
    flowing, quiet, waiting, whole = attempt(w, 0.5), attempt(w, 10.0), attempt(w, 0.1, first=False), attempt(w, None)
    for a in (flowing, quiet, waiting, whole):
        reg.add(a)
    assert reg.quiet_for("w") == 0.5  # (a try before its first token is no evidence)
    assert reg.abort_worker("w", "marked down", spare_within=4.0) == 3
    assert not flowing.task.cancelled and flowing.spared == ("marked down", 4.0)
    assert all(a.task.cancelled and a.aborted == "marked down" for a in (quiet, waiting, whole))
    reg.sweep(now=1.0)
    assert not flowing.task.cancelled  # still delivering
    flowing.progress.seconds = 4.0
    reg.sweep(now=2.0)
    assert flowing.task.cancelled and flowing.aborted == "marked down" and flowing.spared is None


def test_a_spared_stream_whose_worker_is_back_in_rotation_is_no_longer_watched():
    w = Worker("w", "http://w", state=WorkerState.UNHEALTHY)
    reg = AttemptRegistry()
    a = attempt(w, 0.5)
    reg.add(a)
    reg.abort_worker("w", "marked down", spare_within=4.0)
    w.state = WorkerState.HEALTHY
    reg.sweep(now=1.0)
    a.progress.seconds = 30.0  # (a long pause later is the stream idle timeout's business)
    reg.sweep(now=2.0)
    assert a.spared is None and not a.task.cancelled


def test_a_removed_worker_pulls_everything():
    w = Worker("w", "http://w")
    reg = AttemptRegistry()
    a = attempt(w, 0.1)
    reg.add(a)
    assert reg.abort_worker("w", "removed") == 1 and a.task.cancelled
