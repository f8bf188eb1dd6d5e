"""Routing: pick the worker(s) for each request. Policies are pure; the Router does the I/O around them."""
