"""Straightforward float64 reference implementations, written independently of the package.

Loops over sequences and tokens on purpose: readable and obviously right, never fast.
"""

from __future__ import annotations

import math

import torch


def valid_tokens(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


def ref_mismatch(lp, lq, mask):
    lp, lq = lp.double(), lq.double()
    toks = valid_tokens(mask)
    flat = [(i, t) for i, ts in enumerate(toks) for t in ts]
    n = len(flat)
    d = [float(lp[i, t] - lq[i, t]) for i, t in flat]
    p = [math.exp(float(lp[i, t])) for i, t in flat]
    q = [math.exp(float(lq[i, t])) for i, t in flat]
    out = {
        "kl": sum(-x for x in d) / n,
        "k3_kl": sum(math.exp(x) - 1 - x for x in d) / n,
        "chi2_token": sum(math.exp(2 * x) for x in d) / n - 1,
        "logprob_abs_diff": sum(abs(x) for x in d) / n,
        "prob_abs_diff": sum(abs(a - b) for a, b in zip(p, q, strict=True)) / n,
        "logprob_abs_diff_max": max(abs(x) for x in d),
        "prob_abs_diff_max": max(abs(a - b) for a, b in zip(p, q, strict=True)),
        "log_ratio_max": max(d),
        "log_ratio_min": min(d),
    }
    seqs = [ts for ts in toks if ts]
    rows = [i for i, ts in enumerate(toks) if ts]
    s = len(seqs)
    mlp = [sum(float(lp[i, t]) for t in toks[i]) / len(toks[i]) for i in rows]
    mlq = [sum(float(lq[i, t]) for t in toks[i]) / len(toks[i]) for i in rows]
    diff = [b - a for a, b in zip(mlp, mlq, strict=True)]
    out["training_ppl"] = sum(math.exp(-a) for a in mlp) / s
    out["rollout_ppl"] = sum(math.exp(-b) for b in mlq) / s
    out["log_ppl_diff"] = sum(diff) / s
    out["log_ppl_abs_diff"] = sum(abs(x) for x in diff) / s
    out["ppl_ratio"] = sum(math.exp(x) for x in diff) / s
    seq_sum = [sum(float(lp[i, t] - lq[i, t]) for t in toks[i]) for i in rows]
    out["chi2_seq"] = sum(math.exp(2 * x) for x in seq_sum) / s - 1
    return out


def ref_seq_discrepancy(lp, lq, mask, distance):
    """Per valid sequence: mean over its tokens of the distance."""
    out = []
    for i, ts in enumerate(valid_tokens(mask)):
        if not ts:
            continue
        vals = []
        for t in ts:
            a, b = float(lp[i, t]), float(lq[i, t])
            if distance == "prob_abs":
                vals.append(abs(math.exp(a) - math.exp(b)))
            elif distance == "logprob_abs":
                vals.append(abs(a - b))
            else:
                r = math.exp(a - b)
                vals.append(r - 1 - math.log(r))
        out.append(sum(vals) / len(vals))
    return out


def ref_weights(cfg, lp, lq, mask, adv=None, x=None, y=None):
    """[B][T] python floats, 0 outside the mask."""
    toks = valid_tokens(mask)
    b, t_len = mask.shape
    w = [[0.0] * t_len for _ in range(b)]
    for i, ts in enumerate(toks):
        if not ts:
            continue
        logr = {t: float(lp[i, t] - lq[i, t]) for t in ts}
        s = sum(logr.values())
        geo = math.exp(s / len(ts))
        seq_r = math.exp(s)
        keep = True
        for t in ts:
            r = math.exp(logr[t])
            if cfg.method == "none":
                v = 1.0
            elif cfg.method == "tis":
                v = min(max(r, cfg.tis_low), cfg.tis_high)
            elif cfg.method == "icepop":
                v = r if cfg.icepop_low <= r <= cfg.icepop_high else 0.0
            elif cfg.method == "seq_tis":
                v = min(max(seq_r, cfg.seq_low), cfg.seq_high)
            elif cfg.method == "seq_mis":
                v = seq_r if cfg.seq_low <= seq_r <= cfg.seq_high else 0.0
            elif cfg.method == "geo_mis":
                v = 1.0 if cfg.geo_low <= geo <= cfg.geo_high else 0.0
            elif cfg.method == "acrl":
                a = float(adv[i, t])
                sign = (a > 0) - (a < 0)
                if cfg.per_sequence_y:
                    yy = ref_seq_discrepancy(lp[i : i + 1], lq[i : i + 1], mask[i : i + 1], cfg.distance)[0]
                else:
                    yy = y
                alpha = cfg.gamma * sign * (1 - yy / max(x, cfg.eps))
                if cfg.alpha_max is not None:
                    alpha = max(-cfg.alpha_max, min(cfg.alpha_max, alpha))
                v = r**alpha
                if cfg.weight_low is not None:
                    v = max(v, cfg.weight_low)
                if cfg.weight_high is not None:
                    v = min(v, cfg.weight_high)
            else:
                raise ValueError(cfg.method)
            w[i][t] = v
        for extra in cfg.masks:
            if extra == "seq_mis":
                keep &= cfg.seq_low <= seq_r <= cfg.seq_high
            else:
                keep &= cfg.geo_low <= geo <= cfg.geo_high
        if cfg.veto_threshold is not None:
            keep &= all(math.exp(logr[t]) >= cfg.veto_threshold for t in ts)
        if not keep:
            for t in ts:
                w[i][t] = 0.0
    return w


def ref_policy_loss(
    lp_new, lp_old, adv, mask, weights, *, clip_low, clip_high, dual_clip, agg, norm_len=None
):
    """Scalar float64 tensor (differentiable w.r.t. lp_new), explicit loops."""
    toks = valid_tokens(mask)
    per_seq = []
    total = lp_new.new_zeros(())
    n_tok = sum(len(ts) for ts in toks)
    for i, ts in enumerate(toks):
        if not ts:
            continue
        seq_total = lp_new.new_zeros(())
        for t in ts:
            r = torch.exp(lp_new[i, t] - float(lp_old[i, t]))
            a = float(adv[i, t])
            l1 = -a * r
            l2 = -a * torch.clamp(r, 1 - clip_low, 1 + clip_high)
            lt = torch.maximum(l1, l2)
            if dual_clip is not None and a < 0:
                lt = torch.minimum(lt, torch.tensor(-a * dual_clip, dtype=lt.dtype))
            lt = lt * weights[i][t]
            seq_total = seq_total + lt
        per_seq.append((seq_total, len(ts)))
        total = total + seq_total
    if agg == "token-mean":
        return total / n_tok
    if agg == "seq-mean-token-mean":
        return sum(s / n for s, n in per_seq) / len(per_seq)
    return total / (len(per_seq) * norm_len)
