"""Where the public traces are, for the benchmark scripts' default ``--trace``.

An explicit ``--trace FILE`` always wins. Otherwise a trace is looked up by file name in
``DYAD_TRACES`` (a directory) when set, else in a ``traces/`` or ``shared/traces/`` directory in the
repository or any directory above it (a checkout next to the shared traces finds them). Nothing here
names a machine path.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def traces_dir() -> Path:
    """The directory the default traces are read from (see the module docstring)."""
    env = os.environ.get("DYAD_TRACES")
    if env:
        return Path(env)
    for base in (REPO, *REPO.parents):
        for candidate in (base / "traces", base / "shared" / "traces"):
            if candidate.is_dir():
                return candidate
    raise FileNotFoundError(f"no traces directory above {REPO}: pass --trace FILE or set DYAD_TRACES")


def trace_path(name: str) -> Path:
    """``name`` (e.g. ``mooncake_synthetic_trace.jsonl``) in ``traces_dir()``."""
    return traces_dir() / name


def find_trace(name: str) -> Path | None:
    """``trace_path(name)`` when that file exists, else ``None`` (for callers that can do without it)."""
    try:
        path = trace_path(name)
    except FileNotFoundError:
        return None
    return path if path.exists() else None
