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

# The oldest supported DeepSpeed (deepspeed_multi/compat.py, SUPPORTED) in its own environment:
# `make test` runs the newest (.venv) and then the core rows on the oldest (.venv-ds-oldest).
# The fast paths run on the checked newest release only, so the oldest runs DeepSpeed's own methods.
DS_OLDEST ?= 0.19.4
# The oldest transformers deepspeed_multi.transformers accepts (TESTED there) runs here too.
TRANSFORMERS_OLDEST ?= 5.23.0
VENV_OLDEST ?= .venv-ds-oldest
PY_OLDEST := $(VENV_OLDEST)/bin/python
STAMP_OLDEST := $(VENV_OLDEST)/.installed
# The correctness matrix's core groups (marked "core": tests/multi_gpu/scenarios.py, CORE), the Accelerate
# loops on two ranks, the resize resume (it runs DeepSpeed's converter), and the Trainer against DDP (with the
# oldest transformers; TRL runs on the newest only, to keep make test in budget). Accelerate is the same release
# in both environments: its API surface and the four-rank RLHF loop (ZeRO-2/3 engines, trained and frozen, which
# the core groups run on the oldest DeepSpeed) run on the newest only.
OLDEST_TESTS := tests/multi_gpu/test_matrix.py tests/multi_gpu/test_accelerate.py::test_distillation_gan_checkpointing \
	tests/multi_gpu/test_accelerate.py::test_encoder_llm \
	tests/multi_gpu/test_checkpoint.py::test_resume_at_another_world_size \
	tests/multi_gpu/test_trainer.py::test_trainer_matches_ddp_trainer

.PHONY: setup setup-oldest test test-newest test-oldest test-wheel test-unit test-multi test-deepspeed-suite test-accelerate-suite test-peer-programs test-peer-trl docs docs-check demo bench test-bench fuzz clean

setup: $(STAMP)

# Everything after torch is installed under a constraint that holds torch at TORCH_SPEC, so that
# nothing (accelerate, transformers, deepspeed) can replace or upgrade it. The fused ops are compiled
# last, as an install compiles an extension (not by the first test that uses them), with DeepSpeed's CPU
# shared-memory op, which DeepSpeed compiles at its first init_distributed on CPU; a failed build is not
# fatal: the ops fall back to PyTorch (DeepSpeed to torch.distributed), and the tests say so.
# The environment's python by its path, PATH unchanged: the tests run with this PATH, and torch builds with the
# first `ninja` on it; ninja versions keep incompatible logs, so a build by another ninja is redone (~50 s).
PREBUILD = DS_ACCELERATOR=cpu $(1) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
	|| echo "note: DeepSpeed's shm op did not build"
# DeepSpeed's CPU Adam and fused Adam in the newest environment: the shipped configs with optimizer offload use
# the first (tests/multi_gpu/test_shipped_configs.py), an "AdamW" config section without offload the second (the
# pipeline engine of test_drop_in.py, OpenRLHF), and a first build inside a test (about 100 s each) would spend
# its deadline.
PREBUILD_CPU_ADAM = DS_ACCELERATOR=cpu $(1) -c "from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder; \
	CPUAdamBuilder().load(); FusedAdamBuilder().load()" || echo "note: DeepSpeed's CPU Adam or fused Adam did not build"
$(STAMP): pyproject.toml setup.py Makefile requirements-test.txt requirements-docs.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt "$(TORCH_SPEC)" -r requirements-test.txt -r requirements-docs.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import torch, deepspeed, accelerate, transformers, deepspeed_multi; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'accelerate', accelerate.__version__, 'transformers', transformers.__version__)"
	$(PY) -m deepspeed_multi.ops.build || echo "note: the fused-reduce extension did not build; see above"
	$(call PREBUILD,$(abspath $(PY)))
	$(call PREBUILD_CPU_ADAM,$(abspath $(PY)))
	touch $@

