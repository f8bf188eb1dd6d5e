"""SGLang's prefill/decode exchange, as request bodies (pure functions, no I/O).

SGLang splits a request by *dual dispatch* (docs/engines.md §6): the router sends the same request to
the prefill and the decode server at the same time, both carrying ``bootstrap_host`` (the prefill
server's host), ``bootstrap_port`` (its bootstrap port, 8998 by default) and ``bootstrap_room``
(a random 63-bit id shared by the pair). The decode server waits for the prefill server to ship
the KV of that room, then generates; the client gets the decode server's answer. A decode server
cannot prefill by itself: if the prefill side never shows up, the decode side fails after its
bootstrap timeout.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

from adapters.sglang import BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM, INTERNAL_FIELDS

DEFAULT_BOOTSTRAP_PORT = 8998
ROOM_BITS = 63

_rng = random.SystemRandom()


def new_room(rng: random.Random | None = None) -> int:
    """A fresh bootstrap room: uniformly random over 63 bits, so concurrent pairs never collide."""
    return (rng or _rng).getrandbits(ROOM_BITS)


def bootstrap_fields(prefill_url: str, bootstrap_port: int | None, room: int) -> dict[str, Any]:
    host = urlsplit(prefill_url).hostname or "127.0.0.1"
    return {BOOTSTRAP_HOST: host, BOOTSTRAP_PORT: bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
            BOOTSTRAP_ROOM: room}


def dual_bodies(body: dict[str, Any], prefill_url: str, bootstrap_port: int | None,
                room: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill body, decode body). The decode body is the client's request (streamed if asked);
    the prefill body is the same request, never streamed (nobody reads its tokens)."""
    fields = bootstrap_fields(prefill_url, bootstrap_port, room)
    decode = {k: v for k, v in body.items() if k not in INTERNAL_FIELDS}
    decode.update(fields)
    prefill = {k: v for k, v in body.items() if k != "stream_options" and k not in INTERNAL_FIELDS}
    prefill.update(fields)
    prefill["stream"] = False
    return prefill, decode
