#!/usr/bin/env python3
"""Compile the gateway's hot-path modules with Cython, in place, for an experiment (issue 13).

Pure-Python mode: the ``.py`` files are compiled as they are (no ``.pyx``, no type declarations added);
each becomes an extension module (``name.cpython-311-x86_64-linux-gnu.so``) beside its ``.py``. This is
not part of the package's build: nothing in pyproject.toml runs it, and no ``.so`` or ``.c`` is committed.

    .venv/bin/pip install cython
    .venv/bin/python scripts/build_native.py --tree DIR [--no-annotation-typing] [--exclude a.py,b.py | --only ...]
    .venv/bin/python scripts/build_native.py --tree DIR --check    # list compiled modules and stale ones
    .venv/bin/python scripts/build_native.py --tree DIR --clean    # remove the .so files again

Python's import system tries extension modules before source files, so a ``.so`` shadows its ``.py``:
after an edit of the ``.py`` the old compiled code still runs. ``--check`` compares each ``.so`` with
the SHA-256 of the ``.py`` it was built from (``build/native/manifest.json`` under the tree) and exits
1 if any is stale or unaccounted for. Build a throwaway copy of the tree (``git archive HEAD | tar -x
-C DIR``), not the checkout you edit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

# What scripts/profile_gateway.py (non-streamed, round_robin) shows with own time per request, plus the
# modules a request passes through on its way (failover, streaming, limits).
HOT = [
    "orchestrator/gateway/http_server.py",
    "orchestrator/gateway/fastpath.py",
    "orchestrator/gateway/proxy.py",
    "orchestrator/gateway/attempt.py",
    "orchestrator/gateway/transport.py",
    "orchestrator/gateway/request.py",
    "orchestrator/gateway/openai_routes.py",
    "orchestrator/gateway/admission.py",
    "orchestrator/gateway/annotate.py",
    "orchestrator/gateway/executor.py",
    "orchestrator/gateway/failover.py",
    "orchestrator/gateway/stream_protocol.py",
    "orchestrator/gateway/stream_timing.py",
    "orchestrator/gateway/lazy_deadline.py",
    "orchestrator/gateway/limits.py",
    "orchestrator/gateway/connection_limit.py",
    "orchestrator/gateway/shutdown.py",
    "orchestrator/gateway/resilience.py",
    "orchestrator/gateway/classify.py",
    "orchestrator/router/router.py",
    "orchestrator/router/inflight.py",
    "orchestrator/router/estimate.py",
    "orchestrator/router/pd_selection.py",
    "orchestrator/router/policies/round_robin.py",
    "orchestrator/telemetry/children.py",
    "orchestrator/telemetry/logging.py",
    "orchestrator/telemetry/tracing.py",
]
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")  # e.g. .cpython-311-x86_64-linux-gnu.so
DIRECTIVES = {"language_level": 3, "binding": True}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def module_name(rel: str) -> str:
    return rel.removesuffix(".py").replace("/", ".")


def built(tree: Path) -> list[Path]:
    """Every extension module under the tree's packages (whether this script built it or not)."""
    return sorted(p for pkg in ("orchestrator", "adapters") for p in (tree / pkg).rglob(f"*{SUFFIX}"))


def check(tree: Path) -> int:
    manifest_path = tree / "build/native/manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    bad = 0
    for so in built(tree):
        rel = str(so.relative_to(tree)).removesuffix(SUFFIX) + ".py"
        src = tree / rel
        if rel not in manifest:
            print(f"UNKNOWN {so.relative_to(tree)} (not in {manifest_path.relative_to(tree)})")
            bad += 1
        elif not src.exists() or sha256(src) != manifest[rel]:
            print(f"STALE   {so.relative_to(tree)} (its {rel} changed since the build: rebuild or --clean)")
            bad += 1
        else:
            print(f"ok      {so.relative_to(tree)}")
    return 1 if bad else 0


def clean(tree: Path) -> int:
    for so in built(tree):
        so.unlink()
        print(f"removed {so.relative_to(tree)}")
    (tree / "build/native/manifest.json").unlink(missing_ok=True)
    return 0


def build(tree: Path, modules: list[str], jobs: int, annotation_typing: bool) -> int:
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    os.chdir(tree)  # module names and in-place outputs are relative to the tree
    exts = [Extension(module_name(rel), [rel]) for rel in modules]
    directives = {**DIRECTIVES, "annotation_typing": annotation_typing}
    ext_modules = cythonize(exts, compiler_directives=directives, build_dir="build/native/c", nthreads=jobs,
                            quiet=True)
    dist = Distribution({"name": "dyad-native", "ext_modules": ext_modules})
    cmd = build_ext(dist)
    cmd.inplace = True
    cmd.build_temp = "build/native/tmp"
    cmd.parallel = jobs
    cmd.ensure_finalized()
    cmd.run()
    manifest = {rel: sha256(tree / rel) for rel in modules}
    (tree / "build/native").mkdir(parents=True, exist_ok=True)
    (tree / "build/native/manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"compiled {len(modules)} modules in {tree} ({directives})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", required=True,
                    help="the source tree to build in place: a throwaway copy, not the checkout you edit")
    ap.add_argument("--exclude", default="", help="comma-separated module paths to leave as Python")
    ap.add_argument("--only", default="", help="comma-separated module paths to compile instead of the default set")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--annotation-typing", action=argparse.BooleanOptionalAction, default=False,
                    help="let Cython type variables from their annotations (Cython's own default, off here: an "
                         "argument annotated float becomes a C double that refuses None, one annotated int is "
                         "converted with int(), 1.5 -> 1); off keeps Python's semantics for every annotated name")
    ap.add_argument("--check", action="store_true", help="list the tree's .so files; exit 1 if any is stale")
    ap.add_argument("--clean", action="store_true", help="remove the tree's .so files")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    if args.check:
        return check(tree)
    if args.clean:
        return clean(tree)
    modules = [m for m in args.only.split(",") if m] or HOT
    excluded = {m for m in args.exclude.split(",") if m}
    missing = [m for m in modules if not (tree / m).exists()]
    if missing:
        print(f"no such module in {tree}: {', '.join(missing)}", file=sys.stderr)
        return 2
    return build(tree, [m for m in modules if m not in excluded], args.jobs, args.annotation_typing)


if __name__ == "__main__":
    sys.exit(main())
