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


def test_dyad_hash_key_on_a_terminal_asks_for_the_key():
    """Run in a terminal without a pipe, ``dyad hash-key`` waited silently for an end of file (it looked hung)."""
    import hashlib
    import os
    import pty
    import select
    import subprocess
    import sys
    import time
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "hash-key", "--name", "t"], cwd=root,
                            stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    seen = b""

    def read_until(marker: bytes) -> None:
        nonlocal seen
        deadline = time.monotonic() + 60  # a liveness bound, not a timing assertion
        while marker not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(leader, 4096)
                except OSError:  # the child closed the terminal
                    break
    try:
        read_until(b"key (not echoed): ")
        assert b"key (not echoed): " in seen, seen
        os.write(leader, b"abc\n")
        digest = hashlib.sha256(b"abc").hexdigest().encode()
        read_until(b"sha256: " + digest)
        assert digest in seen and b"abc\r\n" not in seen.split(b"echoed): ", 1)[1][:8], seen
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
