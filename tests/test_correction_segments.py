"""``correction.level: segment``: the sequence-level corrections taken per agent turn.

The reference below is written from the definition (docs/correction.md, ROLL's ``segment`` weight
type), in Python floats (float64) and loops over each row's turns, never from the code: a segment is
the valid tokens of one row that one turn generated; its log-ratio is the sum of ``log pi_old - log mu``
over them. Every check runs on both kernels (the segment weights are PyTorch on both; the fused pass
supplies the valid tokens).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_rl_loss

from megatron_acrl.algo.losses import rl_loss
from megatron_acrl.config import AlgorithmConfig, ConfigError, CorrectionConfig
from megatron_acrl.correction import (
    MismatchTensors,
    combine_partials,
    compute_correction,
    finalize_metrics,
    fused_cpu,
)
from megatron_acrl.correction.segments import Segments
from megatron_acrl.correction.weights import batch_weight_mean

BOUND = 20.0
FUSED = pytest.mark.parametrize(
    "fused",
    [False, pytest.param(True, marks=pytest.mark.skipif(not fused_cpu.available(), reason="no C compiler"))],
    ids=["torch", "fused_cpu"],
)


# ------------------------------------------------------------------------------------------------
# The float64 reference
# ------------------------------------------------------------------------------------------------


def _clip(v: float, lo: float, hi: float) -> float:
    return min(max(v, lo), hi)


def _band(v: float, low: float, high: float) -> bool:
    """``low <= exp(v) <= high`` for a log value ``v`` (``low == 0``: no lower bound)."""
    return (low == 0 or v >= math.log(low)) and v <= math.log(high)


def ref_segments(cfg, lp, lq, mask, turns):
    """``{(row, turn): [t, ...]}`` over the valid tokens (mask set, both log-probs finite)."""
    units: dict[tuple[int, int], list[int]] = {}
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            p, q = float(lp[i, t]), float(lq[i, t])
            if bool(mask[i, t]) and math.isfinite(p) and math.isfinite(q):
                units.setdefault((i, int(turns[i, t])), []).append(t)
    return units


def ref_segment_correction(cfg, lp, lq, mask, turns, *, n_tok=None, weight_mean=None):
    """``(weights [B][T], metrics)`` of ``cfg`` at segment level."""
    b, t_len = lp.shape
    w = [[0.0] * t_len for _ in range(b)]
    units = ref_segments(cfg, lp, lq, mask, turns)
    n_valid = sum(len(ts) for ts in units.values())
    n_tok = n_valid if n_tok is None else n_tok
    frac = dict.fromkeys(("high", "low", "masked", "veto"), 0)
    lo = math.log(cfg.seq_low) if cfg.seq_low > 0 else -math.inf
    hi = math.log(cfg.seq_high)
    for (i, _turn), ts in units.items():
        d = {t: float(lp[i, t]) - float(lq[i, t]) for t in ts}
        s = sum(d.values())
        mean = s / len(ts)
        keep = True
        for t in ts:
            r = math.exp(_clip(d[t], -BOUND, BOUND))
            if cfg.method == "seq_tis":
                w[i][t] = math.exp(_clip(_clip(s, lo, hi), -BOUND, BOUND))
            elif cfg.method == "seq_mis":
                w[i][t] = math.exp(_clip(s, -BOUND, BOUND))
            elif cfg.method == "tis":
                w[i][t] = _clip(r, cfg.tis_low, cfg.tis_high)
            elif cfg.method in ("none", "geo_mis"):
                w[i][t] = 1.0
            else:
                raise ValueError(cfg.method)
        if cfg.method == "seq_tis":
            frac["high"] += len(ts) * (s > hi)
            frac["low"] += len(ts) * (s < lo)
        if cfg.method == "seq_mis":
            keep = _band(s, cfg.seq_low, cfg.seq_high)
        if cfg.method == "geo_mis":
            keep = _band(mean, cfg.geo_low, cfg.geo_high)
        for extra in cfg.masks:
            keep &= (
                _band(s, cfg.seq_low, cfg.seq_high)
                if extra == "seq_mis"
                else _band(mean, cfg.geo_low, cfg.geo_high)
            )
        frac["masked"] += len(ts) * (not keep)
        if cfg.veto_threshold is not None:
            vetoed = any(v < math.log(cfg.veto_threshold) for v in d.values())
            frac["veto"] += len(ts) * vetoed
            keep &= not vetoed
        if not keep:
            for t in ts:
                w[i][t] = 0.0
    vals = [w[i][t] for (i, _), ts in units.items() for t in ts]
    if cfg.batch_normalize:
        mean_w = sum(vals) / max(n_valid, 1) if weight_mean is None else weight_mean
        w = [[v / max(mean_w, 1e-8) for v in row] for row in w]
        vals = [w[i][t] for (i, _), ts in units.items() for t in ts]
    n = max(n_tok, 1)
    metrics = {"correction/weight_mean": sum(vals) / n}
    if vals:
        metrics["correction/weight_max"], metrics["correction/weight_min"] = max(vals), min(vals)
    if cfg.method == "seq_tis":
        metrics["correction/seg_clip_frac_high"] = frac["high"] / n
        metrics["correction/seg_clip_frac_low"] = frac["low"] / n
    if cfg.method in ("seq_mis", "geo_mis") or cfg.masks:
        metrics["correction/seg_masked_frac"] = frac["masked"] / n
    if cfg.veto_threshold is not None:
        metrics["correction/seg_veto_frac"] = frac["veto"] / n
    return w, metrics


# ------------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------------


def multi_turn_batch(seed: int = 0, b: int = 5, t: int = 24, scale: float = 0.08, turns: int = 4):
    """``(lp, lq, mask, turn_ids, adv)``: rows of a prompt, then turns of generated tokens separated
    by observation gaps (mask 0, turn -1); one turn per row drifts hard; one row is empty, one has a
    one-token turn (a segment's mean must divide by its own count)."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.05
    lq = lp + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    turn_ids = torch.full((b, t), -1, dtype=torch.int64)
    for i in range(b - 1):
        pos = 2 + i % 2  # the prompt
        for k in range(turns):
            n = int(torch.randint(1, 5, (1,), generator=g)) if not (i == 1 and k == 2) else 1
            n = min(n, t - pos)
            mask[i, pos : pos + n] = True
            turn_ids[i, pos : pos + n] = k
            pos += n + 1  # an observation token between turns
            if pos >= t:
                break
        bad = i % turns  # one turn drifts: log mu far below log pi_old on its tokens
        lq[i][turn_ids[i] == bad] += 0.6 if i % 2 else -0.6  # rho = e^-0.6 or e^0.6 on that turn
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    return lp.float(), lq.float(), mask, turn_ids, adv.float()


CONFIGS = {
    "seq_tis": dict(method="seq_tis", seq_low=0.7, seq_high=1.3),
    "seq_tis_open_low": dict(method="seq_tis", seq_low=0.0, seq_high=1.3),
    "seq_mis": dict(method="seq_mis", seq_low=0.6, seq_high=1.5),
    "geo_mis": dict(method="geo_mis", geo_low=0.93, geo_high=1.07),
    "tis_masks": dict(method="tis", masks=("seq_mis", "geo_mis"), seq_low=0.5, geo_low=0.9, geo_high=1.1),
    "geo_mask_only": dict(method="none", masks=("geo_mis",), geo_low=0.9, geo_high=1.1),
    "seq_tis_veto": dict(method="seq_tis", seq_low=0.7, veto_threshold=0.7),
    "none_veto_norm": dict(method="none", veto_threshold=0.6, batch_normalize=True),
    "seq_mis_norm": dict(method="seq_mis", seq_low=0.5, batch_normalize=True),
}


def _seg(**kw) -> CorrectionConfig:
    return CorrectionConfig(level="segment", **kw)


def _check(got, want_w, want_m, *, atol=1e-6):
    assert torch.allclose(
        got.weights.double(), torch.tensor(want_w, dtype=torch.float64), rtol=1e-5, atol=atol
    )
    m = finalize_metrics(got.metrics)
    for k, v in want_m.items():
        assert m[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    seg_keys = {k for k in m if k.startswith("correction/seg_")}
    assert seg_keys == {k for k in want_m if k.startswith("correction/seg_")}
    assert not any(k.startswith("correction/seq_") for k in m)  # token fractions, not sequence ones


# ------------------------------------------------------------------------------------------------
# Values against the reference
# ------------------------------------------------------------------------------------------------


@FUSED
@pytest.mark.parametrize("name", list(CONFIGS))
def test_segment_weights_and_metrics_match_the_float64_reference(fused, name):
    cfg = _seg(**CONFIGS[name])
    for seed in (0, 1, 2):
        lp, lq, mask, turns, _ = multi_turn_batch(seed)
        n_tok = int(mask.sum())
        got = compute_correction(cfg, MismatchTensors(lp, lq, mask, fused=fused), num_tokens=n_tok,
                                 num_seqs=4, turn_ids=turns)  # fmt: skip
        want_w, want_m = ref_segment_correction(cfg, lp, lq, mask, turns)
        _check(got, want_w, want_m)


def test_the_batches_exercise_every_branch():
    """The reference cases above are not vacuous: on these batches each band drops, clips or keeps
    some segments and not all, so a rule that is off by a unit or a bound shows."""
    seen = {name: set() for name in CONFIGS}
    for seed in (0, 1, 2):
        lp, lq, mask, turns, _ = multi_turn_batch(seed)
        for name, kw in CONFIGS.items():
            w, _ = ref_segment_correction(_seg(**kw), lp, lq, mask, turns)
            seen[name] |= {
                round(w[i][t], 12) for i in range(lp.shape[0]) for t in range(lp.shape[1]) if mask[i, t]
            }
    for name in ("seq_mis", "geo_mis", "tis_masks", "geo_mask_only", "seq_tis_veto", "none_veto_norm"):
        assert 0.0 in seen[name] and len(seen[name]) > 1, name
    assert min(seen["seq_tis"]) == pytest.approx(0.7) and max(seen["seq_tis"]) == pytest.approx(1.3)
    assert any(0.7 < v < 1.3 for v in seen["seq_tis"])  # clipped both ways, and some inside the band
    assert min(seen["seq_tis_open_low"]) < 0.7  # no lower clamp: the product itself


@FUSED
def test_one_bad_turn_drops_only_that_turn(fused):
    """The point of the segment level: a 5-turn row whose turn 3 drifts. Sequence-level seq_mis drops
    the whole row; segment level drops turn 3 only and keeps the other turns' own ratios."""
    t = 50
    lp = torch.full((1, t), -1.0)
    lq = lp - 0.01
    mask = torch.zeros(1, t, dtype=torch.bool)
    turns = torch.full((1, t), -1)
    for k in range(5):
        mask[0, k * 10 + 2 : k * 10 + 9] = True
        turns[0, k * 10 + 2 : k * 10 + 9] = k
    lq[0, 32:39] = -3.0  # turn 3: rho = e^2 per token
    kw = dict(method="seq_mis", seq_low=0.5, seq_high=2.0)
    seq_cfg = CorrectionConfig(**kw)
    seq = compute_correction(seq_cfg, MismatchTensors(lp, lq, mask, fused=fused), num_tokens=35, num_seqs=1)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    seg = compute_correction(_seg(**kw), sh, num_tokens=35, num_seqs=1, turn_ids=turns)
    assert float(seq.weights.sum()) == 0.0
    kept = seg.weights[0][mask[0]].view(5, 7)
    assert torch.all(kept[3] == 0)
    assert torch.allclose(kept[[0, 1, 2, 4]], torch.full((4, 7), math.exp(0.07)), rtol=1e-5)
    assert finalize_metrics(seg.metrics)["correction/seg_masked_frac"] == pytest.approx(7 / 35)


@FUSED
@pytest.mark.parametrize("name", ["seq_tis", "seq_mis", "geo_mis", "tis_masks", "seq_tis_veto"])
def test_one_turn_per_row_is_the_sequence_level_exactly(fused, name):
    """A single-turn batch (every trained token in turn 0) at segment level gives the sequence level's
    weights bit for bit; without turn_ids the segment level is the sequence level."""
    lp, lq, mask, _, adv = multi_turn_batch(3)
    turns = torch.where(mask, 0, -1)
    seq_cfg = CorrectionConfig(**CONFIGS[name])
    kw = dict(num_tokens=int(mask.sum()), num_seqs=4, advantages=adv)
    seq = compute_correction(seq_cfg, MismatchTensors(lp, lq, mask, fused=fused), **kw)
    seg = compute_correction(
        _seg(**CONFIGS[name]), MismatchTensors(lp, lq, mask, fused=fused), turn_ids=turns, **kw
    )
    none = compute_correction(_seg(**CONFIGS[name]), MismatchTensors(lp, lq, mask, fused=fused), **kw)
    assert torch.equal(seq.weights, seg.weights) and torch.equal(seq.weights, none.weights)
    assert seq.metrics.keys() == none.metrics.keys()


@FUSED
def test_turn_ids_off_the_trained_tokens_are_never_read(fused):
    """Whatever turn_ids hold on prompt, observation and padding tokens (and NaN log-probs there), the
    weights are the same; float turn ids (the loss adapter hands float32) are read as integers."""
    lp, lq, mask, turns, _ = multi_turn_batch(4)
    cfg = _seg(**CONFIGS["seq_tis_veto"])
    base = compute_correction(cfg, MismatchTensors(lp, lq, mask, fused=fused), num_tokens=1, num_seqs=1,
                              turn_ids=turns)  # fmt: skip
    lp2, lq2 = lp.clone(), lq.clone()
    lp2[~mask], lq2[~mask] = float("nan"), float("inf")
    junk = torch.where(mask, turns, 7).float()
    other = compute_correction(cfg, MismatchTensors(lp2, lq2, mask, fused=fused), num_tokens=1, num_seqs=1,
                               turn_ids=junk)  # fmt: skip
    assert torch.equal(base.weights, other.weights)
    for k in base.metrics:
        assert torch.equal(base.metrics[k], other.metrics[k]), k


@FUSED
def test_micro_batches_sum_to_the_whole_batch(fused):
    """Segments live inside rows: split by rows, the partial metrics of the micro-batches sum to the
    whole batch's, and the weights are the same rows (global denominators, batch-wide mean)."""
    lp, lq, mask, turns, _ = multi_turn_batch(5, b=6)
    cfg = _seg(**CONFIGS["seq_mis_norm"], veto_threshold=0.6)
    n_tok = int(mask.sum())
    mean = batch_weight_mean(cfg, MismatchTensors(lp, lq, mask, fused=fused), turn_ids=turns)
    whole = compute_correction(cfg, MismatchTensors(lp, lq, mask, fused=fused), num_tokens=n_tok, num_seqs=5,
                               turn_ids=turns, weight_mean=mean)  # fmt: skip
    parts, rows = [], []
    for sl in (slice(0, 2), slice(2, 3), slice(3, 6)):
        c = compute_correction(cfg, MismatchTensors(lp[sl], lq[sl], mask[sl], fused=fused), num_tokens=n_tok,
                               num_seqs=5, turn_ids=turns[sl], weight_mean=mean)  # fmt: skip
        parts.append(c.metrics)
        rows.append(c.weights)
    assert torch.allclose(torch.cat(rows), whole.weights, rtol=0, atol=1e-7)
    got, want = finalize_metrics(combine_partials(parts)), finalize_metrics(whole.metrics)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    want_w, want_m = ref_segment_correction(cfg, lp, lq, mask, turns)
    _check(whole, want_w, want_m)  # the batch-wide mean is the plain mean over the valid tokens


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    name=st.sampled_from(sorted(CONFIGS)),
    scale=st.sampled_from([0.01, 0.1, 0.5]),
    turns=st.integers(1, 6),
)
def test_segment_reference_on_random_trajectories(seed, name, scale, turns):
    lp, lq, mask, turn_ids, _ = multi_turn_batch(seed, b=4, t=30, scale=scale, turns=turns)
    cfg = _seg(**CONFIGS[name])
    for fused in [False, True] if fused_cpu.available() else [False]:
        got = compute_correction(cfg, MismatchTensors(lp, lq, mask, fused=fused), num_tokens=int(mask.sum()),
                                 num_seqs=3, turn_ids=turn_ids)  # fmt: skip
        want_w, want_m = ref_segment_correction(cfg, lp, lq, mask, turn_ids)
        _check(got, want_w, want_m)


def test_segments_sums_and_counts():
    """The unit sums themselves: a non-contiguous turn, a turn number skipped, a one-token segment."""
    lp = torch.tensor([[0.0, -1.0, -2.0, -1.0, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]])
    lq = torch.tensor([[0.0, -1.5, -1.0, -1.25, -0.5, 0.0], [-2.0, -1.0, -1.0, -1.0, -1.0, -0.5]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    turns = torch.tensor([[-1, 0, 2, 0, 2, -1], [0, -1, -1, -1, -1, 3]])
    seg = Segments(MismatchTensors(lp, lq, mask, fused=False), turns)
    want_sum = [[0.0, 0.75, -1.0, 0.75, -1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, -0.5]]
    want_cnt = [[0.0, 2.0, 2.0, 2.0, 2.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]]
    assert seg.log_ratio.tolist() == want_sum and seg.count.tolist() == want_cnt
    assert seg.mean_log_ratio.tolist() == [[0.0, 0.375, -0.5, 0.375, -0.5, 0.0], [1.0, 0, 0, 0, 0, -0.5]]
    assert seg.vetoed(math.exp(-0.75)).tolist() == [[False, False, True, False, True, False], [False] * 6]
    assert seg.vetoed(math.exp(-0.4)).tolist() == [
        [False, False, True, False, True, False],
        [False] * 5 + [True],
    ]


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------


@FUSED
@pytest.mark.parametrize("name", ["seq_tis", "seq_mis", "tis_masks", "seq_tis_veto"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_segment_loss_and_gradient_match_the_reference(fused, name, agg):
    """The whole loss through rl_loss with turn_ids: the value and d loss / d log pi against the
    hand-written reference, fed the reference's own segment weights."""
    lp_old, lq, mask, turns, adv = multi_turn_batch(6)
    g = torch.Generator().manual_seed(1)
    lp_new = (lp_old.double() + 0.1 * torch.randn(lp_old.shape, generator=g, dtype=torch.float64)).float()
    x = lp_new.clone().requires_grad_(True)
    cfg = _seg(**CONFIGS[name])
    alg = AlgorithmConfig(loss_agg=agg)
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    loss, _ = rl_loss(x, lp_old, lq, adv, mask.float(), algorithm=alg, correction=cfg, acrl=None,
                      num_tokens=n_tok, num_seqs=n_seq, fused=fused, turn_ids=turns.float())  # fmt: skip
    loss.backward()
    w, _ = ref_segment_correction(cfg, lp_old, lq, mask, turns)
    want, grad, _ = ref_rl_loss(lp_new, lp_old, lq, adv, mask, w, agg=agg, clip_low=alg.clip_low,
                                clip_high=alg.clip_high, n_tok=n_tok, n_seq=n_seq)  # fmt: skip
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5, abs=1e-8)
    assert torch.allclose(x.grad.double(), torch.tensor(grad, dtype=torch.float64), rtol=1e-4, atol=1e-8)
    # and the turns matter: the sequence level gives another loss on these trajectories
    seq_cfg = dataclasses.replace(cfg, level="sequence")
    seq_loss, _ = rl_loss(lp_new, lp_old, lq, adv, mask.float(), algorithm=alg, correction=seq_cfg, acrl=None,
                          num_tokens=n_tok, num_seqs=n_seq, fused=fused, turn_ids=turns.float())  # fmt: skip
    assert abs(float(seq_loss) - float(loss.detach())) > 1e-6


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def test_bad_turn_ids_are_refused_with_the_fix():
    lp, lq, mask, turns, _ = multi_turn_batch(0)
    cfg = _seg(**CONFIGS["seq_mis"])
    sh = MismatchTensors(lp, lq, mask, fused=False)
    with pytest.raises(ValueError, match=r"turn_ids of shape \(5, 23\).*pass the micro-batch's own turn_ids"):
        compute_correction(cfg, sh, num_tokens=1, num_seqs=1, turn_ids=turns[:, 1:])
    broken = turns.clone()
    broken[mask.nonzero()[0].tolist()[0], mask.nonzero()[0].tolist()[1]] = -1
    with pytest.raises(ValueError, match="turn_ids is negative on a trained token.*disagree"):
        compute_correction(cfg, sh, num_tokens=1, num_seqs=1, turn_ids=broken)


def test_level_segment_without_a_sequence_unit_is_refused():
    for method in ("tis", "acrl", "icepop", "none"):
        with pytest.raises(
            ConfigError, match=r"level.*level=segment changes only seq_tis, seq_mis, geo_mis.*set level"
        ):
            CorrectionConfig(method=method, level="segment")
    for ok in (
        dict(method="geo_mis"),
        dict(method="acrl", masks=("geo_mis",)),
        dict(method="tis", veto_threshold=0.1),
    ):
        assert CorrectionConfig(level="segment", **ok).level == "segment"


def test_the_bound_loss_reads_the_micro_batch_turn_ids():
    """RLLoss, as the Megatron loss adapter calls it (the micro-batch's tensors as float32, turn_ids
    among them), gives rl_loss with those turn ids; a micro-batch without them is the sequence level."""
    from megatron_acrl.algo.losses import RLLoss

    lp_old, lq, mask, turns, adv = multi_turn_batch(7)
    cfg, alg = _seg(**CONFIGS["seq_mis"]), AlgorithmConfig()
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    micro = {"old_logprobs": lp_old, "rollout_logprobs": lq, "advantages": adv, "loss_mask": mask.float()}
    bound = RLLoss(alg, cfg, fused=False)
    got, _ = bound(lp_old, dict(micro, turn_ids=turns.float()), n_tok, n_seq)
    want, _ = rl_loss(lp_old, lp_old, lq, adv, mask.float(), algorithm=alg, correction=cfg, acrl=None,
                      num_tokens=n_tok, num_seqs=n_seq, fused=False, turn_ids=turns)  # fmt: skip
    seq, _ = rl_loss(lp_old, lp_old, lq, adv, mask.float(), algorithm=alg, correction=cfg, acrl=None,
                     num_tokens=n_tok, num_seqs=n_seq, fused=False)  # fmt: skip
    assert torch.equal(got, want) and not torch.equal(got, seq)
    assert torch.equal(bound(lp_old, micro, n_tok, n_seq)[0], seq)


# ------------------------------------------------------------------------------------------------
# Edges the reference batches do not reach (each kills a mutant that survived them)
# ------------------------------------------------------------------------------------------------


def _one_row(log_ratios, turns):
    """One row whose valid tokens have exactly these ``log pi_old - log mu`` (exact in float32) and
    turns; the rest of its 8 places padding (turn -1)."""
    t = 8
    lp = torch.full((1, t), -1.0)
    lq = torch.full((1, t), -1.0)
    mask = torch.zeros(1, t, dtype=torch.bool)
    turn_ids = torch.full((1, t), -1)
    for j, (d, k) in enumerate(zip(log_ratios, turns, strict=True)):
        lq[0, j + 1] = -1.0 - d
        mask[0, j + 1] = True
        turn_ids[0, j + 1] = k
    return lp, lq, mask, turn_ids


@FUSED
def test_a_segment_exactly_on_a_bound_is_inside_the_band(fused):
    """The bands are closed: a segment whose ratio is exactly seq_high or seq_low (here e^0 = 1) is
    neither clipped nor counted as clipped, nor dropped (also geo_mis's); the veto drops a segment
    with a token *below* the threshold, not one exactly on it."""
    lp, lq, mask, turns = _one_row([0.5, -0.5, 0.25, -0.25, 1.0], [0, 0, 1, 1, 2])  # sums 0, 0, 1
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    n = int(mask.sum())

    def run(**kw):
        corr = compute_correction(_seg(**kw), sh, num_tokens=n, num_seqs=1, turn_ids=turns)
        return corr.weights[mask].tolist(), finalize_metrics(corr.metrics)

    w, m = run(method="seq_tis", seq_low=0.5, seq_high=1.0)
    assert w == [1.0] * 5  # the e^1 segment clipped to 1; the two on the bound are not clipped
    assert m["correction/seg_clip_frac_high"] == pytest.approx(1 / 5)
    assert m["correction/seg_clip_frac_low"] == 0.0
    w, m = run(method="seq_tis", seq_low=1.0, seq_high=2.0)
    assert m["correction/seg_clip_frac_low"] == 0.0 and m["correction/seg_clip_frac_high"] == pytest.approx(
        1 / 5
    )
    for method, low, high in (("seq_mis", "seq_low", "seq_high"), ("geo_mis", "geo_low", "geo_high")):
        for band in ((0.5, 1.0), (1.0, 2.0)):  # on the high bound, then on the low one
            w, m = run(method=method, **{low: band[0], high: band[1]})
            assert [round(v, 6) for v in w] == [1.0, 1.0, 1.0, 1.0, 0.0], (method, band, w)
            assert m["correction/seg_masked_frac"] == pytest.approx(1 / 5)
    seg = Segments(sh, turns)
    assert seg.vetoed(math.exp(-0.5))[mask].tolist() == [False] * 5  # -0.5 is not below e^-0.5 ...
    assert seg.vetoed(1.0)[mask].tolist() == [True, True, True, True, False]  # ... -0.5 < 0 is


@FUSED
def test_segment_ratios_beyond_the_log_bound_are_clamped_to_it(fused):
    """A segment's log-ratio is clamped to +-20 before its exp (the weight is e^+-20, to the last
    digit, not e^+-25): seq_tis with an open band and seq_mis without a band on it."""
    lp, lq, mask, turns = _one_row([12.5, 12.5, -12.5, -12.5, 0.5], [0, 0, 1, 1, 2])  # +25, -25, 0.5
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    n = int(mask.sum())
    for cfg in (
        _seg(method="seq_tis", seq_low=0.0, seq_high=1e30),
        _seg(method="seq_mis", seq_low=0.0, seq_high=1e30),
    ):
        w = compute_correction(cfg, sh, num_tokens=n, num_seqs=1, turn_ids=turns).weights.double()[mask]
        want = torch.tensor(
            [math.exp(BOUND)] * 2 + [math.exp(-BOUND)] * 2 + [math.exp(0.5)], dtype=torch.float64
        )
        assert torch.allclose(w, want, rtol=1e-6, atol=0), (cfg.method, w)


@FUSED
def test_the_method_keep_and_every_mask_all_apply(fused):
    """A segment survives only if the method's band and every mask keep it: one segment dropped by
    the product band alone (four small steps), one by the geometric band alone (one big step)."""
    lp, lq, mask, turns = _one_row([0.2, 0.2, 0.2, 0.2, 0.5, 0.1, -0.1], [0, 0, 0, 0, 1, 2, 2])
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    bands = dict(seq_low=0.5, seq_high=2.0, geo_low=0.8, geo_high=1.25)
    for kw in (dict(method="seq_mis", masks=("geo_mis",)), dict(method="none", masks=("seq_mis", "geo_mis"))):
        corr = compute_correction(_seg(**kw, **bands), sh, num_tokens=7, num_seqs=1, turn_ids=turns)
        assert [round(v, 5) for v in corr.weights[mask].tolist()] == [0.0] * 5 + [1.0] * 2, kw
        assert finalize_metrics(corr.metrics)["correction/seg_masked_frac"] == pytest.approx(5 / 7)


def test_segments_layout_index_and_units():
    """``index`` is ``row * K + turn`` on the valid tokens and turn 0's segment elsewhere (padding's
    turn -1 never makes a segment of its own), K the largest turn + 1; a batch without tokens has
    one unit per row."""
    lp = torch.zeros(2, 4)
    lq = torch.tensor([[0.0, -0.5, -0.25, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    turns = torch.tensor([[-1, 0, 2, -1], [1, -1, -1, -1]])
    seg = Segments(MismatchTensors(lp, lq, mask, fused=False), turns.float())  # a float row works too
    assert seg.num_units == 2 * 3 and seg.index.dtype == torch.int64
    assert seg.index.tolist() == [[0, 0, 2, 0], [4, 3, 3, 3]]
    assert seg.count.dtype == torch.float64 and seg.count.tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert seg.unit_sums(mask.double()).tolist() == [1, 0, 1, 0, 1, 0]
    empty = torch.zeros(2, 0)
    none = Segments(MismatchTensors(empty, empty, torch.zeros(2, 0, dtype=torch.bool), fused=False), empty)
    assert none.num_units == 2 and none.log_ratio.shape == (2, 0)


def test_bad_turn_ids_messages_are_whole():
    """The errors name what is wrong and the fix, word for word."""
    lp, lq, mask, turns, _ = multi_turn_batch(0)
    sh = MismatchTensors(lp, lq, mask, fused=False)
    with pytest.raises(ValueError) as err:
        Segments(sh, turns[:, 1:])
    assert str(err.value) == (
        "turn_ids of shape (5, 23) do not match the log-probs' (5, 24): pass the micro-batch's own "
        "turn_ids ([B, T], -1 off generated tokens)"
    )
    broken = torch.where(mask, -1, turns)
    with pytest.raises(ValueError) as err:
        Segments(sh, broken)
    assert str(err.value) == (
        "turn_ids is negative on a trained token (loss_mask 1, finite log-probs): every trained "
        "token must carry the turn that generated it; the batch's turn_ids and loss_mask disagree"
    )
