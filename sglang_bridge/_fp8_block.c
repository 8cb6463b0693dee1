/* Block-FP8 (e4m3fn) quantize and fake-quantize of one [N, K] weight in one pass per block row.
 *
 * The same numbers as the reference in sglang_bridge/fp8.py (_quantize_block_reference,
 * _fake_quantize_block_reference, fake_quantize_stress), bit for bit, for bf16 and fp32 weights:
 *
 *   amax  = max |x| over the bn x bk block (zero padding of a ragged edge block never raises it;
 *           NaN propagates: integer max of the magnitude bits, NaN sorts above inf)
 *   scale = max(amax, 1e-12f) / 448            (fp32 IEEE division; UE8M0: exponent rounded up)
 *   y     = x / scale                          (fp32 IEEE division, per element)
 *   q     = e4m3(clamp(y, -448, 448))          (round to nearest even, like torch's fp8 cast;
 *                                               stress modes: toward zero, fewer mantissa bits)
 *   fake  = to_dtype(float(q) * scale)         (fp32 product, one RNE rounding to bf16)
 *
 * The e4m3 rounding is exact arithmetic, not a cast: the grid step of |y| is 2^(e-3) with e its
 * exponent clamped below at -6 (e4m3's subnormal range), and (|y| + M) - M with M = step * 2^23
 * rounds |y| to a multiple of step, half to even, in the default rounding mode (M's ulp is step).
 * That needs IEEE evaluation order, so this file is built WITHOUT the relaxed FP flags of
 * ckernels/__init__.py (see FP8_CFLAGS in fp8.py: no -ffast-math family, no FP contraction);
 * NaN handling is written with comparisons whose false branch keeps the NaN.
 *
 * bf16 weights on AVX-512BW take a table path (fake_seg_bf16_tab below) that gives the same bits
 * without dividing: per block, the result depends on the 7 mantissa bits of x alone once the
 * exponent is factored out.
 *
 * Plain C99 (plus AVX-512 intrinsics in one function built for that target only), no Python or
 * torch headers; called through ctypes (which releases the GIL).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_TABLE_PATH 1
#endif
#define NT_MIN_BYTES ((size_t)1 << 20) /* smaller outputs are likely read again from cache */

/* Hot loops are compiled for AVX-512 / AVX2 / baseline x86-64 and picked at load time (GCC
 * function multi-versioning), so a library cached in a shared home directory stays valid on every
 * x86-64 machine; other compilers and architectures get the plain build. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HOT
#endif
#define INLINE static inline __attribute__((always_inline))

#define FP8_MAX 448.0f
#define AMAX_EPS 1e-12f
#define DT_BF16 0
#define DT_F32 1

INLINE uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* fp32 -> bf16, round to nearest even (torch's conversion); any NaN -> a quiet NaN */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}

