# Chorus: the two setup-free commands are `make run` (the main job) and `make test` (the suite).
# Both create and reuse a local virtual environment in .venv on first use.

# The venv's interpreter: PYTHON if given, else the first supported one found (3.11 to 3.13).
PYTHONS := $(or $(PYTHON),python3.11 python3.12 python3.13 python3)
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# An index for torch alone, e.g. https://download.pytorch.org/whl/cpu for the CPU build (docs/deployment.md, "Install");
# torch's own dependencies still come from PyPI.
TORCH_INDEX_URL ?=

# Triton kernels run in the interpreter on machines without a GPU.
export TRITON_INTERPRET ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo 1)

.PHONY: run test lint bench info venv constraints clean

# the first of PYTHONS that runs and is 3.11 to 3.13 (looked for only when the venv is to be made)
supported_python = $(firstword $(foreach p,$(PYTHONS),$(shell $(p) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null && echo $(p))))

# constraints.txt pins every package to the versions the suite passed with (`make constraints` rewrites it).
$(STAMP): pyproject.toml constraints.txt
	$(if $(wildcard $(PY)),,$(if $(call supported_python),$(call supported_python) -m venv $(VENV),\
	    $(error Chorus needs Python 3.11 to 3.13 and found none (tried: $(PYTHONS)); install one or pass PYTHON=/path/to/python3.1x)))
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX_URL),$(PY) -m pip install --quiet --no-deps -c constraints.txt --index-url $(TORCH_INDEX_URL) torch)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

# The main job: 16 virtual rooms (4 making scripted tool calls, 4 on the phone) on one engine for 30 s, no LiveKit server;
# about a minute on a 2-core CPU. The full benchmark is `python -m agent simulate` (64 rooms, 16 tool rooms, 60 s).
run: $(STAMP)
	$(PY) -m agent simulate --rooms 16 --tool-rooms 4 --seconds 30 --out out/simulate

# The suite on TEST_WORKERS processes (pytest-xdist; 2, the CI machine's cores): the tests that share a service
# or keep time on the wall clock run one after another on one of them, the rest beside them (tests/conftest.py).
# TEST_WORKERS=0 runs the whole suite in this one process, one test after another.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

info: $(STAMP)
	$(PY) -m engine info --preset nemotron-voicechat-11b

bench: $(STAMP)
	$(PY) -m benchmarks.engine_bench thinker --preset tiny

# The tested versions, from this venv: editable installs and local version labels (torch's +cpu) left out.
constraints: $(STAMP)
	@{ echo "# The versions the suite passed with (make constraints, from a venv that make built): pip install -c constraints.txt"; \
	   $(PY) -m pip freeze --exclude-editable | sed -e 's/+[A-Za-z0-9.]*$$//'; } > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
