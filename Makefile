# Every target that needs the virtual environment depends on its stamp, so on a fresh machine
# `make test` alone installs everything and runs the suite.
PY      := .venv/bin/python
STAMP   := .venv/.installed
PYTEST_ARGS ?=

.PHONY: setup test test-slow test-all lint bench demo study mutate clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.lock scripts/post_install.py
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first, from the CPU wheel on local disk, so no later step can pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps -r requirements/cpu.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) scripts/post_install.py
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m "slow and not gpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	.venv/bin/lint-imports --no-logo

bench: $(STAMP)
	$(PY) benchmarks/correction_overhead.py
	$(PY) benchmarks/logprob.py
	$(PY) benchmarks/weight_sync.py
	$(PY) benchmarks/fp8_logprob_gap.py
	$(PY) benchmarks/rl_step.py

# Mutation testing of the pure math (mutmut over correction/, losses.py, advantages.py against the
# fast pure tests; long, so not part of `make test`): lists the survivors, prints `mutation score: X`
# last (goal >= 0.9; the equivalent mutants are listed and explained in docs/correction.md).
mutate: $(STAMP)
	$(PY) scripts/mutate.py

# The tiny config end to end: 2 Megatron ranks (TP=2, gloo), a real SGLang CPU server, ACRL, W&B offline.
demo: $(STAMP)
	rm -rf runs/demo
	WANDB_SILENT=true OMP_NUM_THREADS=1 $(PY) -m launch.torchrun --standalone --nproc-per-node 2 \
		-m megatron_acrl.train --config configs/demo.yaml --run-dir runs/demo
	$(PY) -m megatron_acrl.plots runs/demo
	@echo "demo run: runs/demo (metrics.jsonl, W&B offline run in runs/demo/wandb, plots in runs/demo/plots)"

# The mismatch study (issue #7): dense FP8, dense truncated-FP8 stress, MoE stress grids, run
# concurrently (--jobs 3, each with its shared SGLang servers) -> docs/study/REPORT.md with plots;
# prints the total wall time.
study: $(STAMP)
	$(PY) -m megatron_acrl.study configs/study/dense.yaml configs/study/dense_stress.yaml \
		configs/study/moe_stress.yaml --jobs 3 --out runs/study --report docs/study

clean:
	rm -rf .venv .pytest_cache .ruff_cache
