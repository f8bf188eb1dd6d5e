"""The HTTP surface: OpenAI endpoints, admin API, health/readiness/metrics, and the serve command.

Request path, top to bottom: ``openai_routes`` (read, parse, validate) → ``Router.route`` (pick a
worker) → ``proxy`` (attempts, retries, streaming back) → an ``executor`` (talk to the engine
through its adapter) → the engine.
"""
