"""The sequence-level corrections on a long agent trajectory: no underflow, weights equal a float64
reference taken in log space, at sequence and at segment (per-turn) level.

A 4,000-token row: a prompt, 6 turns of generated tokens separated by observation gaps (loss_mask 0,
turn -1), per-token log-ratios ``log pi_old - log mu`` drawn as an FP8 sampler's are (a small negative
mean, spread 0.05: every token-level ratio within a few percent of 1). Over ~3,500 generated tokens the
sum of log-ratios is about -105: ``exp`` of it, or the product of the per-token ratios, is 0 in float32
(the smallest float32 is e^-103.3), which is how NeMo-RL's 40-60-turn runs saw a sequence weight of
0.06 against 0.9999 token-level. The code never forms that product: it sums log-ratios in float64 and
exponentiates after the method's clamp.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import (
    MismatchTensors,
    compute_correction,
    finalize_metrics,
    fused_cpu,
    mismatch_metrics,
)

KERNELS = [False, True] if fused_cpu.available() else [False]
BOUND = 20.0  # the saturation bound of an exponentiated log-ratio (correction/mismatch.py)
TURNS = 6


def long_trajectory(seed: int = 0, length: int = 4000, prompt: int = 120, gap: int = 60):
    """``(lp, lq, mask, turn_ids)`` ``[1, length]`` float32: a prompt, then TURNS turns with an
    observation of ``gap`` tokens after each but the last."""
    g = torch.Generator().manual_seed(seed)
    gen_total = length - prompt - gap * (TURNS - 1)
    cuts = torch.linspace(0, gen_total, TURNS + 1).round().long().tolist()
    mask = torch.zeros(1, length, dtype=torch.bool)
    turns = torch.full((1, length), -1, dtype=torch.int64)
    pos = prompt
    for k in range(TURNS):
        n = cuts[k + 1] - cuts[k]
        mask[0, pos : pos + n] = True
        turns[0, pos : pos + n] = k
        pos += n + gap
    assert pos - gap == length
    lq = -torch.rand(1, length, generator=g, dtype=torch.float64) * 4  # log mu of the sampled tokens
    d = -0.03 + 0.05 * torch.randn(1, length, generator=g, dtype=torch.float64)  # log pi_old - log mu
    lp = lq + d
    return lp.float(), lq.float(), mask, turns


def ref_units(lp, lq, mask, turns, level):
    """``{unit: (sum of log rho, token count, [positions])}``, in float64 (math.fsum of the exact
    differences of the float32 inputs)."""
    groups: dict[int, list[int]] = {}
    for t in range(lp.shape[1]):
        if mask[0, t]:
            groups.setdefault(int(turns[0, t]) if level == "segment" else 0, []).append(t)
    return {
        u: (math.fsum(float(lp[0, t]) - float(lq[0, t]) for t in ts), len(ts), ts) for u, ts in groups.items()
    }


def ref_log_weight(cfg: CorrectionConfig, s: float, n: int) -> float | None:
    """The unit's log weight (None: the unit is dropped), in log space, from the definition."""
    lo = math.log(cfg.seq_low) if cfg.seq_low > 0 else -math.inf
    hi = math.log(cfg.seq_high)
    if cfg.method == "seq_tis":
        return min(max(min(max(s, lo), hi), -BOUND), BOUND)
    if cfg.method == "seq_mis":
        return min(max(s, -BOUND), BOUND) if lo <= s <= hi else None
    if cfg.method == "geo_mis":
        return 0.0 if math.log(cfg.geo_low) <= s / n <= math.log(cfg.geo_high) else None
    raise ValueError(cfg.method)


def test_the_trajectory_is_what_it_claims_and_the_naive_product_underflows():
    lp, lq, mask, turns = long_trajectory()
    assert lp.shape == (1, 4000) and int(mask.sum()) == 4000 - 120 - 5 * 60
    assert sorted(set(turns[mask].tolist())) == list(range(TURNS)) and bool((turns[~mask] == -1).all())
    d32 = (lp - lq)[mask]  # float32, as a naive implementation holds it
    rho = torch.exp(d32)
    assert float(rho.min()) > 0.75 and float(rho.max()) < 1.25  # token level: every ratio near 1
    s = ref_units(lp, lq, mask, turns, "sequence")[0][0]
    assert -120 < s < -104  # below float32's smallest value, e^-103.3
    # the naive forms: exp of the float32 sum, the product of the float32 ratios, its geometric mean
    assert float(torch.exp(d32.sum())) == 0.0
    assert float(torch.prod(rho)) == 0.0
    assert float(torch.prod(rho) ** (1.0 / d32.numel())) == 0.0  # would drop the row from any geo band
    assert math.exp(s / d32.numel()) == pytest.approx(0.97, abs=0.005)  # the true geometric mean


