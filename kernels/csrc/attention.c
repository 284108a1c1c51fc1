/* The arithmetic of one split of a query row's attention on the CPU, shared by prefill.c (many rows of one
 * sequence) and decode.c (one row per sequence, splits spread over the threads), float32, keys read in place from
 * the paged pool through the block table.
 *
 * Why one routine: a row's output must be the same bits whether its context came from the prefix cache or was just
 * computed, whether it ran in a prefill, an extend or a decode, alone or in a batch, on one thread or two. Float
 * sums depend on their order, so every path takes the same one: splits and chunks of keys at fixed positions (not
 * sized from the rows, the batch or the threads), within a chunk the scores s = (scale q) K^T as dot8 computes them
 * (8 lanes over the head dimension, then a fixed tree), an online softmax over the split's chunks
 * (tsterm_exp_sum, the output rescaled when the maximum grows), P V as the tile's chain over the chunk's positions
 * added to the rescaled output; the splits' partials are then merged in order (tsterm_att_merge). A row's work
 * depends only on its position, its q and the keys at or before it.
 *
 * A sliding window (gpt-oss) keeps the same positions for splits and chunks: a row starts at the split and the
 * chunk that hold the first key of its window, the keys before it in that chunk left out of its max and its sum
 * (the sum's lanes start at that key, in every path alike), and the splits and chunks before it are never read.
 * An attention sink (a learned per-head logit) joins only the final normalisation (tsterm_att_norm).
 *
 * A bfloat16 pool (kv->kv_bf16) is read in place, each K and V row widened to float32 as it is loaded (exact: a
 * bfloat16 is a float32's high half), and then everything above runs on those float32 values in the same order: a
 * row's result is the bits the float32 kernel gives on the pool converted to float32, without converting it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tsterm.h"

/* off[j] <- where position p + j's row of K (or V) for KV head h starts in its pool, for the positions of the chunk
 * from p (up to ATT_CHUNK, before `end`); returns how many (one division, then the table walked). Positions before
 * `from` (before every row's sliding window: 0 without one) take the row of `from` instead, which their P = 0 leaves
 * out of every sum: their table entries are never read (a block out of every window may have left the table). */
static inline int64_t slots(const tsterm_kv *kv, int64_t h, int64_t p, int64_t end, int64_t from, int64_t *off) {
    const int64_t n = end - p < ATT_CHUNK ? end - p : ATT_CHUNK, B = kv->block_size, row = kv->num_kv_heads * kv->head_dim;
    const int64_t skip = from > p ? (from - p < n ? from - p : n) : 0, q = p + skip;
    for (int64_t j = skip, blk = q / B, in = q % B; j < n; j++) {
        off[j] = ((int64_t)kv->table[blk] * B + in) * row + h * kv->head_dim;
        if (++in == B) in = 0, blk++;
    }
    for (int64_t j = 0; j < skip && skip < n; j++) off[j] = off[skip];
    return n > 0 ? n : 0;
}

/* A pool's element `off` (a float32 or a bfloat16 one): bf16 is a constant in each inlined copy of the kernel */
#define KV_AT(base, off, bf16) ((const void *)((const char *)(base) + (off) * ((bf16) ? 2 : 4)))

/* 8 values of a K or V row from p as float32 */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *p, int bf16) {
    return bf16 ? tsterm_bf16x8((const uint16_t *)p) : _mm256_loadu_ps((const float *)p);
}

static inline void prefetch_row(const void *row, int64_t bytes, int hint) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)row + b, hint);
}

/* 8 dot products q . k[j] (length D, a multiple of 8) as one vector: lane l of each position's accumulator sums the
 * products of the inputs d = l mod 8 in order, then a transposing horizontal reduction (hadd tree) adds the lanes.
 * Decode and prefill score every position this way: no transposed copy of K is made. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const void *const k[8], int64_t D,
                                                         int bf16) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, kv_load8(KV_AT(k[j], d, bf16), bf16), a[j]);
    }
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* dot8 for two query rows at once (16 accumulators: with AVX-512's 32 vector registers they stay in registers),
 * each row's lanes and tree exactly dot8's */
