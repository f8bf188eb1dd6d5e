"""Fixtures for the operations tests (real Prometheus, live gateway + simulated fleet)."""

from tests.fixtures.prometheus import prometheus_server  # noqa: F401
