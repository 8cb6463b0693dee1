/* Fused CPU kernels of the correction: one pass over a [B, T] micro-batch instead of a few dozen
 * small PyTorch ops.
 *
 * On a CPU the correction of one micro-batch is a few dozen eager ops over a few thousand tokens,
 * and their dispatch, not their arithmetic, is what it costs. These loops compute the same
 * quantities as the PyTorch path in megatron_acrl/correction/ (mismatch.py, metrics.py, and the acrl
 * entry of weights.py with acrl.py's coefficient; that path stays the reference and the GPU path),
 * and are tested against it and against a float64 reference in tests/test_fused_cpu.py. Whether they
 * run is chosen once per run (correction.kernel, resolved by fused_cpu.resolve_kernel).
 *
 * Numerics: per-token values in float32 like the PyTorch path; every sum is accumulated in float64.
 * exp/expm1 are branch-free polynomials (below) so that the compiler vectorises the token loop; their
 * error is within 2 ulp of float32 on the ranges used (checked by the tests against libm).
 * Padding (mask == 0) is replaced by log pi_old = log mu = 0 before any arithmetic, as in the PyTorch
 * path, so NaN/Inf in padding never reaches a result.
 *
 * Built by ckernels/__init__.py with the system C compiler; plain C99, no Python or torch headers.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LOG_RATIO_BOUND 20.0f
#define NROWS 9

/* exp(x) for x in [-87, 88] (callers clamp): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-7
 * Taylor polynomial (truncation < 2e-8 relative), 2^n by building the float's exponent bits.
 * r is reduced in float64: the file is compiled with -fassociative-math (for vectorised sums), which
 * would fold a float32 Cody-Waite reduction (x - n ln2_hi) - n ln2_lo into x - n ln2 and lose up
 * to ~1e-6 relative at |x| ~ 20. */
static inline float exp_poly(float x) {
    const float log2e = 1.44269504088896341f;
    /* round to nearest by truncating x log2e +- 1/2: vectorises on every x86-64 (no roundps) */
    float t = x * log2e;
    int32_t k = (int32_t)(t + copysignf(0.5f, t));
    float r = (float)((double)x - (double)k * 0.693147180559945309);
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)(k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);  /* a register move once compiled */
    return p * scale;
}

/* expm1(x) for x in [-20, 20]: e^x - 1 without cancellation near 0 (a Taylor polynomial for
 * |x| < ln2 / 2, where e^x - 1 would lose bits), exp_poly(x) - 1 elsewhere. */
static inline float expm1_poly(float x) {
    float p = 1.0f / 362880.0f;
    p = p * x + 1.0f / 40320.0f;
    p = p * x + 1.0f / 5040.0f;
    p = p * x + 1.0f / 720.0f;
    p = p * x + 1.0f / 120.0f;
    p = p * x + 1.0f / 24.0f;
    p = p * x + 1.0f / 6.0f;
    p = p * x + 0.5f;
    float small = (p * x + 1.0f) * x;
    float big = exp_poly(x) - 1.0f;
    /* bitwise blend, not ?: (gcc would move exp_poly under a branch and stop vectorising) */
    uint32_t bs, bb, sel = -(uint32_t)(fabsf(x) < 0.34657359f);
    memcpy(&bs, &small, sizeof bs);
    memcpy(&bb, &big, sizeof bb);
    bs = (bs & sel) | (bb & ~sel);
    memcpy(&small, &bs, sizeof small);
    return small;
}

/* x where m != 0, else +0.0, by masking the bits: a select here would keep gcc from vectorising
 * the loop (a conditional before a float->int conversion is not if-converted), and NaN/Inf in
 * padding must not leak through arithmetic like x * m. */
static inline float keep(float x, uint8_t m) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits &= -(uint32_t)(m != 0);
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Added to a value to exclude padding from a min (subtracted: from a max); finite on purpose. */
#define PAD_BIG 1e30f

static inline float clampf(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }

/* Shared mismatch intermediates of one micro-batch.
 *
 * old_logprobs (log pi_old), rollout_logprobs (log mu): [B, T] float32 with row strides sp, sq (unit
 * stride along T); mask: [B, T] bytes (0/1) with row stride sm. With rho = pi_old / mu, writes
 * seq_sums [NROWS, B] float64, the per-sequence sums of the rows
 *   0 log pi_old, 1 log mu, 2 log mu - log pi_old, 3 log rho, 4 |pi_old - mu|, 5 |log rho|,
 *   6 k3 = rho - 1 - log rho, 7 rho^2 - 1, 8 valid tokens
 * (log rho clamped to +-LOG_RATIO_BOUND where exponentiated), ext [3] float64: the maxima over
 * valid tokens of -log rho, log rho and |pi_old - mu| (-inf without valid tokens), and dstats [3, 2]
 * float64: for each distance (|pi_old - mu|, |log rho|, k3) the sum over sequences with a valid
 * token of their mean distance (the ACRL controller's Y_i) and the number of those sequences. */
