# kvbaton: the single entry point for install, tests, lint, demo and benchmarks.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint typecheck check demo bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev]'
	@command -v redis-server >/dev/null || { \
	  echo "redis-server not found: installing it (Debian package redis-server)"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null; }
	@command -v promtool >/dev/null || { \
	  echo "promtool not found: installing it (Debian package prometheus; checks deploy/prometheus)"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus) >/dev/null; }
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/pytest --cov --cov-report=term

lint: install
	$(BIN)/ruff check router sessions vllm_sim tests
	$(BIN)/ruff format --check router sessions vllm_sim tests

typecheck: install
	$(BIN)/mypy

check: lint typecheck test

demo: install
	$(BIN)/kvbaton demo

bench: install
	$(BIN)/python -m tests.bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage htmlcov

# The router's end-to-end tests against real vLLM (CPU build, NIXL): a separate engine venv
# (.venv-vllm), a tiny model built offline, P/D/reference engines on loopback. Skips with one
# line where the engine cannot be installed (no local torch 2.13.0+cpu wheel), but not in CI.
.PHONY: test-vllm
test-vllm: install
	@bash tests/vllm/tier.sh
