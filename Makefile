# Chorus: the two setup-free commands are `make run` (the main job) and `make test` (the suite).
# Both create and reuse a local virtual environment in .venv on first use.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# glibc re-maps large temporaries every tick without these (see shared perf notes); they must be
# set before the process starts.
export MALLOC_MMAP_THRESHOLD_ := 4294967296
export MALLOC_TRIM_THRESHOLD_ := 4294967296
# Triton kernels run in the interpreter on machines without a GPU.
export TRITON_INTERPRET ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo 1)

.PHONY: run test lint bench info venv clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

# The main job: 16 virtual rooms (4 making scripted tool calls) on one engine for 30 s, no LiveKit server;
# about a minute on a 2-core CPU. The full benchmark is `python -m agent simulate` (64 rooms, 16 tool rooms, 60 s).
run: $(STAMP)
	$(PY) -m agent simulate --rooms 16 --tool-rooms 4 --seconds 30 --out out/simulate

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

info: $(STAMP)
	$(PY) -m engine info --preset nemotron-voicechat-11b

bench: $(STAMP)
	$(PY) -m engine.bench thinker --preset tiny

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
