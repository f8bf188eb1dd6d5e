"""``dyad serve`` started with flags only (no config file) serves requests through ``dyad sim-engine``
processes: two aggregated workers, and a SGLang-dialect prefill/decode pair whose bootstrap port is
given after the prefill URL. Everything is a real process on loopback; the simulator stands in for
vLLM (any number of engines on 2 cores) and for SGLang (which cannot run here)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx

from tests.fixtures.dyad_process import dyad_serve, dyad_sim_engine

MODEL = "flags-model"


@contextlib.contextmanager
def sim_engine(*extra: str) -> Iterator[str]:
    with dyad_sim_engine("--model", MODEL, "--no-kv-events", *extra) as engine:
        yield engine.url


@contextlib.contextmanager
def serve(*flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    with dyad_serve(*flags, env=env) as gw:
        yield gw.url


def _chat(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello " * 30}]})


def test_two_workers_from_flags_serve_with_the_model_learned_from_the_engines():
    with sim_engine() as a, sim_engine("--seed", "1") as b, \
            serve("--worker", a, "--worker", b, "--policy", "round_robin",
                  env={"DYAD_ROUTER__DEBUG_HEADERS": "true", "DYAD_HEALTH__INTERVAL_S": "0.2"}) as gw:
        # no --model: the gateway asked each engine's /v1/models
        models = httpx.get(f"{gw}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        # the context length, as the engines report it on their own model cards
        engine_len = httpx.get(f"{a}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        assert models["data"][0]["max_model_len"] == engine_len
        served_by = set()
        for _ in range(4):
            r = _chat(gw)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            served_by.add(r.headers["x-dyad-worker"])  # DYAD_* environment applied next to the flags
        assert served_by == {"w0", "w1"}  # --policy round_robin over both --worker engines


def test_workers_from_the_environment_alone():
    """No file, no fleet flags: the list of workers comes from DYAD_WORKERS__<i>__* variables."""
    with sim_engine() as a, sim_engine("--seed", "2") as b, \
            serve(env={"DYAD_WORKERS__0__URL": a, "DYAD_WORKERS__1__URL": b, "DYAD_WORKERS__1__ID": "second",
                       "DYAD_ROUTER__POLICY": "round_robin", "DYAD_ROUTER__DEBUG_HEADERS": "true",
                       "DYAD_HEALTH__INTERVAL_S": "0.2"}) as gw:
        served_by = {_chat(gw).headers["x-dyad-worker"] for _ in range(4)}
        assert served_by == {"w0", "second"}


def test_prefill_decode_pair_from_flags_with_an_sglang_bootstrap_port():
    # The simulated SGLang prefill serves its bootstrap rooms on its HTTP port, not SGLang's default
    # 8998: the decode side only gets the KV when the gateway passes the port given after the URL.
    with sim_engine("--dialect", "sglang", "--disaggregation-mode", "prefill") as p, \
            sim_engine("--dialect", "sglang", "--disaggregation-mode", "decode", "--bootstrap-timeout", "5") as d:
        bootstrap = p.rsplit(":", 1)[1]
        with serve("--prefill", p, bootstrap, "--decode", d, "--engine", "sglang", "--model", MODEL,
                   "--policy", "least_load") as gw:
            r = _chat(gw)
            assert r.status_code == 200, r.text
            metrics = httpx.get(f"{gw}/metrics", timeout=10).text
            assert 'dyad_pd_requests_total{mode="disaggregated"' in metrics  # prefilled on the prefill engine


def test_a_malformed_flag_or_variable_is_one_line_naming_it():
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--prefill", "http://p:1", "x"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "bootstrap port 'x' is not a number" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve"], capture_output=True, text=True,
                         timeout=30, env={**os.environ, "DYAD_WORKERS__1__URL": "http://a:1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "dyad serve: DYAD_WORKERS__1__URL: index 1 of workers leaves a gap: workers has 0 item(s), set index 0 first"]
