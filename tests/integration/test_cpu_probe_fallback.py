"""The CPU probe's fallback ladder, really taken (tests/fixtures/cpu_probe.py).

On the machines the suite runs on, the ladder below ``native`` never runs in the real-vLLM tier (a CPU
listing bf16 instructions runs them natively; one listing none serves float32 directly). Here the
probe is told the CPU lists bf16 (``bf16_listed=True``, ``--try-bf16``), and its own ``python`` parameter points at a small launcher for the vLLM venv's
interpreter that behaves like a CPU whose advertised instructions fault: it dies of a real SIGILL
(``os.kill(os.getpid(), SIGILL)``, the signal the kernel sends on an invalid opcode) unless the
environment or the dtype avoids the faulting kernels, and otherwise execs the real interpreter on the
real probe code (torch's bf16/float32 matmul). Nothing is mocked: every rung is a subprocess, the
signal is the kernel's, and the rung the probe lands on computes for real.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import deps
from tests.fixtures.cpu_probe import LADDER, probe_cpu
from tests.fixtures.vllm import VllmPaths

# Runs in the vLLM venv's interpreter, called as ``<launcher> -c PROBE_CODE <dtype>``.
LAUNCHER = """\
#!{python}
import os, resource, signal, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the SIGILL below
faults = {faults!r}
if faults == "amx" and "ONEDNN_MAX_CPU_ISA" not in os.environ:
    os.kill(os.getpid(), signal.SIGILL)  # native: the libraries pick AMX, which faults
if faults == "bf16" and sys.argv[-1] != "float32":
    os.kill(os.getpid(), signal.SIGILL)  # any bf16 kernel faults, whatever oneDNN is told
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


@pytest.fixture(scope="module")
def venv_python() -> str:
    paths = VllmPaths.from_env()
    if not paths.python.exists():
        deps.missing(f"the vLLM venv {paths.venv} (DYAD_VLLM_VENV)", deps.VLLM_VENV)
    return str(paths.python)


def launcher(tmp_path: Path, python: str, faults: str) -> str:
    path = tmp_path / f"python-{faults}-faults"
    path.write_text(LAUNCHER.format(python=python, faults=faults))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def clean_env() -> dict[str, str]:
    """This process's environment without a user's ISA cap (the probe would respect it)."""
    return {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}


def test_a_sigill_on_the_native_path_lands_on_onednn_without_amx(tmp_path: Path, venv_python: str):
    choice = probe_cpu(launcher(tmp_path, venv_python, "amx"), clean_env(), bf16_listed=True)
    assert choice.path == LADDER[1] and choice.path.env == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    (native, native_result), (landed, landed_result) = choice.tried
    assert native.name == "native" and not native_result.ok and native_result.detail == "killed by SIGILL"
    assert landed == LADDER[1] and landed_result.ok
    assert landed_result.detail.startswith("max abs error ") and landed_result.detail.endswith("(bfloat16)")
    assert choice.describe() == ("vLLM CPU path: AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16) "
                                 "after native: killed by SIGILL")


def test_when_every_bf16_rung_faults_the_probe_serves_float32(tmp_path: Path, venv_python: str):
    choice = probe_cpu(launcher(tmp_path, venv_python, "bf16"), clean_env(), bf16_listed=True)
    assert choice.path == LADDER[-1] and choice.path.dtype == "float32"
    assert [p.name for p, _ in choice.tried] == [p.name for p in LADDER]
    assert [r.detail for _, r in choice.tried[:-1]] == ["killed by SIGILL"] * (len(LADDER) - 1)
    assert choice.tried[-1][1].ok and choice.tried[-1][1].detail.endswith("(float32)")


def test_the_command_line_prints_the_step_taken_and_the_export(tmp_path: Path, venv_python: str):
    """``python3 tests/fixtures/cpu_probe.py --python ...``, as docs tell users to run it."""
    probe = Path(__file__).resolve().parents[1] / "fixtures" / "cpu_probe.py"
    out = subprocess.run([sys.executable, str(probe), "--python", launcher(tmp_path, venv_python, "amx"), "--try-bf16"],
                         capture_output=True, text=True, timeout=600, env=clean_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "vLLM CPU path: AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16) after native: killed by SIGILL",
        "export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16",
    ]