$(STAMP_OLDEST): pyproject.toml setup.py Makefile requirements-test.txt
	python3 -m venv $(VENV_OLDEST)
	$(PY_OLDEST) -m pip install -q --upgrade pip
	$(PY_OLDEST) -m pip install -q "$(TORCH_SPEC)"
	printf '%s\n' "$(TORCH_SPEC)" "deepspeed==$(DS_OLDEST)" "transformers==$(TRANSFORMERS_OLDEST)" > $(VENV_OLDEST)/constraint.txt
	grep -v '^deepspeed\|^transformers\|^trl\|^peft\|^lightning' requirements-test.txt > $(VENV_OLDEST)/requirements.txt
	$(PY_OLDEST) -m pip install -q -c $(VENV_OLDEST)/constraint.txt "deepspeed==$(DS_OLDEST)" \
	  "transformers==$(TRANSFORMERS_OLDEST)" -r $(VENV_OLDEST)/requirements.txt
	$(PY_OLDEST) -m pip install -q --no-deps -e .
	$(PY_OLDEST) -c "import torch, deepspeed, transformers; assert deepspeed.__version__ == '$(DS_OLDEST)', deepspeed.__version__; \
	  assert transformers.__version__ == '$(TRANSFORMERS_OLDEST)', transformers.__version__; \
	  print('oldest: torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV_OLDEST))/torch_extensions $(call PREBUILD,$(abspath $(PY_OLDEST)))
	touch $@

setup-oldest: $(STAMP_OLDEST)

test: test-newest test-oldest

# The wheel check runs first: a file the build leaves out fails in about a minute, not after the suite.
test-newest: setup test-wheel
	DS_ACCELERATOR=cpu $(PY) -m pytest tests --durations=25

# The package as pip installs it (tools/wheel_check.py): the sdist and, from it, the wheel built; the wheel's
# files checked against the package's; the wheel installed in a fresh venv outside the checkout, where the fused
# op is built from its csrc/ and the report and the demo run (about 70 s on 2 cores).
test-wheel: setup
	$(PY) tools/wheel_check.py

test-oldest: setup-oldest
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(VENV_OLDEST))/torch_extensions \
	  DSM_BUILD_DIR=$(abspath $(VENV_OLDEST))/dsm_build \
	  $(PY_OLDEST) -m pytest $(OLDEST_TESTS) -m "core or not matrix"

# The documentation site (mkdocs.yml, docs/, README.md as its home page) into site/; strict: a broken link or
# anchor, a page missing from the navigation or an unresolved API reference fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The built site looked at in a real headless browser (Debian's chromium): screenshots of the landing page,
# an API page and the knob page at a laptop width, into site-check/ (tools/docs/check_site.py).
docs-check: docs
	$(PY) tools/docs/check_site.py --site site --out site-check

test-unit: setup
	DS_ACCELERATOR=cpu $(PY) -m pytest tests/unit

test-multi: setup
	DS_ACCELERATOR=cpu $(PY) -m pytest tests/multi_gpu

# DeepSpeed's own unit tests, upstream and with deepspeed_multi.initialize in every test process
# (tools/deepspeed_suite/run.py, docs/deepspeed_suite.md); not part of `make test`.
# `make test-deepspeed-suite DEEPSPEED_SRC=<a DeepSpeed source checkout>`. DeepSpeed pins pytest < 8.4
# and runs its tests with pytest-forked: those go to a folder of their own, never into the venv.
SUITE_PKGS := $(abspath $(VENV))/deepspeed-suite-packages
$(SUITE_PKGS)/.installed: $(STAMP)
	$(PY) -m pip install -q --target $(SUITE_PKGS) "pytest>=8,<8.4" pytest-forked "pytest-xdist<3.7"
	touch $@

test-deepspeed-suite: setup $(SUITE_PKGS)/.installed
	@test -n "$(DEEPSPEED_SRC)" || { echo "usage: make test-deepspeed-suite DEEPSPEED_SRC=<a DeepSpeed source checkout>"; exit 2; }
	$(PY) tools/deepspeed_suite/run.py --deepspeed-src $(DEEPSPEED_SRC) --pytest-packages $(SUITE_PKGS)

# Accelerate's own DeepSpeed tests (tests/deepspeed of an Accelerate checkout, the scripts they launch from the
# installed package) upstream, through the drop-in, through our Accelerator and both (tools/accelerate_suite/run.py,
# docs/accelerate_suite.md); not part of `make test`. `make test-accelerate-suite ACCELERATE_SRC=<a checkout>`.
ACC_SUITE_PKGS := $(abspath $(VENV))/accelerate-suite-packages
ACC_SUITE_OUT ?= $(abspath $(VENV))/accelerate-suite-results
$(ACC_SUITE_PKGS)/.installed: $(STAMP)
	$(PY) -m pip install -q --target $(ACC_SUITE_PKGS) parameterized
	touch $@

