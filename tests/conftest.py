"""Shared fixtures (a thin importer of tests/fixtures modules, one module per real service), and the
run order of the real-vLLM tier.

Real-vLLM tests (marker ``vllm``) run after every other test, grouped by the engine configuration
they need (``@pytest.mark.vllm_config("pd")``; ``default`` when unmarked) so that each configuration
starts once per session; see tests/fixtures/vllm.py. The first test of each group also pays for the
engine start (and, on a shared machine, the wait for the machine lock), so its timeout is raised by
that budget.
"""

from __future__ import annotations

import pytest

from tests.fixtures.vllm import (
    LOCK_WAIT_S,
    START_TIMEOUT_S,
    engine_start_summary,
    vllm_engine,  # noqa: F401
    vllm_engines,  # noqa: F401
    vllm_paths,  # noqa: F401
    vllm_pool,  # noqa: F401
    vllm_run_order,
)
from tests.fixtures.vllm_pd import vllm_pd_engines  # noqa: F401


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--data-plane", choices=["python", "native"], default="python",
                     help="What carries the bytes of every GatewayThread these tests start (gateway.data_plane): "
                          "`make test` runs the request-path suites once more with 'native' (needs the module "
                          "that scripts/build_dataplane.sh builds)")


def _use_native_plane() -> None:
    """``--data-plane native``: every ``GatewayThread`` of this test session runs the native plane in front (unless
    its config serves TLS to clients, which the plane does not), fixtures of every scope included. Patched once
    for the whole session, before any fixture builds a gateway."""
    import os

    from orchestrator.gateway import native, serve

    if native.load() is None:
        message = f"--data-plane native: the native data plane is not built: run `{native.BUILD}`"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise pytest.UsageError(message)
        pytest.exit(message + " (nothing run)", returncode=0)
    original = serve.GatewayThread.__init__

    def native_init(self, config, *args, **kwargs):  # type: ignore[no-untyped-def]
        if config.gateway.tls.cert_file is None:
            config.gateway.data_plane = "native"
        original(self, config, *args, **kwargs)

    serve.GatewayThread.__init__ = native_init  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--data-plane") == "native":
        _use_native_plane()
    config.addinivalue_line(
        "markers",
        "vllm_config(name): the real-vLLM engine configuration the test needs (tests/fixtures/vllm.py "
        "ENGINE_SETS: default, small-kv, both, pd); tests are grouped by it",
    )


def vllm_config_of(item: pytest.Item) -> str | None:
    """The engine configuration a real-vLLM test needs; ``None`` for other tests. A test that uses
    the engine pool (directly or through another fixture) is a real-vLLM test even if unmarked."""
    marker = item.get_closest_marker("vllm_config")
    if marker is not None:
        return marker.args[0]
    uses_pool = "vllm_pool" in getattr(item, "fixturenames", ())
    return "default" if uses_pool or item.get_closest_marker("vllm") else None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: every test that needs engines is a vllm test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    others, real = [], []
    for item in items:
        key = vllm_config_of(item)
        if key is None:
            others.append(item)
            continue
        if item.get_closest_marker("vllm") is None:
            item.add_marker(pytest.mark.vllm)
        real.append((key, item))
    order = vllm_run_order([(key, item.name) for key, item in real])
    ordered = [real[i] for i in order]
    previous = None
    for key, item in ordered:
        if key != previous:  # this test starts the configuration's engines
            marker = item.get_closest_marker("timeout")
            base = float(marker.args[0]) if marker is not None and marker.args else float(config.getini("timeout") or 0)
            if base > 0:  # 0: no timeout at all
                item.add_marker(pytest.mark.timeout(base + START_TIMEOUT_S + LOCK_WAIT_S), append=False)
            previous = key
    items[:] = others + [item for _, item in ordered]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lines = engine_start_summary()
    if lines:
        terminalreporter.section("real vLLM engine starts")
        for line in lines:
            terminalreporter.write_line(line)