/* Per-block scale from the amax magnitude bits (fp32 pattern). */
INLINE float block_scale(uint32_t amax_bits, int ue8m0) {
    float amax = u2f(amax_bits);
    amax = amax < AMAX_EPS ? AMAX_EPS : amax; /* NaN: comparison false, NaN kept (torch clamp) */
    float s = amax / FP8_MAX;
    if (ue8m0) { /* DeepGEMM ceil_to_ue8m0 on the bits, as fp8._ue8m0 */
        uint32_t b = f2u(s) & 0x7FFFFFFFu;
        int32_t e = (int32_t)((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0);
        e = e < 1 ? 1 : (e > 254 ? 254 : e);
        s = u2f((uint32_t)e << 23);
    }
    return s;
}

/* |y| (>= 0 or NaN, <= 448) rounded onto the e4m3 grid of `mbits` mantissa bits: nearest-even to
 * 3 bits then the low 3 - mbits bits of the code cleared (to_e4m3's "nearest"), or truncation toward
 * zero ("toward_zero": the largest grid value not above |y|, then the same clearing). Returns the
 * rounded magnitude (fp32, exact). `tz_mask` clears the dropped mantissa bits of a normal value,
 * `sub_mask` those of a subnormal code (m in 0..7, value m * 2^-9). A NaN becomes `nan_val`: what
 * to_e4m3 makes of the NaN code 0x7F once its low bits are cleared (NaN itself at 3 bits). */
INLINE float round_mag(float a, int toward_zero, uint32_t tz_mask, int32_t sub_mask, float nan_val) {
    float r;
    if (toward_zero) {
        r = a;
    } else {
        uint32_t e = f2u(a) & 0x7F800000u;
        e = e < (121u << 23) ? (121u << 23) : e;
        float m = u2f(e + (20u << 23)); /* step * 2^23; garbage for NaN, whose result is NaN anyway */
        r = (a + m) - m;
        if (tz_mask == 0xFFF00000u) return r;
    }
    /* truncation toward zero onto the grid: clear mantissa bits of a normal value, floor the
     * subnormal code (value m * 2^-9, m in 0..7) and clear its low bits */
    uint32_t rb = f2u(r);
    int normal = rb >= (121u << 23); /* NaN counts as normal here and is handled below */
    float rs = normal ? 0.0f : r;
    float sr = (float)((int32_t)(rs * 512.0f) & sub_mask) * (1.0f / 512.0f);
    float t = normal ? u2f(rb & tz_mask) : sr;
    return r != r ? nan_val : t;
}

INLINE float load(const void *w, int dt, int64_t i) {
    if (dt == DT_BF16) return u2f((uint32_t)((const uint16_t *)w)[i] << 16);
    return ((const float *)w)[i];
}

/* Magnitude bits (fp32 pattern) of the largest |x| in row segment [c0, c1), NaN above inf. */
INLINE uint32_t seg_amax(const void *row, int dt, int64_t c0, int64_t c1, uint32_t m) {
    if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)row;
        uint16_t mm = (uint16_t)(m >> 16);
        for (int64_t c = c0; c < c1; c++) {
            uint16_t v = p[c] & 0x7FFFu;
            mm = v > mm ? v : mm;
        }
        return (uint32_t)mm << 16;
    }
    const uint32_t *p = (const uint32_t *)row;
    for (int64_t c = c0; c < c1; c++) {
        uint32_t v = p[c] & 0x7FFFFFFFu;
        m = v > m ? v : m;
    }
    return m;
}

/* Column-wise running max of the magnitude bits of bf16 rows [r0, r1) into acc [k], then each
 * block's max: one vertical max per element (vectorised) instead of a horizontal reduction per
 * row segment. */
INLINE void bf16_block_amax(const uint16_t *w, int64_t r0, int64_t r1, int64_t k, int64_t ld,
                            int64_t bk, int64_t kb, uint16_t *acc, uint32_t *amax) {
    memset(acc, 0, (size_t)k * sizeof(uint16_t));
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = w + r * ld;
        for (int64_t c = 0; c < k; c++) {
            uint16_t v = row[c] & 0x7FFFu;
            acc[c] = v > acc[c] ? v : acc[c];
        }
    }
    for (int64_t j = 0; j < kb; j++) {
        int64_t c1 = (j + 1) * bk < k ? (j + 1) * bk : k;
        amax[j] = seg_amax(acc, DT_BF16, j * bk, c1, 0);
    }
}

INLINE void block_row_scales(const void *w, int dt, int64_t r0, int64_t r1, int64_t k, int64_t ld,
                             int64_t bk, int64_t kb, int ue8m0, uint32_t *amax, float *scale,
                             uint16_t *acc) {
    size_t es = dt == DT_BF16 ? 2 : 4;
    if (dt == DT_BF16 && acc) {
        bf16_block_amax((const uint16_t *)w, r0, r1, k, ld, bk, kb, acc, amax);
        for (int64_t j = 0; j < kb; j++) scale[j] = block_scale(amax[j], ue8m0);
        return;
    }
    for (int64_t j = 0; j < kb; j++) amax[j] = 0;
    for (int64_t r = r0; r < r1; r++) {
        const char *row = (const char *)w + (size_t)(r * ld) * es;
        for (int64_t j = 0; j < kb; j++) {
            int64_t c1 = (j + 1) * bk < k ? (j + 1) * bk : k;
            amax[j] = seg_amax(row, dt, j * bk, c1, amax[j]);
        }
    }
    for (int64_t j = 0; j < kb; j++) scale[j] = block_scale(amax[j], ue8m0);
}

