"""Dyad's native data plane (``native/dataplane``, the compiled module ``dyad_dataplane``).

``load()`` returns the module, or None when it is not built (``bash scripts/build_dataplane.sh`` builds it
into this directory); ``require()`` returns it or raises a RuntimeError saying how to build it. The lane
that answers its callbacks is ``lane.py``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

BUILD = "bash scripts/build_dataplane.sh"


def load() -> ModuleType | None:
    """The compiled ``dyad_dataplane`` module next to this file, or None if it is not built."""
    try:
        return importlib.import_module(f"{__name__}.dyad_dataplane")
    except ImportError:
        return None


def require() -> ModuleType:
    """The compiled module; a RuntimeError naming the build command when it is missing."""
    module = load()
    if module is None:
        raise RuntimeError(f"the native data plane (dyad_dataplane) is not built: run `{BUILD}`")
    return module
