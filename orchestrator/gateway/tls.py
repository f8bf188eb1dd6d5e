"""TLS on both sides of the gateway.

- Clients → gateway: uvicorn serves HTTPS from ``gateway.tls`` (certificate + key), and with
  ``client_ca_file`` asks for client certificates signed by that CA (mutual TLS; required unless
  ``require_client_cert: false``).
- Gateway → engines: ``https://`` workers are reached through httpx's own transport (the lean
  transport handles plain HTTP only) with an SSL context from ``gateway.engine_tls``: the CA that
  signed the engines' certificates, and a client certificate for engines that require one (vLLM:
  ``--ssl-ca-certs ... --ssl-cert-reqs 2``). Bearer keys towards engines are per worker
  (``workers[].api_key``).

Certificate problems surface at startup (a missing or unreadable file is a clear error naming the
setting), not on the first request.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from orchestrator.config import ConfigError, EngineTlsConfig, GatewayTlsConfig


def _readable(path: str, setting: str) -> str:
    p = Path(path).expanduser()
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{setting}: cannot read {p}: {e.strerror}") from None
    return str(p)


def server_ssl_options(tls: GatewayTlsConfig) -> dict[str, Any]:
    """uvicorn ``Config`` keyword arguments for ``gateway.tls`` (empty when TLS is off)."""
    if not tls.enabled:
        return {}
    assert tls.cert_file is not None and tls.key_file is not None
    opts: dict[str, Any] = {"ssl_certfile": _readable(tls.cert_file, "gateway.tls.cert_file"),
                            "ssl_keyfile": _readable(tls.key_file, "gateway.tls.key_file")}
    if tls.client_ca_file:
        opts["ssl_ca_certs"] = _readable(tls.client_ca_file, "gateway.tls.client_ca_file")
        opts["ssl_cert_reqs"] = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL
    # Loaded once here as uvicorn will load them: a file that is readable but no PEM certificate/key (or a key
    # that does not match) is a configuration error naming the setting, not a traceback from the server's start.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(opts["ssl_certfile"], opts["ssl_keyfile"])
    except ssl.SSLError as e:
        raise ConfigError("gateway.tls.cert_file / gateway.tls.key_file: the certificate and key do not load "
                          f"(PEM certificate chain and its private key expected): {e}") from None
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(opts["ssl_ca_certs"])
        except ssl.SSLError as e:
            raise ConfigError(f"gateway.tls.client_ca_file: no PEM CA certificates in it: {e}") from None
    return opts


def engine_ssl_context(tls: EngineTlsConfig) -> ssl.SSLContext:
    """The client-side SSL context for ``https://`` workers."""
    ca = _readable(tls.ca_file, "gateway.engine_tls.ca_file") if tls.ca_file else None
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except ssl.SSLError as e:
        raise ConfigError(f"gateway.engine_tls.ca_file: no PEM CA certificates in it: {e}") from None
    if not tls.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.cert_file and tls.key_file:
        try:
            ctx.load_cert_chain(_readable(tls.cert_file, "gateway.engine_tls.cert_file"),
                                _readable(tls.key_file, "gateway.engine_tls.key_file"))
        except ssl.SSLError as e:
            raise ConfigError(f"gateway.engine_tls: the client certificate and key do not load: {e}") from None
    return ctx
