"""Schema-driven fuzzing of the gateway's HTTP API (schemathesis, from the served /openapi.json).

Every operation in the document gets generated requests — valid ones (positive mode) and ones that
violate the schema (negative mode: wrong types, missing fields, out-of-range values) — sent over real
HTTP to a gateway in front of a simulated engine. The property: no 5xx, ever. CI runs a bounded
number of examples per operation and mode (``DYAD_FUZZ_EXAMPLES``, default 12); the longer run for
the docs sets it higher. The number of requests sent, by status, is printed.

(schemathesis's pytest plugin does not load under this pytest version, so the cases are drawn with
Hypothesis directly from ``APIOperation.as_strategy``.)
"""

from __future__ import annotations

import os
import re

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.fuzz.conftest import ADMIN

EXAMPLES = int(os.environ.get("DYAD_FUZZ_EXAMPLES", "12"))


@pytest.fixture(scope="module")
def operations(fuzz_gateway):
    schema = schemathesis.openapi.from_url(f"{fuzz_gateway.url}/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/admin/workers",
                                       "/admin/workers/{worker_id}/role", "/admin/pools", "/admin/planner",
                                       "/ui", "/ui/api/state"}
    return ops


def test_every_route_of_the_app_is_in_the_schema(fuzz_gateway):
    """A route mounted without a schema would be invisible to the fuzzer (and to clients)."""
    from starlette.routing import Route

    # ("{worker_id:path}" is "{worker_id}" in the schema: the converter is Starlette's)
    served = {(re.sub(r":\w+}", "}", r.path), m.lower()) for r in _routes(fuzz_gateway.app.router.routes)
              if isinstance(r, Route)
              and r.path not in ("/openapi.json", "/ui/") for m in r.methods or () if m != "HEAD"}
    schema = fuzz_gateway.app.openapi()["paths"]
    documented = {(path, method) for path, item in schema.items() for method in item}
    assert served - documented == set()


def _routes(routes):
    for r in routes:
        included = getattr(r, "original_router", None)  # app.include_router(...) (no prefix used here)
        if included is not None:
            yield from _routes(included.routes)
        else:
            yield r


def test_no_server_errors_from_schema_generated_requests(operations, fuzz_gateway):
    sent: dict[int, int] = {}
    failures: list[str] = []
    for op in operations:
        for mode in GenerationMode:
            try:
                _runner(op, op.as_strategy(generation_mode=mode), mode, fuzz_gateway.url, sent, failures)()
            except Unsatisfiable:  # nothing to violate (e.g. GET /health has no inputs): positive mode covers it
                assert mode is GenerationMode.NEGATIVE, op.label
    # workers the fuzzer added are removed again by the test (the gateway fixture is shared)
    rt = fuzz_gateway.runtime
    for w in rt.fleet.workers():
        if w.id != "sim":
            fuzz_gateway.call(_remove(rt, w.id))
    total = sum(sent.values())
    print(f"\nschema fuzz: {total} requests over {len(operations)} operations, by status {dict(sorted(sent.items()))}")
    assert not failures, "\n".join(failures[:10])
    assert total >= len(operations) * 2


_ADDED = [0]  # workers the fuzzer asked to add, for an address of their own each


def _runner(op, strategy, mode, url: str, sent: dict[int, int], failures: list[str]):
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    @given(data=st.data())
    def run(data):
        case = data.draw(strategy)
        headers = {}
        if op.path.startswith("/admin"):
            headers["authorization"] = f"Bearer {ADMIN}"
            if "worker_id" in (case.path_parameters or {}):
                if mode is GenerationMode.POSITIVE and op.method.upper() != "DELETE" and data.draw(st.booleans()):
                    case.path_parameters = {"worker_id": "spare"}  # reach the handler's work, not just a 404
                elif case.path_parameters["worker_id"] in ("sim", "spare"):
                    case.path_parameters = {"worker_id": "no-such-worker"}  # never remove the only serving worker
        if (mode is GenerationMode.POSITIVE and op.path.startswith("/v1/") and isinstance(case.body, dict)
                and data.draw(st.booleans())):
            case.body["model"] = data.draw(st.sampled_from(["m", "m-alias"]))  # reach the engine, not just a 404
        if op.path == "/admin/workers" and op.method.upper() == "POST" and isinstance(case.body, dict):
            # a worker that never answers (probed, stays unhealthy), at an address no other worker has: one engine
            # is one worker (a registered URL is 409 worker_url_exists), and the add itself should be reached
            _ADDED[0] += 1
            case.body["url"] = f"http://127.0.{_ADDED[0] // 250 % 250}.{_ADDED[0] % 250 + 2}:9"
        response = case.call(base_url=url, headers=headers, timeout=30)
        sent[response.status_code] = sent.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            failures.append(f"{op.method.upper()} {op.path} {mode.value} body={case.body!r:.300} -> "
                            f"{response.status_code} {response.text[:300]}")

    return run


async def _remove(rt, worker_id: str) -> None:
    rt.fleet.remove(worker_id)
