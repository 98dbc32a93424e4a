# The two commands a newcomer runs (each sets everything up first, and is safe to re-run):
#   make study   - the full study on the bundled model, writing an HTML report under runs/
#   make test    - lint + type check (mypy, every package) + the test suite
# (while iterating, `make test-fast`: the tests that load no real model and start no process, minutes)
VENV := .venv/bin

.PHONY: setup setup-dev test-deps study study-quick test test-fast test-gpu test-optional lint typecheck format bench
setup:
	@bash scripts/install.sh

# the test and lint toolchain too (pytest, ruff, mypy, hypothesis, Ray, the openai client): `make test` only
setup-dev:
	@bash scripts/install.sh --dev

study: setup
	$(VENV)/kvlab study

study-quick: setup
	$(VENV)/kvlab study --quick

lint: setup-dev
	$(VENV)/ruff check src tests benchmarks
	$(VENV)/ruff format --check src tests benchmarks

# mypy over every package, the study and the CLI included ([tool.mypy] in pyproject.toml).
typecheck: setup-dev
	$(VENV)/mypy

format: setup-dev
	$(VENV)/ruff format src tests benchmarks
	$(VENV)/ruff check --fix src tests benchmarks

test-deps:
	@bash scripts/install-test-deps.sh

# A skipped test fails the run (KVLAB_TEST_NO_SKIPS=1): every test runs, or the run says what is missing.
test: lint typecheck test-deps
	KVLAB_TEST_NO_SKIPS=1 $(VENV)/python -m pytest -q

# The fast tier, for iteration (CI runs `make test`): every test not marked real_model (loads the bundled
# model), process (starts a subprocess, server, redis-server, Ray cluster, Chromium or workers) or slow.
# tests/conftest.py sets and checks those markers. No lint or type check here (`make lint`, `make typecheck`).
test-fast: setup-dev
	KVLAB_TEST_NO_SKIPS=1 $(VENV)/python -m pytest -q -m "not real_model and not process and not slow"

# The device tests alone (issue 29): every path of the GPU table, the static device check. They run on
# every device torch sees: on a CPU-only machine on the CPU (with meta as the default device around
# each path, which exposes a factory without device=); on a CUDA machine the same tests also run on
# cuda and compare each result with the CPU one within the dtype's tolerance. Tiny random models only.
test-gpu: setup-dev
	KVLAB_TEST_NO_SKIPS=1 $(VENV)/python -m pytest -q tests/test_devices.py tests/test_device_static.py tests/test_static_rolling.py tests/test_ring_rows.py tests/optional/test_triton_kernels.py tests/test_eval_capture.py::test_the_captured_answer_on_every_device

# Checks that need what is not installed by default (Gemma-3-270M, Triton: see tests/optional/).
test-optional: setup-dev
	$(VENV)/python -m pip install -q "triton>=3.1,<4"
	$(VENV)/python -m pytest -q tests/optional

bench: setup-dev
	$(VENV)/python benchmarks/run_all.py