void acrl_mismatch_pass(const float *old_logprobs, const float *rollout_logprobs, const uint8_t *mask,
                        int64_t B, int64_t T, int64_t sp, int64_t sq, int64_t sm, double *seq_sums,
                        double *ext, double *dstats) {
    double y_dp = 0, y_ad = 0, y_k3 = 0, n_seqs = 0;
    float max_neg = -INFINITY, max_pos = -INFINITY, max_dp = -INFINITY;
    for (int64_t b = 0; b < B; ++b) {
        const float *lp_old = old_logprobs + b * sp, *lp_roll = rollout_logprobs + b * sq;
        const uint8_t *m = mask + b * sm;
        double s_lp = 0, s_lq = 0, s_d = 0, s_dp = 0, s_ad = 0, s_k3 = 0, s_chi = 0, s_n = 0;
        float mn_d = FLT_MAX, mx_d = -FLT_MAX, mx_dp = 0.0f;
        for (int64_t t = 0; t < T; ++t) {
            /* unconditional loads, then selects: the loop stays branch-free and vectorises */
            float p = keep(lp_old[t], m[t]), q = keep(lp_roll[t], m[t]); /* log pi_old, log mu */
            float valid = (float)(m[t] != 0), pad_big = (1.0f - valid) * PAD_BIG;
            float d = p - q;
            float dc = clampf(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND);
            float em1 = expm1_poly(dc);
            /* |pi_old - mu| from the unclamped log-probs, like the PyTorch path (mu |rho - 1| would need
             * the unclamped rho); the clamp only keeps exp_poly in range (e^-87 is 0 here). */
            float dp = fabsf(exp_poly(clampf(p, -87.0f, 88.0f)) - exp_poly(clampf(q, -87.0f, 88.0f)));
            s_lp += p;
            s_lq += q;
            s_d += d;
            s_dp += dp;
            s_ad += fabsf(d);
            s_k3 += em1 - dc;
            s_chi += em1 * (em1 + 2.0f);
            s_n += valid;
            /* padding has dp = 0 <= any valid |pi_old - mu|, so only log rho's extrema need the mask */
            mn_d = fminf(mn_d, d + pad_big);
            mx_d = fmaxf(mx_d, d - pad_big);
            mx_dp = fmaxf(mx_dp, dp);
        }
        if (s_n > 0) {
            max_neg = -mn_d > max_neg ? -mn_d : max_neg;
            max_pos = mx_d > max_pos ? mx_d : max_pos;
            max_dp = mx_dp > max_dp ? mx_dp : max_dp;
        }
        if (s_n > 0) { /* the controller's per-sequence discrepancies Y_i, summed over sequences */
            y_dp += s_dp / s_n, y_ad += s_ad / s_n, y_k3 += s_k3 / s_n, n_seqs += 1;
        }
        double *o = seq_sums + b;
        o[0 * B] = s_lp, o[1 * B] = s_lq, o[2 * B] = -s_d, o[3 * B] = s_d, o[4 * B] = s_dp;
        o[5 * B] = s_ad, o[6 * B] = s_k3, o[7 * B] = s_chi, o[8 * B] = s_n;
    }
    ext[0] = max_neg, ext[1] = max_pos, ext[2] = max_dp;
    dstats[0] = y_dp, dstats[2] = y_ad, dstats[4] = y_k3;
    dstats[1] = dstats[3] = dstats[5] = n_seqs;
}

/* ACRL weights w = exp(clamp(alpha * clamp(log rho), +-B)), alpha = sign(A) * coef[b] bounded to
 * +-alpha_max, then clamped to [w_low, w_high], 0 on padding: the C twin of the acrl entry of
 * weights.py (alpha as in acrl.py's acrl_alpha, coef from its acrl_coefficient).
 *
 * old_logprobs, rollout_logprobs, mask: as in acrl_mismatch_pass.
 * adv: advantages with strides (sa_b, sa_t) (sa_t = 0 for one advantage per sequence); coef: [B]
 * gamma * (1 - Y / X) per sequence, or NULL for coef0 on every sequence. "No bound" is passed as a
 * large finite number (the file is compiled for finite arithmetic). inv_tokens: 1 / the global token
 * count, so that stats are already partial means. Writes weights [B, T] float32 (contiguous) and
 * stats [4] float64 (sums over valid tokens of w, w^2, alpha, |alpha|, times inv_tokens) and wext [2] float64 (max w
 * and min w over valid tokens; -inf / +inf without valid tokens). */
