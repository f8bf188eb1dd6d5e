"""The annotate-and-decide core runs without the HTTP server.

The modules that turn a request into a decision — the router, its policies and P/D pair selection,
the in-flight ledger, the prefix tracker and index, and the gateway's ``annotate`` — must stay
callable from anything that is not the gateway's HTTP server: the virtual-time simulator today, and
next (docs/roadmap.md) an Envoy endpoint picker and multi-tenant routing. This scans their imports
(the AST, at any depth, following Dyad's own modules; imports under ``if TYPE_CHECKING:`` do not run
and are skipped) and checks that no HTTP server framework and none of the gateway's server modules is
reached. HTTP *clients* are allowed: annotation may ask an engine to tokenize.
"""

from __future__ import annotations

import ast
from pathlib import Path

import orchestrator
from tests.fixtures.source import parse_source

REPO = Path(orchestrator.__file__).resolve().parent.parent
CORE = ["orchestrator.router.router", "orchestrator.router.pd_selection", "orchestrator.router.estimate",
        "orchestrator.kv.tracker", "orchestrator.gateway.annotate"]
CORE += sorted(f"orchestrator.router.policies.{p.stem}" for p in (REPO / "orchestrator/router/policies").glob("*.py"))
SERVER_PACKAGES = {"starlette", "fastapi", "uvicorn", "httptools"}
SERVER_MODULES = {f"orchestrator.gateway.{m}" for m in (
    "app", "http_server", "fastpath", "openai_routes", "proxy", "serve", "compose", "admission", "runtime",
    "failover", "attempt", "executor")}


def _module_path(name: str) -> Path | None:
    for p in (REPO / (name.replace(".", "/") + ".py"), REPO / name.replace(".", "/") / "__init__.py"):
        if p.exists():
            return p
    return None


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def imports_of(src: str, package: str) -> list[str]:
    """Every module ``src`` imports when it runs (at any depth; not under ``if TYPE_CHECKING:``)."""
    out: list[str] = []
    stack: list[ast.AST] = [parse_source(src)]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            stack.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[:len(parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append(module)
            out += [f"{module}.{a.name}" for a in node.names]
        stack.extend(ast.iter_child_nodes(node))
    return out


def closure(roots: list[str]) -> tuple[set[str], set[str]]:
    """(Dyad modules reached from ``roots``, third-party top-level packages they import)."""
    seen: set[str] = set()
    external: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_path(name)
        if path is None:
            continue
        seen.add(name)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for imported in imports_of(path.read_text(), package):
            top = imported.split(".")[0]
            if top in ("orchestrator", "adapters"):
                if _module_path(imported) is not None:
                    todo.append(imported)
            else:
                external.add(top)
    return seen, external


def test_the_decision_core_reaches_no_http_server():
    modules, external = closure(CORE)
    assert len(modules) > 20  # the scan follows the core into the fleet, kv and telemetry modules
    assert "orchestrator.kv.memory_index" in modules and "orchestrator.fleet.registry" in modules
    assert external & SERVER_PACKAGES == set()
    assert modules & SERVER_MODULES == set()


def test_the_scan_sees_lazy_imports_and_skips_type_checking_blocks():
    src = ("from typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    from orchestrator.gateway.runtime import GatewayRuntime\n"
           "def f():\n    import starlette.requests\n"
           "from . import sibling\n")
    found = imports_of(src, "orchestrator.router")
    assert "starlette.requests" in found and "orchestrator.router.sibling" in found
    assert "orchestrator.gateway.runtime" not in found
    modules, external = closure(["orchestrator.gateway.openai_routes"])  # the HTTP side does reach them
    assert "starlette" in external and "orchestrator.gateway.proxy" in modules
