"""The shared Prometheus fixture really starts Prometheus, scrapes targets and answers PromQL."""

import pytest

pytestmark = pytest.mark.prometheus


def test_scrapes_a_target_set_after_start(prometheus_server):
    prom = prometheus_server
    prom.set_targets([(f"{prom.url}/metrics", {"job": "self"})])
    up = prom.wait_for('up{job="self"} == 1')
    assert up[0]["metric"]["instance"] == f"127.0.0.1:{prom.port}"
    # A real PromQL evaluation over scraped data, not an echo of what we wrote.
    prom.wait_for('prometheus_build_info{job="self"}')
    assert prom.query_value("vector(2) * 21") == 42.0
    prom.set_targets([])
    prom.wait_until(lambda: not prom.active_targets(), what="targets removed")


def test_bad_promql_is_reported(prometheus_server):
    with pytest.raises(ValueError, match="bad_data"):
        prometheus_server.query("sum(")