static inline __attribute__((always_inline)) void dot8x2(const float *q0, const float *q1, const void *const k[8],
                                                         int64_t D, float *s0, float *s1, int bf16) {
#ifdef __AVX512VL__
    __m256 a[8], b[8];
    for (int j = 0; j < 8; j++) a[j] = b[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qa = _mm256_loadu_ps(q0 + d), qb = _mm256_loadu_ps(q1 + d);
        for (int j = 0; j < 8; j++) {
            const __m256 kv = kv_load8(KV_AT(k[j], d, bf16), bf16);
            a[j] = _mm256_fmadd_ps(qa, kv, a[j]);
            b[j] = _mm256_fmadd_ps(qb, kv, b[j]);
        }
    }
    __m256 *acc[2] = {a, b};
    float *out[2] = {s0, s1};
    for (int r = 0; r < 2; r++) {
        const __m256 *x = acc[r];
        const __m256 t0 = _mm256_hadd_ps(x[0], x[1]), t1 = _mm256_hadd_ps(x[2], x[3]);
        const __m256 t2 = _mm256_hadd_ps(x[4], x[5]), t3 = _mm256_hadd_ps(x[6], x[7]);
        const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
        _mm256_storeu_ps(out[r], _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
    }
#else /* 16 ymm registers: one row at a time, no spills */
    _mm256_storeu_ps(s0, dot8(q0, k, D, bf16));
    _mm256_storeu_ps(s1, dot8(q1, k, D, bf16));
#endif
}

/* the first of R position-major rows (G a position) at or after position c0 */
static inline int64_t r_first(int64_t c0, int64_t first_pos, int64_t G) {
    return c0 > first_pos ? (c0 - first_pos) * G : 0;
}

/* o [D] = sum over positions j < n of p[j] * rows[j][0..D), a chain of FMAs from zero in position order for each
 * lane, then + o: the bits tsterm_f32_tile gives the same row with V packed (its padding adds p = 0 terms, which
 * leave a sum that never is -0 unchanged), without copying V. */
static inline __attribute__((always_inline)) void pv_rows(const float *p, const void *const *rows, int64_t n,
                                                          int64_t D, float *o, int bf16) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const int wide = D - d0 >= 32;
        for (int64_t j = 0; j < n; j++) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            const void *v = rows[j];
            a0 = _mm256_fmadd_ps(pj, kv_load8(KV_AT(v, d0, bf16), bf16), a0);
            a1 = _mm256_fmadd_ps(pj, kv_load8(KV_AT(v, d0 + 8, bf16), bf16), a1);
            if (wide) {
                a2 = _mm256_fmadd_ps(pj, kv_load8(KV_AT(v, d0 + 16, bf16), bf16), a2);
                a3 = _mm256_fmadd_ps(pj, kv_load8(KV_AT(v, d0 + 24, bf16), bf16), a3);
            }
        }
        _mm256_storeu_ps(o + d0, _mm256_add_ps(a0, _mm256_loadu_ps(o + d0)));
        _mm256_storeu_ps(o + d0 + 8, _mm256_add_ps(a1, _mm256_loadu_ps(o + d0 + 8)));
        if (wide) {
            _mm256_storeu_ps(o + d0 + 16, _mm256_add_ps(a2, _mm256_loadu_ps(o + d0 + 16)));
            _mm256_storeu_ps(o + d0 + 24, _mm256_add_ps(a3, _mm256_loadu_ps(o + d0 + 24)));
        }
    }
}