/* |y| clamped to 448 and rounded to the nearest-even e4m3 value (fp32, exact); NaN stays NaN. */
INLINE float e4m3_mag(float y) {
    float a = u2f(f2u(y) & 0x7FFFFFFFu);
    a = a > FP8_MAX ? FP8_MAX : a;
    uint32_t e = f2u(a) & 0x7F800000u;
    e = e < (121u << 23) ? (121u << 23) : e;
    float m = u2f(e + (20u << 23)); /* step * 2^23; garbage for NaN, whose result is NaN anyway */
    return (a + m) - m;
}

/* Fake-quant of one row segment: out[c] = to_dtype(e4m3(x[c] / s) * s). Specialised per dtype
 * and rounding so that the common case (bf16, nearest, 3 bits) is a straight vectorisable loop. The
 * sign is x's: s > 0, or NaN, which makes the result NaN. */
INLINE void fake_seg_bf16(const uint16_t *x, uint16_t *o, int64_t n, float s) {
    for (int64_t c = 0; c < n; c++) {
        uint32_t xb = (uint32_t)x[c] << 16;
        float r = e4m3_mag(u2f(xb) / s);
        o[c] = f32_to_bf16(u2f(f2u(r) | (xb & 0x80000000u)) * s);
    }
}

INLINE void fake_seg_f32(const float *x, float *o, int64_t n, float s) {
    for (int64_t c = 0; c < n; c++) {
        float r = e4m3_mag(x[c] / s);
        o[c] = u2f(f2u(r) | (f2u(x[c]) & 0x80000000u)) * s;
    }
}

INLINE void fake_seg_generic(const void *x, int dt, void *o, int64_t n, float s, int toward_zero,
                             uint32_t tz_mask, int32_t sub_mask, float nan_val) {
    for (int64_t c = 0; c < n; c++) {
        float y = load(x, dt, c) / s;
        uint32_t sign = f2u(y) & 0x80000000u;
        float a = u2f(f2u(y) & 0x7FFFFFFFu);
        a = a > FP8_MAX ? FP8_MAX : a;
        float r = round_mag(a, toward_zero, tz_mask, sub_mask, nan_val);
        float v = u2f(f2u(r) | sign) * s;
        if (dt == DT_BF16)
            ((uint16_t *)o)[c] = f32_to_bf16(v);
        else
            ((float *)o)[c] = v;
    }
}

/* ---- Table path (bf16 fake-quant) ----
 * For a bf16 x = +-2^E * 1.f (f: 7 bits) whose quotient y = x / s is an e4m3 normal (|y| >= 2^-6),
 * every step above is exact up to a power of two: the correctly rounded x / s, the e4m3 rounding
 * (relative to y's exponent, in every rounding mode and mantissa width), the fp32 product and its
 * bf16 rounding all scale by 2^(E - E0) when x does, as no value under- or overflows (y <= 448
 * because |x| <= amax; s >= 1e-12 / 448, so the products are far from fp32's subnormals). So the
 * result's bits are (x's sign and exponent bits) + T[f], T[f] = fake(2^E0 * 1.f) - (E0's exponent
 * bits) in 16-bit wrap-around arithmetic, for one E0 per block: a 128-entry table built from the
 * scalar code above, looked up 32 lanes at a time with two-source word permutes. Lanes below
 * 2^E_lo (e4m3 subnormals, zeros, bf16 subnormals) and inf / NaN lanes (whose block scale is NaN,
 * inf, or with UE8M0 the finite 2^127) take the scalar code; blocks whose scale is not a normal
 * number never take the table. */
typedef struct {
    uint16_t t[128];
    uint16_t lo; /* magnitude bits 2^E_lo: the smallest bf16 exponent whose quotients are normal */
    int ok;
} mant_table;

/* The scalar fake-quant of one bf16 pattern (any mode). */
INLINE uint16_t fake_one_bf16(uint16_t xb, float s, int plain, int toward_zero, uint32_t tz_mask,
                              int32_t sub_mask, float nan_val) {
    uint16_t o;
    if (plain)
        fake_seg_bf16(&xb, &o, 1, s);
    else
        fake_seg_generic(&xb, DT_BF16, &o, 1, s, toward_zero, tz_mask, sub_mask, nan_val);
    return o;
}

/* E_lo for scale s: the smallest biased exponent with fl(2^(E-127) / s) >= 2^-6 (the correctly
 * rounded quotient is monotone in x, so every x of that exponent or above qualifies), or -1 when s
 * is not a normal number or no exponent qualifies. */
