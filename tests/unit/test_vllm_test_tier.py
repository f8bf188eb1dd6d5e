"""The real-vLLM tier's planning, without starting vLLM: the engine configurations and the run order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import pytest_collection_modifyitems
from tests.fixtures.vllm import (
    ENGINE_SETS,
    LOCK_WAIT_S,
    RUN_ORDER,
    SMALL_KV_BYTES,
    START_TIMEOUT_S,
    EngineSpec,
    VllmPaths,
    VllmPool,
    vllm_run_order,
)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]  # the last occurrence wins in argparse


def test_every_configuration_fits_the_machine_and_has_a_place_in_the_order():
    assert set(ENGINE_SETS) == set(RUN_ORDER)
    assert all(1 <= s.count <= 2 for s in ENGINE_SETS.values())
    assert ENGINE_SETS["default"].kv_events and not ENGINE_SETS["default"].nixl_roles
    assert ENGINE_SETS["pd"].nixl_roles == ("kv_producer", "kv_consumer")
    assert ENGINE_SETS["both"].nixl_roles == ("kv_both", "kv_both")


def test_pd_engines_get_their_nixl_role_a_side_channel_port_each_and_no_event_publisher(tmp_path: Path):
    pool = VllmPool(VllmPaths(venv=tmp_path, model_dir=tmp_path), tmp_path)
    s = ENGINE_SETS["pd"]


    engines = [pool._engine("pd", i, EngineSpec(args, nixl=True, kv_events=s.kv_events)) for i, args in enumerate(s.args)]
    roles, side_ports = [], set()
    for i, e in enumerate(engines):
        cmd = e.command()
        assert "--kv-events-config" not in cmd
        cfg = json.loads(_flag(cmd, "--kv-transfer-config"))
        assert cfg["kv_connector"] == "NixlConnector" and cfg["kv_buffer_device"] == "cpu"
        roles.append(cfg["kv_role"])
        assert ("kv_load_failure_policy" in cfg) == (cfg["kv_role"] == "kv_consumer")
        env = e.environment()
        side_ports.add(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(i)
        assert env["PYTHONPATH"].split(":")[0] == str(tmp_path / "site")  # AMX sitecustomize
    assert roles == ["kv_producer", "kv_consumer"] and len(side_ports) == 2


def test_small_kv_engine_overrides_cache_bytes_and_context():
    (args,) = ENGINE_SETS["small-kv"].args
    cmd = ["--kv-cache-memory-bytes", "268435456", "--max-model-len", "4096", *args]
    assert _flag(cmd, "--kv-cache-memory-bytes") == str(SMALL_KV_BYTES) == str(64 * 32 * 2048)
    assert _flag(cmd, "--max-model-len") == "1024"


def test_run_order_groups_by_configuration_and_runs_killers_last():
    tests = [
        ("pd", "test_pd_a"), ("default", "test_one_engine_killed"), ("default", "test_a"),
        ("small-kv", "test_evict"), ("both", "test_roles"), ("default", "test_b"),
        ("pd", "test_prefill_engine_killed"), ("pd", "test_pd_b"), ("custom", "test_x"),
    ]  # fmt: skip
    names = [tests[i][1] for i in vllm_run_order(tests)]
    assert names == ["test_a", "test_b", "test_one_engine_killed", "test_evict", "test_roles",
                     "test_pd_a", "test_pd_b", "test_prefill_engine_killed", "test_x"]


def test_pool_rejects_unknown_configurations_and_oversized_requests(tmp_path: Path):
    pool = VllmPool(VllmPaths(venv=tmp_path, model_dir=tmp_path), tmp_path)
    with pytest.raises(ValueError, match="unknown vLLM engine configuration"):
        pool.use("four-engines")
    with pytest.raises(ValueError, match="has 1 engine"):
        pool.get(2, key="small-kv")
    with pytest.raises(RuntimeError, match="nixl is not installed"):
        pool.use("pd")  # checked before anything starts
    assert pool.engines == [] and not pool.lock.held


class _Item:
    """Just what the conftest hook reads of a collected test."""

    def __init__(self, name: str, *markers: pytest.MarkDecorator, fixtures: tuple[str, ...] = ()) -> None:
        self.name = name
        self.own_markers = [m.mark for m in markers]
        self.fixturenames = fixtures

    def get_closest_marker(self, name: str):
        return next((m for m in self.own_markers if m.name == name), None)

    def add_marker(self, marker: pytest.MarkDecorator, append: bool = True) -> None:
        self.own_markers.insert(len(self.own_markers) if append else 0, marker.mark)


class _Config:
    def getini(self, name: str) -> str:
        assert name == "timeout"
        return "300"


def test_conftest_puts_vllm_tests_last_in_configuration_groups_with_a_start_budget():
    items = [
        _Item("test_pd", pytest.mark.vllm, pytest.mark.vllm_config("pd"), pytest.mark.timeout(900)),
        _Item("test_unit"),
        _Item("test_uses_pool_unmarked", fixtures=("vllm_pool",)),
        _Item("test_a_killed", pytest.mark.vllm),
        _Item("test_evict", pytest.mark.vllm_config("small-kv")),
        _Item("test_b", pytest.mark.vllm),
    ]
    pytest_collection_modifyitems(_Config(), items)
    assert [i.name for i in items] == ["test_unit", "test_uses_pool_unmarked", "test_b", "test_a_killed",
                                       "test_evict", "test_pd"]
    assert all(i.get_closest_marker("vllm") for i in items[1:]) and not items[0].get_closest_marker("vllm")
    budget = {i.name: i.get_closest_marker("timeout").args[0] for i in items if i.get_closest_marker("timeout")}
    # the first test of each group starts its engines; the others keep their own timeout
    assert budget == {"test_uses_pool_unmarked": 300 + START_TIMEOUT_S + LOCK_WAIT_S,
                      "test_evict": 300 + START_TIMEOUT_S + LOCK_WAIT_S,
                      "test_pd": 900 + START_TIMEOUT_S + LOCK_WAIT_S}