void acrl_weights_pass(const float *old_logprobs, const float *rollout_logprobs, const uint8_t *mask,
                       const float *adv, int64_t B, int64_t T, int64_t sp, int64_t sq, int64_t sm,
                       int64_t sa_b, int64_t sa_t, const double *coef, double coef0, float alpha_max,
                       float w_low, float w_high, double inv_tokens, float *weights, double *stats,
                       double *wext) {
    double s_w = 0, s_w2 = 0, s_a = 0, s_aa = 0;
    float w_max = -INFINITY, w_min = INFINITY;
    for (int64_t b = 0; b < B; ++b) {
        const float *lp_old = old_logprobs + b * sp, *lp_roll = rollout_logprobs + b * sq;
        const float *a = adv + b * sa_b;
        const uint8_t *m = mask + b * sm;
        float *w = weights + b * T;
        float c = (float)(coef ? coef[b] : coef0);
        double r_w = 0, r_w2 = 0, r_a = 0, r_aa = 0;
        float r_max = 0.0f, r_min = FLT_MAX;
        float n_valid = 0.0f;
        for (int64_t t = 0; t < T; ++t) {
            float valid = (float)(m[t] != 0), pad_big = (1.0f - valid) * PAD_BIG;
            float d = keep(lp_old[t] - lp_roll[t], m[t]);
            float av = a[t * sa_t];
            float sgn = (float)((av > 0.0f) - (av < 0.0f));
            float alpha = keep(clampf(sgn * c, -alpha_max, alpha_max), m[t]);
            float dc = clampf(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND);
            float wt = exp_poly(clampf(alpha * dc, -LOG_RATIO_BOUND, LOG_RATIO_BOUND));
            wt = keep(clampf(wt, w_low, w_high), m[t]);
            w[t] = wt;
            r_w += wt;
            r_w2 += wt * wt;
            r_a += alpha;
            r_aa += fabsf(alpha);
            n_valid += valid;
            r_max = fmaxf(r_max, wt);
            r_min = fminf(r_min, wt + pad_big);
        }
        s_w += r_w, s_w2 += r_w2, s_a += r_a, s_aa += r_aa;
        if (n_valid > 0) {
            w_max = r_max > w_max ? r_max : w_max;
            w_min = r_min < w_min ? r_min : w_min;
        }
    }
    stats[0] = s_w * inv_tokens, stats[1] = s_w2 * inv_tokens, stats[2] = s_a * inv_tokens;
    stats[3] = s_aa * inv_tokens;
    wext[0] = w_max, wext[1] = w_min;
}

/* The partial mismatch metrics of metrics.py's mismatch_metrics, from acrl_mismatch_pass's output:
 * out[17] in the order of its _MISMATCH_NAMES (token means of rows 2..7, five sequence means,
 * log E[(prod rho)^2], five extrema). inv_tokens / inv_seqs: 1 / the global token / sequence counts,
 * log_seqs: log of the global sequence count. Runs over B sequences only. */
void acrl_mismatch_partials(const double *seq_sums, int64_t B, const double *ext, double inv_tokens,
                            double inv_seqs, double log_seqs, double *out) {
    for (int r = 2; r < 8; ++r) {
        double s = 0;
        for (int64_t b = 0; b < B; ++b) s += seq_sums[r * B + b];
        out[r - 2] = s * inv_tokens;
    }
    double ppl_t = 0, ppl_r = 0, ppl_ratio = 0, diff = 0, abs_diff = 0, peak = -1e300;
    int any = 0;
    for (int64_t b = 0; b < B; ++b) {
        double n = seq_sums[8 * B + b];
        if (n <= 0) continue;
        double m_p = seq_sums[b] / n, m_q = seq_sums[B + b] / n, m_d = seq_sums[2 * B + b] / n;
        double m_c = m_d < -LOG_RATIO_BOUND ? -LOG_RATIO_BOUND : (m_d > LOG_RATIO_BOUND ? LOG_RATIO_BOUND : m_d);
        ppl_t += exp(-m_p), ppl_r += exp(-m_q), ppl_ratio += exp(m_c), diff += m_d, abs_diff += fabs(m_d);
        double v = 2.0 * seq_sums[3 * B + b];
        peak = v > peak ? v : peak;
        any = 1;
    }
    out[6] = ppl_t * inv_seqs, out[7] = ppl_r * inv_seqs, out[8] = ppl_ratio * inv_seqs;
    out[9] = diff * inv_seqs, out[10] = abs_diff * inv_seqs;
    double lse_sum = 0;
    for (int64_t b = 0; b < B; ++b)
        if (seq_sums[8 * B + b] > 0) lse_sum += exp(2.0 * seq_sums[3 * B + b] - peak);
    out[11] = any ? peak + log(lse_sum) - log_seqs : -INFINITY;
    out[12] = ext[0], out[13] = ext[1], out[14] = ext[2];
    out[15] = ext[0] > ext[1] ? ext[0] : ext[1];
    out[16] = -ext[0];
}
