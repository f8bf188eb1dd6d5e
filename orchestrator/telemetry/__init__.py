"""Telemetry: the single place Dyad's Prometheus metrics are declared, plus structured logging."""
