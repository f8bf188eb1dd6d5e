"""The benchmark scripts' default traces resolve from DYAD_TRACES or from the repository, never a machine path."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.bench import trace_paths


def test_dyad_traces_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("DYAD_TRACES", str(tmp_path))
    assert trace_paths.trace_path("x.jsonl") == tmp_path / "x.jsonl"


def test_a_shared_traces_directory_above_the_repository_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("DYAD_TRACES", raising=False)
    repo = tmp_path / "checkouts" / "dyad"
    repo.mkdir(parents=True)
    (tmp_path / "shared" / "traces").mkdir(parents=True)
    monkeypatch.setattr(trace_paths, "REPO", repo)
    assert trace_paths.traces_dir() == tmp_path / "shared" / "traces"


def test_no_traces_directory_says_what_to_pass(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("DYAD_TRACES", raising=False)
    monkeypatch.setattr(trace_paths, "REPO", tmp_path / "repo")
    with pytest.raises(FileNotFoundError, match="--trace FILE or set DYAD_TRACES"):
        trace_paths.traces_dir()