CASES = [
    ("seq_tis", dict(method="seq_tis", seq_low=0.5, seq_high=2.0)),
    ("seq_tis_open", dict(method="seq_tis", seq_low=0.0, seq_high=2.0)),
    ("seq_mis_open", dict(method="seq_mis", seq_low=0.0, seq_high=2.0)),
    ("seq_mis", dict(method="seq_mis", seq_low=1e-12, seq_high=2.0)),
    ("geo_mis", dict(method="geo_mis", geo_low=0.95, geo_high=1.05)),
    ("geo_mis_tight", dict(method="geo_mis", geo_low=0.999, geo_high=1.001)),
]


# the fused pass takes float32 log-probs; float64 inputs run the PyTorch path (float64 weights)
INPUTS = [(f, torch.float32) for f in KERNELS] + [(False, torch.float64)]


@pytest.mark.parametrize(
    "fused,dtype", INPUTS, ids=[f"{'fused_cpu' if f else 'torch'}-{str(d)[6:]}" for f, d in INPUTS]
)
@pytest.mark.parametrize("level", ["sequence", "segment"])
@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_sequence_methods_on_4000_tokens_equal_the_log_space_reference(fused, level, name, kw, dtype):
    lp, lq, mask, turns = long_trajectory()
    lp, lq = lp.to(dtype), lq.to(dtype)
    cfg = CorrectionConfig(level=level, **kw)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    n_tok = int(mask.sum())
    corr = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=1, turn_ids=turns)
    w = corr.weights.double()
    assert bool(torch.isfinite(w).all())
    assert bool((w[~mask] == 0).all())
    for s, n, ts in ref_units(lp, lq, mask, turns, level).values():
        log_w = ref_log_weight(cfg, s, n)
        want = 0.0 if log_w is None else math.exp(log_w)
        got = w[0, ts]
        assert bool((got == got[0]).all())  # one weight per unit
        # float32 weights: rounding of the float32 result only; float64: of the float64 sum
        assert float(got[0]) == pytest.approx(want, rel=1e-6 if dtype == torch.float32 else 1e-12, abs=0)
        if log_w is not None:
            assert float(got[0]) > 0.0  # nothing underflowed to a dropped unit
    metrics = finalize_metrics({**corr.metrics, **mismatch_metrics(sh, num_tokens=n_tok, num_seqs=1)})
    # ess = E[w]^2 / E[w^2] is derived from E[w] and E[(w - 1)^2], partials kept for weights near 1:
    # when every weight is below ~1e-8 (a floor of e^-20) E[w^2] cancels to 0 and ess reads NaN
    # ("unknown"), never a wrong number; every other statistic stays finite
    tiny = float(w[mask].max()) < 1e-7
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v) and not (tiny and k == "correction/ess")}
    assert not bad
    assert metrics["mismatch/chi2_seq"] == pytest.approx(-1.0)  # E[(prod rho)^2] - 1, prod rho ~ e^-105


@pytest.mark.parametrize("fused", KERNELS, ids=lambda f: "fused_cpu" if f else "torch")
def test_what_the_long_trajectory_keeps_at_each_level(fused):
    """The figures the docs quote: at sequence level seq_tis cuts the row to its floor and seq_mis drops
    it; at segment level each turn (~580 tokens, log-ratio sum ~ -17) keeps its own weight e^S_k,
    ~1e-8..1e-7, and geo_mis keeps the row in [0.95, 1.05] (the naive float32 form dropped it)."""
    lp, lq, mask, turns = long_trajectory()
    sh = MismatchTensors(lp, lq, mask, fused=fused)

    def w(level, **kw):
        return compute_correction(
            CorrectionConfig(level=level, **kw), sh, num_tokens=1, num_seqs=1, turn_ids=turns
        )

    assert float(w("sequence", method="seq_tis").weights[mask].max()) == pytest.approx(0.5)
    assert float(w("sequence", method="seq_mis", seq_low=1e-12).weights.sum()) == 0.0  # e^-105 < 1e-12
    seg = w("segment", method="seq_mis", seq_low=1e-12).weights[mask]
    units = ref_units(lp, lq, mask, turns, "segment")
    assert len({round(float(v), 20) for v in seg}) == TURNS
    assert bool((seg > 1e-9).all() & (seg < 1e-6).all())
    for s, _, _ in units.values():
        assert -25 < s < -12
    assert bool((w("sequence", method="geo_mis", geo_low=0.95, geo_high=1.05).weights[mask] == 1).all())


