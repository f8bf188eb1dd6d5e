"""The live fleet page served by the gateway at ``/ui`` (no front-end build step)."""

from orchestrator.ui.routes import ui_router

__all__ = ["ui_router"]