INLINE int32_t e4m3_normal_edge(float s) {
    if (!(s >= 1.17549435e-38f && s <= 3.40282347e38f)) return -1;
    int32_t e = (int32_t)((f2u(s) >> 23) & 0xFFu) - 8;
    e = e < 2 ? 2 : e;
    while (e < 254 && u2f((uint32_t)e << 23) / s < 0.015625f) e++;
    return e >= 254 ? -1 : e;
}

INLINE void build_table(float s, mant_table *tb, int plain, int toward_zero, uint32_t tz_mask,
                        int32_t sub_mask, float nan_val) {
    tb->ok = 0;
    int32_t e = e4m3_normal_edge(s);
    if (e < 0) return;
    /* the 128 entries through the (vectorised) segment code, as one segment */
    uint16_t xs[128], os[128];
    for (uint32_t f = 0; f < 128; f++) xs[f] = (uint16_t)(((uint32_t)e << 7) | f);
    if (plain)
        fake_seg_bf16(xs, os, 128, s);
    else
        fake_seg_generic(xs, DT_BF16, os, 128, s, toward_zero, tz_mask, sub_mask, nan_val);
    for (uint32_t f = 0; f < 128; f++) tb->t[f] = (uint16_t)(os[f] - (uint16_t)((uint32_t)e << 7));
    tb->lo = (uint16_t)((uint32_t)e << 7);
    tb->ok = 1;
}

#ifdef HAVE_TABLE_PATH
#define AVX512BW __attribute__((target("avx512f,avx512bw")))

/* One block's table in registers, and the bounds of the lanes it covers. */
typedef struct {
    __m512i t0, t1, t2, t3, lo, span;
} tab_regs;

AVX512BW INLINE tab_regs tab_load(const mant_table *tb) {
    tab_regs r;
    r.t0 = _mm512_loadu_si512(tb->t);
    r.t1 = _mm512_loadu_si512(tb->t + 32);
    r.t2 = _mm512_loadu_si512(tb->t + 64);
    r.t3 = _mm512_loadu_si512(tb->t + 96);
    r.lo = _mm512_set1_epi16((short)tb->lo);
    /* |x| bits - lo, unsigned: below lo wraps around, so one compare finds both kinds of slow lane */
    r.span = _mm512_set1_epi16((short)(0x7F80 - tb->lo));
    return r;
}

/* T[f] of each of 32 bf16 lanes (f: the low 7 bits). vpermt2w reads the low 6 bits of each index:
 * entries 0-63 from (t0, t1), 64-127 from (t2, t3). */
AVX512BW INLINE __m512i tab_entry(const tab_regs *r, __m512i v) {
    __m512i a = _mm512_permutex2var_epi16(r->t0, v, r->t1);
    __m512i b = _mm512_permutex2var_epi16(r->t2, v, r->t3);
    return _mm512_mask_blend_epi16(_mm512_test_epi16_mask(v, _mm512_set1_epi16(0x40)), a, b);
}

/* The lanes the table does not cover (below 2^E_lo, or not finite): the scalar code's. */
AVX512BW INLINE __mmask32 tab_slow(const tab_regs *r, __m512i v) {
    __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
    return _mm512_cmpge_epu16_mask(_mm512_sub_epi16(mag, r->lo), r->span);
}

AVX512BW INLINE void fake_seg_bf16_tab(const uint16_t *x, uint16_t *o, int64_t n, float s,
                                       const mant_table *tb, int plain, int toward_zero,
                                       uint32_t tz_mask, int32_t sub_mask, float nan_val, int nt) {
    const tab_regs tr = tab_load(tb);
    const __m512i sign_exp = _mm512_set1_epi16((short)0xFF80);
    int64_t c = 0;
    for (; c + 32 <= n; c += 32) {
        __m512i v = _mm512_loadu_si512(x + c);
        __m512i r = _mm512_add_epi16(_mm512_and_si512(v, sign_exp), tab_entry(&tr, v));
        __mmask32 slow = tab_slow(&tr, v);
        if (slow) { /* rare in real weights: |x| below ~amax * 2^-15, or not finite */
            uint16_t xv[32], rv[32]; /* the inputs, kept: o may be x (in-place fake-quant) */
            _mm512_storeu_si512(xv, v);
            _mm512_storeu_si512(rv, r);
            for (; slow; slow &= slow - 1) {
                int i = __builtin_ctz(slow);
                rv[i] = fake_one_bf16(xv[i], s, plain, toward_zero, tz_mask, sub_mask, nan_val);
            }
            r = _mm512_loadu_si512(rv);
        }
        if (nt)
            _mm512_stream_si512((void *)(o + c), r);
        else
            _mm512_storeu_si512(o + c, r);
    }
    for (; c < n; c++) o[c] = fake_one_bf16(x[c], s, plain, toward_zero, tz_mask, sub_mask, nan_val);
}

