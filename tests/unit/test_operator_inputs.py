"""Operator inputs of the control plane that were accepted silently, or ended in a traceback: a
configuration file or workers file with a key written twice, a config file that is not text, worker
URLs that cannot be a base URL, one engine listed twice among the static workers, a workers file
whose ``draining`` is a string or that is a mapping without ``workers``, a workers file error that
outlived its cause, and numeric flags of ``dyad plan`` / ``dyad sim`` out of range."""

from __future__ import annotations

import json

import pytest

from orchestrator.config import ConfigError, FileDiscoveryConfig, WorkerConfig, load_config
from orchestrator.fleet.discovery.file import MAX_FILE_BYTES, FileSource, WorkersFileError, parse_workers_file

# ---------------------------------------------------------------- configuration file


def test_a_section_written_twice_is_refused_not_half_ignored(tmp_path):
    """PyYAML keeps the last of two equal keys: the first ``gateway:`` block (here the admin token)
    was dropped without a word."""
    path = tmp_path / "dyad.yaml"
    path.write_text("gateway:\n  admin_token: secret\ngateway:\n  port: 9001\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'gateway' \(first on line 1\)"):
        load_config(path)
    path.write_text("workers:\n  - url: http://10.0.0.1:8000\n    role: prefill\n    role: decode\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'role'"):
        load_config(path)


def test_yaml_merge_keys_still_override_what_they_merge(tmp_path):
    path = tmp_path / "dyad.yaml"
    path.write_text("health: &h\n  interval_s: 3.0\n  timeout_s: 1.0\n"
                    "scrape:\n  <<: *h\n  timeout_s: 0.5\n")
    cfg = load_config(path)
    assert cfg.scrape.interval_s == 3.0 and cfg.scrape.timeout_s == 0.5


def test_a_config_file_that_is_not_text_is_a_config_error(tmp_path):
    """It raised UnicodeDecodeError: a traceback from ``dyad serve`` and ``dyad check-config``."""
    path = tmp_path / "dyad.yaml"
    path.write_bytes(b"\xff\xfe\x00gateway")
    with pytest.raises(ConfigError, match="not a text file"):
        load_config(path)


