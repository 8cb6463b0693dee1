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
 * Numerics: per-token values in float32 (the PyTorch path computes them in float64), in forms without
 * cancellation (k3 and |pi_old - mu| near rho = 1, see expm1_k3); every sum is accumulated in float64.
 * exp/expm1 are branch-free polynomials (below) so that the compiler vectorises the token loop; their
 * error is within 2 ulp of float32 on the ranges used (checked by the tests against libm).
 * Tokens off the mask, and masked-in tokens whose log-probs are not finite (counted), are replaced by
 * log pi_old = log mu = 0 before any arithmetic, as in the PyTorch path, so NaN/Inf never reaches a
 * result; finiteness is read from the bits, since the file is compiled for finite arithmetic.
 *
 * Built by ckernels/__init__.py with the system C compiler; plain C99, no Python or torch headers.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LOG_RATIO_BOUND 20.0f
#define NROWS 10

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

/* x where sel is all ones, else +0.0, by masking the bits: a select here would keep gcc from
 * vectorising the loop (a conditional before a float->int conversion is not if-converted), and
 * NaN/Inf off the valid tokens must not leak through arithmetic like x * m. */
static inline float keep(float x, uint32_t sel) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits &= sel;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* a where sel is all ones, else b, bitwise (gcc would move a costly operand of ?: under a branch
 * and stop vectorising) */
static inline float blend(float a, float b, uint32_t sel) {
    uint32_t ba, bb;
    memcpy(&ba, &a, sizeof ba);
    memcpy(&bb, &b, sizeof bb);
    ba = (ba & sel) | (bb & ~sel);
    memcpy(&a, &ba, sizeof a);
    return a;
}

/* 1 for a finite float, 0 for +-Inf and NaN, read from its exponent bits: the file is compiled with
 * -ffinite-math-only, under which isfinite() and x != x fold to constants. */
static inline uint32_t finite_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x7f800000u) != 0x7f800000u;
}

/* All ones where a token counts (mask set, both log-probs finite), else 0. */
static inline uint32_t valid_bits(uint8_t m, float p, float q) {
    return -((uint32_t)(m != 0) & finite_bits(p) & finite_bits(q));
}

/* Added to a value to exclude padding from a min (subtracted: from a max); finite on purpose. */
#define PAD_BIG 1e30f

static inline float clampf(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }

/* expm1(x) for x in [-20, 20], and k3(x) = e^x - 1 - x through *k3, both without cancellation near 0:
 * for |x| < ln2 / 2 the Taylor polynomial q(x) = (e^x - 1 - x) / x^2 gives k3 = x^2 q and
 * expm1 = x + k3 (e^x - 1 - x computed as written loses every bit at |x| ~ 1e-4); elsewhere
 * exp_poly(x) - 1 and expm1 - x, within a few ulp there. */
static inline float expm1_k3(float x, float *k3) {
    float q = 1.0f / 362880.0f;
    q = q * x + 1.0f / 40320.0f;
    q = q * x + 1.0f / 5040.0f;
    q = q * x + 1.0f / 720.0f;
    q = q * x + 1.0f / 120.0f;
    q = q * x + 1.0f / 24.0f;
    q = q * x + 1.0f / 6.0f;
    q = q * x + 0.5f;
    float k3_small = q * x * x;
    float em1_big = exp_poly(x) - 1.0f;
    uint32_t sel = -(uint32_t)(fabsf(x) < 0.34657359f);
    *k3 = blend(k3_small, em1_big - x, sel);
    return blend(x + k3_small, em1_big, sel);
}

