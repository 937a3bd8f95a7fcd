# kvbaton: the single entry point for install, tests, lint, demo and benchmarks.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-unit test-component test-e2e lint typecheck check demo load bench clean

$(STAMP): pyproject.toml
	@echo "make install: $(VENV) with kvbaton and its dev tools (pip, about 40 s the first time)"
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

# In a git work tree, git runs .githooks/commit-msg (a subject of 72 characters or fewer, then
# a blank line); outside one (an unpacked tarball) there is nothing to set.
install: $(STAMP)
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && \
	  [ "$$(git config core.hooksPath)" != .githooks ]; then \
	  git config core.hooksPath .githooks && echo "make install: git config core.hooksPath .githooks"; \
	fi

# Test files spread over every core (a file's tests stay on one worker: they share its stacks).
# Coverage data of its own per run: two runs at once in one checkout must not combine (and
# delete) each other's files.
test: install
	d=$$(mktemp -d /tmp/kvbaton-cov.XXXXXX) && COVERAGE_FILE=$$d/.coverage \
	  $(BIN)/pytest -n auto --dist loadfile --cov --cov-report=term; \
	  rc=$$?; rm -rf $$d; exit $$rc

# One tier at a time (markers set per folder in tests/conftest.py; README, "Tests").
test-unit: install
	$(BIN)/pytest -m unit

test-component: install
	$(BIN)/pytest -m component

test-e2e: install
	$(BIN)/pytest -m e2e

# ruff, then the subjects of the commits after tools/check_commits.py's base (a shallow clone
# without that commit skips it).
lint: install
	$(BIN)/ruff check router sessions vllm_sim tests bench harness tools loadtest
	$(BIN)/ruff format --check router sessions vllm_sim tests bench harness tools loadtest
	$(BIN)/python tools/check_commits.py

typecheck: install
	$(BIN)/mypy

check: lint typecheck test

demo: install
	$(BIN)/kvbaton demo

bench: install
	$(BIN)/python -m bench $(ARGS)

# The reliability load test (loadtest/): `make load ARGS=--quick` for 40 x 3 turns.
load: install
	$(BIN)/python -m loadtest $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage htmlcov

# The router's end-to-end tests against real vLLM (CPU build, NIXL): a separate engine venv
# (.venv-vllm), a tiny model built offline, P/D/reference engines on loopback. Skips with one
# line where the engine cannot be installed (no local torch 2.13.0+cpu wheel), but not in CI.
.PHONY: test-vllm
test-vllm: install
	@bash tests/vllm/tier.sh

# The container image and the compose stacks, built and run for real with podman, without a
# registry (docs/containers.md): base images from Debian packages, deploy/Dockerfile as it is,
# the default, push and store stacks used from the host; everything removed afterwards.
.PHONY: test-compose compose-env
test-compose: install
	@VENV_BIN=$(BIN) bash tests/compose/tier.sh

# deploy/.env for `docker compose` / `podman-compose` in deploy/: random session secret and
# admin key (kept when the file has them).
compose-env:
	@bash deploy/make-env.sh
