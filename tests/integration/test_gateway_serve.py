"""`dyad serve` as a real process: it starts from a config file, answers, and stops on SIGTERM; `dyad serve` and
`dyad sim-engine` on a port that is taken say so in one line."""

from __future__ import annotations

import os
import signal

import httpx

from tests.fixtures.dyad_process import dyad_serve


def test_dyad_serve_process_answers_and_stops(tmp_path):
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text("models:\n  - name: m\nworkers:\n  - url: http://127.0.0.1:1\n    models: [m]\n"
                   "health:\n  interval_s: 0.2\n  timeout_s: 0.2\n")
    gw = dyad_serve("--config", str(cfg), ready_path="/health")  # /ready stays 503: its worker is down
    try:
        gw.start()
        url = gw.url
        r = httpx.get(url + "/health", timeout=10)
        assert r.json() == {"status": "ok"}
        r = httpx.get(url + "/ready")
        assert r.status_code == 503 and r.json()["models"] == {"m": {"healthy_workers": 0, "usable_workers": 0}}
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        code = gw.stop()
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a clean shutdown
    assert "gateway on http://127.0.0.1:" in gw.log_text()


FREEZE_PROBE = """
import gc, sys
from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
config = load_config({"models": [{"name": "m"}], "workers": [{"url": "http://127.0.0.1:1", "models": ["m"]}]},
                     environ={})
before = gc.get_freeze_count()
with GatewayThread(config, freeze=sys.argv[1] == "1") as gw:
    import httpx
    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
    print(before, gc.get_freeze_count())
"""


def test_a_serving_gateway_freezes_its_start_up_heap():
    """``dyad serve`` (``create_app(freeze=True)``) moves what start-up built out of the collector's reach
    (its full collections took ~70 ms each over that heap); an in-process gateway (tests) does not."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    counts = {}
    for flag in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", FREEZE_PROBE, flag], cwd=root, capture_output=True, text=True,
                             timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr[-2000:]
        counts[flag] = tuple(int(x) for x in out.stdout.split())
    assert counts["1"][0] == 0 and counts["1"][1] > 50_000  # the runtime, the app and every module: frozen
    assert counts["0"] == (0, 0)


GARBAGE_PROBE = """
import asyncio, gc, subprocess, sys
from orchestrator.bench.loadgen import RawConnection, encode_request
from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.ports import free_port, wait_ready
CLIENT = '''
import asyncio, json, sys
from orchestrator.bench.loadgen import RawConnection, encode_request
async def main(url, n, body, fresh):
    host, port, raw = encode_request(url, body)
    conn = RawConnection(host, port)
    for _ in range(n):
        t = await conn.send(raw)
        assert t.status == 200, t.body[:200]
        if fresh:
            await conn.close()
    await conn.close()
asyncio.run(main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "fresh"))
'''
port = free_port()
engine = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sim-engine", "--port", str(port), "--model", "m",
                           "--profile", "zero"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    assert wait_ready(f"http://127.0.0.1:{port}/health", engine)
    config = load_config({"models": [{"name": "m"}], "workers": [{"url": f"http://127.0.0.1:{port}", "engine": "sim",
                          "models": ["m"]}], "gateway": {"host": "127.0.0.1"},
                          "health": {"interval_s": 0.1}, "scrape": {"interval_s": 0.1}}, environ={})
    completions = ("completions", {"prompt": "a b c"})
    chat = ("chat/completions", {"messages": [{"role": "user", "content": "a b c"}]})
    with GatewayThread(config) as gw:
        for (endpoint, body), stream, connection in ((completions, False, "kept"), (completions, True, "kept"),
                                                     (chat, False, "kept"), (chat, True, "kept"),
                                                     (completions, False, "fresh")):
                counts = []
                for n in (10, 90):
                    req = {"model": "m", "max_tokens": 4, "stream": stream, **body}
                    gc.collect()
                    gc.set_debug(gc.DEBUG_SAVEALL)
                    subprocess.run([sys.executable, "-c", CLIENT, f"{gw.url}/v1/{endpoint}", str(n), __import__("json").dumps(req),
                                    connection], check=True)
                    gc.collect()
                    gc.set_debug(0)
                    counts.append(len(gc.garbage))
                    gc.garbage.clear()
                print(endpoint, stream, connection, *counts)
finally:
    engine.terminate()
"""


def test_a_request_leaves_no_garbage_only_the_collector_can_free():
    """Every object a request makes is freed when the request ends (reference counts), not left in reference
    cycles for the collector: cyclic garbage per request would make gen-0 collections run every hundred
    requests or so and keep each request's memory until then. Measured as the collector's finds
    (``gc.DEBUG_SAVEALL``) after 10 and after 90 requests of each kind: the difference may not grow with them.
    Covered with them: a connection per request (the connection's own objects), and the background calls
    the gateway makes meanwhile (health checks and scrapes every 0.1 s: each httpx answer is bound to its
    stream, a cycle ``EngineClient`` undoes). Today the collector finds nothing at all in either run."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", GARBAGE_PROBE], cwd=root, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    assert len(rows) == 5, out.stdout
    for endpoint, stream, connection, few, many in rows:
        assert int(many) - int(few) < 40, \
            f"{endpoint} stream={stream} {connection} connection: {few} -> {many} cyclic objects for 80 more requests"


