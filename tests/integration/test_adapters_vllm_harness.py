"""The real-vLLM harness's own logic, without starting vLLM: paths, command line, machine lock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.vllm import MachineLock, VllmEngine, VllmPaths, VllmPool


def test_paths_from_env_and_missing_reasons(tmp_path: Path):
    paths = VllmPaths.from_env({"DYAD_VLLM_VENV": str(tmp_path / "v"), "DYAD_MODEL_DIR": str(tmp_path / "m")})
    assert paths.venv == tmp_path / "v" and paths.model_dir == tmp_path / "m"
    assert "DYAD_VLLM_VENV" in paths.missing()[0]  # (what is missing, the install step)
    (tmp_path / "v/bin").mkdir(parents=True)
    (tmp_path / "v/bin/python").write_text("")
    assert "DYAD_MODEL_DIR" in paths.missing()[0]
    (tmp_path / "m").mkdir()
    (tmp_path / "m/config.json").write_text("{}")
    assert paths.missing() is None


def test_engine_command_and_environment(tmp_path: Path):
    paths = VllmPaths(venv=tmp_path / "v", model_dir=tmp_path / "m")
    e = VllmEngine(name="e", paths=paths, core=1, log_path=tmp_path / "e.log", extra_args=["--seed", "3"],
                   extra_env={"X": "1"}, site_dir=tmp_path / "site")
    cmd = e.command()
    assert cmd[:3] == [str(tmp_path / "v/bin/python"), "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enforce-eager", "--enable-prefix-caching"):
        assert flag in cmd
    assert cmd[cmd.index("--block-size") + 1] == "32" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == str(e.port) and cmd[-2:] == ["--seed", "3"]
    kv = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert kv["endpoint"] == f"tcp://*:{e.kv_events_port}" and e.kv_events_endpoint.endswith(f":{e.kv_events_port}")
    env = e.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1" and env["X"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path / "site")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_pool_writes_sitecustomize_and_caps_engines(tmp_path: Path):
    pool = VllmPool(VllmPaths(venv=tmp_path, model_dir=tmp_path), tmp_path)
    assert (tmp_path / "site/sitecustomize.py").read_text().count("syscall(158") == 1
    with pytest.raises(ValueError):
        pool.get(3)


def test_machine_lock_is_exclusive(tmp_path: Path):
    a, b = MachineLock(tmp_path / "lock"), MachineLock(tmp_path / "lock")
    a.acquire()
    with pytest.raises(TimeoutError):
        b.acquire(wait_s=0)
    a.release()
    b.acquire(wait_s=0)
    assert b.held and not a.held
    b.release()
