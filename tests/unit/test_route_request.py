"""RouteRequest is an immutable value: annotation and each try make copies that keep every other field."""

from __future__ import annotations

import dataclasses

import pytest

from orchestrator.router.types import Overlap, PeerLoad, RouteRequest


def full() -> RouteRequest:
    """A request with every field set to a non-default value."""
    values = {"request_id": "r", "model": "m", "prompt_tokens": 7, "max_tokens": 9, "token_ids": [1, 2],
              "block_hashes": [11], "block_size": 16, "overlaps": {"w": Overlap(1, 1.0)},
              "inflight_overlaps": {"w": 1}, "peer_load": {"w": PeerLoad(1, 2)}, "session_key": "s",
              "priority": 2, "split_allowed": False, "prefer_local": True}
    assert set(values) == {f.name for f in dataclasses.fields(RouteRequest)}, "a new field: add it here and to the copies"
    return RouteRequest(**values)


def test_it_cannot_be_changed():
    with pytest.raises(dataclasses.FrozenInstanceError):
        full().prompt_tokens = 1  # type: ignore[misc]


def test_copies_change_only_what_they_name():
    r = full()
    a = r.annotated(token_ids=[5], prompt_tokens=1, block_size=32, block_hashes=[6], overlaps={}, peer_load={},
                    session_key="k")
    changed = {"token_ids", "prompt_tokens", "block_size", "block_hashes", "overlaps", "peer_load", "session_key"}
    for f in dataclasses.fields(RouteRequest):
        if f.name not in changed:
            assert getattr(a, f.name) == getattr(r, f.name), f.name
    t = r.with_inflight({"x": 3})
    assert t.inflight_overlaps == {"x": 3} and r.inflight_overlaps == {"w": 1}
    for f in dataclasses.fields(RouteRequest):
        if f.name != "inflight_overlaps":
            assert getattr(t, f.name) == getattr(r, f.name), f.name
