"""Role changes without restart, with REAL vLLM ``kv_both`` engines behind the gateway.

Two NIXL ``kv_both`` engines start as decode workers (no prefill pool: each prefills its own
requests). Under steady load one of them is moved to the prefill pool — from then on requests are
split, prefilled on it and decoded on the other — and back, with zero failed requests.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from tests.fixtures.vllm import MODEL_NAME
from tests.fixtures.vllm_gateway import engines_or_fail, vllm_gateway
from tests.fixtures.vllm_pd import PdEngines
from tests.fixtures.vllm_pd import external_tokens as external

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_config("both"), pytest.mark.slow, pytest.mark.timeout(900)]

ADMIN = "roles-admin-token"
AUTH = {"authorization": f"Bearer {ADMIN}"}


def gateway_sample(url: str, name: str, labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def both(vllm_pd_engines: PdEngines):
    a, b = engines_or_fail(vllm_pd_engines.get, "both")
    with vllm_gateway([a, b], policy="least_load", worker_ids=["a", "b"], roles=["decode", "decode"],
                      model={"block_size": 32}, gateway={"admin_token": ADMIN},
                      # the prefill step's bound is a liveness limit, as in test_pd_vllm.py: a run with the
                      # machine's load average at ~18 saw two ~400-token prefill steps on b take over 20 s
                      # (then those requests fell back to a local prefill and the split count came up short)
                      disagg={"min_prefill_tokens": 64, "prefill_timeout_s": 120},
                      # and, as there, neither health nor the stall watchdog pulls an engine busy with its
                      # first NIXL hand-off (docs/engines.md: minutes on CPU, /health mostly unanswered):
                      # a run at load average ~30 saw a's first pull from b wait 16.7 s, called a stall,
                      # and the request had no other decode worker. This test is about the role change.
                      health={"interval_s": 0.5, "timeout_s": 5.0, "failure_threshold": 1000},
                      resilience={"stall_timeout_s": 120}) as gw:
        yield gw, a, b


# The clients wait longer than the gateway's own bounds on a split request (prefill step 120 s + stall
# watchdog 120 s, the fixture above), as in test_pd_vllm.py: under load the gateway's verdict must arrive,
# not the client's timeout. A fresh-clone CI run (load average ~36) had a hand-off's NIXL read post for
# 82 s on the decode engine (vLLM's "Avg post time (ms)=82289"; docs/engines.md) and a client give up at
# 120 s; the waits for the load's progress outlast such a stall too.
CLIENT_TIMEOUT_S = 300.0


class SteadyLoad:
    """``concurrency`` clients sending long-prompt requests back to back until stopped."""

    def __init__(self, url: str, concurrency: int = 2) -> None:
        self.url = url
        self.concurrency = concurrency
        self.results: list[tuple[int, str | None, str]] = []  # (status, prefill worker, decode worker)
        self.failures: list[tuple[int, float, str]] = []  # (index in results, time, body or exception)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, n: int) -> None:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http:
            i = 0
            while not self._stop.is_set():
                prompt = f"client {n} request {i}: " + " ".join(f"part{j} of {j * 3}" for j in range(90))
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
                try:
                    r = await http.post(f"{self.url}/v1/completions", json=body)
                    if r.status_code != 200:  # what answered, for the failure message
                        self.failures.append((len(self.results), time.monotonic(), r.text[:500]))
                    self.results.append((r.status_code, r.headers.get("x-dyad-prefill-worker"),
                                         r.headers.get("x-dyad-worker", "")))
                except httpx.HTTPError as e:
                    self.failures.append((len(self.results), time.monotonic(), repr(e)))
                    self.results.append((-1, None, repr(e)))
                i += 1

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(n)) for n in range(self.concurrency)]

    async def until(self, count: int, timeout: float = CLIENT_TIMEOUT_S) -> None:
        async with asyncio.timeout(timeout):
            while len(self.results) < count:
                await asyncio.sleep(0.1)

    async def until_served(self, workers: set[str], since: int, timeout: float = CLIENT_TIMEOUT_S) -> None:
        async with asyncio.timeout(timeout):
            while not workers <= {x[2] for x in self.results[since:]}:
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_move_a_worker_decode_to_prefill_and_back_under_load_without_failures(both):
    gw, a, b = both
    load = SteadyLoad(gw.url)
    load.start()
    try:
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as admin:
            await load.until(4)
            assert {r[1] for r in load.results} == {None}  # no prefill pool yet: every request local
            ext_a = external(a.url)

            r = await admin.post(f"{gw.url}/admin/workers/b/role", json={"role": "prefill", "wait": True})
            assert r.status_code == 200, r.text
            assert r.json()["role"] == "prefill" and r.json()["target_role"] is None
            assert r.json()["pools"]["prefill"] == ["b"] and r.json()["pools"]["decode"] == ["a"]
            moved_at = len(load.results)
            await load.until(moved_at + 6)
            split = [x for x in load.results[moved_at:] if x[1] == "b"]
            assert len(split) >= 4  # requests now prefill on b and decode on a
            assert all(x[2] == "a" for x in split)
            assert external(a.url) > ext_a  # a really pulled KV from b over NIXL
            assert not load.failures, load.failures

            r = await admin.post(f"{gw.url}/admin/workers/b/role", json={"role": "decode", "wait": True})
            assert r.status_code == 200, r.text
            back_at = len(load.results)
            # least_load also reads each engine's scraped queue, up to one scrape old: a's still shows
            # the split phase's decodes for a moment, so the first requests can all go to b.
            await load.until(back_at + 6)
            await load.until_served({"a", "b"}, since=back_at)
            assert not load.failures, load.failures  # (what failed, before what it did to the counts below)
            assert {x[1] for x in load.results[back_at + 2:]} == {None}
            assert {x[2] for x in load.results[back_at:]} == {"a", "b"}

            workers = (await admin.get(f"{gw.url}/admin/workers")).json()["workers"]
            assert {w["id"]: (w["role"], w["target_role"]) for w in workers} == {
                "a": ("decode", None), "b": ("decode", None)}
    finally:
        await load.stop()
    failed = [x for x in load.results if x[0] != 200]
    assert failed == [], (failed, load.failures)
    assert gateway_sample(gw.url, "dyad_role_changes_total", 'from_role="decode",to_role="prefill"') == 1
    assert gateway_sample(gw.url, "dyad_role_changes_total", 'from_role="prefill",to_role="decode"') == 1
    assert gateway_sample(gw.url, "dyad_worker_role", 'role="decode",worker="b"') == 1
