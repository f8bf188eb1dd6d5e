# Two commands on a fresh machine:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest exit 5 means "no tests collected": a run that tested nothing is a failure, said plainly.
PYTEST = run_pytest() { $(BIN)/python -m pytest -q -p no:cacheprovider "$$@"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5) for: $$*; a run that tests nothing fails" >&2; return 1; fi; \
	return $$rc; }; run_pytest

$(BIN)/dyad: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/dyad

.PHONY: demo test test-fast install lint readme
install: $(BIN)/dyad

demo: $(BIN)/dyad
	$(BIN)/dyad demo

# Everything: unit, integration (servers, simulator, Redis, Prometheus, real vLLM), ops, fuzz.
# Four phases, each always run (the target fails if any did): everything but real vLLM on three pytest
# workers (those tests mostly wait on servers and clocks, so three share two cores well; a file stays on
# one worker); the request-path suites again with the native data plane carrying the bytes
# (gateway.data_plane: native; tests/conftest.py --data-plane: the same tests, the same expectations;
# python_plane tests inject faults into the Python plane's own code and have native counterparts; P/D suites run
# once: the native plane parks a P/D request and the Python executor carries it, test_request_path_failures
# checks that hand-over); the
# real-vLLM tier alone and in order (its engines take a core each; they start once per configuration);
# and the real-vLLM request-path tests with the native plane.
TEST_WORKERS ?= 3
NATIVE_SUITES = tests/integration/test_stream_endings.py tests/integration/test_request_path_failures.py \
	tests/integration/test_request_path_inputs.py tests/integration/test_failover.py \
	tests/integration/test_engine_liveness.py tests/integration/test_gateway.py \
	tests/integration/test_gateway_intake.py tests/integration/test_limits.py tests/integration/test_auth.py \
	tests/integration/test_path_telemetry.py tests/integration/test_admin_audit.py tests/fuzz \
	tests/integration/test_unseen_inputs.py tests/integration/test_native_framing.py \
	tests/integration/test_stream_memory.py tests/integration/test_flapping_worker.py \
	tests/integration/test_surface_unseen_loop.py tests/integration/test_surface_unseen_responses.py \
	tests/integration/test_surface_unseen_admin.py tests/integration/test_surface_unseen_auth.py \
	tests/integration/test_surface_unseen_slow_body.py
NATIVE_VLLM_SUITES = tests/integration/test_request_path_vllm.py tests/integration/test_vllm_gateway.py \
	tests/integration/test_chaos_vllm.py
test: $(BIN)/dyad
	bash scripts/setup_test_deps.sh
	@failed=0; $(PYTEST) -m "not vllm" -n $(TEST_WORKERS) --dist loadfile --durations=10 || failed=1; \
	$(PYTEST) -m "not vllm and not python_plane" --data-plane native -n $(TEST_WORKERS) --dist loadfile $(NATIVE_SUITES) || failed=1; \
	$(PYTEST) -m vllm --durations=10 || failed=1; \
	$(PYTEST) -m vllm --data-plane native $(NATIVE_VLLM_SUITES) || failed=1; exit $$failed

# The unit tier only: no sockets, no subprocesses, no servers (tests/unit/conftest.py enforces it).
test-fast: $(BIN)/dyad
	@$(PYTEST) tests/unit

lint: $(BIN)/dyad
	$(BIN)/ruff check orchestrator adapters tests scripts

# Refresh the generated reference sections of README.md (config, CLI, metrics) from the code.
readme: $(BIN)/dyad
	$(BIN)/python scripts/gen_reference.py
