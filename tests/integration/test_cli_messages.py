"""The ``dyad`` commands a new user runs first, meeting what is not there: one line naming it, no traceback."""

from __future__ import annotations

import socket

from orchestrator.cli import main as dyad


def test_dyad_profile_names_an_engine_it_cannot_reach(tmp_path, capsys):
    # httpx's message alone ("All connection attempts failed") did not say which engine
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        assert dyad(["profile", "--url", url, "--out", str(tmp_path / "p.json"), "--timeout", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dyad profile: cannot reach {url}: "), err
    assert not (tmp_path / "p.json").exists()
