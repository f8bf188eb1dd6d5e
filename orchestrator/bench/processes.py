"""Child processes a benchmark script starts (engines, gateways, anchor routers), each in its own
process group so one ``stop`` takes down whatever it spawned, and a readiness wait that fails fast
with the child's log when the child dies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class Processes:
    """Processes this script started; stopped through their own process groups."""

    logdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.logdir / f"{name}.log"
        p = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, **(env or {})})
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def stop(self, procs: list[Proc]) -> None:
        for proc in procs:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(5)
            if proc in self.procs:
                self.procs.remove(proc)

    def stop_all(self) -> None:
        self.stop(list(reversed(self.procs)))


def wait_http(url: str, proc: Proc, timeout_s: float = 60.0, ok: tuple[int, ...] = (200,)) -> None:
    """Poll ``url`` until it answers one of ``ok``; raise with the log tail if the child exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}); log: {proc.log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} not ready at {url} after {timeout_s:g} s; log: {proc.log.read_text()[-2000:]}")
