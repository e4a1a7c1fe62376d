# Two commands on a fresh machine: `make demo` (the main job) and `make test` (what CI runs).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

CVENV := .venv-compile
CBIN := $(CVENV)/bin

VVENV := .venv-vllm
VLLM_RELEASES := 0.33.0 0.34.0

GVENV := .venv-guidellm
GUIDELLM_VERSION := 0.8.1

.PHONY: test test-fast test-slow lint demo report clean compile-venv test-compile vllm-venv guidellm-venv

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# speculators (the independent PyTorch check) pins an older transformers; its import-time
# needs come from the `speculators` extra and the package itself goes in without deps.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,demo,train,speculators,report]'
	$(BIN)/pip install -q --no-deps speculators==0.9.0
	touch $@

# the accelerators' compilers (jax[tpu] + jax[cuda12], ~6.5 GB), deviceless, in a venv of their own so
# that the main one stays CPU-only: tests/compile/ and `python -m peagle_jax.plan` run in it
$(CBIN)/python:
	$(PY) -m venv $(CVENV)
	$(CBIN)/pip install -q --upgrade pip

$(CVENV)/.installed: pyproject.toml | $(CBIN)/python
	$(CBIN)/pip install -q -e '.[compile]'
	touch $@

compile-venv: $(CVENV)/.installed

# compile-only tests: the CUDA (H100) and TPU (v5e) compilers on the kernels, no device needed
test-compile: $(CVENV)/.installed
	$(CBIN)/python -m pytest -q -p no:xdist tests/compile --durations=5

# vLLM's own config and loading code, run on CPU as the oracle for the exports (tests/test_vllm_oracle.py):
# what its import path needs (tests/vllm-oracle.txt), and each release without deps in .vllm/VERSION
$(VVENV)/.installed: tests/vllm-oracle.txt
	rm -rf $(VVENV) .vllm
	$(PY) -m venv $(VVENV)
	$(VVENV)/bin/pip install -q --upgrade pip
	$(VVENV)/bin/pip install -q -r tests/vllm-oracle.txt
	for v in $(VLLM_RELEASES); do $(VVENV)/bin/pip install -q --no-deps --target .vllm/$$v vllm==$$v || exit 1; done
	touch $@

vllm-venv: $(VVENV)/.installed

# GuideLLM (vllm-project's load generator, ~6 GB with its torch), a measurement tool in a venv of its own:
# never a dependency, never needed by make test; python -m bench.guidellm_sweep runs it against the server
$(GVENV)/.installed:
	rm -rf $(GVENV)
	$(PY) -m venv $(GVENV)
	$(GVENV)/bin/pip install -q --upgrade pip
	$(GVENV)/bin/pip install -q guidellm==$(GUIDELLM_VERSION)
	touch $@

guidellm-venv: $(GVENV)/.installed

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[demo,train]'
	touch $@

# the import contracts (pyproject [tool.importlinter]) and ruff's lint and format checks
lint: $(VENV)/.installed-test
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# tests run in parallel workers (most of a test's time is single-threaded XLA compilation), one file
# per worker at a time so that module fixtures (models, reference runs) are built once; the
# compile-only suite (one process: the TPU compiler's library takes a lock) runs beside them, its
# output printed once both end
test: lint $(CVENV)/.installed $(VVENV)/.installed
	@start=$$(date +%s); log=$$(mktemp); \
	$(CBIN)/python -m pytest -q -p no:xdist tests/compile --durations=5 >$$log 2>&1 & compile=$$!; \
	trap 'kill $$compile 2>/dev/null; rm -f $$log' EXIT; \
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=25; main=$$?; \
	wait $$compile; compiled=$$?; echo "--- tests/compile ($(CVENV)):"; cat $$log; \
	[ $$main -eq 0 ] && [ $$compiled -eq 0 ] && \
	echo "make test: both suites passed in $$(( $$(date +%s) - start )) s"

# the minutes-long checks the default run leaves out (the released-size head, the MoE matrix, the
# train steps through the TPU compiler)
test-slow: $(VENV)/.installed-test $(CVENV)/.installed
	$(BIN)/python -m pytest -q -m slow
	$(CBIN)/python -m pytest -q -p no:xdist -m slow tests/compile

test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m 'not real and not gpu'

# the main job: train a P-EAGLE head for the real Gemma-3-270M on ShareGPT, evaluate it, export it
demo: $(VENV)/.installed-demo
	$(BIN)/python -m train

# P-EAGLE vs EAGLE-3 vs DFlash vs plain decoding on Gemma-3-270M -> docs/report.md (about an hour on a 2-core CPU;
# resumable: rerun to continue; e.g. make report REPORT_ARGS='--budget 0.25')
report: $(VENV)/.installed-test
	$(BIN)/python -m report $(REPORT_ARGS)

clean:
	rm -rf $(VENV) $(CVENV) $(VVENV) $(GVENV) .vllm .pytest_cache
