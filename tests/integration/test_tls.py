"""TLS on both sides of the gateway, with certificates from a throwaway CA made here by the openssl CLI.

Clients → gateway: HTTPS with mutual TLS (the client must present a certificate signed by the CA).
Gateway → engine: the engine serves HTTPS and requires a client certificate; the gateway trusts the
CA from ``gateway.engine_tls`` and presents its own certificate. The engine is the project's
simulated engine served by uvicorn with the same ssl options vLLM's server exposes
(``--ssl-certfile/--ssl-keyfile/--ssl-ca-certs/--ssl-cert-reqs``); real vLLM is not started here
to keep the suite within budget.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import uvicorn

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from tests.fixtures.pki import make_pki

MODEL = "tls-model"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


class TlsSimEngine(SimEngineThread):
    """The simulated engine behind HTTPS that requires a client certificate from ``ca``."""

    def __init__(self, pki: Path, **kw) -> None:
        super().__init__(**kw)
        self.pki = pki

    @property
    def url(self) -> str:
        return f"https://{self.config.host}:{self.port}"

    def uvicorn_config(self) -> uvicorn.Config:
        return uvicorn.Config(self.app, lifespan="on", log_level="warning", access_log=False,
                              ssl_certfile=str(self.pki / "server.pem"), ssl_keyfile=str(self.pki / "server.key"),
                              ssl_ca_certs=str(self.pki / "ca.pem"), ssl_cert_reqs=ssl.CERT_REQUIRED)


@pytest.fixture(scope="module")
def engine(pki):
    with TlsSimEngine(pki, model=MODEL, profile="zero", kv_events=False) as e:
        yield e


def _config(pki: Path, engine_url: str, client_cert: bool = True) -> dict:
    engine_tls = {"ca_file": str(pki / "ca.pem")}
    if client_cert:
        engine_tls |= {"cert_file": str(pki / "client.pem"), "key_file": str(pki / "client.key")}
    return {
        "workers": [{"id": "tls-0", "url": engine_url, "engine": "sim", "models": [MODEL]}],
        "gateway": {"tls": {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key"),
                            "client_ca_file": str(pki / "ca.pem")},
                    "engine_tls": engine_tls},
        "health": {"interval_s": 0.2, "failure_threshold": 1},
    }


def _client(pki: Path, cert: bool = True, trust: bool = True) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem") if trust else None)
    if cert:
        ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    return httpx.Client(verify=ctx, timeout=10)


def test_mutual_tls_on_both_sides(pki, engine):
    with GatewayThread(load_config(_config(pki, engine.url), environ={})) as gw:
        assert gw.url.startswith("https://")
        with _client(pki) as c:
            assert c.get(gw.url + "/ready").status_code == 200  # the engine passed health checks over mTLS
            r = c.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        with _client(pki, cert=False) as c, pytest.raises(httpx.TransportError):
            c.get(gw.url + "/health")  # no client certificate: the handshake is refused
        with _client(pki, trust=False) as c, pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            c.get(gw.url + "/health")  # the gateway's certificate is not from a public CA


def test_engine_refuses_a_gateway_without_its_client_certificate(pki, engine):
    with GatewayThread(load_config(_config(pki, engine.url, client_cert=False), environ={})) as gw, _client(pki) as c:
        r = c.get(gw.url + "/ready")
        assert r.status_code == 503 and r.json()["models"][MODEL]["healthy_workers"] == 0
        r = c.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"


def test_serve_names_an_unreadable_certificate(tmp_path):
    cfg = tmp_path / "dyad.yaml"
    cfg.write_text(f"gateway:\n  tls: {{cert_file: {tmp_path}/nope.pem, key_file: {tmp_path}/nope.key}}\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "-c", str(cfg), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "gateway.tls.cert_file: cannot read" in out.stderr


@pytest.mark.parametrize("files, message", [
    # readable, but no certificate: uvicorn's start-up raised ssl.SSLError (a traceback, exit 1)
    (("not-pem", "server.key", None), "gateway.tls.cert_file / gateway.tls.key_file: the certificate and key do not load"),
    (("server.pem", "client.key", None), "gateway.tls.cert_file / gateway.tls.key_file: the certificate and key do not load"),
    (("server.pem", "server.key", "not-pem"), "gateway.tls.client_ca_file: no PEM CA certificates in it"),
    ((None, None, "not-pem"), "gateway.engine_tls.ca_file: no PEM CA certificates in it"),
])
def test_serve_names_a_certificate_that_does_not_load(pki, tmp_path, files, message):
    (tmp_path / "not-pem").write_text("not a certificate\n")
    cert, key, ca = (str(tmp_path / f) if f == "not-pem" else str(pki / f) if f else None for f in files)
    cfg = tmp_path / "dyad.yaml"
    if cert is None:  # the CA the gateway trusts for https:// engines
        cfg.write_text(f"gateway:\n  engine_tls: {{ca_file: {ca}}}\n")
    else:
        tls = {"cert_file": cert, "key_file": key, **({"client_ca_file": ca} if ca else {})}
        cfg.write_text(f"gateway:\n  tls: {tls}\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "-c", str(cfg), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith(f"dyad serve: {message}") and "Traceback" not in out.stderr
