"""Issue #34: sign-safe ACRL (``correction.alpha_min``) on both kernels against float64 references,
its gradients, the study's replay, and the two audit defects (``weight_sq_mean`` of an empty batch,
the dtype of the PyTorch path's alpha)."""

from __future__ import annotations

import math

import pytest
import torch
from reference import ref_alpha, ref_weights

from megatron_acrl.algo.losses import RLLoss
from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction import (
    AcrlSignal,
    MismatchTensors,
    acrl_alpha,
    compute_correction,
    finalize_metrics,
    fused_cpu,
)
from megatron_acrl.study.replay import replay

KERNELS = [False, True] if fused_cpu.available() else [False]
STALE = AcrlSignal(x=0.02, y=0.05)  # Y/X = 2.5: the paper's alpha is negative on A > 0


def stale_batch(seed: int = 3, b: int = 5, t: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.1
    lq = lp + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.arange(t) < torch.tensor([8, 5, 2, 7, 3])[:, None]
    adv = torch.tensor([[1.0], [-0.5], [2.0], [-1.5], [0.7]], dtype=torch.float64).expand(b, t)
    return lp.float(), lq.float(), mask, adv.float().contiguous()


@pytest.mark.parametrize(
    ("alpha_max", "alpha_min"), [(None, None), (0.3, None), (None, 0.0), (0.3, 0.0), (0.5, -0.1), (None, 0.2)]
)
def test_alpha_is_clipped_to_its_bounds_in_float64(alpha_max, alpha_min) -> None:
    adv = torch.tensor([[1.0, -2.0, 0.0, 3.0]], dtype=torch.float32)
    for c in (-0.9, -0.05, 0.0, 0.4, 1.7):
        got = acrl_alpha(adv, c, alpha_max, alpha_min)
        assert got.dtype == torch.float64  # the audit: float32 advantages gave float32 alpha
        cfg = CorrectionConfig(method="acrl", alpha_max=alpha_max, alpha_min=alpha_min)
        want = [ref_alpha(cfg, a, c) for a in adv[0].tolist()]
        assert got[0].tolist() == want


def test_alpha_of_a_per_sequence_coefficient_is_float64_too() -> None:
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    coef = torch.tensor([[-0.3], [0.2]], dtype=torch.float64)
    got = acrl_alpha(adv, coef, None, 0.0)
    assert got.dtype == torch.float64
    assert got.tolist() == [[0.0, 0.0], [0.0, 0.0]]  # -0.3 and -0.2: both clipped to 0


@pytest.mark.parametrize("fused", KERNELS, ids=lambda f: "fused_cpu" if f else "torch")
@pytest.mark.parametrize("overrides", [{"alpha_min": 0.0}, {"alpha_min": 0.0, "alpha_max": 0.4}])
def test_sign_safe_weights_match_the_reference_and_never_invert(fused: bool, overrides: dict) -> None:
    lp, lq, mask, adv = stale_batch()
    cfg = CorrectionConfig(method="acrl", gamma=1.0, **overrides)
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    corr = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=STALE)
    want = torch.tensor(ref_weights(cfg, lp, lq, mask, adv, x=STALE.x, y=STALE.y), dtype=torch.float64)
    torch.testing.assert_close(corr.weights.double(), want, rtol=1e-5, atol=1e-6)
    rho = torch.exp((lp - lq).double())
    w, pos = corr.weights.double(), (adv > 0) & mask
    assert (w[pos] == 1.0).all()  # alpha = 0 there: the paper's law would invert rho
    neg = (adv < 0) & mask  # alpha >= 0: the weight rho ** alpha is on rho's side of 1, never inverted
    assert ((w[neg] - 1) * (rho[neg] - 1) >= -1e-7).all()
    assert finalize_metrics(corr.metrics)["acrl/alpha_mean"] >= 0