/* The shared mismatch intermediates of one micro-batch.
 *
 * old_logprobs (log pi_old), rollout_logprobs (log mu): [B, T] float32 with row strides sp, sq (unit
 * stride along T); mask: [B, T] bytes (0/1) with row stride sm. A token is valid when its mask is
 * set and both log-probs are finite; a masked-in token with a NaN/Inf log-prob is dropped like
 * padding, and counted. With rho = pi_old / mu, writes seq_sums [NROWS, B] float64, the
 * per-sequence sums over valid tokens of the rows
 *   0 log pi_old, 1 log mu, 2 log mu - log pi_old, 3 log rho, 4 |pi_old - mu|, 5 |log rho|,
 *   6 k3 = rho - 1 - log rho, 7 rho^2 - 1, 8 valid tokens, 9 masked-in non-finite tokens
 * (log rho clamped to +-LOG_RATIO_BOUND where exponentiated; rows 2, 3, 5 from the exact float64
 * difference), ext [3] float64: the maxima over valid tokens of -log rho, log rho and
 * |pi_old - mu| (-inf without valid tokens), and dstats [3, 2] float64: for each distance
 * (|pi_old - mu|, |log rho|, k3) the sum over sequences with a valid token of their mean distance
 * (the ACRL controller's Y_i) and the number of those sequences, and valid [B, T] bytes
 * (contiguous): 1 on the valid tokens, the mask the loss uses. */
void acrl_mismatch_pass(const float *old_logprobs, const float *rollout_logprobs, const uint8_t *mask,
                        int64_t B, int64_t T, int64_t sp, int64_t sq, int64_t sm, double *seq_sums,
                        double *ext, double *dstats, uint8_t *valid_out) {
    double y_dp = 0, y_ad = 0, y_k3 = 0, n_seqs = 0;
    float max_neg = -INFINITY, max_pos = -INFINITY, max_dp = -INFINITY;
    for (int64_t b = 0; b < B; ++b) {
        const float *lp_old = old_logprobs + b * sp, *lp_roll = rollout_logprobs + b * sq;
        const uint8_t *m = mask + b * sm;
        uint8_t *vo = valid_out + b * T;
        double s_lp = 0, s_lq = 0, s_d = 0, s_dp = 0, s_ad = 0, s_k3 = 0, s_chi = 0, s_n = 0, s_bad = 0;
        float mn_d = FLT_MAX, mx_d = -FLT_MAX, mx_dp = 0.0f;
        for (int64_t t = 0; t < T; ++t) {
            /* unconditional loads, then selects: the loop stays branch-free and vectorises */
            uint32_t v = valid_bits(m[t], lp_old[t], lp_roll[t]);
            float p = keep(lp_old[t], v), q = keep(lp_roll[t], v); /* log pi_old, log mu; 0 off valid */
            float valid = (float)(v & 1u), pad_big = (1.0f - valid) * PAD_BIG;
            vo[t] = (uint8_t)(v & 1u);
            double dd = (double)p - (double)q; /* exact */
            float d = (float)dd, ad = fabsf(d);
            float dc = clampf(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND);
            float k3, k3_unused;
            float em1 = expm1_k3(dc, &k3);
            /* |pi_old - mu| = e^max(p, q) (1 - e^-|log rho|): no difference of nearly equal numbers;
             * the clamps only keep the polynomials in range (e^-87 and 1 - e^-20 round to 0 and 1) */
            float dp = -exp_poly(clampf(fmaxf(p, q), -87.0f, 88.0f)) *
                       expm1_k3(fmaxf(-ad, -LOG_RATIO_BOUND), &k3_unused);
            s_lp += p;
            s_lq += q;
            s_d += dd;
            s_dp += dp;
            s_ad += fabs(dd);
            s_k3 += k3;
            s_chi += em1 * (em1 + 2.0f);
            s_n += valid;
            s_bad += (float)(m[t] != 0) - valid;
            /* off the valid tokens dp = 0 <= any valid |pi_old - mu|: only log rho's extrema need
             * the mask */
            mn_d = fminf(mn_d, d + pad_big);
            mx_d = fmaxf(mx_d, d - pad_big);
            mx_dp = fmaxf(mx_dp, dp);
        }
        if (s_n > 0) { /* extrema, and the controller's per-sequence discrepancies Y_i */
            max_neg = -mn_d > max_neg ? -mn_d : max_neg;
            max_pos = mx_d > max_pos ? mx_d : max_pos;
            max_dp = mx_dp > max_dp ? mx_dp : max_dp;
            y_dp += s_dp / s_n, y_ad += s_ad / s_n, y_k3 += s_k3 / s_n, n_seqs += 1;
        }
        double *o = seq_sums + b;
        o[0 * B] = s_lp, o[1 * B] = s_lq, o[2 * B] = -s_d, o[3 * B] = s_d, o[4 * B] = s_dp;
        o[5 * B] = s_ad, o[6 * B] = s_k3, o[7 * B] = s_chi, o[8 * B] = s_n, o[9 * B] = s_bad;
    }
    ext[0] = max_neg, ext[1] = max_pos, ext[2] = max_dp;
    dstats[0] = y_dp, dstats[2] = y_ad, dstats[4] = y_k3;
    dstats[1] = dstats[3] = dstats[5] = n_seqs;
}

