"""The unit tier's rule, enforced: no sockets, no subprocesses, no servers.

Every unit test runs with the ways out of the process blocked: ``bind``/``connect``/``listen`` on
any Python socket, ``bind``/``connect`` of a ZMQ socket to anything but ``inproc://``, and starting
a process (``subprocess``, ``os.fork``, ``os.posix_spawn``, ``os.system``; asyncio and
multiprocessing go through these). A blocked call raises ``UnitTierViolation`` and is also recorded,
so a test that catches the error still fails at teardown. A test that needs any of these belongs in
``tests/integration`` (or ``tests/ops``). In-process socket pairs (asyncio's self-pipe) are allowed.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator

import pytest


class UnitTierViolation(RuntimeError):
    pass


# matplotlib lists the machine's fonts once, on its first import anywhere (``fc-list``, a subprocess), and caches
# the list in ~/.cache/matplotlib. Do it here, before the guard, so that a unit test that draws a figure passes on
# a fresh machine whether or not another tier imported matplotlib first.
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401
except ImportError:  # pragma: no cover - matplotlib comes with the test extra
    pass


_SOCKET_CALLS = ("bind", "connect", "connect_ex", "listen")
_PROCESS_CALLS = ((os, "fork"), (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
                  (os, "execv"), (os, "execve"))


@pytest.fixture(autouse=True)
def _unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    seen: list[str] = []

    def blocked(what: str):
        def refuse(*args, **kwargs):
            where = next((repr(a) for a in args[1:2]), "")
            seen.append(f"{what}({where})")
            raise UnitTierViolation(f"unit tier: {what}({where}) is not allowed; move the test to tests/integration")

        return refuse

    for name in _SOCKET_CALLS:
        monkeypatch.setattr(socket.socket, name, blocked(f"socket.{name}"))
    monkeypatch.setattr(subprocess.Popen, "__init__", blocked("subprocess.Popen"))
    for module, name in _PROCESS_CALLS:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, blocked(f"os.{name}"))
    try:
        import zmq
    except ImportError:  # pragma: no cover - pyzmq is a dependency
        zmq = None
    if zmq is not None:
        for name in ("bind", "connect"):
            original = getattr(zmq.Socket, name)

            def only_inproc(self, addr, *args, _original=original, _name=name, **kwargs):
                if not str(addr).startswith("inproc://"):
                    seen.append(f"zmq.{_name}({addr!r})")
                    raise UnitTierViolation(f"unit tier: zmq {_name}({addr!r}) is not allowed; use inproc:// "
                                            "or move the test to tests/integration")
                return _original(self, addr, *args, **kwargs)

            monkeypatch.setattr(zmq.Socket, name, only_inproc)
    yield
    if seen:
        pytest.fail(f"unit tier: {request.node.nodeid} used {', '.join(dict.fromkeys(seen))}; "
                    "sockets, subprocesses and servers belong in tests/integration", pytrace=False)
