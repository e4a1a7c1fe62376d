# Two commands on a fresh machine: `make demo` (the main job) and `make test` (what CI runs).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test test-fast demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# speculators (the independent PyTorch check) pins an older transformers; its import-time
# needs come from the `speculators` extra and the package itself goes in without deps.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,demo,speculators]'
	$(BIN)/pip install -q --no-deps speculators==0.9.0
	touch $@

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[demo]'
	touch $@

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m 'not real and not gpu'

demo: $(VENV)/.installed-demo
	$(BIN)/python -m peagle_jax.demo

clean:
	rm -rf $(VENV) .pytest_cache
