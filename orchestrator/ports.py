"""Local child servers (engines, gateways, redis, Prometheus): a free loopback port to listen on, and
waiting until the child answers.

Shared by the planner's local-process actuator, the benchmark scripts and the tests. The port is
free when asked; the child binds it moments later (a race no caller here has hit).
"""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 30.0, interval_s: float = 0.1) -> bool:
    """Poll ``GET url`` until it answers 200 (True); False once ``proc`` has exited or time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
