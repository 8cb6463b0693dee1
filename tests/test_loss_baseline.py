"""Issue #34: with ``step_control: none`` and ``alpha_min`` unset, the loss, the gradient and the
metrics of a recorded batch are bit-identical to the outputs frozen on main before the change
(``tests/data/rl_loss_baseline.pt``, written by ``tests/record_loss_baseline.py``), so the study's
30 lag-8 runs stay valid comparators. Metrics added since are ignored; a removed or changed one fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from record_loss_baseline import CASES, run_case

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import fused_cpu

RECORD = torch.load(Path(__file__).with_name("data") / "rl_loss_baseline.pt", weights_only=True)


@pytest.mark.parametrize(("name", "alg", "corr", "fused"), CASES, ids=[c[0] for c in CASES])
def test_default_path_is_bit_identical(name: str, alg: dict, corr: dict, fused: bool) -> None:
    if fused and not fused_cpu.available():
        pytest.skip("the fused C kernel did not build here")
    cfg = CorrectionConfig(**corr)
    assert cfg.alpha_min is None and cfg.step_control == "none"  # the defaults this test pins
    got = run_case(RECORD["inputs"], alg, corr, fused)
    for key, want in RECORD[name].items():
        assert key in got, f"{name}: {key} is no longer produced"
        assert got[key].dtype == want.dtype, f"{name}: {key} changed dtype"
        assert torch.equal(got[key], want) or (want.isnan().all() and got[key].isnan().all()), (
            f"{name}: {key} changed: {got[key]} != {want}"
        )
