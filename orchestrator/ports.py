"""A free loopback TCP port for a child process (engines, gateways, redis, Prometheus) to listen on.

Shared by the planner's local-process actuator, the benchmark scripts and the test fixtures. The
port is free when asked; the child binds it moments later (a race no caller here has hit).
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
