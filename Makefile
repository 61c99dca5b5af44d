# Two commands for a fresh machine: `make demo` and `make test` (both create the environment).
# torch is pinned to the CPU build that lies on this machine's disk: an unpinned torch would
# pull a multi-GB CUDA build. On a GPU machine: make TORCH_SPEC="torch==<your CUDA build>" ...
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# JIT-built ops (DeepSpeed's CPU shm comm op, our fused ops) live with the environment they were
# built for: a cache shared by two environments rebuilds on every switch between them.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
export DSM_BUILD_DIR ?= $(abspath $(VENV))/dsm_build

.PHONY: setup test test-unit test-multi demo bench clean

setup: $(STAMP)

$(STAMP): setup.py Makefile requirements-test.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import torch, deepspeed, deepspeed_multi; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
	touch $@

test: setup
	DS_ACCELERATOR=cpu $(PY) -m pytest tests

test-unit: setup
	DS_ACCELERATOR=cpu $(PY) -m pytest tests/unit

test-multi: setup
	DS_ACCELERATOR=cpu $(PY) -m pytest tests/multi_gpu

demo: setup
	DS_ACCELERATOR=cpu $(PY) -m torch.distributed.run --standalone --nproc_per_node=2 examples/demo.py

bench: setup
	PYTHON=$(PY) bash benchmarks/run_all.sh

clean:
	rm -rf $(VENV) build *.egg-info
