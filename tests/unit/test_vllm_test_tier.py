"""The real-vLLM tier's planning, without starting vLLM: the engine configurations and the run order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import pytest_collection_modifyitems
from tests.fixtures.cpu_probe import (
    LADDER,
    CpuChoice,
    CpuPath,
    CpuProbeError,
    ProbeResult,
    choose_cpu_path,
    lists_bf16,
)
from tests.fixtures.vllm import (
    ENGINE_SETS,
    LOCK_WAIT_S,
    PORT_BLOCK,
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


NATIVE = CpuPath("native")


def _pool(tmp_path: Path, cpu: CpuPath = NATIVE) -> VllmPool:
    pool = VllmPool(VllmPaths(venv=tmp_path, model_dir=tmp_path), tmp_path)
    pool.cpu = CpuChoice(cpu, ((cpu, ProbeResult(True, "faked")),))  # the real probe runs in the fixture
    return pool


def test_pd_engines_get_their_nixl_role_a_side_channel_port_each_and_no_event_publisher(tmp_path: Path):
    pool = _pool(tmp_path)
    s = ENGINE_SETS["pd"]
    engines = [pool._engine("pd", i, EngineSpec(args, nixl=True, kv_events=s.kv_events), port_base=20000 + 16 * i)
               for i, args in enumerate(s.args)]
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


def _fake_probe(works: set[str]):
    """A probe that succeeds for the named rungs and dies of SIGILL elsewhere; records the calls."""
    calls: list[str] = []

    def probe(path: CpuPath) -> ProbeResult:
        calls.append(path.name)
        return ProbeResult(True, "max abs error 0.0") if path.name in works else ProbeResult(False, "killed by SIGILL")

    return probe, calls


def test_cpu_probe_keeps_the_native_path_when_it_works():
    probe, calls = _fake_probe({"native", "AVX512_CORE_BF16"})
    choice = choose_cpu_path(probe)
    assert choice.path.name == "native" and choice.path.env == {} and calls == ["native"]
    assert choice.describe() == "vLLM CPU path: native"


def test_cpu_probe_falls_back_to_onednn_without_amx_on_sigill():
    probe, calls = _fake_probe({"AVX512_CORE_BF16", "AVX2"})
    choice = choose_cpu_path(probe)
    assert choice.path.env == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"} and choice.path.dtype == "bfloat16"
    assert calls == ["native", "AVX512_CORE_BF16"]
    assert "AVX512_CORE_BF16" in choice.describe() and "native: killed by SIGILL" in choice.describe()


def test_cpu_probe_walks_down_to_float32_and_fails_clearly_when_nothing_runs():
    probe, calls = _fake_probe({"float32"})
    choice = choose_cpu_path(probe)
    assert choice.path.dtype == "float32" and calls == [p.name for p in LADDER]
    probe, _ = _fake_probe(set())
    with pytest.raises(CpuProbeError, match="native: killed by SIGILL"):
        choose_cpu_path(probe)


def test_cpu_probe_respects_an_onednn_cap_the_user_set():
    probe, calls = _fake_probe({"AVX2"})
    choice = choose_cpu_path(probe, user_cap="AVX2")
    assert calls == ["native", "AVX2"] and choice.path.name == "AVX2"  # no rung that lifts the cap


def test_a_cpu_listing_no_bf16_instructions_serves_float32_without_probing_bf16():
    probe, calls = _fake_probe({"native", "AVX2", "float32"})  # bf16 would run here, emulated
    choice = choose_cpu_path(probe, bf16_listed=False)
    assert choice.path.dtype == "float32" and calls == ["float32"]
    assert choice.describe() == ("vLLM CPU path: float32 (--dtype float32) (bf16 rungs skipped: the CPU lists "
                                 "no bf16 instructions, so bf16 would be emulated)")
    # unknown (no /proc/cpuinfo) keeps the ladder; a cap the user set keeps the bf16 rungs it allows
    assert choose_cpu_path(_fake_probe({"native"})[0], bf16_listed=None).path.name == "native"
    assert choose_cpu_path(_fake_probe({"AVX2"})[0], user_cap="AVX2", bf16_listed=False).path.name == "AVX2"


def test_bf16_instructions_are_read_from_cpuinfo_flags_or_arm_features():
    epyc_avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    sapphire = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
    graviton3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert lists_bf16(epyc_avx2) is False
    assert lists_bf16(sapphire) is True and lists_bf16(graviton3) is True
    assert lists_bf16("model name\t: something\n") is None  # no flag line: unknown


def test_engines_take_the_probed_path_env_and_dtype(tmp_path: Path):
    capped = LADDER[1]
    e = _pool(tmp_path, capped)._engine("default", 0, EngineSpec(), port_base=20000)
    assert e.environment()["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    assert _flag(e.command(), "--dtype") == "bfloat16"
    f32 = _pool(tmp_path, LADDER[-1])._engine("small-kv", 0, EngineSpec(ENGINE_SETS["small-kv"].args[0]), port_base=20000)
    assert _flag(f32.command(), "--dtype") == "float32"
    assert _flag(f32.command(), "--kv-cache-memory-bytes") == str(2 * SMALL_KV_BYTES)  # same block count


def test_an_engine_takes_every_port_from_its_block(tmp_path: Path):
    e = _pool(tmp_path)._engine("pd", 0, EngineSpec(nixl=True), port_base=20032)
    env, cmd = e.environment(), e.command()
    ports = {e.port, e.kv_events_port, e.kv_replay_port, int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]), int(env["VLLM_PORT"])}
    assert len(ports) == 5 and all(20032 <= p < 20032 + PORT_BLOCK for p in ports)
    assert _flag(cmd, "--port") == str(e.port)
    unplaced = _pool(tmp_path)._engine("default", 0, EngineSpec())
    with pytest.raises(RuntimeError, match="no ports yet"):
        unplaced.start()


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
    pool = _pool(tmp_path)
    with pytest.raises(ValueError, match="unknown vLLM engine configuration"):
        pool.use("four-engines")
    with pytest.raises(ValueError, match="has 1 engine"):
        pool.get(2, key="small-kv")
    with pytest.raises(RuntimeError, match="nixl in .* is missing: install step"):
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
