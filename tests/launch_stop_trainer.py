"""The real driver for the SLURM stop tests (``--entry-module tests.launch_stop_trainer``).

    python -m tests.launch_stop_trainer --config run/submitted-config.yaml --run-dir run [k=v ...]

``megatron_acrl.train`` itself (real Megatron ranks, real checkpoints, W&B offline) on the recorded
rollouts in ``STOP_TEST_ROLLOUTS`` (no server), with the faults of ``tests/stop_runner.py`` given as
JSON in ``STOP_TEST_FAULTS`` on the job's first run only (environment knobs like the stand-in
trainer's, inherited through sbatch and srun).
"""

from __future__ import annotations

import json
import os
import sys

from tests.stop_runner import run_with_faults

if __name__ == "__main__":
    first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    faults = json.loads(os.environ.get("STOP_TEST_FAULTS", "{}")) if first else {}
    sys.exit(run_with_faults(faults, [*sys.argv[1:], "--load-rollouts", os.environ["STOP_TEST_ROLLOUTS"]]))
