"""orchestrator.ports.free_port: ports below the kernel's ephemeral range, claimed so that no two callers on the
machine get the same one while a child may still be starting on it (a CI run lost a gateway's port to another
test process between ``bind(0)`` and the child's own bind)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from orchestrator import ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ephemeral_start() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_come_from_below_the_ephemeral_range_free_and_distinct():
    got = [ports.free_port() for _ in range(100)]
    assert len(set(got)) == 100
    assert all(p < _ephemeral_start() for p in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))  # nothing listens on it


def test_two_processes_never_get_the_same_port():
    code = "from orchestrator.ports import free_port; print(' '.join(str(free_port()) for _ in range(150)))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT) for _ in range(2)]
    sets = [set(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert all(len(s) == 150 for s in sets)
    assert not sets[0] & sets[1]


def test_a_claimed_port_is_skipped_until_its_claim_expires(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "_claims", lambda: tmp_path)
    with socket.socket() as a, socket.socket() as b:  # two ports the kernel says are free (then released)
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        first, second = a.getsockname()[1], b.getsockname()[1]
    picks = iter([first, first, second, first])
    monkeypatch.setattr(ports.random, "randrange", lambda *span: next(picks))
    assert ports.free_port() == first
    assert ports.free_port() == second  # ``first`` is claimed: skipped
    old = time.time() - ports.CLAIM_TTL_S - 1
    os.utime(tmp_path / str(first), (old, old))
    assert ports.free_port() == first  # its claim expired, and nothing listens on it


def test_a_port_something_listens_on_is_not_handed_out(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "_claims", lambda: tmp_path)
    with socket.socket() as listener, socket.socket() as other:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        other.bind(("127.0.0.1", 0))
        busy, free = listener.getsockname()[1], other.getsockname()[1]
        other.close()
        picks = iter([busy, free])
        monkeypatch.setattr(ports.random, "randrange", lambda *span: next(picks))
        assert ports.free_port() == free
        assert not (tmp_path / str(busy)).exists()


@pytest.mark.parametrize("content", ["1024 65000", "bad"])
def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernels_pick(content, monkeypatch, tmp_path):
    f = tmp_path / "range"
    f.write_text(content)
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(f if "ip_local_port_range" in str(path)
                                                                          else path, *a, **k))
    assert ports._claim_range() is None
    assert ports.free_port() > 0
