"""``dyad serve`` flags → config overrides, list-valued settings from the environment, and
``dyad check-config`` over several files. Pure: argparse and ``load_config`` only."""

from __future__ import annotations

import argparse

import pytest

from orchestrator.cli import main as dyad
from orchestrator.config import ConfigError, load_config
from orchestrator.config_cli import add_serve_flags, flag_overrides


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_serve_flags(p)
    return p.parse_args(argv)


def config_from(*argv: str, file: dict | None = None, env: dict | None = None):
    return load_config(file or {}, environ=env or {}, overrides=flag_overrides(parse(*argv)))


def test_workers_policy_redis_and_listener_from_flags():
    cfg = config_from("--worker", "http://a:8000", "--worker", "http://b:8000/", "--policy", "kv_aware",
                      "--redis", "rediss://r:6380/0", "--host", "0.0.0.0", "--port", "9000")
    assert [(w.id, w.url, w.role.value, w.engine.value, w.models) for w in cfg.workers] == [
        ("w0", "http://a:8000", "both", "vllm", []), ("w1", "http://b:8000", "both", "vllm", [])]
    assert cfg.router.policy == "kv_aware"
    assert (cfg.index.backend, cfg.index.redis_url) == ("redis", "rediss://r:6380/0")
    assert (cfg.gateway.host, cfg.gateway.port) == ("0.0.0.0", 9000)


def test_prefill_decode_with_bootstrap_port_engine_and_model():
    cfg = config_from("--prefill", "http://p0:30000", "9001", "--prefill", "http://p1:30000",
                      "--decode", "http://d0:30001", "--engine", "sglang", "--model", "llama")
    assert [(w.url, w.role.value, w.bootstrap_port, w.engine.value, w.models) for w in cfg.workers] == [
        ("http://p0:30000", "prefill", 9001, "sglang", ["llama"]),
        ("http://p1:30000", "prefill", None, "sglang", ["llama"]),
        ("http://d0:30001", "decode", None, "sglang", ["llama"])]


def test_flags_override_file_and_environment():
    file = {"workers": [{"url": "http://from-file:1"}, {"url": "http://from-file:2"}],
            "router": {"policy": "random", "seed": 7}, "gateway": {"port": 8100, "admin_token": "t"}}
    env = {"DYAD_ROUTER__POLICY": "least_load", "DYAD_GATEWAY__PORT": "8200"}
    cfg = config_from("--worker", "http://flag:1", "--policy", "power_of_two", "--port", "8300", file=file, env=env)
    assert [w.url for w in cfg.workers] == ["http://flag:1"]  # the flag list replaces the file's
    assert cfg.router.policy == "power_of_two" and cfg.router.seed == 7  # other keys of the file stay
    assert cfg.gateway.port == 8300 and cfg.gateway.admin_token == "t"
    # without flags the environment wins over the file
    cfg = config_from(file=file, env=env)
    assert cfg.router.policy == "least_load" and cfg.gateway.port == 8200 and len(cfg.workers) == 2


@pytest.mark.parametrize("argv, message", [
    (("--prefill", "http://p:1", "x"), "bootstrap port 'x' is not a number"),
    (("--prefill", "http://p:1", "1", "2"), "at most one bootstrap port"),
    (("--prefill", "http://p:1", "70000"), "out of range"),
    (("--model", "m"), "--engine and --model describe engines"),
])
def test_malformed_flags(argv, message):
    with pytest.raises(ConfigError, match=message):
        flag_overrides(parse(*argv))


@pytest.mark.parametrize("argv, message", [
    (("--worker", "a:8000"), "--worker a:8000: the URL must start with http"),
    (("--worker", "http://a:1", "--decode", "http://u:p@d:1"), "--decode http://u:p@d:1: the URL must not carry credentials"),
    (("--prefill", "ftp://p:1", "9000"), "--prefill ftp://p:1: the URL must start with http"),
    # a --redis URL the gateway could not connect with stopped its start-up with a traceback (exit 3)
    (("--worker", "http://a:1", "--redis", "localhost:6379"), "--redis: not a usable Redis URL .* redis://host:port"),
    (("--worker", "http://a:1", "--redis", "redis://h1:7000,h2:7001"), "--redis: must name one Redis node"),
])
def test_bad_flag_values_are_named_by_their_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        flag_overrides(parse(*argv))


