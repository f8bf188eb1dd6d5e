"""The real-vLLM pool's start-up handling, with a stand-in engine (a shell script in place of the
venv's python, so no vLLM is needed): an engine that exits during start fails at once with its log
tail; one whose port was taken ("Address already in use", while the process hangs on, as vLLM's
NIXL listener does) is restarted on a fresh port block; a configuration that keeps failing stops
trying after ``PORT_ATTEMPTS``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fixtures import vllm
from tests.fixtures.cpu_probe import CpuChoice, CpuPath, ProbeResult

# Stands in for ``python -m vllm.entrypoints.openai.api_server ... --port N ...``.
FAKE = r"""#!/bin/sh
port=""
while [ $# -gt 0 ]; do [ "$1" = "--port" ] && port="$2"; shift; done
echo "fake engine on $port (mode $FAKE_MODE)"
case "$FAKE_MODE" in
  exit) echo "RuntimeError: Engine core initialization failed"; exit 3 ;;
  clash) echo "zmq.error.ZMQError: Address already in use (addr='tcp://*:$port')"; exec sleep 600 ;;
  clash-once)
    if [ ! -f "$FAKE_DIR/clashed" ]; then touch "$FAKE_DIR/clashed"; echo "OSError: [Errno 98] Address already in use"; exec sleep 600; fi
    mkdir -p "$FAKE_DIR/www"; : > "$FAKE_DIR/www/health"
    exec python3 -m http.server "$port" --bind 127.0.0.1 --directory "$FAKE_DIR/www" ;;
esac
"""


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> vllm.VllmPool:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE)
    (venv / "bin" / "python").chmod(0o755)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    # Real engines of another run on this machine are not this test's business.
    monkeypatch.setattr(vllm, "running_vllm_servers", lambda: {})
    p = vllm.VllmPool(vllm.VllmPaths(venv=venv, model_dir=tmp_path), tmp_path / "logs")
    p.lock = vllm.MachineLock(tmp_path / "lock")
    p.cpu = CpuChoice(CpuPath("native"), ((CpuPath("native"), ProbeResult(True, "not probed: stand-in engine")),))
    yield p
    p.stop_all()


def _start(pool: vllm.VllmPool, mode: str) -> None:
    pool.get(1, key=f"fake-{mode}", extra_env={"FAKE_MODE": mode})


def test_an_engine_that_exits_during_start_fails_at_once_with_its_log(pool):
    began = time.monotonic()
    with pytest.raises(vllm.EngineExited, match="exited with status 3") as err:
        _start(pool, "exit")
    assert time.monotonic() - began < 30  # not START_TIMEOUT_S
    assert "Engine core initialization failed" in str(err.value)
    with pytest.raises(RuntimeError, match="failed to start earlier in this session"):
        _start(pool, "exit")  # not retried: each real try costs minutes


def test_a_port_clash_is_retried_on_a_fresh_block_and_then_serves(pool):
    _start(pool, "clash-once")
    (engine,) = pool.engines
    assert engine.alive() and engine.ready_after_s is not None
    assert len(pool._blocks) == 2 and engine.port_base in pool._blocks  # the first block was given up
    assert all(vllm.PORT_BLOCK <= b and (b + vllm.PORT_BLOCK <= vllm._ephemeral_range()[0]
                                         or b > vllm._ephemeral_range()[1]) for b in pool._blocks)


def test_an_engine_that_keeps_clashing_gives_up_after_the_attempts_quickly(pool):
    began = time.monotonic()
    with pytest.raises(vllm.PortClash, match="Address already in use"):
        _start(pool, "clash")
    assert time.monotonic() - began < 60
    assert len(pool._blocks) == vllm.PORT_ATTEMPTS
    assert not any(e.alive() for e in pool.engines)
