"""Independent float64 references for the correction, the losses and the advantages.

Written from the formulas (``/work/shared/docs/research/acrl-and-anchors.md``, ``docs/correction.md``),
not from the package: plain Python floats and the ``math`` module, explicit loops over sequences and
tokens, no torch arithmetic, no vectorised tricks. Slow and obviously right. Tensors are converted to
nested lists at the entry of every function; results are Python floats (or lists of them).

Conventions the package documents and these references encode:

- a token is valid when its mask is set and both log-probs are finite; a sequence is valid when it
  has a valid token; every mean over tokens (sequences) divides by the number of valid tokens
  (sequences) of the whole batch, unless the caller passes other denominators;
- ``rho = pi_old / mu`` is saturated at ``exp(+-BOUND)`` wherever it is exponentiated, and so is the
  ACRL weight ``rho ** alpha``; ``|log rho|``, ``|pi_old - mu|`` and the sequence sums are not;
- an extreme (max / min) of nothing is NaN, and so is ``chi2_seq`` of no sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

BOUND = 20.0
NAN = float("nan")


def _rows(x) -> list[list[float]]:
    """A ``[B, T]`` tensor (or nested lists) as lists of Python floats."""
    return [[float(v) for v in row] for row in (x.tolist() if hasattr(x, "tolist") else x)]


def _clip(v: float, lo: float, hi: float) -> float:
    return lo if v < lo else hi if v > hi else v


def _sign(v: float) -> int:
    return (v > 0) - (v < 0)


def valid_tokens(lp, lq, mask) -> list[list[int]]:
    """Per sequence, the indices of its valid tokens (mask set, both log-probs finite)."""
    lp, lq, m = _rows(lp), _rows(lq), _rows(mask)
    return [
        [t for t in range(len(m[i])) if m[i][t] and math.isfinite(lp[i][t]) and math.isfinite(lq[i][t])]
        for i in range(len(m))
    ]


def counts(lp, lq, mask) -> tuple[int, int]:
    """``(valid tokens, valid sequences)``: the global denominators of a whole batch."""
    toks = valid_tokens(lp, lq, mask)
    return sum(len(ts) for ts in toks), sum(1 for ts in toks if ts)


def _mean(xs: Sequence[float], n: float | None = None) -> float:
    return sum(xs) / (n if n is not None else len(xs)) if (n or xs) else 0.0


def _ext(fn, xs: Sequence[float]) -> float:
    return fn(xs) if xs else NAN


def ref_mismatch(lp, lq, mask) -> dict[str, float]:
    """Every ``mismatch/*`` metric (without the prefix), from the definitions in docs/correction.md."""
    toks = valid_tokens(lp, lq, mask)
    p, q, m = _rows(lp), _rows(lq), _rows(mask)
    flat = [(i, t) for i, ts in enumerate(toks) for t in ts]
    d = [p[i][t] - q[i][t] for i, t in flat]  # log rho
    rho = [math.exp(_clip(x, -BOUND, BOUND)) for x in d]
    dp = [abs(math.exp(p[i][t]) - math.exp(q[i][t])) for i, t in flat]
    n = len(flat)
    out = {
        "kl": _mean([-x for x in d]),
        "k3_kl": _mean([r - 1.0 - _clip(x, -BOUND, BOUND) for r, x in zip(rho, d, strict=True)]),
        "chi2_token": _mean([r * r for r in rho]) - 1.0 if n else 0.0,
        "logprob_abs_diff": _mean([abs(x) for x in d]),
        "prob_abs_diff": _mean(dp),
        "logprob_abs_diff_max": _ext(max, [abs(x) for x in d]),
        "prob_abs_diff_max": _ext(max, dp),
        "log_ratio_max": _ext(max, d),
        "log_ratio_min": _ext(min, d),
    }
    seqs = [ts for ts in toks if ts]
    rows = [i for i, ts in enumerate(toks) if ts]
    mean_p = [sum(p[i][t] for t in toks[i]) / len(toks[i]) for i in rows]
    mean_q = [sum(q[i][t] for t in toks[i]) / len(toks[i]) for i in rows]
    diff = [b - a for a, b in zip(mean_p, mean_q, strict=True)]  # mean_t log(mu / pi_old)
    out.update(
        training_ppl=_mean([math.exp(-a) for a in mean_p]),
        rollout_ppl=_mean([math.exp(-b) for b in mean_q]),
        training_log_ppl=_mean([-a for a in mean_p]),
        rollout_log_ppl=_mean([-b for b in mean_q]),
        log_ppl_diff=_mean(diff),
        log_ppl_abs_diff=_mean([abs(x) for x in diff]),
        log_ppl_diff_max=_ext(max, diff),
        log_ppl_diff_min=_ext(min, diff),
        ppl_ratio=_mean([math.exp(_clip(x, -BOUND, BOUND)) for x in diff]),
    )
    sums = [sum(p[i][t] - q[i][t] for t in toks[i]) for i in rows]  # log prod rho
    if not seqs:
        out["chi2_seq"] = NAN
    else:  # log-sum-exp by hand: exp(2 S) overflows for long sequences
        peak = max(2 * s for s in sums)
        lse = peak + math.log(sum(math.exp(2 * s - peak) for s in sums)) - math.log(len(seqs))
        out["chi2_seq"] = math.exp(lse) - 1.0 if lse < 700 else math.inf
    bad = sum(1 for i in range(len(m)) for t in range(len(m[i])) if m[i][t]) - n
    out["nonfinite_tokens"] = float(bad)
    return out


def token_distance(a: float, b: float, distance: str) -> float:
    """The per-token ACRL distance between log pi_old ``a`` and log mu ``b``."""
    if distance == "prob_abs":
        return abs(math.exp(a) - math.exp(b))
    if distance == "logprob_abs":
        return abs(a - b)
    if distance == "k3":
        x = _clip(a - b, -BOUND, BOUND)
        return math.exp(x) - 1.0 - x
    raise ValueError(distance)


def ref_seq_discrepancy(lp, lq, mask, distance: str) -> list[float]:
    """Per valid sequence, ``Y_i``: the mean over its valid tokens of the distance."""
    p, q = _rows(lp), _rows(lq)
    return [
        sum(token_distance(p[i][t], q[i][t], distance) for t in ts) / len(ts)
        for i, ts in enumerate(valid_tokens(lp, lq, mask))
        if ts
    ]


def ref_batch_y(lp, lq, mask, distance: str) -> float:
    """The batch discrepancy Y: the mean of ``Y_i`` over valid sequences."""
    ys = ref_seq_discrepancy(lp, lq, mask, distance)
    return sum(ys) / len(ys)


def ref_controller(
    ys: Sequence[float],
    *,
    gamma: float,
    reference: str = "static",
    reference_batches: int = 1,
    ema_decay: float = 0.9,
    floor: float = 0.0,
) -> list[tuple[float | None, float]]:
    """The controller's ``(X used for the batch, coefficient c = gamma (1 - Y / X))`` per batch.

    Only batches with ``Y >= floor`` are measured into the reference (``floor = 0``: the paper, every
    batch); until one is, X is None and c = 0 (the plain loss). The reference is the running mean of
    the measured Y of the first ``reference_batches`` measured batches (this batch's included), then
    fixed (static) or, for ema, each later batch is controlled against the previous value and then
    folded in: ``X <- decay X + (1 - decay) Y``. X is floored at ``floor`` where it is used.
    """
    out: list[tuple[float | None, float]] = []
    measured: list[float] = []
    x_next: float | None = None
    for y in ys:
        if len(measured) < reference_batches:
            if y >= floor:
                measured.append(y)
                x_next = sum(measured) / len(measured)
            x = x_next
        else:
            x = x_next
            if reference == "ema":
                x_next = ema_decay * x_next + (1.0 - ema_decay) * y  # type: ignore[operator]
        if x is None:
            out.append((None, 0.0))
            continue
        x_used = max(x, floor)
        out.append((x_used, gamma * (1.0 - y / max(x_used, 1e-8))))
    return out


def ref_weights(
    cfg, lp, lq, mask, adv=None, x=None, y=None, *, coef=None, weight_mean=None
) -> list[list[float]]:
    """Correction weights ``[B][T]`` (0 outside the valid tokens) of ``cfg.method`` and its composition.

    ACRL: ``coef`` (gamma (1 - Y / X)) if given, else from ``x``, ``y``; per_sequence_y uses each
    sequence's own ``Y_i``. ``weight_mean``: the global mean for ``batch_normalize`` (None: this
    batch's own mean over valid tokens).
    """
    return ref_correction(cfg, lp, lq, mask, adv, x, y, coef=coef, weight_mean=weight_mean)[0]


def ref_alpha(cfg, a: float, c: float) -> float:
    """ACRL's alpha of one token: ``sign(a) * c``, then at most ``alpha_max`` and at least
    ``alpha_min`` (sign-safe ACRL), or at least ``-alpha_max`` when ``alpha_min`` is unset."""
    alpha = _sign(a) * c
    if cfg.alpha_max is not None:
        alpha = min(alpha, cfg.alpha_max)
    low = getattr(cfg, "alpha_min", None)
    if low is None and cfg.alpha_max is not None:
        low = -cfg.alpha_max
    return alpha if low is None else max(alpha, low)


def _method_weight(cfg, d: float, seq_sum: float, mean_d: float, a: float, c: float | None) -> float:
    """One valid token's weight under ``cfg.method`` (before masks, veto, normalisation)."""
    r = math.exp(_clip(d, -BOUND, BOUND))
    if cfg.method == "none":
        return 1.0
    if cfg.method == "tis":
        return _clip(r, cfg.tis_low, cfg.tis_high)
    if cfg.method == "icepop":
        return r if cfg.icepop_low <= r <= cfg.icepop_high else 0.0
    if cfg.method == "seq_tis":
        return math.exp(_clip(_log_clip(seq_sum, cfg.seq_low, cfg.seq_high), -BOUND, BOUND))
    if cfg.method == "seq_mis":
        return math.exp(_clip(seq_sum, -BOUND, BOUND))
    if cfg.method == "geo_mis":
        return 1.0
    if cfg.method == "acrl":
        alpha = ref_alpha(cfg, a, c)  # type: ignore[arg-type]
        v = math.exp(_clip(alpha * _clip(d, -BOUND, BOUND), -BOUND, BOUND))
        if cfg.weight_low is not None:
            v = max(v, cfg.weight_low)
        if cfg.weight_high is not None:
            v = min(v, cfg.weight_high)
        return v
    raise ValueError(cfg.method)


def _log_clip(s: float, low: float, high: float) -> float:
    lo = math.log(low) if low > 0 else -math.inf
    return _clip(s, lo, math.log(high))


def _in_band(v: float, low: float, high: float) -> bool:
    """``low <= exp(v) <= high`` for a log value ``v``."""
    return (low == 0 or v >= math.log(low)) and v <= math.log(high)


def ref_correction(cfg, lp, lq, mask, adv=None, x=None, y=None, *, coef=None, weight_mean=None, n_tok=None,
                   n_seq=None):  # fmt: skip
    """``(weights [B][T], metrics)``: the weights as :func:`ref_weights` and the ``correction/*`` and
    ``acrl/*`` statistics of the method (means over ``n_tok`` / ``n_seq``, default this batch's)."""
    p, q = _rows(lp), _rows(lq)
    a_rows = _rows(adv) if adv is not None else None
    toks = valid_tokens(lp, lq, mask)
    tok_n, seq_n = counts(lp, lq, mask)
    n_tok = tok_n if n_tok is None else n_tok
    n_seq = seq_n if n_seq is None else n_seq
    b, t_len = len(p), (len(p[0]) if p else 0)
    w = [[0.0] * t_len for _ in range(b)]
    alphas: list[float] = []
    saturated = 0
    frac = dict.fromkeys(("clip_high", "clip_low", "mask_high", "mask_low", "seq_high", "seq_low", "masked",
                          "veto"), 0)  # fmt: skip
    for i, ts in enumerate(toks):
        if not ts:
            continue
        d_row = {t: p[i][t] - q[i][t] for t in ts}
        s = sum(d_row.values())
        mean_d = s / len(ts)
        c = None
        if cfg.method == "acrl":
            if coef is not None:
                c = coef
            elif cfg.per_sequence_y:
                yi = sum(token_distance(p[i][t], q[i][t], cfg.distance) for t in ts) / len(ts)
                c = cfg.gamma * (1.0 - yi / max(x, cfg.eps))
            else:
                c = cfg.gamma * (1.0 - y / max(x, cfg.eps))
        for t in ts:
            a = a_rows[i][t] if a_rows is not None else 0.0
            w[i][t] = _method_weight(cfg, d_row[t], s, mean_d, a, c)
            r = math.exp(_clip(d_row[t], -BOUND, BOUND))
            frac["clip_high"] += r > cfg.tis_high
            frac["clip_low"] += r < cfg.tis_low
            frac["mask_high"] += r > cfg.icepop_high
            frac["mask_low"] += r < cfg.icepop_low
            if cfg.method == "acrl":
                alpha = ref_alpha(cfg, a, c)  # type: ignore[arg-type]
                alphas.append(alpha)
                saturated += abs(alpha * _clip(d_row[t], -BOUND, BOUND)) >= BOUND
        frac["seq_high"] += not (s <= math.log(cfg.seq_high))
        frac["seq_low"] += cfg.seq_low > 0 and s < math.log(cfg.seq_low)
        keep = True
        if cfg.method == "seq_mis":
            keep = _in_band(s, cfg.seq_low, cfg.seq_high)
        elif cfg.method == "geo_mis":
            keep = _in_band(mean_d, cfg.geo_low, cfg.geo_high)
        for extra in cfg.masks:
            keep &= (
                _in_band(s, cfg.seq_low, cfg.seq_high)
                if extra == "seq_mis"
                else _in_band(mean_d, cfg.geo_low, cfg.geo_high)
            )
        frac["masked"] += not keep
        if cfg.veto_threshold is not None:
            vetoed = any(d_row[t] < math.log(cfg.veto_threshold) for t in ts)
            frac["veto"] += vetoed
            keep &= not vetoed
        if not keep:
            for t in ts:
                w[i][t] = 0.0
    if cfg.batch_normalize:
        mean = weight_mean
        if mean is None:
            mean = sum(w[i][t] for i, ts in enumerate(toks) for t in ts) / max(tok_n, 1)
        w = [[v / max(mean, 1e-8) for v in row] for row in w]
    metrics = _weight_stats(w, toks, n_tok)
    if cfg.method == "tis":
        metrics.update({"correction/clip_frac_high": frac["clip_high"] / max(n_tok, 1),
                        "correction/clip_frac_low": frac["clip_low"] / max(n_tok, 1)})  # fmt: skip
    if cfg.method == "icepop":
        metrics.update({"correction/mask_frac_high": frac["mask_high"] / max(n_tok, 1),
                        "correction/mask_frac_low": frac["mask_low"] / max(n_tok, 1)})  # fmt: skip
    if cfg.method == "seq_tis":
        metrics.update({"correction/seq_clip_frac_high": frac["seq_high"] / max(n_seq, 1),
                        "correction/seq_clip_frac_low": frac["seq_low"] / max(n_seq, 1)})  # fmt: skip
    if cfg.method in ("seq_mis", "geo_mis") or cfg.masks:
        metrics["correction/seq_masked_frac"] = frac["masked"] / max(n_seq, 1)
    if cfg.veto_threshold is not None:
        metrics["correction/seq_veto_frac"] = frac["veto"] / max(n_seq, 1)
    if cfg.method == "acrl":
        metrics["acrl/alpha_mean"] = sum(alphas) / max(n_tok, 1)
        metrics["acrl/alpha_abs_mean"] = sum(abs(v) for v in alphas) / max(n_tok, 1)
        metrics["acrl/saturated_frac"] = saturated / max(n_tok, 1)
    return w, metrics


def _weight_stats(w: list[list[float]], toks: list[list[int]], n_tok: int) -> dict[str, float]:
    vals = [w[i][t] for i, ts in enumerate(toks) for t in ts]
    n = max(n_tok, 1)
    mean = sum(vals) / n
    sq = sum(v * v for v in vals) / n
    # the population std from the deviations, not from E[w^2] - E[w]^2 (no cancellation at all)
    var = sum((v - mean) ** 2 for v in vals) / n if n_tok == len(vals) else max(sq - mean * mean, 0.0)
    return {
        "correction/weight_mean": mean,
        "correction/weight_std": math.sqrt(var),
        "correction/weight_max": _ext(max, vals),
        "correction/weight_min": _ext(min, vals),
        # every weight 0: no effective sample (0); no valid token: undefined (NaN)
        "correction/ess": mean * mean / sq if sq > 0 else (0.0 if vals else NAN),
    }


def ref_rl_loss(
    lp_new,
    lp_old,
    lq,
    adv,
    mask,
    weights: list[list[float]],
    *,
    agg: str,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    norm_len: int | None = None,
    n_tok: int | None = None,
    n_seq: int | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "k1",
    ref_lp=None,
    entropy=None,
    entropy_coef: float = 0.0,
) -> tuple[float, list[list[float]], list[list[float]]]:
    """``(loss, d loss / d log pi [B][T], d loss / d entropy [B][T])``, the gradients by hand.

    The loss is ``agg(w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)))`` (with dual-clip,
    ``min(., -A c)`` for A < 0), ``r = pi / pi_old``, plus ``kl_coef * agg(KL)`` and minus
    ``entropy_coef * agg(H)``; ``agg`` is token-mean (``/ n_tok``), seq-mean-token-mean (each
    sequence's token mean, ``/ n_seq``) or seq-mean-token-sum-norm (``/ (n_seq * norm_len)``).
    """
    x, old, a_rows = _rows(lp_new), _rows(lp_old), _rows(adv)
    ref = _rows(ref_lp) if ref_lp is not None else None
    ent = _rows(entropy) if entropy is not None else None
    toks = valid_tokens(lp_old, lq, mask)
    tok_n, seq_n = counts(lp_old, lq, mask)
    n_tok = tok_n if n_tok is None else n_tok
    n_seq = seq_n if n_seq is None else n_seq
    b, t_len = len(x), (len(x[0]) if x else 0)
    grad = [[0.0] * t_len for _ in range(b)]
    grad_h = [[0.0] * t_len for _ in range(b)]
    loss = 0.0
    for i, ts in enumerate(toks):
        for t in ts:
            if agg == "token-mean":
                scale = 1.0 / max(n_tok, 1)
            elif agg == "seq-mean-token-mean":
                scale = 1.0 / (max(n_seq, 1) * len(ts))
            elif agg == "seq-mean-token-sum-norm":
                scale = 1.0 / (max(n_seq, 1) * norm_len)  # type: ignore[operator]
            else:
                raise ValueError(agg)
            a, r = a_rows[i][t], math.exp(x[i][t] - old[i][t])
            l1 = -a * r
            l2 = -a * _clip(r, 1.0 - clip_low, 1.0 + clip_high)
            val, g = (l1, -a * r) if l1 >= l2 else (l2, 0.0)  # l2 > l1 only where r is clipped
            if dual_clip is not None and a < 0 and -a * dual_clip < val:
                val, g = -a * dual_clip, 0.0
            loss += scale * weights[i][t] * val
            grad[i][t] += scale * weights[i][t] * g
            if kl_coef > 0:
                u = ref[i][t] - x[i][t]  # type: ignore[index]
                if kl_type == "k1":
                    k, dk = -u, 1.0
                else:
                    uc = _clip(u, -BOUND, BOUND)
                    k, dk = math.exp(uc) - 1.0 - uc, (1.0 - math.exp(uc)) if abs(u) < BOUND else 0.0
                loss += kl_coef * scale * k
                grad[i][t] += kl_coef * scale * dk
            if ent is not None:
                loss -= entropy_coef * scale * ent[i][t]
                grad_h[i][t] = -entropy_coef * scale
    return loss, grad, grad_h


def ref_grpo(rewards: Sequence[float], group_ids: Sequence[int], *, norm_std: bool, eps: float = 1e-6):
    """GRPO advantages ``(r - mean_group) / (std_group + eps)`` (unbiased std; Dr. GRPO: no std)."""
    rewards, gids = [float(r) for r in rewards], [int(g) for g in group_ids]
    out = []
    for r, g in zip(rewards, gids, strict=True):
        grp = [rr for rr, gg in zip(rewards, gids, strict=True) if gg == g]
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((v - mean) ** 2 for v in grp) / max(len(grp) - 1, 1))
        out.append((r - mean) / (std + eps) if norm_std else r - mean)
    return out