/* ACRL weights w = exp(clamp(alpha * clamp(log rho), +-B)), alpha = sign(A) * coef[b] clipped to
 * [alpha_lo, alpha_hi] (float32, like every per-token value here), then clamped to [w_low, w_high],
 * 0 off the valid tokens (as in acrl_mismatch_pass): the C twin of the acrl entry of weights.py
 * (alpha as in acrl.py's acrl_alpha, coef from its acrl_coefficient).
 *
 * old_logprobs, rollout_logprobs, mask: as in acrl_mismatch_pass.
 * adv: advantages with strides (sa_b, sa_t) (sa_t = 0 for one advantage per sequence); coef: [B]
 * gamma * (1 - Y / X) per sequence, or NULL for coef0 on every sequence; alpha_lo / alpha_hi: the
 * bounds of alpha (sign-safe ACRL: alpha_lo = 0; the paper's law: none). "No bound" is passed as a
 * large finite number (the file is compiled for finite arithmetic). inv_tokens: 1 / the global token
 * count, so that stats are already partial means. Writes weights [B, T] float32 (contiguous), stats
 * [5] float64: the sums over valid tokens of w, (w - 1)^2 (in float64: the std is a difference of
 * two such sums, sqrt(E[(w - 1)^2] - (E[w] - 1)^2), exact about 1 where the weights live), alpha,
 * |alpha| and of the saturated tokens (|alpha * clamp(log rho)| >= B), times inv_tokens, and wext [2] float64 (max w and min w over valid tokens; -inf / +inf without any). */
void acrl_weights_pass(const float *old_logprobs, const float *rollout_logprobs, const uint8_t *mask,
                       const float *adv, int64_t B, int64_t T, int64_t sp, int64_t sq, int64_t sm,
                       int64_t sa_b, int64_t sa_t, const double *coef, double coef0, float alpha_lo,
                       float alpha_hi, float w_low, float w_high, double inv_tokens, float *weights,
                       double *stats, double *wext) {
    double s_w = 0, s_w2 = 0, s_a = 0, s_aa = 0, s_sat = 0;
    float w_max = -INFINITY, w_min = INFINITY;
    for (int64_t b = 0; b < B; ++b) {
        const float *lp_old = old_logprobs + b * sp, *lp_roll = rollout_logprobs + b * sq;
        const float *a = adv + b * sa_b;
        const uint8_t *m = mask + b * sm;
        float *w = weights + b * T;
        float c = (float)(coef ? coef[b] : coef0);
        double r_w = 0, r_w2 = 0, r_a = 0, r_aa = 0, r_sat = 0;
        float r_max = 0.0f, r_min = FLT_MAX;
        float n_valid = 0.0f;
        for (int64_t t = 0; t < T; ++t) {
            uint32_t v = valid_bits(m[t], lp_old[t], lp_roll[t]);
            float valid = (float)(v & 1u), pad_big = (1.0f - valid) * PAD_BIG;
            float d = (float)((double)keep(lp_old[t], v) - (double)keep(lp_roll[t], v));
            float av = a[t * sa_t];
            float sgn = (float)((av > 0.0f) - (av < 0.0f));
            float alpha = keep(clampf(sgn * c, alpha_lo, alpha_hi), v);
            float e = alpha * clampf(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND);
            float wt = exp_poly(clampf(e, -LOG_RATIO_BOUND, LOG_RATIO_BOUND));
            wt = keep(clampf(wt, w_low, w_high), v);
            w[t] = wt;
            r_w += wt;
            double dw = (double)wt - (double)valid; /* w - 1 on valid tokens, exact */
            r_w2 += dw * dw;
            r_a += alpha;
            r_aa += fabsf(alpha);
            r_sat += (float)(fabsf(e) >= LOG_RATIO_BOUND);
            n_valid += valid;
            r_max = fmaxf(r_max, wt);
            r_min = fminf(r_min, wt + pad_big);
        }
        s_w += r_w, s_w2 += r_w2, s_a += r_a, s_aa += r_aa, s_sat += r_sat;
        if (n_valid > 0) {
            w_max = r_max > w_max ? r_max : w_max;
            w_min = r_min < w_min ? r_min : w_min;
        }
    }
    stats[0] = s_w * inv_tokens, stats[1] = s_w2 * inv_tokens, stats[2] = s_a * inv_tokens;
    stats[3] = s_aa * inv_tokens, stats[4] = s_sat * inv_tokens;
    wext[0] = w_max, wext[1] = w_min;
}

