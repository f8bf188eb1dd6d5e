"""The live fleet page served by the gateway at ``/ui`` (no front-end build step)."""

from typing import Any

from orchestrator.ui.history import History
from orchestrator.ui.history import start_history as _start_history
from orchestrator.ui.routes import ui_router

__all__ = ["start_history", "ui_router"]


def start_history(runtime: Any) -> History:
    """Start the page's history sampler on a started gateway runtime (``ui:`` in the config)."""
    ui = runtime.config.ui
    return _start_history(runtime, ui.history_interval_s, ui.history_span_s, ui.history_window_s)
