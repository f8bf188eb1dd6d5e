"""scripts/build_native.py's guard against a stale compiled module (a .so that shadows an edited .py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("build_native", ROOT / "scripts" / "build_native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tree_with(tmp_path: Path, bn, source: str, recorded: str | None) -> Path:
    """A tree with orchestrator/x.py, a (fake) x<EXT_SUFFIX> beside it, and a manifest recording ``recorded``."""
    pkg = tmp_path / "orchestrator"
    pkg.mkdir()
    (pkg / "x.py").write_text(source)
    (pkg / f"x{bn.SUFFIX}").write_bytes(b"\x7fELF")
    (tmp_path / "adapters").mkdir()
    if recorded is not None:
        (tmp_path / "build/native").mkdir(parents=True)
        digest = hashlib.sha256(recorded.encode()).hexdigest()
        (tmp_path / "build/native/manifest.json").write_text(json.dumps({"orchestrator/x.py": digest}))
    return tmp_path


def test_check_passes_when_each_so_was_built_from_its_py(tmp_path, capsys):
    bn = load()
    assert bn.check(tree_with(tmp_path, bn, "A = 1\n", "A = 1\n")) == 0
    assert capsys.readouterr().out.startswith("ok")


def test_check_fails_on_an_edited_py(tmp_path, capsys):
    bn = load()
    assert bn.check(tree_with(tmp_path, bn, "A = 2\n", "A = 1\n")) == 1
    assert "STALE" in capsys.readouterr().out


def test_check_fails_on_a_so_it_did_not_build(tmp_path, capsys):
    bn = load()
    assert bn.check(tree_with(tmp_path, bn, "A = 1\n", None)) == 1
    assert "UNKNOWN" in capsys.readouterr().out


def test_clean_removes_the_so_files_and_the_manifest(tmp_path):
    bn = load()
    tree = tree_with(tmp_path, bn, "A = 1\n", "A = 1\n")
    assert bn.clean(tree) == 0
    assert bn.built(tree) == [] and (tree / "orchestrator/x.py").exists()
    assert not (tree / "build/native/manifest.json").exists()