def test_dyad_serve_on_port_0_names_the_port_it_took(tmp_path):
    """``gateway.port: 0`` (any free port): the start-up line said ``http://127.0.0.1:0``, so nobody could find the
    gateway. It names the bound port now, and the gateway answers there; discovery's workers are named too."""
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    workers = tmp_path / "workers.json"
    workers.write_text("[]")
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text(f"discovery:\n  source: file\n  file:\n    path: {workers}\n")
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(cfg), "--port", "0"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=root, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60  # a liveness bound, not a timing assertion
        port = None
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"gateway on http://127\.0\.0\.1:(\d+) \(0 workers \+ those in (\S+),", log.read_text())
            if m:
                port = int(m.group(1))
                assert m.group(2) == str(workers)
            else:
                time.sleep(0.1)
        assert port, log.read_text()[-2000:]
        answer = None
        while answer is None and time.monotonic() < deadline:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.1)
        assert answer is not None and answer.json() == {"status": "ok"}, log.read_text()[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_dyad_serve_on_a_port_in_use_says_so_and_exits_2():
    """A taken port printed 'gateway on http://...:PORT' and then uvicorn's bind error, exit 3 (the native plane:
    a traceback). The port is bound (or tried, for the native plane) before anything starts: one line, exit 2."""
    import socket
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        for plane in ("python", "native"):
            out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--worker", "http://127.0.0.1:1",
                                  "--port", str(port)], cwd=root, capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "DYAD_GATEWAY__DATA_PLANE": plane}, stdin=subprocess.DEVNULL)
            assert out.returncode == 2, (plane, out.stderr[-2000:])
            assert out.stderr.strip() == (f"dyad serve: cannot listen on 127.0.0.1:{port} (gateway.host, gateway.port): "
                                          "Address already in use"), plane


def test_dyad_sim_engine_on_a_port_in_use_says_so_and_exits_2():
    """``dyad sim-engine`` on a taken HTTP or KV-event port printed a traceback; now one line naming the address."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import zmq
    root = Path(__file__).resolve().parents[2]
    ctx = zmq.Context.instance()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        pub = ctx.socket(zmq.PUB)
        kv_port = pub.bind_to_random_port("tcp://127.0.0.1")
        try:
            for argv, line in [
                (["--port", str(port)], f"dyad sim-engine: cannot listen on 127.0.0.1:{port}: Address already in use"),
                (["--port", "0", "--kv-events-port", str(kv_port)],
                 f"dyad sim-engine: cannot bind the KV-event sockets: Address already in use "
                 f"(addr='tcp://127.0.0.1:{kv_port}')"),
            ]:
                out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sim-engine", "--model", "m", *argv],
                                     cwd=root, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
                assert out.returncode == 2, out.stderr[-2000:]
                assert out.stderr.strip().splitlines()[-1] == line
                assert "Traceback" not in out.stderr
        finally:
            pub.close(linger=0)


def test_dyad_serve_native_without_the_built_plane_says_how_to_build_it():
    """``gateway.data_plane: native`` before ``scripts/build_dataplane.sh`` (a fresh clone): the start-up failed with
    the right message, then uvicorn's traceback, exit 3. Now one line naming the script, exit 2, nothing started."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    # the module as a fresh clone has it: not built (an import of it fails)
    probe = ("import sys; sys.modules['orchestrator.gateway.native.dyad_dataplane'] = None; "
             "from orchestrator.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", probe, "serve", "--worker", "http://127.0.0.1:1", "--port", "0"],
                         cwd=root, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                         env={**os.environ, "DYAD_GATEWAY__DATA_PLANE": "native"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == ("dyad serve: gateway.data_plane: native needs the compiled plane, which is not "
                                  "built: run `bash scripts/build_dataplane.sh`")


def test_dyad_serve_names_a_file_its_start_up_would_fail_on(tmp_path):
    """A planner profile that is missing or not a profile, or an access log in a directory that does not exist, passed
    validation and failed the start-up inside uvicorn's lifespan: a traceback, exit 3. Now one line, exit 2."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "bad.json").write_text('{"x": 1}')
    for text, line in [
        (f"planner: {{enabled: true, profile: {tmp_path}/nope.json}}\n",
         f"planner.profile: cannot read profile {tmp_path}/nope.json: No such file or directory"),
        (f"planner: {{enabled: true, decode_profile: {tmp_path}/bad.json}}\n", "planner.decode_profile: profile."),
        (f"access_log: {{enabled: true, output: {tmp_path}/no/dir/access.log}}\n",
         f"access_log.output: cannot open {tmp_path}/no/dir/access.log for appending: No such file or directory"),
    ]:
        cfg = tmp_path / "dyad.yaml"
        cfg.write_text(text)
        out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "-c", str(cfg), "--port", "0"],
                             cwd=root, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.startswith(f"dyad serve: {line}") and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_dyad_serve_without_workers_says_how_to_add_one(tmp_path):
    """``dyad serve`` with nothing to route to served 503s with no word why; the start-up says it now."""
    import subprocess
    import sys
    import time
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYAD_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=root, stdin=subprocess.DEVNULL)
    hint = "dyad: no workers: requests get 503 until one is added (--worker URL"
    try:
        deadline = time.monotonic() + 60  # a liveness bound, not a timing assertion
        while hint not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert hint in log.read_text(), log.read_text()[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_dyad_serve_names_the_workers_its_start_up_probe_left_out(tmp_path):
    """Engines that are down at start: the gateway answered 503 and logged nothing (a worker that starts out of
    rotation changes no state, so no health transition line ever named it). Now one warning names them and why."""
    import subprocess
    import sys
    import time
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text("models: [{name: m}]\nworkers: [{id: gone, url: 'http://127.0.0.1:1', models: [m]}]\n")
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYAD_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "-c", str(cfg), "--port", "0"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root, stdin=subprocess.DEVNULL)
    said = "not in rotation after the start-up health probe: gone (http://127.0.0.1:1): "
    try:
        deadline = time.monotonic() + 60  # a liveness bound, not a timing assertion
        while said not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert said in log.read_text(), log.read_text()[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
