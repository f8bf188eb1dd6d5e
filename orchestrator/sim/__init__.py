"""The simulated engine: a pure cost-model core (``engine_model``), its profiles and tokenizer, and
an HTTP server speaking vLLM's (or SGLang's) wire dialect around it (``server``).

It stands in for what cannot run on this machine: SGLang, fleets of more than two engines, and
GPU-scale timing.
"""
