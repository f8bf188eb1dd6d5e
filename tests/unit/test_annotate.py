"""gateway/annotate.py: the prompt's length is the tokenizer's count when the prefix tracker tokenized
the request, and the character-class estimate only otherwise (it is not computed and thrown away)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from orchestrator.config import load_config
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.gateway import annotate as annotate_mod
from orchestrator.kv.tracker import build_prefix_tracker
from orchestrator.router.estimate import estimate_prompt_tokens
from orchestrator.router.policies import make_policy
from orchestrator.router.router import Router

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _runtime(policy: str, healthy: bool = True) -> SimpleNamespace:
    cfg = load_config({
        "models": [{"name": "m", "block_size": 4}],
        "workers": [{"id": "w0", "url": "http://127.0.0.1:9", "engine": "sim", "models": ["m"]}],
        "router": {"policy": policy},
    }, environ={})
    fleet = FleetRegistry.from_config(cfg)
    for w in fleet.workers():
        fleet.record_health(w, healthy, 0.0)
    router = Router(make_policy(cfg.router), fleet)
    if policy == "kv_aware":
        router.prefix_tracker = build_prefix_tracker(cfg, fleet)
    return SimpleNamespace(config=cfg, router=router)


def _annotate(rt: SimpleNamespace, endpoint: str, body: dict):
    return asyncio.run(annotate_mod.annotate(rt, {}, "r1", endpoint, "m", body))


def test_a_tokenized_prompt_is_counted_by_its_tokens_without_the_estimate(monkeypatch):
    calls = []
    monkeypatch.setattr(annotate_mod, "estimate_prompt_tokens", lambda *a: calls.append(a) or 1)
    rt = _runtime("kv_aware")
    prompt = "alpha, beta; gamma! " * 10  # 30 words: the estimate (punctuation counts) would say more
    req = _annotate(rt, COMPLETIONS, {"model": "m", "prompt": prompt})
    assert req.token_ids is not None and req.prompt_tokens == 30 and len(req.block_hashes) == 7
    chat = _annotate(rt, CHAT, {"model": "m", "messages": [{"role": "user", "content": prompt}]})
    assert chat.token_ids is not None and chat.prompt_tokens == len(chat.token_ids) > 30
    assert calls == []


@pytest.mark.parametrize("policy,healthy,body", [
    ("round_robin", True, {"model": "m", "prompt": "alpha, beta; gamma!"}),  # no tracker
    ("kv_aware", False, {"model": "m", "prompt": "alpha, beta; gamma!"}),  # no worker to tokenize for
    ("kv_aware", True, {"model": "m", "prompt": ["alpha, beta", "gamma!"]}),  # a batch: not tokenized
])
def test_otherwise_the_estimate(policy, healthy, body):
    req = _annotate(_runtime(policy, healthy), COMPLETIONS, body)
    assert req.token_ids is None
    assert req.prompt_tokens == estimate_prompt_tokens(COMPLETIONS, body) > 0


@pytest.mark.parametrize(("body", "budget"), [
    ({}, None),  # no limit set: nothing to charge ahead
    ({"max_tokens": 100}, 100),
    ({"max_tokens": 100, "n": 3}, 300),
    ({"max_completion_tokens": 50, "max_tokens": 100, "n": 2}, 100),  # the newer name wins, as for engines
    ({"max_tokens": 10, "n": 2, "best_of": 5}, 50),  # completions: best_of candidates are generated
    ({"max_tokens": 10, "n": None}, 10),
    ({"max_tokens": 10, "best_of": "5"}, 10),  # (the engine refuses it; nothing multiplied here)
])
def test_output_budget_counts_every_sequence_generated(body, budget):
    from orchestrator.gateway.annotate import output_budget

    assert output_budget(body) == budget