test-accelerate-suite: setup $(ACC_SUITE_PKGS)/.installed
	@test -n "$(ACCELERATE_SRC)" || { echo "usage: make test-accelerate-suite ACCELERATE_SRC=<an Accelerate checkout>"; exit 2; }
	$(PY) tools/accelerate_suite/run.py --accelerate-src $(ACCELERATE_SRC) --test-packages $(ACC_SUITE_PKGS) \
	  --out $(ACC_SUITE_OUT)

# Peer programs, upstream vs ours (tools/peer_programs/run.py, docs/tests.md); not part of `make test`, about
# an hour and a half on 2 cores (QUICK=1: one case of each, 5 minutes).
# `make test-peer-programs DSCHAT_SRC=<DeepSpeedExamples>/applications/DeepSpeed-Chat TRL_SRC=<a TRL checkout>`.
# OpenRLHF is installed, pinned and without its dependencies (ray, vllm, flash-attn: none run here), into a
# folder of its own; nothing of either program enters this repository or the venv.
OPENRLHF_SPEC ?= openrlhf==0.11.0
PEER_PKGS := .venv-peers/openrlhf
PEER_OUT ?= .venv-peers/results
$(PEER_PKGS)/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(PEER_PKGS) "$(OPENRLHF_SPEC)" torchdata pylatexenc sympy mpmath pillow
	touch $@

test-peer-programs: setup $(PEER_PKGS)/.installed
	@test -n "$(DSCHAT_SRC)" -a -n "$(TRL_SRC)" || { echo "usage: make test-peer-programs DSCHAT_SRC=<DeepSpeedExamples>/applications/DeepSpeed-Chat TRL_SRC=<a TRL checkout>"; exit 2; }
	$(PY) tools/peer_programs/run.py --out $(PEER_OUT) --dschat-src $(DSCHAT_SRC) --openrlhf-packages $(PEER_PKGS) \
	  --trl-src $(TRL_SRC) $(if $(filter 1,$(QUICK)),--quick)

# TRL's scripts alone (tools/peer_programs/trl/run.py): `make test-peer-trl TRL_SRC=<a TRL checkout>`, about 25 minutes.
test-peer-trl: setup
	@test -n "$(TRL_SRC)" || { echo "usage: make test-peer-trl TRL_SRC=<a TRL checkout>"; exit 2; }
	$(PY) tools/peer_programs/run.py --out $(PEER_OUT) --only trl --trl-src $(TRL_SRC) $(if $(filter 1,$(QUICK)),--quick)

demo: setup
	DS_ACCELERATOR=cpu $(PY) -m torch.distributed.run --standalone --nproc_per_node=2 examples/demo.py

# The differential fuzzer (tests/multi_gpu/fuzz.py): `make fuzz SEED=N [PROFILE=bf16] [KNOBS=1]` replays one
# program; `make fuzz [FUZZ_SECONDS=600] [FUZZ_START=N]` runs new programs for that long.
FUZZ_SECONDS ?= 600
FUZZ_START ?= 100000
PROFILE ?= fp32
fuzz: setup
	DS_ACCELERATOR=cpu $(PY) tests/multi_gpu/fuzz.py $(if $(SEED),--seed $(SEED) --profile $(PROFILE) $(if $(KNOBS),--knobs) $(if $(PARTS),--parts),--seconds $(FUZZ_SECONDS) --start $(FUZZ_START))

# `make bench` reruns every benchmark into benchmarks/results/ and regenerates benchmarks/PERFORMANCE.md and the
# README's performance table from them; `make bench QUICK=1` is a short run (fewer steps, smaller sizes) whose
# results and report go to benchmarks/results/quick/ instead.
QUICK ?= 0
# The benchmarks draw their plots with matplotlib (requirements-bench.txt), installed under the torch constraint.
STAMP_BENCH := $(VENV)/.installed-bench
$(STAMP_BENCH): $(STAMP) requirements-bench.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -r requirements-bench.txt
	touch $@

bench: $(STAMP_BENCH)
	QUICK=$(QUICK) PYTHON=$(PY) bash benchmarks/run_all.sh

# make bench QUICK=1 end to end and the renderer over its results (tests/bench_quick.py; about 5 minutes).
test-bench: $(STAMP_BENCH)
	DS_ACCELERATOR=cpu $(PY) -m pytest -s tests/bench_quick.py

clean:
	rm -rf $(VENV) $(VENV_OLDEST) build *.egg-info