def _ref_loss_and_grad(lp_new, lp, lq, mask, adv, cfg, alg) -> tuple[float, list[list[float]]]:
    """Token-mean clipped surrogate ``sum w * max(-A r, -A clip(r)) / n`` and its gradient d/d log pi,
    in float64 Python (r = exp(log pi - log pi_old), w the reference weights)."""
    w = ref_weights(cfg, lp, lq, mask, adv, x=STALE.x, y=STALE.y)
    n = int(mask.sum())
    total, grad = 0.0, [[0.0] * lp.shape[1] for _ in range(lp.shape[0])]
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            a, r = float(adv[i, t]), math.exp(float(lp_new[i, t]) - float(lp[i, t]))
            rc = min(max(r, 1 - alg.clip_low), 1 + alg.clip_high)
            l1, l2 = -a * r, -a * rc
            total += w[i][t] * max(l1, l2) / n
            grad[i][t] = w[i][t] * (-a * r if l1 >= l2 else 0.0) / n  # the clipped branch has no gradient
    return total, grad


@pytest.mark.parametrize("fused", KERNELS, ids=lambda f: "fused_cpu" if f else "torch")
def test_sign_safe_loss_and_gradient_match_a_float64_reference(fused: bool) -> None:
    lp, lq, mask, adv = stale_batch(seed=11)
    g = torch.Generator().manual_seed(5)
    new = (lp.double() + 0.1 * torch.randn(lp.shape, generator=g, dtype=torch.float64)).float()
    cfg = CorrectionConfig(method="acrl", gamma=0.8, alpha_min=0.0)
    alg = AlgorithmConfig(loss_agg="token-mean", clip_high=0.28)
    logp = new.clone().requires_grad_(True)
    batch = {"old_logprobs": lp, "rollout_logprobs": lq, "advantages": adv, "loss_mask": mask.float()}
    loss, _ = RLLoss(alg, cfg, fused=fused)(logp, batch, mask.sum(), mask.any(-1).sum(), acrl=STALE)
    loss.backward()
    want, grad = _ref_loss_and_grad(new, lp, lq, mask, adv, cfg, alg)
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(
        logp.grad.double(), torch.tensor(grad, dtype=torch.float64), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("fused", KERNELS, ids=lambda f: "fused_cpu" if f else "torch")
def test_weight_sq_mean_of_a_batch_without_a_valid_token_reads_like_its_siblings(fused: bool) -> None:
    lp, lq, _, adv = stale_batch()
    mask = torch.zeros(lp.shape, dtype=torch.bool)
    for method in ("none", "tis", "acrl"):
        cfg = CorrectionConfig(method=method)
        sh = MismatchTensors(lp, lq, mask, fused=fused)
        corr = compute_correction(cfg, sh, num_tokens=0, num_seqs=0, advantages=adv, acrl=STALE)
        fin = finalize_metrics(corr.metrics)
        assert fin["correction/weight_mean"] == 0.0 and fin["correction/weight_std"] == 0.0
        assert fin["correction/weight_sq_mean"] == 0.0, method  # was -1.0
        assert math.isnan(fin["correction/ess"])


def test_replay_reports_the_larger_alpha_of_both_signs_under_the_bounds() -> None:
    rows = [{"mismatch/prob_abs_diff": y, "mismatch/log_ratio_min": -1.0, "mismatch/log_ratio_max": 2.0}
            for y in (0.01, 0.03, 0.005)]  # fmt: skip
    # X = 0.01: coef = gamma (1 - Y/X) = -1.3 then +0.65 (gamma 0.65)
    paper = replay(rows, CorrectionConfig(method="acrl", reference_min=0.0))
    assert paper.alpha == pytest.approx([0.0, 1.3, 0.325])
    safe = replay(rows, CorrectionConfig(method="acrl", reference_min=0.0, alpha_min=0.0, alpha_max=1.0))
    # sign-safe: |alpha| = max(clip(c), clip(-c)) over [0, 1]: 1.0 (A < 0 gets +1.3, capped) and 0.325
    assert safe.alpha == pytest.approx([0.0, 1.0, 0.325])
    assert safe.log10_weight[1] == pytest.approx(1.0 * 2.0 / math.log(10))
