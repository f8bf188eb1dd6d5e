"""Configuration: validation naming every bad field, env overrides, and the CLI exit status 2."""

from __future__ import annotations

import pytest

from orchestrator.cli import main as dyad
from orchestrator.config import ConfigError, DyadConfig, load_config


def test_empty_config_is_valid_with_defaults():
    cfg = load_config(None, environ={})
    assert isinstance(cfg, DyadConfig)
    assert cfg.gateway.max_body_bytes == 10 * 1024 * 1024 and cfg.router.policy == "round_robin"


def test_every_bad_field_is_named_in_one_message():
    raw = {
        "workers": [{"url": "localhost:8000"}, {"url": "http://ok", "engine": "tgi", "role": "chef"}],
        "router": {"policy": "fastest"},
        "gateway": {"port": 70000, "max_body_bytes": 0, "surprise": 1},
        "health": {"failure_threshold": 0},
    }
    with pytest.raises(ConfigError) as e:
        load_config(raw, environ={})
    msg = str(e.value)
    for field in ("workers.0.url", "workers.1.engine", "workers.1.role", "router.policy", "gateway.port",
                  "gateway.max_body_bytes", "gateway.surprise", "health.failure_threshold"):
        assert field in msg, field
    assert msg.startswith("invalid configuration (8 problems)")


def test_duplicate_worker_ids_and_generated_ids():
    cfg = load_config({"workers": [{"url": "http://a"}, {"url": "http://b", "id": "x"}]}, environ={})
    assert [w.id for w in cfg.workers] == ["w0", "x"]
    with pytest.raises(ConfigError, match="duplicate worker id 'x'"):
        load_config({"workers": [{"url": "http://a", "id": "x"}, {"url": "http://b", "id": "x"}]}, environ={})


def test_env_overrides_nested_and_list_items():
    env = {"DYAD_GATEWAY__PORT": "9001", "DYAD_ROUTER__POLICY": "least_load",
           "DYAD_GATEWAY__API_KEYS": "[k1, k2]", "DYAD_WORKERS__0__URL": "http://override:1",
           "OTHER": "x"}
    cfg = load_config({"workers": [{"url": "http://a"}]}, environ=env)
    assert cfg.gateway.port == 9001 and cfg.router.policy == "least_load"
    assert cfg.gateway.api_keys == ["k1", "k2"] and cfg.workers[0].url == "http://override:1"
    with pytest.raises(ConfigError, match="gateway.port"):
        load_config({}, environ={"DYAD_GATEWAY__PORT": "many"})


def test_unreadable_and_non_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top, environ={})


def test_worker_url_trailing_slash_stripped():
    cfg = load_config({"workers": [{"url": "http://a:1/"}]}, environ={})
    assert cfg.workers[0].url == "http://a:1"


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_cli_invalid_config_exits_2_listing_fields(tmp_path, capsys, command):
    path = tmp_path / "c.yaml"
    path.write_text("gateway:\n  port: -1\nrouter:\n  policy: nope\n")
    args = [command, "--config", str(path)] if command == "serve" else [command, str(path)]
    assert dyad(args) == 2
    err = capsys.readouterr().err
    assert "gateway.port" in err and "router.policy" in err


@pytest.mark.parametrize("text, field", [
    ("health:\n  interval_s: .inf\n", "health.interval_s"),
    ("gateway:\n  request_timeout_s: .nan\n", "gateway.request_timeout_s"),
    ("planner:\n  interval_s: .inf\n", "planner.interval_s"),
])
def test_no_setting_takes_an_infinite_or_nan_measure(tmp_path, text, field):
    # ``.inf`` passes ``gt=0``: a health loop that sleeps forever (no worker ever marked down), a deadline that
    # never fires. Every float setting refuses it, from the file and from the environment, naming the field.
    path = tmp_path / "dyad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{field}: Input should be a finite number"):
        load_config(path)
    section, key = field.split(".")
    with pytest.raises(ConfigError, match=rf"{field}: Input should be a finite number \(set by DYAD_"):
        load_config(None, environ={f"DYAD_{section.upper()}__{key.upper()}": ".inf"})


@pytest.mark.parametrize("raw, message", [
    ({"index": {"backend": "redis", "redis_url": "localhost:6379"}}, r"index\.redis_url: not a usable Redis URL"),
    ({"index": {"backend": "redis", "redis_url": "redis://h1:7000,h2:7001"}}, r"index\.redis_url: must name one Redis node"),
    ({"index": {"backend": "redis_cluster", "redis_url": "redis://h1:abc"}}, r"index\.redis_url: not a usable Redis URL"),
    ({"limits": {"backend": "redis", "redis_url": "h:6379"}}, r"limits\.redis_url: not a usable Redis URL"),
    ({"limits": {"backend": "redis"}, "index": {"redis_url": "h:6379"}},
     r"limits\.redis_url is unset, so the buckets use index\.redis_url: not a usable"),
    # the rate limiter talks to one node: a cluster's seed list failed the start-up, a single cluster node MOVED
    ({"limits": {"backend": "redis"}, "index": {"backend": "redis_cluster", "redis_url": "redis://h1:7000,h2:7001"}},
     r"limits\.redis_url: limits\.backend: redis keeps its buckets on one Redis node"),
])
def test_redis_urls_the_gateway_could_not_connect_with_are_refused(raw, message):
    # these passed validation, then stopped `dyad serve` at start-up with a traceback (exit 3)
    with pytest.raises(ConfigError, match=message):
        load_config(raw, environ={})


