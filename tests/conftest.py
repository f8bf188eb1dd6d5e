"""Shared fixtures: a thin importer of tests/fixtures modules (one module per real service)."""

from tests.fixtures.vllm import vllm_engine, vllm_engines, vllm_paths, vllm_pool  # noqa: F401
from tests.fixtures.vllm_pd import vllm_pd_engines  # noqa: F401