def _agent_batch():
    """A two-row batch through the batch contract (``build_batch``): prompt, turn 0, an observation,
    turn 1; the trainer's log pi_old drifts from the server's on turn 1 of row 0 only."""
    from megatron_acrl.batch.rollout_batch import build_batch

    out = [[10, 11, 12, 20, 21, 13, 14], [10, 11, 20, 21, 22, 13, 14]]
    gen = [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 1, 1]]
    turns = [[0, 0, 0, -1, -1, 1, 1], [0, 0, -1, -1, -1, 1, 1]]
    lp = [[-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5], [-0.3, -0.2, 0.0, 0.0, 0.0, -0.6, -0.7]]
    vers = [[3 if t == 0 else 4 if t == 1 else -1 for t in row] for row in turns]
    b = build_batch([[1, 2], [1, 2]], out, lp, rewards=[1.0, 0.0], group_ids=[0, 0], pad_id=0, generated=gen,
                    turn_ids=turns, token_versions=vers)  # fmt: skip
    tb = dict(b.tensors())
    old = tb["rollout_logprobs"].clone()
    old[0][tb["turn_ids"][0] == 1] += 0.5  # turn 1 of row 0: rho = e^0.5 per token
    tb["old_logprobs"] = old
    return tb


def test_the_driver_logs_the_mismatch_of_each_turn_of_a_built_batch():
    """``train.drift_metrics`` (called by the driver every step) on a batch from the batch contract:
    ``mismatch_turn/<k>/*`` for both turns, turn 0 exact, turn 1 the drift of its 4 tokens (2 of them
    drifted by 0.5: k1 = E[log mu - log pi_old] = -0.25), beside the staleness split by lag."""
    from megatron_acrl.train import drift_metrics

    m = drift_metrics(_agent_batch(), trainer_version=4)  # type: ignore[arg-type]
    assert m["mismatch_turn/0/kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch_turn/1/kl"] == pytest.approx(-0.25, rel=1e-6)
    assert m["mismatch_turn/1/k3_kl"] == pytest.approx((math.exp(0.5) - 1.5) / 2, rel=1e-6)
    assert not any(k.startswith("mismatch_turn/2/") for k in m)
    assert m["async/lag_frac/0"] == pytest.approx(4 / 9) and m["async/lag_frac/1"] == pytest.approx(5 / 9)


@pytest.mark.parametrize("fused", KERNELS, ids=lambda f: "fused_cpu" if f else "torch")
def test_the_loss_drops_only_the_drifting_turn_of_a_built_batch(fused):
    """rl_loss at segment level on the built batch's own turn_ids: seq_mis ([0.5, 2]) drops turn 1
    of row 0 (prod rho = e^1) and keeps every other turn; at sequence level it drops row 0 whole."""
    from megatron_acrl.algo.losses import rl_loss
    from megatron_acrl.config import AlgorithmConfig

    tb = _agent_batch()
    mask = tb["loss_mask"]
    adv = torch.ones_like(mask)
    kw = dict(algorithm=AlgorithmConfig(loss_agg="token-mean"), acrl=None, num_tokens=int(mask.sum()),
              num_seqs=2, fused=fused, turn_ids=tb["turn_ids"])  # fmt: skip
    for level, dropped in (("segment", 2), ("sequence", 5)):
        cfg = CorrectionConfig(method="seq_mis", level=level)
        x = tb["old_logprobs"].clone().requires_grad_(True)
        loss, _ = rl_loss(x, tb["old_logprobs"], tb["rollout_logprobs"], adv, mask, correction=cfg, **kw)
        loss.backward()
        # token-mean of -A r with r = 1: -(kept tokens) / 9; the gradient is -1/9 on each kept token
        assert float(loss.detach()) == pytest.approx(-(9 - dropped) / 9, rel=1e-6)
        assert int((x.grad != 0).sum()) == 9 - dropped