@pytest.mark.parametrize("raw", [
    {"index": {"backend": "redis", "redis_url": "rediss://r:6380/0?ssl_ca_certs=/etc/ca.pem"}},
    {"index": {"backend": "redis", "redis_url": "unix:///run/redis.sock"}},
    {"index": {"backend": "redis_cluster", "redis_url": "redis://h1:7000,h2:7001"},
     "limits": {"backend": "redis", "redis_url": "redis://r:6379"}},
    {"index": {"backend": "memory", "redis_url": "unused"}, "limits": {"backend": "memory", "redis_url": "unused"}},
])
def test_usable_redis_urls_pass(raw):
    load_config(raw, environ={})


@pytest.mark.parametrize("endpoint", ["tcp://*", "http://h:5557", "tcp://h:99999", "tcp://:5557", "h:5557"])
def test_a_kv_events_endpoint_the_subscriber_cannot_connect_to_is_refused(endpoint):
    # it passed, and the subscriber's connect then failed inside a background task: no KV events, no word why
    for key in ("endpoint", "replay_endpoint"):
        kv = {"endpoint": "tcp://*:5557", key: endpoint}
        with pytest.raises(ConfigError, match=rf"workers\.0\.kv_events\.{key}: must be tcp://HOST:PORT"):
            load_config({"workers": [{"url": "http://e:1", "kv_events": kv}]}, environ={})


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://10.0.0.5:5557", "tcp://[fd00::1]:5557", "ipc:///run/kv"])
def test_kv_events_endpoints_as_engines_publish_them_pass(endpoint):
    load_config({"workers": [{"url": "http://e:1", "kv_events": {"endpoint": endpoint, "replay_endpoint": endpoint}}]},
                environ={})


@pytest.mark.parametrize("raw, field", [
    ({"planner": {"prometheus_url": "localhost:9090"}}, "planner.prometheus_url"),
    ({"planner": {"kubernetes_api": "kubernetes.default.svc"}}, "planner.kubernetes_api"),
    ({"discovery": {"kubernetes": {"api": {"api_url": "127.0.0.1:8001"}}}}, "discovery.kubernetes.api.api_url"),
])
def test_a_server_url_without_http_is_refused(raw, field):
    # it passed, and every call of the planner or the pod watch then failed in the background ('unsupported protocol')
    with pytest.raises(ConfigError, match=rf"{field}: must be an http:// or https:// URL with a host"):
        load_config(raw, environ={})
    load_config({"planner": {"prometheus_url": "http://prometheus:9090", "kubernetes_api": "https://10.0.0.1:6443"},
                 "discovery": {"kubernetes": {"api": {"api_url": "http://127.0.0.1:8001"}}}}, environ={})


def test_tier_weights_left_out_keep_their_defaults_and_unknown_tiers_are_refused():
    # {host: 0.5} replaced the whole map: a GPU hit then earned no credit, and kv_aware routed blind to the GPU cache
    cfg = load_config({"router": {"kv_aware": {"tier_weights": {"host": 0.5}}}}, environ={})
    assert cfg.router.kv_aware.tier_weights == {"device": 1.0, "host": 0.5, "disk": 0.25}
    # vLLM names the media GPU/CPU; Dyad's tiers are device/host/disk: gpu was silently ignored
    with pytest.raises(ConfigError, match=r"router\.kv_aware\.tier_weights: unknown tier gpu: the tiers are device, host, "
                                          r"disk"):
        load_config({"router": {"kv_aware": {"tier_weights": {"gpu": 1.0}}}}, environ={})
    with pytest.raises(ConfigError, match=r"tier_weights: host: a credit is >= 0"):
        load_config({"router": {"kv_aware": {"tier_weights": {"host": -1}}}}, environ={})


@pytest.mark.parametrize("models, message", [
    ([{"name": "a"}, {"name": "a", "block_size": 16}], r"models\.1\.name: 'a' is already models\.0\.name"),
    # model b's requests resolved to model a (the first match)
    ([{"name": "a", "aliases": ["b"]}, {"name": "b"}], r"models\.1\.name: 'b' is already models\.0\.aliases\.0"),
    ([{"name": "a", "aliases": ["x", "x"]}], r"models\.0\.aliases\.1: 'x' is already models\.0\.aliases\.0"),
])
def test_a_model_name_or_alias_names_one_model(models, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"models": models}, environ={})


@pytest.mark.parametrize("text", ["gateway: " + "[" * 100_000, "gateway: " + "{x: " * 2_000 + "1" + "}" * 2_000])
def test_a_configuration_nested_too_deeply_is_a_config_error_not_a_recursion_error(tmp_path, text):
    # PyYAML's constructor recurses per level: such a file ended dyad serve's start-up in a RecursionError traceback.
    path = tmp_path / "dyad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="not valid YAML: nested too deeply"):
        load_config(path)
