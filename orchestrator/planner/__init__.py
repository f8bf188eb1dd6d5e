"""The SLO planner: how many prefill and decode workers the next interval needs.

Read top to bottom: ``metrics_source`` turns gateway metrics into an ``Observation``;
``predictors`` forecast the next interval's load; ``perf_model`` says what one worker can do
under the latency targets; ``solver`` turns load + model into worker counts; ``core`` keeps the
state between intervals (hysteresis, cooldown, draining) and emits a ``PlanDecision``;
``actuators`` carry the decision out (recommend only, local processes, Kubernetes, role change).
Everything except the sources and actuators is pure: plain data and a ``now`` in, data out.
"""
