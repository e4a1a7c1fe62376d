# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-all demo venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[$*]'
	touch $@

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

test-all: $(VENV)/.installed-test $(VENV)/.installed-demo
	$(BIN)/python -m pytest -q -m ''

demo: $(VENV)/.installed-demo
	$(BIN)/python -m train

clean:
	rm -rf $(VENV) .pytest_cache
