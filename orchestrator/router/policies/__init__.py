"""Routing policies, one module each, selected by name from ``router.policy``.

Every policy implements ``RoutingPolicy.choose(req, candidates, now)`` over plain data (no I/O, no
wall clock), so it is unit-tested on hand-made ``Worker`` objects and runs in the simulator.
``kv_aware`` lives in ``kv_aware.py`` and is imported only when selected.
"""

from __future__ import annotations

import importlib
from typing import Any

from orchestrator.config import RouterConfig
from orchestrator.router.types import RoutingPolicy


class UnknownPolicy(ValueError):
    """The configured policy name does not exist or its module cannot be loaded."""


def make_policy(config: RouterConfig, **deps: Any) -> RoutingPolicy:
    """Build the policy ``config.policy`` names. ``deps`` go to policies that take them (kv_aware)."""
    name = config.policy
    if name == "round_robin":
        from orchestrator.router.policies.round_robin import RoundRobinPolicy
        return RoundRobinPolicy()
    if name == "least_load":
        from orchestrator.router.policies.least_load import LeastLoadPolicy
        return LeastLoadPolicy()
    if name == "power_of_two":
        from orchestrator.router.policies.power_of_two import PowerOfTwoPolicy
        return PowerOfTwoPolicy(seed=config.seed)
    if name == "random":
        from orchestrator.router.policies.random import RandomPolicy
        return RandomPolicy(seed=config.seed)
    if name == "kv_aware":
        module_name = "orchestrator.router.policies.kv_aware"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            raise UnknownPolicy(f"router.policy 'kv_aware' is not available: module {module_name} is missing") from e
        cls = getattr(module, "KvAwarePolicy", None)
        if cls is None:
            raise UnknownPolicy(f"router.policy 'kv_aware': {module_name} does not define KvAwarePolicy")
        return cls(config.kv_aware, seed=config.seed, **deps)
    raise UnknownPolicy(f"router.policy '{name}' is unknown (choose from round_robin, least_load, "
                        "power_of_two, random, kv_aware)")
