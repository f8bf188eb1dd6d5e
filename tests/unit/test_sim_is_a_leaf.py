"""The simulator is a leaf: production code never imports ``orchestrator.sim``.

Scans the AST of every module in the production packages (imports at any depth, lazy ones inside
functions included). The only modules allowed to import the simulator are the command-line tools
whose job is to run it, listed here with the reason. Also checks that the planner's shipped profile
(used when ``planner.profile`` is unset, instead of sweeping the simulator at gateway start) is what
``dyad profile --sim gpu-like`` produces today.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import orchestrator
from tests.fixtures.source import parse_source

ROOT = Path(orchestrator.__file__).resolve().parent
REPO = ROOT.parent
PRODUCTION = [ROOT / p for p in ("gateway", "router", "planner", "kv", "fleet", "disagg", "telemetry", "ui")]
PRODUCTION += [REPO / "adapters"] + sorted(p for p in ROOT.glob("*.py") if p.name not in ("cli.py", "demo.py"))
# CLI front-ends of the simulator itself (never imported by the gateway):
ALLOWED = {
    "orchestrator/planner/plan_cli.py": "`dyad plan`: replays a trace on the simulated fleet in virtual time",
    "orchestrator/planner/profile_cli.py": "`dyad profile --sim`: sweeps a simulated engine into a profile",
}


def sim_imports_in(src: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(parse_source(src, name)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [f"{name}:{node.lineno} imports {n}" for n in names
                  if n == "orchestrator.sim" or n.startswith("orchestrator.sim.")]
    return found


def sim_imports(path: Path) -> list[str]:
    return sim_imports_in(path.read_text(), str(path.relative_to(REPO)))


def production_files() -> list[Path]:
    out = []
    for p in PRODUCTION:
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def test_production_code_does_not_import_the_simulator():
    files = production_files()
    assert len(files) > 50  # the scan really covers the packages
    offenders = [hit for f in files if str(f.relative_to(REPO)) not in ALLOWED for hit in sim_imports(f)]
    assert offenders == []


def test_the_scan_finds_an_import_at_any_depth():
    src = ("import json\n"
           "def f():\n    from orchestrator.sim.profiles import GPU_LIKE\n"
           "class C:\n    def g(self):\n        import orchestrator.sim.server\n"
           "from orchestrator import sim\n")
    hits = sim_imports_in(src, "probe.py")
    assert sorted({int(h.split(":")[1].split()[0]) for h in hits}) == [3, 6, 7], hits


def test_allowed_modules_still_exist():
    for rel in ALLOWED:
        assert (REPO / rel).exists(), rel


def test_shipped_profile_is_the_current_sweep_of_the_gpu_like_engine():
    from orchestrator.planner.install import DEFAULT_PROFILE
    from orchestrator.sim.profiles import load_profile
    from orchestrator.sim.virtual_time import sweep_profile

    shipped = json.loads(DEFAULT_PROFILE.read_text())
    assert shipped == json.loads(json.dumps(sweep_profile(load_profile("gpu-like")))), (
        "regenerate it: dyad profile --sim gpu-like --out orchestrator/planner/profiles/gpu-like.json")
