"""The loss and correction tests can fail: known bugs planted in a copy of the package make them fail.

Issue #25 found tests that passed unchanged against a copy with the PPO clip bounds swapped and a
wrong Dr. GRPO denominator (finite differences of the same function, a reference that was the
implementation's own expression, the fused kernel compared with the PyTorch path only). Each plant
below is one such bug, applied to a copy of ``megatron_acrl/`` in a temporary directory; the tests
it names, run on that copy in a subprocess, must fail. ``make mutate`` does the same with every
mutant a mutation-testing tool can make (docs/correction.md, "Tests that can fail").
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (name, file, text, replacement, tests that must fail)
PLANTS = [
    (
        "ppo_clip_bounds_swapped",
        "algo/losses.py",
        "ratio.clamp(1.0 - clip_low, 1.0 + clip_high)",
        "ratio.clamp(1.0 - clip_high, 1.0 + clip_low)",
        [
            "test_losses.py::test_rl_loss_matches_reference_value_and_grad",
            "test_losses.py::test_gradcheck_policy_kl_entropy",
            "test_losses.py::test_acrl_gamma_zero_equals_plain_loss",
            "test_losses.py::test_micro_batches_with_global_denominators_match_whole_batch",
        ],
    ),
    (
        "dr_grpo_denominator",
        "algo/losses.py",
        "return x.sum() / (n_seq * norm_len)",
        "return x.sum() / n_tok",
        [
            "test_losses.py::test_rl_loss_matches_reference_value_and_grad",
            "test_losses.py::test_gradcheck_policy_kl_entropy",
            "test_losses.py::test_acrl_gamma_zero_equals_plain_loss",
            "test_losses.py::test_micro_batches_with_global_denominators_match_whole_batch",
        ],
    ),
    (
        "kl_k3_direction",
        "algo/losses.py",
        "log_r = ref_logprobs.detach() - logprobs",
        "log_r = logprobs - ref_logprobs.detach()",
        [
            "test_losses.py::test_kl_penalty_reference",
            "test_losses.py::test_gradcheck_policy_kl_entropy",
            "test_losses.py::test_micro_batches_with_global_denominators_match_whole_batch",
        ],
    ),
    (  # shared by both kernels: a fused-vs-PyTorch comparison alone cannot see it
        "weight_std_without_the_mean",
        "correction/metrics.py",
        'out[base + "weight_std"] = math.sqrt(max(dev - (mean - 1.0) ** 2, 0.0))',
        'out[base + "weight_std"] = math.sqrt(max(dev, 0.0))',
        [
            "test_fused_cpu.py::test_acrl_weights_and_metrics_equal_pytorch_path",
            "test_fused_cpu.py::test_every_edge_case_on_both_kernels_against_the_reference",
        ],
    ),
]


def _failed(output: str) -> set[str]:
    """``file::test`` of every FAILED line of a ``pytest -rf`` run (parameters stripped)."""
    return {re.sub(r"\[.*$", "", m) for m in re.findall(r"^FAILED tests/(\S+)", output, re.M)}


# The two bugs the issue names run in the default tier; the others with the slow tests.
_TIER = {"ppo_clip_bounds_swapped": (), "dr_grpo_denominator": ()}


@pytest.mark.parametrize(
    "plant", [pytest.param(p, id=p[0], marks=_TIER.get(p[0], pytest.mark.slow)) for p in PLANTS]
)
def test_planted_bug_fails_the_tests_named_for_it(plant, tmp_path):
    name, rel, text, bug, must_fail = plant
    for part in ("megatron_acrl", "tests"):  # run from the copy: its directory comes first on sys.path
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / "megatron_acrl" / rel
    source = target.read_text()
    assert source.count(text) == 1, f"plant {name}: {text!r} is no longer in {rel} exactly once"
    target.write_text(source.replace(text, bug))
    where = subprocess.run(
        [sys.executable, "-c", "import megatron_acrl; print(megatron_acrl.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(tmp_path)), f"the copy is not what the tests import: {where}"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rf",
            "-p",
            "no:cacheprovider",
            # fixed examples: each named test must fail on every run, not on most draws
            "--hypothesis-seed=0",
            *[f"tests/{t}" for t in must_fail],
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    missed = set(must_fail) - _failed(out)
    assert not missed, f"plant {name} left {sorted(missed)} passing:\n{out[-3000:]}"
