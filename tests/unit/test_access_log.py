"""The access log's lines: fields, JSON and key=value formats, sampling, destinations, never raising."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import shlex

import pytest

from orchestrator.config import AccessLogConfig, ConfigError, load_config
from orchestrator.telemetry.access_log import AccessLog, AccessRecord, format_kv, record_fields, sampled

TS = 1_767_268_800.123  # 2026-01-01T12:00:00.123Z


def _record(**kw):
    base = dict(request_id="req-1", model="tiny", endpoint="chat", stream=True,
                workers=[("p0", "prefill"), ("d1", "decode")], attempts=2, status=200, prompt_tokens=812,
                cached_tokens=768, generated_tokens=64, ttft_s=0.0412345678, itl_mean_s=0.0121, total_s=0.8164,
                client_key_id="team-a", trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
    base.update(kw)
    return AccessRecord(**base)


def test_json_line_has_every_field_in_order_and_workers_with_roles():
    buf = io.StringIO()
    AccessLog(True, stream=buf, clock=lambda: TS).emit(_record())
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert list(d) == ["ts", "request_id", "model", "endpoint", "stream", "workers", "attempts", "status",
                       "error_class", "prompt_tokens", "cached_tokens", "generated_tokens", "ttft_s",
                       "itl_mean_s", "total_s", "client_key_id", "trace_id"]
    assert d["ts"] == "2026-01-01T12:00:00.123Z"
    assert d["workers"] == [{"id": "p0", "role": "prefill"}, {"id": "d1", "role": "decode"}]
    assert d["ttft_s"] == 0.041235 and d["attempts"] == 2 and d["stream"] is True
    assert d["error_class"] is None and d["client_key_id"] == "team-a"


def test_every_record_field_is_in_the_line():
    names = [f.name for f in dataclasses.fields(AccessRecord)]
    assert list(record_fields(_record(), TS)) == ["ts", *names]


def test_kv_line_parses_back_with_shell_quoting_rules():
    rec = _record(error_class='engine said "no" = bad', model=None, workers=[])
    line = AccessLog(True, format="kv", clock=lambda: TS).line(rec)
    pairs = dict(tok.split("=", 1) for tok in shlex.split(line))
    assert pairs["error_class"] == 'engine said "no" = bad'
    assert pairs["model"] == "-" and pairs["workers"] == "-" and pairs["stream"] == "true"
    assert pairs["ttft_s"] == "0.041235" and pairs["status"] == "200"
    assert format_kv(record_fields(_record(), TS)).split()[5] == "workers=p0:prefill,d1:decode"


def test_sampling_is_deterministic_by_request_id_and_close_to_the_rate():
    ids = [f"req-{i}" for i in range(20_000)]
    kept = [i for i in ids if sampled(i, 0.1)]
    assert 0.09 < len(kept) / len(ids) < 0.11
    assert kept == [i for i in ids if sampled(i, 0.1)]  # same decision every time
    assert all(sampled(i, 1.0) for i in ids[:100]) and not any(sampled(i, 0.0) for i in ids[:100])
    # a larger rate keeps a superset (one threshold on one hash)
    assert set(kept) <= {i for i in ids if sampled(i, 0.3)}


def test_errors_are_logged_whatever_the_rate_unless_turned_off():
    buf = io.StringIO()
    log = AccessLog(True, sample_rate=0.0, stream=buf)
    log.emit(_record(status=200))
    log.emit(_record(request_id="r-429", status=429, error_class="rate_limited"))
    log.emit(_record(request_id="r-499", status=499, error_class="client_gone"))
    assert [json.loads(x)["request_id"] for x in buf.getvalue().splitlines()] == ["r-429", "r-499"]
    quiet = AccessLog(True, sample_rate=0.0, always_log_errors=False, stream=io.StringIO())
    quiet.emit(_record(status=503, error_class="no_healthy_worker"))
    assert quiet.written == 0


def test_disabled_log_writes_nothing_and_emit_never_raises():
    buf = io.StringIO()
    AccessLog(False, stream=buf).emit(_record())
    assert buf.getvalue() == ""

    class Broken(io.StringIO):
        def write(self, s):
            raise OSError("disk full")

    AccessLog(True, stream=Broken()).emit(_record())  # swallowed


def test_logger_output_goes_through_the_dyad_access_logger(caplog):
    log = AccessLog.from_config(AccessLogConfig(enabled=True, output="logger", format="kv"))
    with caplog.at_level(logging.INFO, logger="dyad.access"):
        log.emit(_record())
    [rec] = [r for r in caplog.records if r.name == "dyad.access"]
    assert rec.getMessage().startswith("ts=") and "request_id=req-1" in rec.getMessage()
    assert rec.access["workers"] == [{"id": "p0", "role": "prefill"}, {"id": "d1", "role": "decode"}]


def test_file_output_appends_lines(tmp_path):
    path = tmp_path / "access.log"
    for _ in range(2):
        log = AccessLog.from_config(AccessLogConfig(enabled=True, output=str(path)))
        log.emit(_record())
        log.close()
    assert len(path.read_text().splitlines()) == 2


def test_config_section_defaults_and_validation():
    cfg = load_config({}, environ={})
    assert cfg.access_log.enabled is False and cfg.access_log.format == "json"
    assert AccessLog.from_config(cfg.access_log).enabled is False
    cfg = load_config({}, environ={"DYAD_ACCESS_LOG__ENABLED": "true", "DYAD_ACCESS_LOG__FORMAT": "kv",
                                   "DYAD_ACCESS_LOG__SAMPLE_RATE": "0.25"})
    assert (cfg.access_log.enabled, cfg.access_log.format, cfg.access_log.sample_rate) == (True, "kv", 0.25)
    with pytest.raises(ConfigError, match="access_log.format"):
        load_config({"access_log": {"format": "xml"}}, environ={})
    with pytest.raises(ConfigError, match="access_log.sample_rate"):
        load_config({"access_log": {"sample_rate": 1.5}}, environ={})
