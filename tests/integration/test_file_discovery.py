"""The file discovery source in a real gateway: workers added to the file get health-checked and
serve, removed ones are drained (their streams finish) and then leave, a role edit applies in place,
a broken file keeps the last good list, and the static ``workers`` list is left alone. Engines are
the project's simulator (``SimEngineThread``) standing in for vLLM."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread

pytestmark = [pytest.mark.timeout(120)]

MODEL = "sim"


def until(pred, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def write(path, workers) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(workers))
    tmp.replace(path)  # atomic, as an operator's tooling should write it


async def stream(url: str, max_tokens: int = 8) -> tuple[str | None, bool]:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        lines = [line async for line in r.aiter_lines()]
        return r.headers.get("x-dyad-worker"), r.status_code == 200 and "data: [DONE]" in lines


def test_file_source_adds_drains_removes_and_switches_roles(tmp_path):
    engines = [SimEngineThread(model=MODEL, profile="gpu-like", seed=i, kv_events=False).start() for i in range(3)]
    path = tmp_path / "workers.json"
    write(path, [{"id": "f1", "url": engines[1].url, "engine": "sim", "models": [MODEL]}])
    gw = None
    try:
        gw = GatewayThread(load_config({
            "models": [{"name": MODEL}],
            "workers": [{"id": "static", "url": engines[0].url, "engine": "sim", "models": [MODEL]}],
            "discovery": {"source": "file", "file": {"path": str(path), "interval_s": 0.1}},
            "router": {"policy": "round_robin", "debug_headers": True},
            "health": {"interval_s": 0.2},
        }, environ={})).start()
        fleet = gw.runtime.fleet
        until(lambda: fleet.get("f1") is not None and fleet.get("f1").state.value == "healthy", what="f1 healthy")
        # a worker added to the file is probed and takes traffic
        write(path, [{"id": "f1", "url": engines[1].url, "engine": "sim", "models": [MODEL]},
                     {"id": "f2", "url": engines[2].url, "engine": "sim", "models": [MODEL]}])
        until(lambda: fleet.get("f2") is not None and fleet.get("f2").state.value == "healthy", what="f2 healthy")
        served = {asyncio.run(stream(gw.url))[0] for _ in range(6)}
        assert served == {"static", "f1", "f2"}
        # removing f2 while it streams: no new requests, the stream finishes, then f2 leaves

        async def long_stream_on_f2():
            while True:  # round robin: start streams until one lands on f2
                task = asyncio.create_task(stream(gw.url, max_tokens=200))
                await asyncio.sleep(0.3)
                if fleet.get("f2").inflight > 0:
                    return task
                await task

        async def remove_while_busy():
            task = await long_stream_on_f2()
            write(path, [{"id": "f1", "url": engines[1].url, "engine": "sim", "models": [MODEL]}])
            while fleet.get("f2") is not None and fleet.get("f2").state.value != "draining":
                await asyncio.sleep(0.02)
            assert fleet.get("f2") is not None and fleet.get("f2").inflight > 0  # still finishing
            after = [await stream(gw.url) for _ in range(4)]
            worker, ok = await task
            return worker, ok, after

        worker, ok, after = asyncio.run(remove_while_busy())
        assert worker == "f2" and ok
        assert all(ok2 for _, ok2 in after) and "f2" not in {w for w, _ in after}
        until(lambda: fleet.get("f2") is None, what="f2 removed once idle")
        # a role edit applies in place; a broken file changes nothing
        write(path, [{"id": "f1", "url": engines[1].url, "engine": "sim", "models": [MODEL], "role": "decode"}])
        until(lambda: fleet.get("f1").role.value == "decode", what="the role edit")
        path.write_text("- {url: 'ftp://nope'}\n")
        time.sleep(0.5)
        assert fleet.get("f1") is not None and fleet.get("static") is not None
        assert "workers.0.url" in gw.runtime.discovery.status()["last_error"]
        # emptying the file withdraws every file worker and never the static one
        write(path, [])
        until(lambda: fleet.get("f1") is None, what="f1 withdrawn")
        assert [w.id for w in fleet.workers()] == ["static"]
        sample = gw.runtime.metrics.registry.get_sample_value
        assert sample("dyad_discovery_changes_total", {"source": "file", "change": "add"}) == 2
        assert sample("dyad_discovery_changes_total", {"source": "file", "change": "remove"}) == 2
        assert sample("dyad_discovery_errors_total", {"source": "file"}) == 1
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
