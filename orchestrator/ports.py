"""Local child servers (engines, gateways, redis, Prometheus): a free loopback port to listen on, and
waiting until the child answers.

Shared by the planner's local-process actuator, the benchmark scripts and the tests. The port is
free when asked; the child binds it moments later — seconds for a gateway, longer for an engine on a
loaded machine. ``bind(0)``'s answer was taken in that gap (a fresh-clone CI run: a ``dyad serve`` child
"address already in use"): the kernel hands the same ephemeral ports to every ``bind(0)`` and outbound
connection on the machine, and parallel test processes each asked it for ports. So ``free_port`` picks
below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), where the kernel never assigns a
port by itself, and claims each port it hands out for ``CLAIM_TTL_S`` with a file that every caller on the
machine checks (``O_CREAT | O_EXCL``): two callers never get the same port while a child may still be
starting on it.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

CLAIM_TTL_S = 600.0  # a claimed port is not handed out again for this long (a child binds it well within)
CLAIM_SPAN = 12_000  # how many ports below the ephemeral range are handed out
_CLAIM_TRIES = 200


def _claim_range() -> tuple[int, int] | None:
    """[start, end): the ports below the kernel's ephemeral range; None when that range starts too low."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(10_000, lo - CLAIM_SPAN)
    return (start, lo) if lo - start >= 1_000 else None


def _claims() -> Path:
    d = Path(tempfile.gettempdir()) / f"dyad-port-claims-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _claim(claims: Path, port: int) -> bool:
    """Claim ``port`` for ``CLAIM_TTL_S`` (False: another caller holds a live claim on it)."""
    path = claims / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime < CLAIM_TTL_S:
                    return False
                path.unlink()  # an expired claim: the port is handed out again (if nothing listens on it)
            except FileNotFoundError:
                pass
    return False


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, that the kernel will not hand to a ``bind(0)`` or
    an outbound connection, and that no other ``free_port`` caller on this machine gets within
    ``CLAIM_TTL_S`` (module docstring). Where the ephemeral range leaves no room below it, the kernel's pick."""
    span = _claim_range()
    if span is not None:
        claims = _claims()
        for _ in range(_CLAIM_TRIES):
            port = random.randrange(*span)
            if _bindable(port) and _claim(claims, port):
                return port
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