/* Rows [r0, r1) of one block row (bf16): the table where the block has one, else the scalar code.
 * One call per block row, so the per-segment work stays inside one AVX-512 function. */
AVX512BW __attribute__((noinline)) static void fake_rows_bf16_tab(
    const uint16_t *w, int64_t r0, int64_t r1, int64_t k, int64_t ld_w, uint16_t *out, int64_t ld_o,
    int64_t bk, int64_t kb, const float *scale, const mant_table *tables, int plain, int toward_zero,
    uint32_t tz_mask, int32_t sub_mask, float nan_val, int nt) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = w + r * ld_w;
        uint16_t *orow = out + r * ld_o;
        for (int64_t j = 0; j < kb; j++) {
            int64_t c0 = j * bk, c1 = c0 + bk < k ? c0 + bk : k;
            if (tables[j].ok)
                fake_seg_bf16_tab(xr + c0, orow + c0, c1 - c0, scale[j], &tables[j], plain, toward_zero,
                                  tz_mask, sub_mask, nan_val, nt);
            else if (plain)
                fake_seg_bf16(xr + c0, orow + c0, c1 - c0, scale[j]);
            else
                fake_seg_generic(xr + c0, DT_BF16, orow + c0, c1 - c0, scale[j], toward_zero, tz_mask,
                                 sub_mask, nan_val);
        }
    }
    if (nt) _mm_sfence(); /* streaming stores are weakly ordered: visible before the caller returns */
}

static int table_path_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
#else
static int table_path_available(void) { return 0; }
#endif

/* Whether fp8_block_fake can take the table path on this CPU (1) or not (0). */
int fp8_table_path(void) { return table_path_available(); }

/* e4m3fn code of x / s: clamp to +-448, round to nearest even (torch's cast), NaN -> 0x7F | sign. */
INLINE uint8_t e4m3_code(float x, float s) {
    float y = x / s;
    uint32_t sign = (f2u(x) >> 24) & 0x80u; /* s > 0, or NaN (then the code is NaN anyway) */
    float r = e4m3_mag(y);
    uint32_t rb = f2u(r);
    uint32_t normal = (((rb >> 23) - 120u) << 3) | ((rb >> 20) & 7u);
    int is_normal = rb >= (121u << 23); /* NaN too: handled below */
    uint32_t sub = (uint32_t)(int32_t)((is_normal ? 0.0f : r) * 512.0f);
    uint32_t code = is_normal ? normal : sub;
    code = r != r ? 0x7Fu : code;
    return (uint8_t)(code | sign);
}

INLINE void quant_seg_bf16(const uint16_t *x, uint8_t *q, int64_t n, float s) {
    for (int64_t c = 0; c < n; c++) q[c] = e4m3_code(u2f((uint32_t)x[c] << 16), s);
}

INLINE void quant_seg_f32(const float *x, uint8_t *q, int64_t n, float s) {
    for (int64_t c = 0; c < n; c++) q[c] = e4m3_code(x[c], s);
}

/* Fake-quantize w [n, k] (row stride ld_w elements, unit column stride; bf16 or fp32) into out
 * [n, k] (row stride ld_o, same dtype). toward_zero / mbits: the stress grid (0 / 3: production
 * e4m3). table: take the table path for bf16 where the CPU has it (0: the scalar code only, which
 * tests compare it with). Returns 0, or -1 if the scratch allocation failed (nothing written then). */
