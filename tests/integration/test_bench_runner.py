"""``dyad bench`` client: SSE parsing, error kinds, pacing, engine counters, summary, CLI.

The endpoint here is a small scripted OpenAI-style server on a real loopback socket (uvicorn), so the
client's HTTP/SSE handling is exercised for real, including failure shapes a healthy engine never
produces (truncated streams, in-stream errors). The end-to-end run against the simulated engine and the
gateway is in tests/integration/test_demo.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from orchestrator.bench import cli as bench_cli
from orchestrator.bench.runner import (
    BenchOptions,
    RequestResult,
    build_body,
    format_table,
    parse_engine_counters,
    percentile,
    run_bench,
    schedule,
    summarize_results,
)
from orchestrator.bench.traces import TraceRequest, load_mooncake


class ScriptedServer:
    """Streams one chunk per requested token; the prompt's first word selects a failure mode."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.queries = 0
        self.hits = 0
        self.requests = 0
        app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
            Route("/metrics", self.metrics),
        ])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "scripted server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(5)

    async def metrics(self, request: Request) -> PlainTextResponse:
        return PlainTextResponse(
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {self.queries}\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {self.hits}\n'
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} {self.requests}\n')

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        text = body.get("prompt") or body["messages"][-1]["content"]
        words = text.split()
        mode = words[0] if words else ""
        self.queries += len(words)
        self.hits += len(words) // 2
        self.requests += 1
        n = body.get("max_tokens", 4)
        if mode == "FAIL":
            return JSONResponse({"error": {"message": "engine exploded", "type": "server_error",
                                           "param": None, "code": 500}}, status_code=500)
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": "x " * n}],
                                 "usage": {"prompt_tokens": len(words), "completion_tokens": n}},
                                headers={"x-dyad-worker": "w-json"})
        chat = "messages" in body

        async def gen():
            for i in range(n):
                if mode == "TRUNC" and i == 2:
                    return
                if mode == "ERR" and i == 1:
                    yield 'data: {"error": {"message": "decode failed"}}\n\n'
                    return
                piece = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
                yield f"data: {json.dumps({'choices': [piece]})}\n\n"
                await asyncio.sleep(0.005)
            yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': len(words), 'completion_tokens': n}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"x-dyad-worker": f"w{len(words) % 2}"})


@pytest.fixture(scope="module")
def server():
    with ScriptedServer() as s:
        yield s


def _req(i: int, prompt: str, out: int = 4, arrival: float = 0.0) -> TraceRequest:
    return TraceRequest(index=i, arrival_s=arrival, input_len=len(prompt.split()), output_len=out, prompt=prompt)


async def test_streaming_records_ttft_itl_usage_and_errors(server: ScriptedServer) -> None:
    reqs = [_req(0, "hello world", 5), _req(1, "FAIL now"), _req(2, "TRUNC a b", 6), _req(3, "ERR x", 4),
            _req(4, "a b c", 3)]
    res = await run_bench(reqs, BenchOptions(url=server.url + "/v1", model="m", concurrency=2, engines=[server.url]))
    r = {x.index: x for x in res.results}
    assert r[0].ok and r[0].output_tokens == 5 and len(r[0].itl_s) == 4
    assert 0 < r[0].ttft_s <= r[0].e2e_s and r[0].worker == "w0"
    assert not r[1].ok and r[1].status == 500 and "engine exploded" in r[1].error
    assert not r[2].ok and r[2].error.startswith("truncated stream")
    assert not r[3].ok and "decode failed" in r[3].error
    assert r[4].ok and r[4].output_tokens == 3
    s = res.summary
    assert (s["ok"], s["errors"]) == (2, 3)
    # engine counters: delta over the run, 11 words queried, 3 hit (integer halves)
    assert s["cache"]["prefix_queries"] == 2 + 2 + 3 + 2 + 3
    assert s["cache"]["hit_ratio"] == pytest.approx((1 + 1 + 1 + 1 + 1) / 12)
    assert s["engines"][0]["requests"] == 5
    body = server.bodies[-1]
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    text = format_table(s)
    assert "TTFT" in text and "errors 3" in text and "engine prefix cache" in text


async def test_chat_and_non_streaming(server: ScriptedServer) -> None:
    chat = TraceRequest(index=0, arrival_s=0, input_len=2, output_len=3,
                        messages=({"role": "user", "content": "hi there"},))
    res = await run_bench([chat], BenchOptions(url=server.url, model="m"))
    assert res.results[0].ok and res.results[0].output_tokens == 3
    assert server.bodies[-1]["messages"] == [{"role": "user", "content": "hi there"}]
    res = await run_bench([_req(0, "p q", 7)], BenchOptions(url=server.url, model="m", stream=False, api="completions"))
    r = res.results[0]
    assert r.ok and r.output_tokens == 7 and r.ttft_s == r.e2e_s and r.worker == "w-json"


async def test_unreachable_endpoint_is_an_error_not_a_crash() -> None:
    res = await run_bench([_req(0, "x")], BenchOptions(url="http://127.0.0.1:9", model="m", timeout_s=2))
    assert res.summary["errors"] == 1 and "Connect" in res.results[0].error


