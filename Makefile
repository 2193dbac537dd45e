# Two commands for a newcomer: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo demo-lm test test-properties bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Pin torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[test,demo]"
	touch $@

install: $(VENV)/.installed

# Eagle3 draft training under context parallelism beside one process (demo_out/eagle3.png)
demo: install
	$(PY) -m ringattn.cli demo

# the plain causal-LM demo (demo_out/losses.png)
demo-lm: install
	$(PY) -m ringattn.cli demo --target lm

test: install
	$(PY) -m pytest -q tests

# the property-based exactness test with 2000 fresh examples per world size (about 4 minutes)
test-properties: install
	RINGATTN_PROPERTY_EXAMPLES=2000 $(PY) -m pytest -q tests/distributed/test_properties.py

# Benchmarks (about 70 minutes on 2 cores): JSON + PNG under benchmarks/results/.
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
	$(PY) benchmarks/bench_yunchang.py
	$(PY) benchmarks/bench_soak.py
	$(PY) benchmarks/bench_host.py
	$(PY) benchmarks/bench_compile.py
	$(PY) benchmarks/strategy_table.py
	-$(PIP) install -q --no-deps yunchang
	$(PY) benchmarks/bench_yunchang.py
	$(PY) benchmarks/report.py

clean:
	rm -rf $(VENV) demo_out