def test_list_settings_from_the_environment_alone():
    env = {f"DYAD_WORKERS__{i}__URL": f"http://w{i}:8000" for i in range(12)}  # __10 after __9, not after __1
    env |= {"DYAD_WORKERS__1__ROLE": "decode", "DYAD_MODELS__0__NAME": "m", "DYAD_MODELS__0__ALIASES": "[a, b]",
            "DYAD_WORKERS__0__KV_EVENTS__ENDPOINT": "tcp://w0:5557", "DYAD_VLLM_VENV": "/not/config"}
    cfg = load_config(None, environ=env)
    assert [w.url for w in cfg.workers] == [f"http://w{i}:8000" for i in range(12)]
    assert cfg.workers[1].role.value == "decode" and cfg.workers[0].kv_events.endpoint == "tcp://w0:5557"
    assert cfg.models[0].aliases == ["a", "b"]
    # a whole item, or the whole list, as YAML; then an item appended after it
    cfg = load_config(None, environ={"DYAD_WORKERS": "[{url: 'http://x:1', role: prefill}]",
                                     "DYAD_WORKERS__1": "{url: 'http://y:1'}"})
    assert [(w.url, w.role.value) for w in cfg.workers] == [("http://x:1", "prefill"), ("http://y:1", "both")]


def test_env_does_not_change_the_callers_dict():
    raw = {"workers": [{"url": "http://a:1"}]}
    load_config(raw, environ={"DYAD_WORKERS__0__URL": "http://b:1"})
    assert raw == {"workers": [{"url": "http://a:1"}]}


@pytest.mark.parametrize("env, message", [
    ({"DYAD_WORKERS__2__URL": "http://a:1"},
     "DYAD_WORKERS__2__URL: index 2 of workers leaves a gap: workers has 0 item(s), set index 0 first"),
    ({"DYAD_WORKERS__ZERO__URL": "http://a:1"}, "workers: Input should be a valid list (set by DYAD_WORKERS__ZERO__URL)"),
    ({"DYAD_GATEWAY__PORT": "many"}, "gateway.port: Input should be a valid integer, unable to parse string as "
                                     "an integer (set by DYAD_GATEWAY__PORT)"),
    ({"DYAD_GATEWAY__PORT__X": "1"}, "gateway.port: Input should be a valid integer (set by DYAD_GATEWAY__PORT__X)"),
    ({"DYAD_WORKERS__0__URL": "ftp://a"}, "workers.0.url: must start with http:// or https:// (set by DYAD_WORKERS__0__URL)"),
    ({"DYAD_GATEWAY____PORT": "1"}, "DYAD_GATEWAY____PORT: empty key in the name"),
])
def test_malformed_environment_is_one_line_naming_the_variable(env, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, environ=env)
    assert message in str(info.value)
    problems = [line for line in str(info.value).splitlines() if not line.startswith("invalid configuration")]
    assert len(problems) == 1


def test_env_into_a_file_list_item_and_past_its_end():
    raw = {"workers": [{"url": "http://a:1", "role": "prefill"}]}
    cfg = load_config(raw, environ={"DYAD_WORKERS__0__ROLE": "decode", "DYAD_WORKERS__1__URL": "http://b:1"})
    assert [(w.url, w.role.value) for w in cfg.workers] == [("http://a:1", "decode"), ("http://b:1", "both")]
    with pytest.raises(ConfigError, match="DYAD_WORKERS__0__URL__X: workers.0.url is a single value"):
        load_config(raw, environ={"DYAD_WORKERS__0__URL__X": "1"})