/* tsterm_attend_split for a float32 (bf16 = 0) or a bfloat16 (bf16 = 1) pool: a constant in each inlined copy */
static inline __attribute__((always_inline)) void attend_split(const tsterm_kv *kv, int64_t h, const float *qs,
                                                               int64_t R, int64_t G, int64_t first_pos, int64_t k0,
                                                               int64_t k1, int64_t ahead_end, float *scratch, float *m,
                                                               float *l, float *o, const int bf16) {
    const int64_t D = kv->head_dim, W = kv->window, row_bytes = D * (bf16 ? 2 : 4);
    float *vp = scratch, *s = vp + ATT_CHUNK * D; /* V panels, scores */
    const int64_t rs = k0 > first_pos ? (k0 - first_pos) * G : 0;           /* rows before the split see none of it */
    for (int64_t r = rs; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(o + r * D, 0, sizeof(float) * (size_t)D);
    }
    /* a sliding window: the chunks (at their fixed positions) before the first row's window are not read at all; a
     * row's chunks before its own window leave its m, l, o as they are, so its result is the one it gets alone */
    const int64_t ws = tsterm_att_window_start(W, first_pos + rs / G);
    const int64_t c_first = ws > k0 ? k0 + (ws - k0) / ATT_CHUNK * ATT_CHUNK : k0;
    /* each position's offset of its K (and V) row for head h, one chunk at a time, the next one's ahead */
    int64_t at[2][ATT_CHUNK];
    slots(kv, h, c_first, k1, ws, at[0]);
    for (int64_t c0 = c_first, c = 0; c0 < k1; c0 += ATT_CHUNK, c ^= 1) {
        const int64_t n = k1 - c0 < ATT_CHUNK ? k1 - c0 : ATT_CHUNK, panels = (n + NR - 1) / NR, width = panels * NR;
        const int64_t *off = at[c], *next = at[c ^ 1];
        const int64_t ahead = slots(kv, h, c0 + ATT_CHUNK, c0 + ATT_CHUNK < k1 ? k1 : ahead_end, ws, at[c ^ 1]);
        const int direct = R - r_first(c0, first_pos, G) <= MR; /* few rows (decode): P V reads V in place */
        for (int64_t j = 0; j < n; j++) /* this chunk's V rows, on their way while the scores are computed */
            prefetch_row(KV_AT(kv->v_cache, off[j], bf16), row_bytes, _MM_HINT_T0);
        for (int64_t j = 0; j < width && !direct; j++) { /* V panels [16 of D] x [width][16] */
            if (j < n) {
                const void *v = KV_AT(kv->v_cache, off[j], bf16);
                for (int64_t d = 0; d < D; d += NR) {
                    _mm256_store_ps(vp + (d / NR) * ATT_CHUNK * NR + j * NR, kv_load8(KV_AT(v, d, bf16), bf16));
                    _mm256_store_ps(vp + (d / NR) * ATT_CHUNK * NR + j * NR + 8, kv_load8(KV_AT(v, d + 8, bf16), bf16));
                }
            } else {
                for (int64_t d = 0; d < D; d += NR) memset(vp + (d / NR) * ATT_CHUNK * NR + j * NR, 0, sizeof(float) * NR);
            }
        }
        const int64_t r0 = r_first(c0, first_pos, G);
        for (int64_t j = 0; j < n; j += 8) { /* scores, 8 positions at a time, every row */
            const void *k[8]; /* past the chunk's end the first position again: its lanes are never read */
            for (int64_t i = 0; i < 8; i++) k[i] = KV_AT(kv->k_cache, off[j + i < n ? j + i : j], bf16);
            int64_t r = r0;
            for (; r + 2 <= R; r += 2)
                dot8x2(qs + r * D, qs + (r + 1) * D, k, D, s + r * ATT_CHUNK + j, s + (r + 1) * ATT_CHUNK + j, bf16);
            if (r < R) _mm256_storeu_ps(s + r * ATT_CHUNK + j, dot8(qs + r * D, k, D, bf16));
        }
        for (int64_t r = r0; r < R; r++) { /* online softmax: S -> P in place */
            float *sr = s + r * ATT_CHUNK;
            const int64_t visible = first_pos + r / G - c0 + 1 < n ? first_pos + r / G - c0 + 1 : n;
            /* positions [c0 + lo, c0 + visible) are the row's: lo > 0 where its window starts inside the chunk */
            const int64_t lo = tsterm_att_window_start(W, first_pos + r / G) > c0
                                   ? tsterm_att_window_start(W, first_pos + r / G) - c0 : 0;
            if (lo >= visible) { /* wholly before the row's window (another row's keys): P = 0 adds nothing */
                memset(sr, 0, sizeof(float) * (size_t)width);
                continue;
            }
            __m256 mx = _mm256_set1_ps(-INFINITY);
            int64_t j = lo;
            for (; j + 8 <= visible; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + j));
            float mc = hmax256(mx);
            for (; j < visible; j++) mc = sr[j] > mc ? sr[j] : mc;
            const float m_new = mc > m[r] ? mc : m[r];
            const float alpha = expf(m[r] - m_new); /* 0 on the row's first chunk (m = -inf) */
            const float lc = tsterm_exp_sum(sr + lo, visible - lo, m_new);
            for (j = 0; j < lo; j++) sr[j] = 0.0f;
            for (j = visible; j < width; j++) sr[j] = 0.0f;
            l[r] = l[r] * alpha + lc;
            m[r] = m_new;
            if (alpha != 1.0f) {
                const __m256 av = _mm256_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(o + r * D + d, _mm256_mul_ps(av, _mm256_loadu_ps(o + r * D + d)));
            }
        }
        for (int64_t j = 0; j < ahead; j++) /* during P V */
            prefetch_row(KV_AT(kv->k_cache, next[j], bf16), row_bytes, _MM_HINT_T1);
        if (direct) {
            const void *rows_v[ATT_CHUNK];
            for (int64_t j = 0; j < n; j++) rows_v[j] = KV_AT(kv->v_cache, off[j], bf16);
            for (int64_t r = r0; r < R; r++) pv_rows(s + r * ATT_CHUNK, rows_v, n, D, o + r * D, bf16);
            continue;
        }
        for (int64_t r = r0; r < R; r += MR) { /* O += P V */
            const int64_t mr = R - r < MR ? R - r : MR;
            for (int64_t d = 0; d < D; d += NR)
                tsterm_f32_tile(mr, width, s + r * ATT_CHUNK, ATT_CHUNK, vp + (d / NR) * ATT_CHUNK * NR, o + r * D + d,
                                D, 1);
        }
    }
}

void tsterm_attend_split(const tsterm_kv *kv, int64_t h, const float *qs, int64_t R, int64_t G, int64_t first_pos,
                         int64_t k0, int64_t k1, int64_t ahead_end, float *scratch, float *m, float *l, float *o) {
    if (kv->kv_bf16)
        attend_split(kv, h, qs, R, G, first_pos, k0, k1, ahead_end, scratch, m, l, o, 1);
    else
        attend_split(kv, h, qs, R, G, first_pos, k0, k1, ahead_end, scratch, m, l, o, 0);
}
