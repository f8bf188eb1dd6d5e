"""Who is calling: client keys for /v1/*, a separate admin token for /admin/*.

Client keys live in the configuration only as SHA-256 digests (``auth.keys``; ``dyad hash-key``
prints the digest of a key). A presented key is hashed once and compared against every stored
digest in constant time, so neither the config file nor response timing gives a key away. Each
key carries its own model allow-list, rate limits and priority class; the gateway carries the
resulting ``ClientIdentity`` through intake (rate limits, queue). The older plain
``gateway.api_keys`` list still works (keys with no limits of their own). The admin token is a
different secret on purpose: a leaked client key never opens the admin API.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

from orchestrator.config import PRIORITIES, AuthConfig, LimitsConfig
from orchestrator.errors import ApiError, Forbidden, InvalidRequest, Unauthorized

if TYPE_CHECKING:
    from orchestrator.gateway.runtime import GatewayRuntime


def bearer(request: Request) -> str | None:
    return bearer_token(request.headers.get("authorization"))


def bearer_token(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, as the text its client meant: header values
    arrive decoded as Latin-1 (HTTP's bytes), while a key is hashed (``dyad hash-key``) and compared as UTF-8 -
    so a token that is valid UTF-8 is read as UTF-8 (a key or admin token with a non-ASCII character never
    matched before); any other stays as it came."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    if not token.isascii():
        try:
            token = token.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            pass
    return token


def hash_key(key: str) -> str:
    """The digest stored in ``auth.keys[].sha256`` for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def _matches(token: str, allowed: list[str]) -> bool:
    # Compare against every key in constant time, so timing does not reveal which one nearly matched.
    found = False
    for key in allowed:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


@dataclass(frozen=True)
class ClientIdentity:
    """The caller as intake sees it. ``models`` None = every model; ``rpm``/``tpm`` None = unlimited."""

    name: str
    models: frozenset[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    priority: str = "normal"

    def check_model(self, model: str, aliases: tuple[str, ...] = ()) -> None:
        """403 naming the model when this key may not use it (an alias counts as its model)."""
        if self.models is None or model in self.models or any(a in self.models for a in aliases):
            return
        raise Forbidden(f"The API key '{self.name}' may not use model '{model}'.", param="model",
                        code="model_not_allowed")

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def priority_from(self, header_value: str | None, header_name: str) -> int:
        """The priority rank (0 = high) for this request: the header may lower the key's class, not raise it."""
        own = PRIORITIES.index(self.priority)
        if header_value is None:
            return own
        wanted = header_value.strip().lower()
        if wanted not in PRIORITIES:
            raise InvalidRequest(f"Header {header_name}: '{header_value[:32]}' is not a priority class "
                                 f"(one of {', '.join(PRIORITIES)}).", param=header_name, code="invalid_priority")
        return max(own, PRIORITIES.index(wanted))


class KeyRing:
    """Resolves ``Authorization: Bearer <key>`` to a ``ClientIdentity``.

    No hashed keys and no plain ``gateway.api_keys``: the gateway is open and every caller is
    ``anonymous`` (with the default limits).
    """

    def __init__(self, auth: AuthConfig, limits: LimitsConfig, plain_keys: list[str] | None = None) -> None:
        self._digests: list[tuple[bytes, ClientIdentity]] = []
        for k in auth.keys:
            identity = ClientIdentity(k.name, frozenset(k.models) if k.models else None,
                                      k.rpm or limits.default_rpm, k.tpm or limits.default_tpm, k.priority)
            self._digests.append((bytes.fromhex(k.sha256), identity))
        for i, key in enumerate(plain_keys or []):
            identity = ClientIdentity(f"api_keys[{i}]", None, limits.default_rpm, limits.default_tpm)
            self._digests.append((hashlib.sha256(key.encode()).digest(), identity))
        self.anonymous = ClientIdentity("anonymous", None, limits.default_rpm, limits.default_tpm)

    @property
    def open(self) -> bool:
        return not self._digests

    def identify(self, token: str) -> ClientIdentity | None:
        digest = hashlib.sha256(token.encode()).digest()
        found: ClientIdentity | None = None
        for stored, identity in self._digests:  # every entry, whatever matched: constant time
            if hmac.compare_digest(digest, stored):
                found = identity
        return found

    def authenticate(self, request: Request) -> ClientIdentity:
        if not self._digests:
            return self.anonymous
        token = bearer(request)
        if token is None:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key")
        identity = self.identify(token)
        if identity is None:
            raise Unauthorized("Invalid API key.", code="invalid_api_key")
        return identity


def check_admin(request: Request, admin_token: str | None) -> None:
    if not admin_token:
        raise ApiError("The admin API is disabled: set gateway.admin_token to enable it.", status=404,
                       type="invalid_request_error", code="admin_disabled")
    token = bearer(request)
    if token is None:
        raise Unauthorized("Missing admin token: send 'Authorization: Bearer <admin token>'.",
                           code="missing_admin_token")
    if not _matches(token, [admin_token]):
        raise Forbidden("Invalid admin token.", code="invalid_admin_token")


def admin_runtime(request: Request) -> GatewayRuntime:
    """The gateway runtime behind an admin route, once the caller has shown the admin token."""
    rt: GatewayRuntime = request.app.state.runtime
    check_admin(request, rt.config.gateway.admin_token)
    return rt
