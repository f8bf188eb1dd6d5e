"""README.md stays true: its generated reference matches the code, and what it points to exists.

The first test is the one CI relies on: ``scripts/gen_reference.py --check`` against the committed
README. The others check the generator itself (so a broken generator cannot make the check pass
vacuously) and the hand-written parts that can be checked mechanically: example configs validate,
linked files exist, every ``dyad`` subcommand the README runs is a real one.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from orchestrator.cli import COMMANDS
from orchestrator.config import DyadConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator()


@pytest.fixture(scope="module")
def fresh() -> dict[str, str]:
    return {name: build() for name, build in gen.BLOCKS.items()}


def test_readme_reference_is_current(capsys):
    status = gen.main(["--check"])
    diff = capsys.readouterr().out
    assert status == 0, f"README.md is stale; run `.venv/bin/python scripts/gen_reference.py`\n{diff[:4000]}"


def test_check_reports_a_stale_block_with_a_diff(tmp_path, capsys):
    stale = README.read_text().replace("[`gateway`](#gateway)", "[`gateway-renamed`](#gateway)", 1)
    assert stale != README.read_text()
    path = tmp_path / "README.md"
    path.write_text(stale)
    assert gen.main(["--check", "--readme", str(path)]) == 1
    out = capsys.readouterr().out
    assert "-| [`gateway-renamed`]" in out and "+| [`gateway`]" in out
    assert path.read_text() == stale  # --check never writes
    assert gen.main(["--readme", str(path)]) == 0
    assert path.read_text() == README.read_text()


def test_missing_or_misordered_markers_are_an_error(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(README.read_text().replace("<!-- END GENERATED: metrics -->", ""))
    assert gen.main(["--check", "--readme", str(path)]) == 2
    with pytest.raises(gen.MarkerError):
        gen.splice("<!-- END GENERATED: x -->\n<!-- BEGIN GENERATED: x -->\n", "x", "body\n")


def test_splice_keeps_hand_written_text():
    text = "intro\n<!-- BEGIN GENERATED: cli -->\nold\n<!-- END GENERATED: cli -->\noutro\n"
    assert gen.splice(text, "cli", "new\n") == \
        "intro\n<!-- BEGIN GENERATED: cli -->\nnew\n<!-- END GENERATED: cli -->\noutro\n"


def test_config_reference_lists_every_key_with_its_default(fresh):
    block = fresh["config"]
    for name, field in DyadConfig.model_fields.items():
        model, is_list = gen.nested_model(field.annotation)
        for path, section in gen.walk_sections(model, f"{name}[]" if is_list else name):
            table = block.split(f"#### `{path}`\n", 1)[1].split("\n#### ", 1)[0]
            for key in section.model_fields:
                assert f"| `{key}` |" in table, f"{path}.{key} missing from the reference"
    assert "| `port` | integer (≥ 0, ≤ 65535) | `8000` |" in block
    assert "| `url` | string | **required** |" in block
    assert "| `policy` | one of `round_robin`, `least_load`" in block
    assert "section [`router.kv_aware`](#routerkv_aware)" in block
    assert "DYAD_WORKERS__0__URL=" in block


def test_cli_reference_covers_every_command_and_flag(fresh):
    block = fresh["cli"]
    for name in COMMANDS:
        assert f"#### `dyad {name}`" in block
        parser = gen.command_parser(name)
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"{option}" in block.split(f"#### `dyad {name}`", 1)[1].split("#### ", 1)[0]
    assert "| `--port PORT` | gateway port (0 = any free port) | `8000` |" in block  # dyad demo


def test_metrics_reference_lists_every_registered_family(fresh):
    from orchestrator.telemetry.metrics import DyadMetrics

    block = fresh["metrics"]
    families = list(DyadMetrics().registry.collect())
    assert families
    for fam in families:
        exposed = f"{fam.name}_total" if fam.type == "counter" else (
            f"{fam.name}_bucket" if fam.type == "histogram" else fam.name)
        assert f"| `{exposed}`" in block, fam.name
    assert "(unknown)" not in block
    assert "| `dyad_requests_total` | counter | `model`, `endpoint`, `status` |" in block


def test_example_configs_validate():
    configs = sorted((ROOT / "examples").glob("*.yaml"))
    assert {p.name for p in configs} >= {"aggregated.yaml", "pd-1p2d.yaml"}
    for path in configs:
        cfg = load_config(path, environ={})
        assert cfg.workers or cfg.discovery.source != "static", path
        if cfg.discovery.source == "file":  # the workers file it names ships too, and parses
            from orchestrator.fleet.discovery.file import parse_workers_file
            assert parse_workers_file((ROOT / cfg.discovery.file.path).read_text()), path
    pd = load_config(ROOT / "examples" / "pd-1p2d.yaml", environ={})
    assert sorted(w.role.value for w in pd.workers) == ["decode", "decode", "prefill"]


def test_readme_links_and_commands_point_at_real_things():
    text = README.read_text()
    for target in re.findall(r"\]\(((?:docs|examples)/[^)#]+)\)", text):
        assert (ROOT / target).exists(), f"README links to missing {target}"
    for sub in re.findall(r"\.venv/bin/dyad ([a-z-]+)", text):
        assert sub in COMMANDS, f"README runs unknown subcommand dyad {sub}"
    for script in re.findall(r"\.venv/bin/python ((?:examples|scripts)/\S+\.py)", text):
        assert (ROOT / script).exists(), script
    setup = [line for line in text.splitlines() if re.match(r"\s*(\$ )?(make|bash|\./|python|pip|uv|dyad|pytest)", line)]
    assert setup[:2] == ["make demo", "make test"], "README's first set-up commands must be make demo / make test"


def test_module_paths_in_the_architecture_sketches_exist():
    for doc in (README, ROOT / "docs" / "architecture.md"):
        paths = set(re.findall(r"\b((?:orchestrator|adapters|scripts|tests)/[\w/]+\.py)\b", doc.read_text()))
        assert len(paths) > 10, doc
        missing = sorted(p for p in paths if not (ROOT / p).exists())
        assert not missing, f"{doc.name} names modules that do not exist: {missing}"
