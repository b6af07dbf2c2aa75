# `make demo`: set up (once) and run the main job on the embedded default.
# `make test`: set up (once) and run the CPU test suite (GPU tests skip without a GPU).
SHELL := /bin/bash
SETUP := ./tools/setup_env.sh
PYTEST_ARGS ?= -q

.PHONY: setup demo test test-gpu bench-kernel

setup:
	@$(SETUP) >/dev/null

demo:
	@PY=$$($(SETUP) | tail -1) && $$PY examples/pretrain_grpo_dualkv.py && $$PY examples/equivalence_demo.py

test:
	@PY=$$($(SETUP) | tail -1) && $$PY -m pytest $(PYTEST_ARGS) tests

test-gpu:
	@PY=$$($(SETUP) | tail -1) && $$PY -m pytest $(PYTEST_ARGS) tests/gpu

bench-kernel:
	@PY=$$($(SETUP) | tail -1) && $$PY tools/bench_kernel.py
