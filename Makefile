# The two commands a newcomer runs (each sets everything up first, and is safe to re-run):
#   make study   - the full study on the bundled model, writing an HTML report under runs/
#   make test    - lint + the test suite
VENV := .venv/bin

.PHONY: setup study study-quick test lint format bench
setup:
	@bash scripts/install.sh

study: setup
	$(VENV)/kvlab study

study-quick: setup
	$(VENV)/kvlab study --quick

lint: setup
	$(VENV)/ruff check src tests benchmarks
	$(VENV)/ruff format --check src tests benchmarks

format: setup
	$(VENV)/ruff format src tests benchmarks
	$(VENV)/ruff check --fix src tests benchmarks

test: lint
	$(VENV)/python -m pytest -q

bench: setup
	$(VENV)/python benchmarks/run_all.py