@pytest.mark.parametrize("url, says", [
    ("http://user:pw@10.0.0.1:8000", "credentials"),
    ("http://10.0.0.1:8000?x=1", "query"),
    ("http://10.0.0.1:8000/v1?", "query"),
    ("http://10.0.0.1:8000#frag", "fragment"),
])
def test_a_worker_url_that_cannot_be_a_base_url_is_refused_everywhere(url, says, tmp_path):
    """The gateway appends /v1/... to a worker's URL: a query or fragment swallowed it (every request
    went to the engine's root), and credentials were shown wherever the URL is (admin API, /ui, logs,
    the id of a file worker, a metric label)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        WorkerConfig(url=url)
    with pytest.raises(ConfigError, match=r"workers\.0\.url"):
        load_config({"workers": [{"url": url}]})
    with pytest.raises(WorkersFileError, match=r"workers\.0\.url"):
        parse_workers_file(json.dumps([{"url": url}]))


def test_one_engine_twice_among_the_static_workers_is_refused():
    """The workers file and POST /admin/workers refuse one URL twice (the engine would get twice its
    share and count twice as capacity); the static list took it."""
    with pytest.raises(ConfigError, match=r"workers\.1\.url: the engine at http://Host:80 is already workers\.0"):
        load_config({"workers": [{"url": "http://host"}, {"url": "http://Host:80/"}]})
    load_config({"workers": [{"url": "http://host:8000"}, {"url": "http://host:8001"}]})


# ---------------------------------------------------------------- workers file


def test_a_workers_file_entry_with_a_key_twice_is_refused():
    with pytest.raises(WorkersFileError, match="duplicate key 'role'"):
        parse_workers_file("- url: http://10.0.0.1:8000\n  role: prefill\n  role: decode\n")


@pytest.mark.parametrize("value", ["false", "no", 0, "true", [1]])
def test_draining_must_be_a_boolean(value):
    """``bool("false")`` is True: a quoted "false" (JSON written by a script) drained the worker."""
    with pytest.raises(WorkersFileError, match=r"workers\.0\.draining: expected true or false"):
        parse_workers_file(json.dumps([{"url": "http://10.0.0.1:8000", "draining": value}]))
    assert parse_workers_file(json.dumps([{"url": "http://10.0.0.1:8000", "draining": True}])
                              )["http://10.0.0.1:8000"].draining


@pytest.mark.parametrize("text, says", [
    ("worker:\n  - url: http://10.0.0.1:8000\n", "worker: unknown key"),
    ("Workers: []\n", "Workers: unknown key"),
    ("workers: [{url: 'http://10.0.0.1:8000'}]\nversion: 2\n", "version: unknown key"),
    ("{}\n", "workers: missing"),
])
def test_a_mapping_without_workers_is_an_error_not_an_empty_list(text, says):
    """A mapping without ``workers`` read as "no workers": one typo withdrew every worker in force."""
    with pytest.raises(WorkersFileError, match=says):
        parse_workers_file(text)
    assert parse_workers_file("workers: []\n") == {}


def test_a_typo_in_the_workers_key_keeps_the_workers_in_force(tmp_path):
    path = tmp_path / "workers.yaml"
    path.write_text("workers:\n  - id: a\n    url: http://10.0.0.1:8000\n")
    src = FileSource(FileDiscoveryConfig(path=str(path), interval_s=0.1))
    assert list(src.poll() or {}) == ["a"]
    path.write_text("worker:\n  - id: a\n    url: http://10.0.0.1:8000\n")
    assert src.poll() is None and src.poll() is None  # seen twice, refused: nothing reported
    assert src.last_error is not None and "worker: unknown key" in src.last_error


def test_the_error_of_a_deleted_workers_file_ends_when_it_comes_back_unchanged(tmp_path):
    """The status kept "cannot read ..." forever once the same contents were back (a restored file, a
    remounted ConfigMap): the unchanged contents returned early, before the error was cleared."""
    path = tmp_path / "workers.yaml"
    text = "- id: a\n  url: http://10.0.0.1:8000\n"
    path.write_text(text)
    src = FileSource(FileDiscoveryConfig(path=str(path), interval_s=0.1))
    assert src.poll() is not None
    path.unlink()
    assert src.poll() is None and "cannot read" in (src.last_error or "")
    path.write_text(text)
    assert src.poll() is None  # nothing changed: nothing to report ...
    assert src.last_error is None  # ... and nothing wrong any more
    assert src.status()["last_error"] is None


def test_a_refused_file_keeps_its_error_while_it_stays(tmp_path):
    path = tmp_path / "workers.yaml"
    path.write_text("- id: a\n  url: http://10.0.0.1:8000\n")
    src = FileSource(FileDiscoveryConfig(path=str(path), interval_s=0.1))
    assert src.poll() is not None
    path.write_text("- id: a\n  url: ftp://x\n")
    src.poll()
    src.poll()
    err = src.last_error
    assert err is not None and "workers.0.url" in err
    assert src.poll() is None and src.last_error == err


def test_a_runaway_workers_file_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "workers.yaml"
    path.write_text("- id: a\n  url: http://10.0.0.1:8000\n")
    src = FileSource(FileDiscoveryConfig(path=str(path), interval_s=0.1))
    assert src.poll() is not None
    with path.open("a") as f:
        f.write("#" * (MAX_FILE_BYTES + 10) + "\n")
    assert src.poll() is None and src.poll() is None
    assert "larger than" in (src.last_error or "")


def test_check_config_names_a_workers_file_that_is_not_text(tmp_path, capsys):
    from orchestrator.config_cli import configure, run

    workers = tmp_path / "workers.yaml"
    workers.write_bytes(b"\xff\xfe\x00\x01")
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text(f"discovery:\n  source: file\n  file:\n    path: {workers}\n")
    import argparse

    p = argparse.ArgumentParser()
    configure(p)
    assert run(p.parse_args([str(cfg)])) == 2
    assert "discovery.file.path" in capsys.readouterr().err


# ---------------------------------------------------------------- dyad plan / dyad sim flags


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 64, "output_length": 8}) + "\n"
                            for i in range(4)))
    return str(path)


@pytest.mark.parametrize("cmd, flags, says", [
    ("plan", ["--interval", "-5"], "argument --interval: must be > 0"),  # was IndexError
    ("plan", ["--interval", "inf"], "argument --interval: expected a finite number"),  # was ValueError: NaN
    ("plan", ["--interval", "nan"], "argument --interval: expected a finite number"),  # message named no flag
    ("plan", ["--ttft", "0"], "argument --ttft: must be > 0"),
    ("plan", ["--speed", "-1"], "argument --speed: must be > 0"),
    ("plan", ["--budget", "100000000"], "argument --budget: must be <= 10000"),  # ran for hours
    ("plan", ["--headroom", "-0.5"], "argument --headroom: must be >= 0"),
    ("plan", ["--rise-quantile", "1"], "argument --rise-quantile: must be < 1"),
    ("plan", ["--keda-decode-target", "0"], "argument --keda-decode-target: must be > 0"),
    ("plan", ["--limit", "0"], "argument --limit: must be >= 1"),
    ("sim", ["--prefill", "100000000", "--decode", "1"], "argument --prefill: must be <= 10000"),
    ("sim", ["--aggregated", "2", "--interval", "0"], "argument --interval: must be > 0"),
])
def test_numeric_flags_out_of_range_are_refused_naming_the_flag(cmd, flags, says, trace, capsys):
    from orchestrator.cli import main

    argv = [cmd, "--trace", trace, *flags]
    if cmd == "plan" and "--budget" not in flags:
        argv += ["--budget", "4"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_a_duration_that_loops_a_trace_into_billions_of_requests_is_refused(trace, capsys):
    """``--duration 1e15`` looped a 4-request trace until memory ran out."""
    from orchestrator.cli import main

    assert main(["plan", "--trace", trace, "--budget", "4", "--duration", "1e15", "--no-static-search"]) == 2
    assert "--duration 1e+15: loops the trace" in capsys.readouterr().err
