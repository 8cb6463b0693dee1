# Every target that needs the virtual environment depends on its stamp, so on a fresh machine
# `make test` alone installs everything and runs the suite.
PY      := .venv/bin/python
STAMP   := .venv/.installed
PYTEST_ARGS ?=

.PHONY: setup test test-slow test-all lint bench demo agent-demo async-reward study study-pilot study-first study-sweep-pilot study-sweep-pilot2 study-sweep mutate clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.lock scripts/post_install.py
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first, from the CPU wheel on local disk, so no later step can pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps -r requirements/cpu.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	# tests: the PEFT round trip of LoRA exports (their other requirements are in cpu.lock already)
	$(PY) -m pip install -q --no-deps peft==0.21.2 accelerate==1.16.0
	$(PY) scripts/post_install.py
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu" --durations=30 $(PYTEST_ARGS)

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

# Agentic RL (issue #33): the calculator environment (3-digit addition with a calculator tool), 2
# Megatron ranks (TP=2, gloo), a real SGLang CPU server, FP8 rollout, ACRL, W&B offline, after a
# supervised warm start on tool-call traces; prints the sampled reward's rise and the tool-call rate
# (megatron_acrl/rollout/agent/report.py) as `name: value` lines.
agent-demo: $(STAMP)
	rm -rf runs/agent-demo
	WANDB_SILENT=true OMP_NUM_THREADS=1 $(PY) -m launch.torchrun --standalone --nproc-per-node 2 \
		-m megatron_acrl.train --config configs/agent_demo.yaml --run-dir runs/agent-demo
	$(PY) -m megatron_acrl.rollout.agent.report runs/agent-demo
	@echo "agent demo run: runs/agent-demo (metrics.jsonl, W&B offline run in runs/agent-demo/wandb)"

# Reward parity of async RL: the demo's config in sync and in async (K = 1), both reward curves (and the
# exact J) in docs/async_reward.png, and a table for docs/async.md (scripts/async_reward.py).
async-reward: $(STAMP)
	rm -rf runs/async-reward
	$(PY) scripts/async_reward.py

# The mismatch study (issue #23): stress FP8 + an 8-step weight lag, BF16 / none / TIS / ACRL / ACRL
# extended, 6 seeds x 150 steps, verdicts on the exact metric, two seed shards side by side (--jobs 2,
# each with its shared SGLang servers) -> docs/study/REPORT.md with plots (the pilot's numbers come
# from docs/study/stress_lag_pilot.runs.json, the first study's section is carried over); prints the
# total wall time. `make study STUDY_ARGS=--report-only` regenerates the report from the runs.
STUDY_ARGS ?=
study: $(STAMP)
	$(PY) -m megatron_acrl.study configs/study/stress_lag.yaml --jobs 2 --out runs/study \
		--report docs/study $(STUDY_ARGS)

# The pilot of that grid (its seeds are not the grid's): 4 arms x 2 seeds x 100 steps; a working
# report in runs/study/pilot_report (`make study` puts the pilot's numbers into docs/study/REPORT.md).
study-pilot: $(STAMP)
	$(PY) -m megatron_acrl.study configs/study/stress_lag_pilot.yaml --jobs 2 --out runs/study \
		--report runs/study/pilot_report $(STUDY_ARGS)

# Issue #34's pilot: dual_clip = 3 alone and the step controller alone on BF16 + lag 8, TIS + the
# step controller on stress + lag 8 (2 seeds x 100 steps; the first pilot's BF16 / lag / TIS runs
# are reused from docs/study/stress_lag_pilot.runs.json) -> runs/study/sweep_pilot_report.
study-sweep-pilot: $(STAMP)
	$(PY) -m megatron_acrl.study configs/study/lag_sweep_pilot.yaml --jobs 2 --out runs/study \
		--report runs/study/sweep_pilot_report $(STUDY_ARGS)

# Issue #34's second pilot: the step controller with kappa 1.5, B_min 0.05 (the first pilot found
# the defaults pinned at the floor on BF16 + lag 8 and idle on stress + lag 8) -> runs/study/sweep_pilot2_report.
study-sweep-pilot2: $(STAMP)
	$(PY) -m megatron_acrl.study configs/study/lag_sweep_pilot2.yaml --jobs 2 --out runs/study \
		--report runs/study/sweep_pilot2_report $(STUDY_ARGS)

# Issue #34's lag sweep: lags {0, 2, 8} x {none, TIS, ACRL-ext, TIS + step control, sign-safe ACRL +
# step control, TIS + dual clip at lag 8}, the 30 lag-8 runs of `make study` reused
# (docs/study/stress_lag.runs.json), 48 new runs -> docs/study/REPORT.md with the pre-registered verdicts and the pick table.
# `make study-sweep STUDY_ARGS=--dry-run` lists the runs it would start.
study-sweep: $(STAMP)
	$(PY) -m megatron_acrl.study configs/study/lag_sweep.yaml --jobs 2 --out runs/study \
		--report docs/study $(STUDY_ARGS)

# The first study (issue #7): dense FP8, dense truncated-FP8 stress, MoE stress grids, run
# concurrently (--jobs 3) -> its own report in docs/study/first/ (docs/study/REPORT.md carries the
# section generated from its original runs).
study-first: $(STAMP)
	$(PY) -m megatron_acrl.study configs/study/dense.yaml configs/study/dense_stress.yaml \
		configs/study/moe_stress.yaml --jobs 3 --out runs/study --report docs/study/first $(STUDY_ARGS)

clean:
	rm -rf .venv .pytest_cache .ruff_cache