async def test_open_loop_sends_on_schedule_not_before(server: ScriptedServer) -> None:
    reqs = [_req(i, "a b", 2, arrival=10 + i * 0.1) for i in range(4)]
    opts = BenchOptions(url=server.url, model="m", speed=2.0)
    assert schedule(reqs, opts) == pytest.approx([0, 0.05, 0.1, 0.15])
    res = await run_bench(reqs, opts)
    assert all(r.sent_s >= r.scheduled_s - 1e-3 for r in res.results)
    assert schedule(reqs, BenchOptions(url="", model="m", rate=4.0)) == [0, 0.25, 0.5, 0.75]


def test_build_body_picks_endpoint() -> None:
    path, body = build_body(_req(0, "a b", 9), "m", "auto")
    assert path == "/v1/completions" and body["prompt"] == "a b" and body["max_tokens"] == 9
    path, body = build_body(_req(0, "a b"), "m", "chat", stream=False, ignore_eos=False)
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "a b"}]
    assert "stream_options" not in body and "ignore_eos" not in body


def test_summary_goodput_and_percentiles() -> None:
    def rr(i: int, ttft: float, e2e: float, n: int, ok: bool = True) -> RequestResult:
        return RequestResult(index=i, scheduled_s=0, sent_s=0, input_len=1, max_tokens=n, ok=ok, ttft_s=ttft,
                             e2e_s=e2e, output_tokens=n)

    results = [rr(0, 0.1, 1.1, 11), rr(1, 0.5, 0.6, 2), rr(2, 0.1, 5.1, 11), rr(3, 0.1, 0.2, 2, ok=False)]
    s = summarize_results(results, 2.0, slo_ttft_s=0.2, slo_itl_s=0.2)
    # r0: ttft ok, tpot 0.1 -> met; r1: ttft too slow; r2: tpot 0.5 too slow; r3 failed
    assert s["slo"]["met"] == 1 and s["slo"]["goodput_rps"] == 0.5
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) is None
    assert s["ttft_s"]["p50"] == pytest.approx(0.1)


def test_parse_engine_counters_sums_series() -> None:
    text = ('vllm:prefix_cache_queries_total{engine="0"} 10\nvllm:prefix_cache_queries_total{engine="1"} 5\n'
            'vllm:prefix_cache_hits_total{engine="0"} 3\n')
    c = parse_engine_counters("u", text)
    assert (c.prefix_queries, c.prefix_hits, c.prompt_tokens) == (15, 3, None)


def test_cli_end_to_end(server: ScriptedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "mc.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i * 10, "input_length": 700, "output_length": 40,
                                           "hash_ids": [0, i + 1]}) for i in range(5)))
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    parser = __import__("argparse").ArgumentParser()
    bench_cli.configure(parser)
    args = parser.parse_args(["--url", server.url, "--model", "m", "--trace", str(trace), "--format", "mooncake",
                              "--scale-len", "0.125", "--limit", "4", "--speed", "10", "--engines", server.url,
                              "--json", str(out), "--plot", str(png), "--quiet"])
    assert bench_cli.run(args) == 0
    printed = capsys.readouterr().out
    assert "requests 4  ok 4" in printed
    data = json.loads(out.read_text())
    assert len(data["requests"]) == 4 and data["summary"]["ok"] == 4
    # lengths scaled: 64-word block + 188/512*64 ≈ 24 words; output 40/8 = 5 tokens
    assert data["requests"][0]["input_len"] == 64 + 24 and data["requests"][0]["max_tokens"] == 5
    assert png.stat().st_size > 10_000
    expected = load_mooncake(trace, scale_len=0.125)[0].render_prompt()
    assert any(b.get("prompt") == expected for b in server.bodies)


def test_cli_rejects_missing_trace(tmp_path: Path) -> None:
    parser = __import__("argparse").ArgumentParser()
    bench_cli.configure(parser)
    args = parser.parse_args(["--url", "http://x", "--model", "m", "--trace", str(tmp_path / "no"), "--format", "azure"])
    assert bench_cli.run(args) == 2


async def test_loadgen_raw_client_reads_json_and_chunked_streams(server: ScriptedServer) -> None:
    from orchestrator.bench.loadgen import RawConnection, encode_request

    host, port, raw = encode_request(server.url + "/v1/completions",
                                     {"model": "m", "prompt": "a b", "max_tokens": 3, "stream": False})
    conn = RawConnection(host, port)
    t = await conn.send(raw)
    assert t.status == 200 and json.loads(t.body)["usage"]["completion_tokens"] == 3
    t2 = await conn.send(raw)  # same keep-alive connection
    assert t2.status == 200
    _, _, sraw = encode_request(server.url + "/v1/completions",
                                {"model": "m", "prompt": "a b", "max_tokens": 4, "stream": True})
    t3 = await conn.send(sraw)
    assert t3.status == 200 and t3.body.count(b"data:") == 6 and t3.body.rstrip().endswith(b"[DONE]")
    assert 0 < t3.first_byte_s < t3.total_s  # chunks were spaced 5 ms apart
    _, _, bad = encode_request(server.url + "/v1/completions", {"model": "m", "prompt": "FAIL", "stream": False})
    assert (await conn.send(bad)).status == 500
    await conn.close()