HOT int fp8_block_fake(const void *w, int64_t n, int64_t k, int64_t ld_w, int dt, void *out, int64_t ld_o,
                   int64_t bn, int64_t bk, int ue8m0, int toward_zero, int mbits, int table) {
    int64_t kb = (k + bk - 1) / bk;
    int tab = table && dt == DT_BF16 && table_path_available();
    /* Streaming (non-temporal) stores for an output too large to stay in cache, such as a send
     * bucket that the transfer reads much later: they skip reading each destination line before
     * writing it (a third of the memory traffic). Only where every 64-byte store is aligned. */
    int nt = tab && ((uintptr_t)out & 63) == 0 && ld_o % 32 == 0 && bk % 32 == 0
          && (size_t)n * (size_t)k * 2 >= NT_MIN_BYTES;
    size_t scratch = (size_t)kb * (sizeof(uint32_t) + sizeof(float))
                   + (tab ? (size_t)kb * sizeof(mant_table) + (size_t)k * sizeof(uint16_t) : 0);
    uint32_t *amax = (uint32_t *)malloc(scratch);
    if (!amax) return -1;
    float *scale = (float *)(amax + kb);
    mant_table *tables = tab ? (mant_table *)(scale + kb) : NULL;
    uint16_t *acc = tab ? (uint16_t *)(tables + kb) : NULL;
    size_t es = dt == DT_BF16 ? 2 : 4;
    uint32_t tz_mask = ~((1u << (23 - mbits)) - 1u);
    int32_t sub_mask = ~((1 << (3 - mbits)) - 1);
    int plain = !toward_zero && mbits == 3;
    /* NaN code 0x7F with its low mantissa bits cleared: 2^8 * (1 + m / 8) */
    float nan_val = mbits == 3 ? u2f(0x7FC00000u) : u2f((135u << 23) | ((7u & (uint32_t)sub_mask) << 20));
    for (int64_t r0 = 0; r0 < n; r0 += bn) {
        int64_t r1 = r0 + bn < n ? r0 + bn : n;
        block_row_scales(w, dt, r0, r1, k, ld_w, bk, kb, ue8m0, amax, scale, acc);
#ifdef HAVE_TABLE_PATH
        if (tab) {
            for (int64_t j = 0; j < kb; j++)
                build_table(scale[j], &tables[j], plain, toward_zero, tz_mask, sub_mask, nan_val);
            fake_rows_bf16_tab((const uint16_t *)w, r0, r1, k, ld_w, (uint16_t *)out, ld_o, bk, kb, scale,
                               tables, plain, toward_zero, tz_mask, sub_mask, nan_val, nt);
            continue;
        }
#endif
        for (int64_t r = r0; r < r1; r++) {
            const char *xr = (const char *)w + (size_t)(r * ld_w) * es;
            char *orow = (char *)out + (size_t)(r * ld_o) * es;
            for (int64_t j = 0; j < kb; j++) {
                int64_t c0 = j * bk, c1 = c0 + bk < k ? c0 + bk : k;
                const char *xs = xr + (size_t)c0 * es;
                char *os = orow + (size_t)c0 * es;
                if (!plain)
                    fake_seg_generic(xs, dt, os, c1 - c0, scale[j], toward_zero, tz_mask, sub_mask,
                                     nan_val);
                else if (dt == DT_BF16)
                    fake_seg_bf16((const uint16_t *)xs, (uint16_t *)os, c1 - c0, scale[j]);
                else
                    fake_seg_f32((const float *)xs, (float *)os, c1 - c0, scale[j]);
            }
        }
    }
    free(amax);
    return 0;
}

/* The table path for the real codes: with the same exponent shift, the e4m3 code of a normal y
 * moves by 8 per power of two of x (code = (exponent - 120) << 3 | mantissa, a rounding carry
 * included), so code(x) = (x's sign) | T[f] + (x's exponent << 3), T built per block at E_lo. */
INLINE void build_code_table(float s, mant_table *tb) {
    tb->ok = 0;
    int32_t e = e4m3_normal_edge(s);
    if (e < 0) return;
    uint16_t xs[128];
    uint8_t qs[128];
    for (uint32_t f = 0; f < 128; f++) xs[f] = (uint16_t)(((uint32_t)e << 7) | f);
    quant_seg_bf16(xs, qs, 128, s);
    for (uint32_t f = 0; f < 128; f++) tb->t[f] = (uint16_t)(qs[f] - (uint16_t)((uint32_t)e << 3));
    tb->lo = (uint16_t)((uint32_t)e << 7);
    tb->ok = 1;
}

