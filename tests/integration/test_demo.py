"""``dyad demo`` as a user runs it: a real subprocess, a real gateway over simulated engines.

The fleet is simulated (profile cpu-tiny) because that is what the demo is: one command, no external
services. The same serving instance is then driven by ``dyad bench`` (a Mooncake slice), whose hit
ratio comes from the simulated engines' own counters.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.bench.trace_paths import find_trace

ROOT = Path(__file__).resolve().parents[2]
DYAD = [sys.executable, "-m", "orchestrator.cli"]
MOONCAKE = find_trace("mooncake_synthetic_trace.jsonl")  # None when the public traces are absent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_demo_requests_prints_summary_and_exits_0() -> None:
    p = subprocess.run([*DYAD, "demo", "--port", "0", "--workers", "2", "--requests", "50"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "curl http://127.0.0.1:" in out
    assert re.search(r"^worker\s+requests\s+prompt tokens\s+cache hit", out, re.M), out
    rows = re.findall(r"^(sim-\d)\s+(\d+)\s+(\d+)\s+([\d.]+)%", out, re.M)
    assert len(rows) == 2, out
    assert sum(int(r[1]) for r in rows) == 50  # every request reached an engine, counted engine-side
    assert "errors 0 of 50" in out
    m = re.search(r"TTFT p50 ([\d.]+) ms, p99 ([\d.]+) ms", out)
    assert m and 0 < float(m.group(1)) <= float(m.group(2))
    # 4 shared system prompts over 50 requests: the engines must have served most prompt tokens from cache
    hit = float(re.search(r"prefix-cache hit ([\d.]+)%", out).group(1))
    assert hit > 50.0, out


@pytest.fixture
def demo_server():
    proc = subprocess.Popen([*DYAD, "demo", "--port", "0", "--workers", "2"], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    url = engines = None
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and (url is None or engines is None):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"gateway (http://127\.0\.0\.1:\d+)", line):
                url = m.group(1)
            if line.startswith("engines:"):
                engines = line.split(":", 1)[1].strip()
        assert url and engines, "".join(lines)
        yield proc, url, engines, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_demo_serves_chat_streamed_and_not_then_stops_on_ctrl_c(demo_server, tmp_path: Path) -> None:
    proc, url, engines, lines = demo_server
    body = {"model": "dyad-demo", "messages": [{"role": "user", "content": "Hello there!"}], "max_tokens": 8}
    with httpx.Client(trust_env=False, timeout=30) as c:
        r = c.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["choices"][0]["message"]["content"]
        assert data["usage"]["completion_tokens"] == 8
        with c.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}) as s:
            assert s.status_code == 200
            events = [ln[5:].strip() for ln in s.iter_lines() if ln.startswith("data:")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                       if json.loads(e).get("choices"))
        assert len(text.split()) == 8

    if MOONCAKE is not None:  # dyad bench against the running demo, real counters from the engines
        out = tmp_path / "bench.json"
        b = subprocess.run([*DYAD, "bench", "--url", url, "--model", "dyad-demo", "--trace", str(MOONCAKE),
                            "--format", "mooncake", "--window", "446.7:449.5", "--limit", "12", "--scale-len", "0.0625", "--max-output", "4",
                            "--concurrency", "4", "--engines", engines, "--json", str(out), "--quiet"],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
        assert b.returncode == 0, b.stdout + b.stderr
        summary = json.loads(out.read_text())["summary"]
        assert summary["ok"] == 12 and summary["errors"] == 0
        # a slice whose requests share prefix blocks (ideal hit ratio ~36%); counters come from the engines
        assert summary["cache"]["prefix_queries"] >= sum(r["input_len"] for r in json.loads(out.read_text())["requests"])
        assert summary["cache"]["hit_ratio"] is not None
        assert "engine prefix cache" in b.stdout

    proc.send_signal(signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a hung stop: fail with every thread's stack (dyad's SIGUSR1 handler)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=10)
        pytest.fail("dyad demo did not stop within 30 s of Ctrl-C; its output and thread stacks:\n"
                    + "".join(lines) + rest)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "stopping" in rest
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2, trust_env=False)
