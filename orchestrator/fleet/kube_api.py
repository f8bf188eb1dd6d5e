"""A small Kubernetes API client: get, list, merge-patch and watch, over the gateway's httpx.

Dyad needs only a handful of calls (pods by label selector, a pod's annotations, a workload's
``scale`` subresource), so it speaks the REST API directly instead of pulling in a client library.
In a pod it uses the service account (``KUBERNETES_SERVICE_HOST``, the mounted token, re-read as it
rotates, and CA); ``api_url``/``token`` point it elsewhere (``kubectl proxy``, the tests' fake server).
"""

from __future__ import annotations

import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import httpx

from orchestrator.config import SA_DIR, KubernetesApiConfig
from orchestrator.deadline import within

TOKEN_REREAD_S = 60.0  # projected service-account tokens rotate; re-read the file this often


class KubeApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"kubernetes API {status}: {message}")
        self.status = status


class Gone(KubeApiError):
    """410: the resourceVersion asked for is older than the server keeps (re-list)."""


def in_cluster_url(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return "https://kubernetes.default.svc"
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def pod_namespace(configured: str | None) -> str:
    """The configured namespace, else this pod's own (mounted with the service account), else default."""
    if configured:
        return configured
    try:
        return Path(f"{SA_DIR}/namespace").read_text().strip() or "default"
    except OSError:
        return "default"


class KubeApi:
    def __init__(self, base_url: str, *, token: str | None = None, token_file: str | None = None,
                 ca_file: str | None = None, timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.deadline_s = 3 * timeout_s  # a whole answer (``get``, ``merge_patch``)
        self._token = token
        self._token_file = token_file if token is None else None
        self._token_read_at = -1e18
        verify: bool | ssl.SSLContext = True
        if ca_file and Path(ca_file).exists():
            verify = ssl.create_default_context(cafile=ca_file)
        self.http = httpx.AsyncClient(base_url=self.base_url, verify=verify, trust_env=False, transport=transport,
                                      timeout=httpx.Timeout(timeout_s))

    @classmethod
    def from_config(cls, cfg: KubernetesApiConfig) -> KubeApi:
        return cls(cfg.api_url or in_cluster_url(), token=cfg.token, token_file=cfg.token_file, ca_file=cfg.ca_file)

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        if self._token_file and time.monotonic() - self._token_read_at > TOKEN_REREAD_S:
            try:
                self._token = Path(self._token_file).read_text().strip() or None
            except OSError:
                pass  # the file is away (a remount): the last token, not none (a minute of 401s)
            self._token_read_at = time.monotonic()
        h = {"Accept": "application/json"}
        if self._token:
            h["Authorization"] = f"Bearer {self._token}"
        if content_type:
            h["Content-Type"] = content_type
        return h

    def _raise(self, r: httpx.Response, body: bytes | None = None) -> None:
        if r.status_code < 400:
            return
        if r.status_code == 401:
            # the token was refused (rotated early, revoked): the next call reads the file again rather
            # than sending the same token for up to TOKEN_REREAD_S
            self._token_read_at = -1e18
        text = (body if body is not None else r.content).decode(errors="replace")
        try:
            message = json.loads(text).get("message") or text
        except (ValueError, AttributeError):
            message = text
        raise (Gone if r.status_code == 410 else KubeApiError)(r.status_code, message[:300])

    async def _answer(self, method: str, path: str, call: Awaitable[httpx.Response]) -> dict[str, Any]:
        """The JSON of one call's answer, within ``deadline_s`` in all (httpx's timeout bounds each read,
        not the answer; a list of a big namespace may take several reads): the actuator and the discovery
        list wait on these. A timeout names the call (asyncio's and httpx's have no message: the planner
        showed 'ReadTimeout: ' and nothing else)."""
        what = f"kubernetes API {method} {path}"

        async def send() -> dict[str, Any]:
            try:
                r = await call
            except httpx.TimeoutException as e:
                raise TimeoutError(f"{what} did not answer within {self.timeout_s:g} s ({type(e).__name__})") from e
            self._raise(r)
            return r.json()

        return await within(self.deadline_s, send(), what)

    async def get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._answer("GET", path, self.http.get(path, params=params, headers=self._headers()))

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._answer("PATCH", path, self.http.patch(
            path, content=json.dumps(body).encode(), headers=self._headers("application/merge-patch+json")))

    async def watch(self, path: str, params: dict[str, Any], timeout_s: float) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request (``{"type": ..., "object": ...}``), until the server ends it.
        An ``ERROR`` event with code 410 raises ``Gone``; other errors raise ``KubeApiError``."""
        params = {**params, "watch": "true", "timeoutSeconds": int(timeout_s)}
        # the read timeout outlives the server's own timeout (and the bookmarks in between)
        timeout = httpx.Timeout(10.0, read=timeout_s + 30.0)
        async with self.http.stream("GET", path, params=params, headers=self._headers(), timeout=timeout) as r:
            if r.status_code >= 400:
                self._raise(r, await r.aread())
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    code = int(status.get("code") or 500)
                    raise (Gone if code == 410 else KubeApiError)(code, str(status.get("message", "")))
                yield event

    async def aclose(self) -> None:
        await self.http.aclose()
