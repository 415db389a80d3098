# GCache: `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-test

.PHONY: run test lint typecheck unit integration proto clean venv compare

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Editable install with the test extras (torch CPU wheel, pytest, hypothesis, ruff, mypy).
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Other ports or options: make run ARGS='--meta-port 17700 --grpc-port 17701 ...'
# (or GCACHE_META_PORT=17700 make run; README "Ports").
ARGS ?=
run: $(STAMP)
	$(VENV)/bin/gcache up --demo $(ARGS)

test: $(STAMP) lint typecheck
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check gcache client tests bench proto
	PYTHONPATH=client $(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# GCache against iperf3, memcpy, Redis and Mooncake; installs the peers on first use.
compare: $(STAMP)
	$(PY) -m bench.compare

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