#ifdef HAVE_TABLE_PATH
/* Codes of rows [r0, r1) of one block row (bf16): the table where the block has one, else scalar. */
AVX512BW __attribute__((noinline)) static void quant_rows_bf16_tab(
    const uint16_t *w, int64_t r0, int64_t r1, int64_t k, int64_t ld_w, uint8_t *q, int64_t ld_q,
    int64_t bk, int64_t kb, const float *scale, const mant_table *tables) {
    const __m512i exp_bits = _mm512_set1_epi16(0x7F80), sign_bit = _mm512_set1_epi16(0x80);
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = w + r * ld_w;
        uint8_t *qr = q + r * ld_q;
        for (int64_t j = 0; j < kb; j++) {
            int64_t c0 = j * bk, c1 = c0 + bk < k ? c0 + bk : k, c = c0;
            if (tables[j].ok) {
                const tab_regs tr = tab_load(&tables[j]);
                for (; c + 32 <= c1; c += 32) {
                    __m512i v = _mm512_loadu_si512(xr + c);
                    __m512i code = _mm512_add_epi16(tab_entry(&tr, v),
                                                    _mm512_srli_epi16(_mm512_and_si512(v, exp_bits), 4));
                    code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi16(v, 8), sign_bit));
                    _mm256_storeu_si256((__m256i *)(qr + c), _mm512_cvtepi16_epi8(code));
                    for (__mmask32 slow = tab_slow(&tr, v); slow; slow &= slow - 1) { /* rare: tiny or non-finite x */
                        int i = __builtin_ctz(slow);
                        qr[c + i] = e4m3_code(u2f((uint32_t)xr[c + i] << 16), scale[j]);
                    }
                }
            }
            quant_seg_bf16(xr + c, qr + c, c1 - c, scale[j]); /* the tail, or the whole segment */
        }
    }
}
#endif

/* Quantize w [n, k] into e4m3fn codes q [n, k] (row stride ld_q bytes) and fp32 scales
 * scale_out [ceil(n/bn), ceil(k/bk)] (contiguous). table: as in fp8_block_fake. Returns 0, or -1 on
 * allocation failure. */
HOT int fp8_block_quant(const void *w, int64_t n, int64_t k, int64_t ld_w, int dt, uint8_t *q, int64_t ld_q,
                    float *scale_out, int64_t bn, int64_t bk, int ue8m0, int table) {
    int64_t kb = (k + bk - 1) / bk;
    int tab = table && dt == DT_BF16 && table_path_available();
    size_t scratch = (size_t)kb * sizeof(uint32_t)
                   + (tab ? (size_t)kb * sizeof(mant_table) + (size_t)k * sizeof(uint16_t) : 0);
    uint32_t *amax = (uint32_t *)malloc(scratch);
    if (!amax) return -1;
    mant_table *tables = tab ? (mant_table *)(amax + kb) : NULL;
    uint16_t *acc = tab ? (uint16_t *)(tables + kb) : NULL;
    size_t es = dt == DT_BF16 ? 2 : 4;
    for (int64_t r0 = 0, i = 0; r0 < n; r0 += bn, i++) {
        int64_t r1 = r0 + bn < n ? r0 + bn : n;
        float *scale = scale_out + i * kb;
        block_row_scales(w, dt, r0, r1, k, ld_w, bk, kb, ue8m0, amax, scale, acc);
#ifdef HAVE_TABLE_PATH
        if (tab) {
            for (int64_t j = 0; j < kb; j++) build_code_table(scale[j], &tables[j]);
            quant_rows_bf16_tab((const uint16_t *)w, r0, r1, k, ld_w, q, ld_q, bk, kb, scale, tables);
            continue;
        }
#endif
        for (int64_t r = r0; r < r1; r++) {
            const char *xr = (const char *)w + (size_t)(r * ld_w) * es;
            for (int64_t j = 0; j < kb; j++) {
                int64_t c0 = j * bk, c1 = c0 + bk < k ? c0 + bk : k;
                uint8_t *qs = q + r * ld_q + c0;
                if (dt == DT_BF16)
                    quant_seg_bf16((const uint16_t *)xr + c0, qs, c1 - c0, scale[j]);
                else
                    quant_seg_f32((const float *)xr + c0, qs, c1 - c0, scale[j]);
            }
        }
    }
    free(amax);
    return 0;
}
