"""``dyad serve`` and the ways tests, the demo and benchmarks run a gateway.

- ``dyad serve [--config FILE] [--worker URL ...] [--policy NAME] [--host H] [--port P]``: the production
  entry point (fleet flags: ``orchestrator/config_cli.py``). An invalid configuration prints every bad
  field on stderr and exits with status 2.
- ``GatewayThread(config)``: a gateway on a free loopback port in a background thread, with
  ``.url`` and ``.runtime``; a context manager that stops it on exit.
- ``await serve(config)``: run a gateway inside the caller's event loop until cancelled.

uvicorn runs with uvloop and the gateway's own httptools protocol (``http_server.py``) when they are
installed (they are, via uvicorn[standard]), with uvicorn's access logging off (the gateway writes its
own access record per request).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import threading
from typing import Any

import uvicorn

from orchestrator.clock import Clock
from orchestrator.config import (
    ConfigError,
    DyadConfig,
    GatewayConfig,
    GatewayTlsConfig,
    ResilienceConfig,
    load_config,
)
from orchestrator.config_cli import add_serve_flags, flag_overrides
from orchestrator.gateway.app import create_app
from orchestrator.gateway.connection_limit import limited_protocol
from orchestrator.gateway.http_server import http_protocol
from orchestrator.gateway.runtime import GatewayRuntime
from orchestrator.gateway.shutdown import DrainingServer
from orchestrator.gateway.tls import engine_ssl_context, server_ssl_options
from orchestrator.telemetry.logging import configure_logging


def _fast_options() -> dict[str, str]:
    opts = {}
    try:
        import uvloop  # noqa: F401
        opts["loop"] = "uvloop"
    except ImportError:
        opts["loop"] = "asyncio"
    try:
        import httptools  # noqa: F401
        opts["http"] = "httptools"
    except ImportError:
        opts["http"] = "h11"
    return opts


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "warning",
                   ssl: dict[str, Any] | None = None, resilience: ResilienceConfig | None = None,
                   gateway: GatewayConfig | None = None) -> uvicorn.Config:
    """``ssl``: uvicorn's ssl_* options (``tls.server_ssl_options``). ``log_config=None``: uvicorn's loggers
    go through the root logger (``dyad serve`` configures it with ``configure_logging``). ``resilience``:
    header/body read timeouts against slow clients (``http_server.py``; with httptools)."""
    options: dict[str, Any] = _fast_options()
    if gateway is not None and gateway.data_plane == "native":  # a loop the plane's thread may schedule on
        options["loop"] = "orchestrator.gateway.native.loop:PlaneSafeLoop"
    if options["http"] == "httptools":
        # the gateway's own connection protocol (http_server.py): one write per step towards the client,
        # header/body timeouts against slow clients when ``resilience`` is given
        options["http"] = http_protocol(resilience.header_timeout_s if resilience else None,
                                        resilience.body_timeout_s if resilience else None,
                                        resilience.client_write_timeout_s if resilience else None)
    if gateway is not None and gateway.max_connections is not None:
        base = options["http"]
        if isinstance(base, str):  # uvicorn's name for its protocol class
            from uvicorn.config import HTTP_PROTOCOLS
            from uvicorn.importer import import_from_string
            base = import_from_string(HTTP_PROTOCOLS[base])
        options["http"] = limited_protocol(base, gateway.max_connections, gateway.retry_after_s)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, log_config=None,
                          lifespan="on", timeout_keep_alive=75, server_header=False, date_header=False,
                          timeout_graceful_shutdown=5, **options, **(ssl or {}))


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (no race between choosing and binding)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(config: DyadConfig, *, clock: Clock | None = None, sock: socket.socket | None = None) -> None:
    """Run a gateway in the current event loop until cancelled."""
    gw = config.gateway
    server = uvicorn.Server(uvicorn_config(create_app(config, clock=clock), gw.host, gw.port,
                                           resilience=config.resilience, gateway=gw))
    await server.serve(sockets=[sock] if sock is not None else None)


class GatewayThread:
    """A gateway in a background thread with its own event loop, on ``config.gateway.host`` and a free
    port (``port=0``, the default) or the given one. ``config.gateway.port`` is ignored so that tests
    and benchmarks never collide on the default port."""

    def __init__(self, config: DyadConfig, *, clock: Clock | None = None, port: int = 0,
                 startup_timeout_s: float = 30.0, runtime: GatewayRuntime | None = None,
                 freeze: bool = False) -> None:
        self.config = config
        self.app = create_app(config, clock=clock, runtime=runtime, freeze=freeze)
        host = config.gateway.host
        self.plane = None
        served = self.app  # what uvicorn serves (``app`` stays the gateway app: tests and callers read it)
        if config.gateway.data_plane == "native":  # the plane on host:port, the Python gateway behind it
            served, self.plane = native_front(self.app, config, host, port)
            self._sock = bind_socket("127.0.0.1", 0)
            self.plane.fallback_port = self._sock.getsockname()[1]
            server_host = "127.0.0.1"
        else:
            self._sock = bind_socket(host, port)
            server_host = host
        self.port = self._sock.getsockname()[1]
        ssl = server_ssl_options(config.gateway.tls)
        self.url = f"{'https' if ssl else 'http'}://{'[' + host + ']' if ':' in host else host}:{self.port}"
        self._server = uvicorn.Server(uvicorn_config(served, server_host, self.port, ssl=ssl,
                                                     resilience=config.resilience, gateway=config.gateway))
        self._thread = threading.Thread(target=self._run, name=f"dyad-gateway-{self.port}", daemon=True)
        self._startup_timeout_s = startup_timeout_s
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=self._server.config.get_loop_factory()) as runner:
                runner.run(self._serve())
        except BaseException as e:  # surfaced by start()
            self._error = e

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self._server.serve(sockets=[self._sock])

    @property
    def runtime(self) -> GatewayRuntime:
        return self.app.state.runtime

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the gateway's event loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> GatewayThread:
        self._thread.start()
        done = threading.Event()
        waited = 0.0
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"gateway failed to start: {self._error!r}")
            if waited > self._startup_timeout_s:
                self.stop()
                raise RuntimeError(f"gateway did not start within {self._startup_timeout_s:g} s")
            done.wait(0.01)
            waited += 0.01
        if self.plane is not None:  # (started with the app's start-up: fallback.FallbackApp._lifespan)
            self.port = self.plane.port
            host = self.config.gateway.host
            self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=15)
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the `dyad serve` subcommand ---------------------------------------------------------------------

def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML configuration file (default: built-in defaults)")
    add_serve_flags(parser)  # --worker/--prefill/--decode/--policy/--redis/--model/--host/--port (config_cli.py)
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="json", choices=["json", "text"],
                        help="json: one object per line with the request id (default); text: for a terminal")
    parser.add_argument("--tls-cert", help="PEM certificate: serve HTTPS (overrides gateway.tls.cert_file)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert (overrides gateway.tls.key_file)")
    parser.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates (mutual TLS)")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, overrides=flag_overrides(args))
    except ConfigError as e:
        print(f"dyad serve: {e}", file=sys.stderr)
        return 2
    configure_logging(json=args.log_format == "json", level=args.log_level)
    gw = config.gateway
    try:
        flags = {"cert_file": args.tls_cert, "key_file": args.tls_key, "client_ca_file": args.tls_client_ca}
        gw.tls = GatewayTlsConfig.model_validate({**gw.tls.model_dump(), **{k: v for k, v in flags.items() if v}})
        ssl = server_ssl_options(gw.tls)
        engine_ssl_context(gw.engine_tls)  # certificate problems now, not on the first https:// engine call
    except (ConfigError, ValueError) as e:
        print(f"dyad serve: {e}", file=sys.stderr)
        return 2
    problem = _files_problem(config)
    if problem:
        print(f"dyad serve: {problem}", file=sys.stderr)
        return 2
    if gw.data_plane == "native":
        from orchestrator.gateway import native
        if native.load() is None:  # (its start-up would fail the same way, after a traceback)
            print(f"dyad serve: gateway.data_plane: native needs the compiled plane, which is not built: "
                  f"run `{native.BUILD}`", file=sys.stderr)
            return 2
    # The client port is bound (Python plane) or tried (the native plane binds it itself) before anything starts:
    # a port in use is one line and exit 2, and with port 0 the line below names the port clients must use.
    try:
        listener = bind_socket(gw.host, gw.port)
    except OSError as e:
        print(f"dyad serve: cannot listen on {gw.host}:{gw.port} (gateway.host, gateway.port): "
              f"{e.strerror or e}", file=sys.stderr)
        return 2
    app = create_app(config, freeze=True)  # its start-up heap left out of garbage collection (app.freeze_heap)
    host, port = gw.host, listener.getsockname()[1]
    sockets = [listener]
    shown = str(port)
    if gw.data_plane == "native":  # the plane on host:port; the Python gateway behind it on a loopback port
        listener.close()
        app, plane = native_front(app, config, gw.host, gw.port)
        sock = bind_socket("127.0.0.1", 0)
        plane.fallback_port = sock.getsockname()[1]
        sockets, host, port = [sock], "127.0.0.1", plane.fallback_port
        if gw.port == 0:
            shown = "0 (a free port, chosen by the native plane)"
    print(f"dyad: gateway on {'https' if ssl else 'http'}://{gw.host}:{shown} ({_fleet_summary(config)}, "
          f"policy {config.router.policy})", file=sys.stderr, flush=True)
    if not config.workers and config.discovery.source == "static":
        print("dyad: no workers: requests get 503 until one is added (--worker URL, workers in a --config file, "
              "or POST /admin/workers)", file=sys.stderr, flush=True)
    # SIGTERM: stop intake, finish in-flight requests (resilience.shutdown_grace_s), exit 0 (shutdown.py)
    server = DrainingServer(uvicorn_config(app, host, port, args.log_level, ssl=ssl,
                                           resilience=config.resilience, gateway=gw),
                            lambda: getattr(getattr(app.state, "runtime", None), "shutdown", None),
                            config.resilience.shutdown_grace_s)
    server.run(sockets=sockets)
    return 0


def _files_problem(config: DyadConfig) -> str | None:
    """A file the configuration names that the gateway's start-up would fail on (with a traceback from inside
    uvicorn's lifespan), as one line naming the setting; None when they are all usable. Checked here rather
    than by ``check-config``, which may run where these files are not (a laptop checking a pod's config)."""
    p = config.planner
    if p.enabled:
        from orchestrator.planner.perf_model import PerfModel, ProfileError
        for key in ("profile", "decode_profile"):
            path = getattr(p, key)
            if path:
                try:
                    PerfModel.load(path)
                except ProfileError as e:
                    return f"planner.{key}: {e}"
    out = config.access_log.output
    if config.access_log.enabled and out not in ("stdout", "stderr", "logger"):
        try:
            open(out, "a").close()  # (the access log opens it the same way, appending)
        except OSError as e:
            return f"access_log.output: cannot open {out} for appending: {e.strerror or e}"
    return None


def _fleet_summary(config: DyadConfig) -> str:
    """The start-up line's fleet: the static workers, and where discovery finds the others."""
    out = f"{len(config.workers)} worker{'s' if len(config.workers) != 1 else ''}"
    source = config.discovery.source
    if source == "file":
        out += f" + those in {config.discovery.file.path}"
    elif source == "kubernetes":
        out += " + Kubernetes pods"
    return out


def native_front(app: Any, config: DyadConfig, host: str, port: int) -> tuple[Any, Any]:
    """``gateway.data_plane: native``: the app behind the plane (``native/fallback.py``) and the plane, which
    the app's start-up starts (its fallback port is set by the caller once the loopback socket is bound)."""
    from orchestrator.gateway.native.fallback import FallbackApp
    from orchestrator.gateway.native.plane import NativePlane

    front = FallbackApp(app)
    plane = front.plane = NativePlane(config, front, 0, host, port)
    return front, plane