def test_check_config_over_several_files(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("workers:\n  - url: http://a:1\nrouter:\n  policy: kv_aware\n")
    also_good = tmp_path / "also.yaml"
    also_good.write_text("")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway:\n  port: -1\n")
    assert dyad(["check-config", str(good), str(also_good)]) == 0
    out = capsys.readouterr().out
    assert f"{good}: ok: 1 worker(s), policy kv_aware" in out and f"{also_good}: ok: 0 worker(s)" in out
    assert "2 of 2 configuration(s) valid" in out
    assert dyad(["check-config", str(good), str(bad), str(tmp_path / "missing.yaml")]) == 2
    captured = capsys.readouterr()
    assert f"{good}: ok" in captured.out
    assert f"{bad}: invalid configuration" in captured.err and "gateway.port" in captured.err
    assert "missing.yaml: cannot read configuration file" in captured.err
    assert "1 of 3 configuration(s) valid" in captured.err


def test_check_config_reads_the_configuration_in_a_configmap(tmp_path, capsys):
    # deploy/kubernetes/40-gateway-config.yaml: every field of the manifest was 'Extra inputs are not permitted'
    cm = tmp_path / "cm.yaml"
    cm.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata:\n"
                  "  dyad.yaml: |\n    router: {policy: kv_aware}\n"
                  "  other.yaml: |\n    gateway: {port: -1}\n"
                  "  notes.txt: not a configuration\n")
    assert dyad(["check-config", str(cm)]) == 2
    captured = capsys.readouterr()
    assert f"{cm} (data.dyad.yaml): ok: 0 worker(s), policy kv_aware" in captured.out
    assert f"{cm} (data.other.yaml): invalid configuration" in captured.err and "gateway.port" in captured.err
    assert "1 of 2 configuration(s) valid" in captured.err and "notes.txt" not in captured.err
    assert dyad(["check-config", "deploy/kubernetes/40-gateway-config.yaml"]) == 0


def test_check_config_names_a_file_once(tmp_path, capsys):
    multi = tmp_path / "multi.yaml"
    multi.write_text("a: 1\n---\nb: 2\n")
    assert dyad(["check-config", str(multi)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{multi}: not valid YAML") and err.count(str(multi)) == 1


@pytest.mark.parametrize("argv, message", [
    (["--policy", "nope"], "argument --policy: invalid choice: 'nope'"),  # was a ConfigError traceback
    (["--workers", "0"], "argument --workers: must be at least 1, not 0"),  # was a ValueError traceback
    (["--requests", "-1"], "argument --requests: must be at least 1, not -1"),
    (["--concurrency", "x"], "argument --concurrency: not an integer: 'x'"),
])
def test_dyad_demo_refuses_bad_flags_with_a_usage_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        dyad(["demo", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["sim-engine", "--model", "m", "--port", "-5"], "argument --port: must be 0-65535, not -5"),  # OverflowError
    (["sim-engine", "--model", "m", "--port", "0", "--kv-events-port", "70000"], "must be 0-65535, not 70000"),
])
def test_cli_port_flags_are_refused_with_a_usage_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        dyad(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_dyad_profile_names_an_output_it_cannot_write(tmp_path, capsys):
    # a write that fails after the sweep (the command line's own check, below, catches the usual cases first)
    # ended in a FileNotFoundError traceback
    from orchestrator.planner import profile_cli
    out = tmp_path / "no" / "dir" / "profile.json"
    parser = argparse.ArgumentParser()
    profile_cli.configure(parser)
    assert profile_cli.run(parser.parse_args(["--sim", "cpu-tiny", "--out", str(out)])) == 2
    assert capsys.readouterr().err.strip() == f"dyad profile: cannot write {out}: No such file or directory"


@pytest.mark.parametrize("argv", [
    ["sim", "--trace", "t.jsonl", "--aggregated", "2", "--json", "{d}/x.json"],
    ["plan", "--trace", "t.jsonl", "--budget", "4", "--plot", "{d}/x.png"],
    ["bench", "--url", "http://e:1", "--model", "m", "--trace", "t", "--format", "azure", "--json", "{d}/x.json"],
    ["profile", "--sim", "gpu-like", "--out", "{d}/x.json"],
])
def test_an_output_file_that_cannot_be_written_is_named_before_the_work(argv, tmp_path, capsys):
    # it was a FileNotFoundError traceback once the simulation, benchmark or sweep had run
    missing = tmp_path / "no-such-dir"
    argv = [a.replace("{d}", str(missing)) for a in argv]
    assert dyad(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dyad {argv[0]}: --") and err.endswith(f": there is no directory {missing}")
    flag = next(a for a in argv if "{d}" not in a and a.startswith("--") and argv[argv.index(a) + 1].startswith(str(missing)))
    assert f"{flag} {missing}/" in err


def test_dyad_sim_says_synthetic_workloads_are_dyad_plans(capsys):
    # it answered "[Errno 2] No such file or directory: 'synthetic:daily'"
    assert dyad(["sim", "--trace", "synthetic:daily", "--aggregated", "2"]) == 2
    assert "synthetic workloads are read by dyad plan; dyad sim replays a trace file" in capsys.readouterr().err