/* The partial mismatch metrics of metrics.py's mismatch_metrics, from acrl_mismatch_pass's output:
 * out[NPARTIALS] in the order of its _MISMATCH_NAMES: token means of rows 2..7, the non-finite
 * count, seven sequence means, log E[(prod rho)^2], five maxima (of -log rho, log rho, |pi_old - mu|,
 * and over sequences of +-mean log(mu / pi_old)) and three derived extrema (max |log rho|, min log
 * rho, min mean log(mu / pi_old)). inv_tokens / inv_seqs: 1 / the global token / sequence counts,
 * log_seqs: log of the global sequence count. Runs over B sequences only. */
void acrl_mismatch_partials(const double *seq_sums, int64_t B, const double *ext, double inv_tokens,
                            double inv_seqs, double log_seqs, double *out) {
    for (int r = 2; r < 8; ++r) {
        double s = 0;
        for (int64_t b = 0; b < B; ++b) s += seq_sums[r * B + b];
        out[r - 2] = s * inv_tokens;
    }
    double bad = 0;
    for (int64_t b = 0; b < B; ++b) bad += seq_sums[9 * B + b];
    out[6] = bad;
    double ppl_t = 0, ppl_r = 0, ppl_ratio = 0, log_t = 0, log_r = 0, diff = 0, abs_diff = 0;
    double peak = -INFINITY, diff_max = -INFINITY, diff_min = INFINITY;
    for (int64_t b = 0; b < B; ++b) {
        double n = seq_sums[8 * B + b];
        if (n <= 0) continue;
        double m_p = seq_sums[b] / n, m_q = seq_sums[B + b] / n, m_d = seq_sums[2 * B + b] / n;
        double m_c = m_d < -LOG_RATIO_BOUND ? -LOG_RATIO_BOUND : (m_d > LOG_RATIO_BOUND ? LOG_RATIO_BOUND : m_d);
        ppl_t += exp(-m_p), ppl_r += exp(-m_q), ppl_ratio += exp(m_c), log_t -= m_p, log_r -= m_q;
        diff += m_d, abs_diff += fabs(m_d);
        diff_max = m_d > diff_max ? m_d : diff_max;
        diff_min = m_d < diff_min ? m_d : diff_min;
        double v = 2.0 * seq_sums[3 * B + b];
        peak = v > peak ? v : peak;
    }
    out[7] = ppl_t * inv_seqs, out[8] = ppl_r * inv_seqs, out[9] = ppl_ratio * inv_seqs;
    out[10] = log_t * inv_seqs, out[11] = log_r * inv_seqs, out[12] = diff * inv_seqs;
    out[13] = abs_diff * inv_seqs;
    double lse_sum = 0;
    for (int64_t b = 0; b < B; ++b)
        if (seq_sums[8 * B + b] > 0) lse_sum += exp(2.0 * seq_sums[3 * B + b] - peak);
    out[14] = lse_sum > 0 ? peak + log(lse_sum) - log_seqs : -INFINITY;
    out[15] = ext[0], out[16] = ext[1], out[17] = ext[2], out[18] = diff_max, out[19] = -diff_min;
    out[20] = ext[0] > ext[1] ? ext[0] : ext[1];
    out[21] = -ext[0], out[22] = diff_min;
}
