"""``dyad hash-key``: the SHA-256 digest to put in ``auth.keys[].sha256`` for a client key.

    dyad hash-key --generate --name team-a     # a fresh random key, its digest, and a config entry
    printf %s "$KEY" | dyad hash-key --name team-a   # digest of an existing key, read from stdin

The key is read from stdin (not argv) so it stays out of shell history and ``ps``; on a terminal it is asked for,
not echoed.
"""

from __future__ import annotations

import argparse
import secrets
import sys

from orchestrator.gateway.auth import hash_key


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--generate", action="store_true", help="make a new random key (printed once)")
    parser.add_argument("--name", default="client", help="name for the printed config entry")


def run(args: argparse.Namespace) -> int:
    if args.generate:
        key = "dyad-" + secrets.token_urlsafe(32)
        print(f"key (give it to the client; it is not stored anywhere): {key}", file=sys.stderr)
    elif sys.stdin.isatty():  # a terminal: ask (not echoed), rather than wait silently for an end of file
        import getpass
        try:
            key = getpass.getpass("key (not echoed): ").strip()
        except (EOFError, KeyboardInterrupt):
            key = ""
    else:
        key = sys.stdin.read().strip()
        if not key:
            print("dyad hash-key: no key on stdin (or use --generate)", file=sys.stderr)
            return 2
    digest = hash_key(key)
    if args.generate:
        print(key)
    print(digest)
    print(f"# auth:\n#   keys:\n#     - {{name: {args.name}, sha256: {digest}}}", file=sys.stderr)
    return 0
