"""Records ``tests/data/rl_loss_baseline.pt``: the loss, metrics and gradient of a fixed batch for the
arms the study's lag-8 runs used (issue #34's bit-identity test, ``tests/test_loss_baseline.py``).

Run once, on main before issue #34's change, to freeze today's outputs:
``PYTHONPATH=$PWD .venv/bin/python tests/record_loss_baseline.py``. Rerunning it after a change
that moves the default path would hide that change: do not, unless the change is intended.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_acrl.algo.losses import RLLoss
from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction import AcrlSignal

OUT = Path(__file__).with_name("data") / "rl_loss_baseline.pt"

# (name, algorithm overrides, correction overrides, fused): the study's arms (none, TIS, the paper's
# ACRL and the bounded extension, on the fused CPU kernel its runs took) and the PyTorch path.
CASES = (
    ("none", {}, {"method": "none"}, False),
    ("tis", {}, {"method": "tis"}, False),
    ("tis_dual", {"dual_clip": 3.0}, {"method": "tis"}, False),
    ("acrl_fused", {}, {"method": "acrl", "reference_min": 0.0}, True),
    ("acrl_ext_fused", {}, {"method": "acrl", "eps": 1e-3, "alpha_max": 2.0, "weight_high": 10.0}, True),
    ("acrl_seq_torch", {}, {"method": "acrl", "per_sequence_y": True}, False),
)
SIGNAL = AcrlSignal(x=0.02, y=0.031)


def make_inputs() -> dict[str, torch.Tensor]:
    """A seeded ``[6, 11]`` batch with ragged lengths, a stale sampler and mixed-sign advantages."""
    g = torch.Generator().manual_seed(34)
    b, t = 6, 11
    old = -torch.rand(b, t, generator=g) * 3.0 - 0.05
    roll = old + torch.randn(b, t, generator=g) * 0.4
    logp = old + torch.randn(b, t, generator=g) * 0.3
    lens = torch.tensor([11, 7, 3, 9, 1, 5])
    mask = (torch.arange(t) < lens[:, None]).float()
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    return {"logprobs": logp, "old_logprobs": old, "rollout_logprobs": roll, "advantages": adv,
            "loss_mask": mask}  # fmt: skip


def run_case(inputs: dict[str, torch.Tensor], alg: dict, corr: dict, fused: bool) -> dict[str, torch.Tensor]:
    """Loss, gradient w.r.t. log pi and the partial metrics of one case."""
    logp = inputs["logprobs"].clone().requires_grad_(True)
    loss_fn = RLLoss(AlgorithmConfig(**alg), CorrectionConfig(**corr), fused=fused)
    n_tok = inputs["loss_mask"].sum()
    loss, metrics = loss_fn(logp, inputs, n_tok, torch.tensor(6.0), acrl=SIGNAL)
    loss.backward()
    out = {"loss": loss.detach(), "grad": logp.grad.detach()}
    out.update({f"metric:{k}": v.detach() for k, v in metrics.items()})
    return out


def main() -> None:
    inputs = make_inputs()
    record = {"inputs": inputs}
    for name, alg, corr, fused in CASES:
        record[name] = run_case(inputs, alg, corr, fused)
    OUT.parent.mkdir(exist_ok=True)
    torch.save(record, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
