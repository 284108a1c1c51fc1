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
 * Built for AVX-512, a split of many rows (prefill, extend) computes the same sums 16 lanes wide: K transposed once
 * a chunk for the scores (each of dot8's 8 lane chains its own accumulator, 16 keys a vector, the tree as vertical
 * adds), P V 64 outputs of 6 rows at a time with V read in place, the exponentials 16 at a time; the bits are the
 * AVX2 build's (tests/kernels/test_attention_builds.py), 1.3x its speed on the bench model's prefill, one thread.
 * The AVX2 build does the same in 16 ymm registers (6 rows x 16 keys, one lane chain at a time; P V 6 rows x 16
 * outputs, V in place): 1.09x its earlier dot8 / packed-V path, the same bits. aarch64 keeps that path (dot8, V
 * packed into panels, gemm.c's tile).
 *
 * A bfloat16 pool (kv->kv_bf16) is read in place, each K and V row widened to float32 as it is loaded (exact: a
 * bfloat16 is a float32's high half), and then everything above runs on those float32 values in the same order: a
 * row's result is the bits the float32 kernel gives on the pool converted to float32, without converting it. Where
 * AMX is built and granted, a bfloat16 pool may run another arithmetic instead (kv_bf16 = TSTERM_ATT_AMX,
 * attend_split_amx): the same splits, chunks, softmax and merges, the two products of a chunk on AMX tiles in
 * bfloat16 (2.4x the widened path on the bench model's 2K-token prefill, one thread); its bits are its own, the
 * same in every path.
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

#if defined(__AVX2__) && !defined(__aarch64__)
/* kT [D][ATT_CHUNK] <- the chunk's K rows (keys j < width, a multiple of 16; past n the chunk's first key again,
 * whose scores are never read), 8 x 8 blocks transposed in registers */
static inline __attribute__((always_inline)) void k_transpose(const tsterm_kv *kv, const int64_t *off, int64_t n,
                                                              int64_t width, float *kT, int bf16) {
    const int64_t D = kv->head_dim;
    for (int64_t j = 0; j < width; j += 8) {
        const void *k[8];
        for (int i = 0; i < 8; i++) k[i] = KV_AT(kv->k_cache, off[j + i < n ? j + i : 0], bf16);
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = kv_load8(KV_AT(k[i], d, bf16), bf16);
            tsterm_transpose8(r);
            float *dst = kT + d * ATT_CHUNK + j; /* row d + i: the 8 keys' element d + i */
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * ATT_CHUNK, r[i]);
        }
    }
}

#endif

#ifdef __AVX512F__
/* AVX-512, many rows (prefill, extend): the same sums as dot8 and pv_rows / tsterm_f32_tile, computed 16 lanes
 * wide. dot8's lane l of a (row, key) pair is a chain of FMAs over d = l, l + 8, ... from zero, and the hadd tree
 * then adds the 8 lanes as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). Here K is transposed once a chunk (kT [D]
 * [ATT_CHUNK], shared by all the task's rows), a zmm holds 16 keys of one row, and each lane chain l runs as its
 * own accumulator (q[d] broadcast), two chains at a time, the tree then vertical adds: the same operations on the
 * same values in the same order (a + b == b + a in IEEE arithmetic), so each score is dot8's bits, with no hadd
 * and 3 x 32 pairs per 10 loads instead of 2 x 8 per 10. */

/* 16 values of a K or V row from p as float32 */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *p, int bf16) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16))
                : _mm512_loadu_ps((const float *)p);
}

/* s[r][0..16 KV) (rows ATT_CHUNK apart) <- q[r] . key, for ROWS rows of q (D apart) and 16 KV keys of kT from its
 * column 0: per key dot8's lane chains and tree (see above) */
static inline __attribute__((always_inline)) void scores_tile(const float *q, int64_t D, const float *kT, float *s,
                                                              const int ROWS, const int KV) {
    __m512 acc[3][2], t45[3][2], a[3][2], b[3][2];
#pragma GCC unroll 4
    for (int l = 0; l < 8; l += 2) { /* lane chains l and l + 1 */
        for (int r = 0; r < ROWS; r++)
            for (int v = 0; v < KV; v++) a[r][v] = b[r][v] = _mm512_setzero_ps();
        for (int64_t d = l; d < D; d += 8) {
            __m512 k0[2], k1[2];
            for (int v = 0; v < KV; v++) {
                k0[v] = _mm512_loadu_ps(kT + d * ATT_CHUNK + 16 * v);
                k1[v] = _mm512_loadu_ps(kT + (d + 1) * ATT_CHUNK + 16 * v);
            }
            for (int r = 0; r < ROWS; r++) {
                const __m512 qa = _mm512_set1_ps(q[r * D + d]), qb = _mm512_set1_ps(q[r * D + d + 1]);
                for (int v = 0; v < KV; v++) {
                    a[r][v] = _mm512_fmadd_ps(qa, k0[v], a[r][v]);
                    b[r][v] = _mm512_fmadd_ps(qb, k1[v], b[r][v]);
                }
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int v = 0; v < KV; v++) {
                const __m512 t = _mm512_add_ps(a[r][v], b[r][v]); /* (l + (l + 1)) */
                if (l == 0) acc[r][v] = t;
                else if (l == 2) acc[r][v] = _mm512_add_ps(acc[r][v], t); /* (0 + 1) + (2 + 3) */
                else if (l == 4) t45[r][v] = t;
                else acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_add_ps(t45[r][v], t)); /* + ((4 + 5) + (6 + 7)) */
            }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < KV; v++) _mm512_storeu_ps(s + r * ATT_CHUNK + 16 * v, acc[r][v]);
}

/* rows [r0, R) x keys [0, width) of the chunk's scores (s: row r at s + r * ATT_CHUNK) from kT */
static void scores512(const float *qs, int64_t D, const float *kT, float *s, int64_t r0, int64_t R, int64_t width) {
    int64_t r = r0;
    for (; r + 3 <= R; r += 3) {
        int64_t j = 0;
        for (; j + 32 <= width; j += 32) scores_tile(qs + r * D, D, kT + j, s + r * ATT_CHUNK + j, 3, 2);
        if (j < width) scores_tile(qs + r * D, D, kT + j, s + r * ATT_CHUNK + j, 3, 1);
    }
    for (; r < R; r++) {
        int64_t j = 0;
        for (; j + 32 <= width; j += 32) scores_tile(qs + r * D, D, kT + j, s + r * ATT_CHUNK + j, 1, 2);
        if (j < width) scores_tile(qs + r * D, D, kT + j, s + r * ATT_CHUNK + j, 1, 1);
    }
}

/* o[r][d0 .. d0 + 16 DV) += P V for ROWS rows (p and o rows ATT_CHUNK and D apart), V read in place: per output a
 * chain of FMAs from zero over the chunk's positions in order, then + o: pv_rows' and tsterm_f32_tile's sums */
static inline __attribute__((always_inline)) void pv_tile(const float *p, const void *const *rows_v, int64_t n,
                                                          float *o, int64_t D, int64_t d0, const int ROWS,
                                                          const int DV, int bf16) {
    __m512 acc[6][4];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < DV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m512 vv[4];
        for (int v = 0; v < DV; v++) vv[v] = kv_load16(KV_AT(rows_v[j], d0 + 16 * v, bf16), bf16);
        for (int r = 0; r < ROWS; r++) {
            const __m512 pj = _mm512_set1_ps(p[r * ATT_CHUNK + j]);
            for (int v = 0; v < DV; v++) acc[r][v] = _mm512_fmadd_ps(pj, vv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < DV; v++) {
            float *dst = o + r * D + d0 + 16 * v;
            _mm512_storeu_ps(dst, _mm512_add_ps(acc[r][v], _mm512_loadu_ps(dst)));
        }
}

#define PV_ROWS(R_, bf16)                                                                                          \
    do {                                                                                                           \
        int64_t d0 = 0;                                                                                            \
        for (; d0 + 64 <= D; d0 += 64) pv_tile(p, rows_v, n, o, D, d0, R_, 4, bf16);                              \
        for (; d0 < D; d0 += 16) pv_tile(p, rows_v, n, o, D, d0, R_, 1, bf16);                                    \
    } while (0)

/* o[r0..R) += P V over the chunk's n positions (V rows in place) */
static inline __attribute__((always_inline)) void pv512(const float *s, const void *const *rows_v, int64_t n,
                                                        float *o_all, int64_t D, int64_t r0, int64_t R, int bf16) {
    for (int64_t r = r0; r < R; r += 6) {
        const float *p = s + r * ATT_CHUNK;
        float *o = o_all + r * D;
        switch (R - r < 6 ? R - r : 6) {
        case 1: PV_ROWS(1, bf16); break;
        case 2: PV_ROWS(2, bf16); break;
        case 3: PV_ROWS(3, bf16); break;
        case 4: PV_ROWS(4, bf16); break;
        case 5: PV_ROWS(5, bf16); break;
        default: PV_ROWS(6, bf16); break;
        }
    }
}
#undef PV_ROWS

/* exp2_256 on 16 lanes: the same operations lane for lane */
static inline __m512 exp2_512(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-125.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(TSTERM_EXP2_C5);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(TSTERM_EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(TSTERM_EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(TSTERM_EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(TSTERM_EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(TSTERM_EXP2_C0));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
}

/* tsterm_exp_sum's values and sum, 16 exponentials at a time: each 16's two halves go into the 8-lane sum in order,
 * as its two steps of 8 did */
static inline float exp_sum16(float *s, int64_t n, float max) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), mv = _mm512_set1_ps(max * 1.44269504088896341f);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(s + i), log2e, mv));
        _mm512_storeu_ps(s + i, e);
        sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(e));
        sum8 = _mm256_add_ps(sum8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    if (i + 8 <= n) {
        const __m256 e = exp2_256(_mm256_fmsub_ps(_mm256_loadu_ps(s + i), _mm512_castps512_ps256(log2e),
                                                  _mm512_castps512_ps256(mv)));
        _mm256_storeu_ps(s + i, e);
        sum8 = _mm256_add_ps(sum8, e);
        i += 8;
    }
    float sum = hsum256(sum8);
    for (; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    return sum;
}
#define WIDE 1 /* many rows take the 512-bit path */
#define TILED 1
#define SCORES scores512
#define PV pv512
#elif defined(__AVX2__) && !defined(__aarch64__)
/* AVX2, many rows (prefill, extend): the AVX-512 build's scheme in 16 ymm registers. The scores of 6 rows x 16 keys
 * (kT as above, 2 ymm of 8 keys) take one of dot8's lane chains at a time: 12 accumulators, 2 loads of kT and a
 * broadcast of q[d] (15 registers), each chain from zero over d = l, l + 8, ..., and between chains the tree's
 * additions through memory in its order, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): dot8's bits, with no hadd and
 * 12 products per 8 loads instead of 8 per 9. P V is gemm.c's 6 x 16 tile with V read in place (no packed copy). */

/* s[r][0..16) (rows ATT_CHUNK apart) <- q[r] . key for ROWS rows of q (D apart) and 16 keys of kT from its column 0 */
static inline __attribute__((always_inline)) void scores_tile8(const float *q, int64_t D, const float *kT, float *s,
                                                               const int ROWS) {
    float even[6][16], t45[6][16]; /* chain l - 1 (l odd); (4 + 5) */
#pragma GCC unroll 1
    for (int l = 0; l < 8; l++) {
        __m256 c[6][2];
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
        for (int64_t d = l; d < D; d += 8) {
            const __m256 k0 = _mm256_loadu_ps(kT + d * ATT_CHUNK), k1 = _mm256_loadu_ps(kT + d * ATT_CHUNK + 8);
#pragma GCC unroll 6
            for (int r = 0; r < ROWS; r++) {
                const __m256 qd = _mm256_broadcast_ss(q + r * D + d);
                c[r][0] = _mm256_fmadd_ps(qd, k0, c[r][0]);
                c[r][1] = _mm256_fmadd_ps(qd, k1, c[r][1]);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; r++) {
            float *sr = s + r * ATT_CHUNK;
            if (!(l & 1)) {
                _mm256_storeu_ps(even[r], c[r][0]);
                _mm256_storeu_ps(even[r] + 8, c[r][1]);
                continue;
            }
            const __m256 t0 = _mm256_add_ps(_mm256_loadu_ps(even[r]), c[r][0]); /* ((l - 1) + l) */
            const __m256 t1 = _mm256_add_ps(_mm256_loadu_ps(even[r] + 8), c[r][1]);
            if (l == 1) {
                _mm256_storeu_ps(sr, t0);
                _mm256_storeu_ps(sr + 8, t1);
            } else if (l == 3) {
                _mm256_storeu_ps(sr, _mm256_add_ps(_mm256_loadu_ps(sr), t0));
                _mm256_storeu_ps(sr + 8, _mm256_add_ps(_mm256_loadu_ps(sr + 8), t1));
            } else if (l == 5) {
                _mm256_storeu_ps(t45[r], t0);
                _mm256_storeu_ps(t45[r] + 8, t1);
            } else {
                _mm256_storeu_ps(sr, _mm256_add_ps(_mm256_loadu_ps(sr), _mm256_add_ps(_mm256_loadu_ps(t45[r]), t0)));
                _mm256_storeu_ps(sr + 8, _mm256_add_ps(_mm256_loadu_ps(sr + 8), _mm256_add_ps(_mm256_loadu_ps(t45[r] + 8), t1)));
            }
        }
    }
}

/* rows [r0, R) x keys [0, width) (a multiple of 16) of the chunk's scores (s: row r at s + r * ATT_CHUNK) from kT */
static void scores256(const float *qs, int64_t D, const float *kT, float *s, int64_t r0, int64_t R, int64_t width) {
    for (int64_t r = r0; r < R; r += 6) {
        const float *q = qs + r * D;
        float *sr = s + r * ATT_CHUNK;
        for (int64_t j = 0; j < width; j += 16) switch (R - r < 6 ? R - r : 6) {
            case 1: scores_tile8(q, D, kT + j, sr + j, 1); break;
            case 2: scores_tile8(q, D, kT + j, sr + j, 2); break;
            case 3: scores_tile8(q, D, kT + j, sr + j, 3); break;
            case 4: scores_tile8(q, D, kT + j, sr + j, 4); break;
            case 5: scores_tile8(q, D, kT + j, sr + j, 5); break;
            default: scores_tile8(q, D, kT + j, sr + j, 6); break;
            }
    }
}

/* o[r][d0 .. d0 + 16) += P V for ROWS rows (p and o rows ATT_CHUNK and D apart), V read in place: per output a chain
 * of FMAs from zero over the chunk's positions in order, then + o: pv_rows' and tsterm_f32_tile's sums */
static inline __attribute__((always_inline)) void pv_tile8(const float *p, const void *const *rows_v, int64_t n,
                                                           float *o, int64_t D, int64_t d0, const int ROWS, int bf16) {
    __m256 acc[6][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const __m256 v0 = kv_load8(KV_AT(rows_v[j], d0, bf16), bf16), v1 = kv_load8(KV_AT(rows_v[j], d0 + 8, bf16), bf16);
        for (int r = 0; r < ROWS; r++) {
            const __m256 pj = _mm256_broadcast_ss(p + r * ATT_CHUNK + j);
            acc[r][0] = _mm256_fmadd_ps(pj, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(pj, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < 2; v++) {
            float *dst = o + r * D + d0 + 8 * v;
            _mm256_storeu_ps(dst, _mm256_add_ps(acc[r][v], _mm256_loadu_ps(dst)));
        }
}

/* o[r0..R) += P V over the chunk's n positions (V rows in place; D a multiple of 16) */
static inline __attribute__((always_inline)) void pv256(const float *s, const void *const *rows_v, int64_t n,
                                                        float *o_all, int64_t D, int64_t r0, int64_t R, int bf16) {
    for (int64_t r = r0; r < R; r += 6) {
        const float *p = s + r * ATT_CHUNK;
        float *o = o_all + r * D;
        for (int64_t d0 = 0; d0 < D; d0 += 16) switch (R - r < 6 ? R - r : 6) {
            case 1: pv_tile8(p, rows_v, n, o, D, d0, 1, bf16); break;
            case 2: pv_tile8(p, rows_v, n, o, D, d0, 2, bf16); break;
            case 3: pv_tile8(p, rows_v, n, o, D, d0, 3, bf16); break;
            case 4: pv_tile8(p, rows_v, n, o, D, d0, 4, bf16); break;
            case 5: pv_tile8(p, rows_v, n, o, D, d0, 5, bf16); break;
            default: pv_tile8(p, rows_v, n, o, D, d0, 6, bf16); break;
            }
    }
}
#define WIDE 0
#define TILED 1
#define SCORES scores256
#define PV pv256
#else /* aarch64: dot8, V panels and gemm.c's tile */
#define WIDE 0
#define TILED 0
#endif
#if WIDE
#define EXP_SUM exp_sum16
#else
#define EXP_SUM tsterm_exp_sum
#endif

/* The online softmax of rows [r0, R) over a chunk's scores (row r at s + r * ATT_CHUNK, keys [0, n) from position
 * c0), S -> P in place: each row's max over the keys it sees, its exponentials and their sum (EXP_SUM), its running
 * m and l, and its output o rescaled where the max grew; P is 0 at the keys it does not see, up to `width`. */
static inline __attribute__((always_inline)) void online_softmax(float *s, int64_t r0, int64_t R, int64_t G,
                                                                 int64_t first_pos, int64_t c0, int64_t n,
                                                                 int64_t width, int64_t W, int64_t D, float *m,
                                                                 float *l, float *o) {
    for (int64_t r = r0; r < R; r++) {
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
        const float lc = EXP_SUM(sr + lo, visible - lo, m_new);
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
}

#if TSTERM_AMX
/* The AMX arithmetic of a bfloat16 pool (kv_bf16 == TSTERM_ATT_AMX): attend_split's splits, chunks, online softmax
 * and merge, with the two products of a chunk on AMX tiles in bfloat16 with float32 sums. The scores: the row's
 * scaled q rounded to bfloat16 (tiles of 16 rows x 32 of D, the A operand) times the chunk's K (the B operand: 16
 * pairs of D x 16 keys, gathered from the pool into that layout; zero past the chunk's keys and past D). P V: each
 * row's P rounded to bfloat16 (16 rows x 32 keys) times V (16 pairs of keys x 16 of D, gathered likewise; zero past
 * the chunk), from a zeroed tile over the chunk's keys in order, then added to the rescaled output.
 *
 * Why a row's result is the same bits in a prefill, an extend or a decode, alone or batched: an output of a tile
 * product depends only on its own row of A and column of B, so which other rows share the tile changes nothing; the
 * chunks are at the same fixed positions in every path; and the keys a path reads beyond a row's own (a longer
 * chunk in a prefill) are P = 0 terms, exact zeros added to a sum (which AMX never holds as -0 or a denormal), so
 * they change nothing either. Another machine's AMX or the widening path (kv_bf16 1) give other bits: a process
 * runs one of them for a model (tsterm_kernels.cpu_select's "bf16-attention" class). */
typedef uint32_t __attribute__((may_alias)) att_u32;

/* kb [key tile][32 of D][16 pairs of D][16 keys][2]: the chunk's n keys (zero past n, up to width16, and past D),
 * each 16 keys' pairs of D transposed in registers */
static void amx_pack_k(const tsterm_kv *kv, const int64_t *off, int64_t n, int64_t width16, int64_t d32,
                       uint16_t *kb) {
    const int64_t D = kv->head_dim, tiles = d32 / 32;
    const uint16_t *k_cache = (const uint16_t *)kv->k_cache;
    for (int64_t k0 = 0; k0 < width16; k0 += 16)
        for (int64_t dt = 0; dt < tiles; dt++) {
            const __mmask16 words = D - dt * 32 >= 32 ? (__mmask16)0xffff : (__mmask16)0x00ff; /* D % 32 == 16 */
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = k0 + j < n ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(words, k_cache + off[k0 + j] + dt * 32))
                                  : _mm512_setzero_ps();
            tsterm_transpose16(r);
            uint16_t *dst = kb + (k0 / 16 * tiles + dt) * 512;
            for (int w = 0; w < 16; w++) _mm512_storeu_ps((float *)(dst + w * 32), r[w]);
        }
}

/* vb [key block of 32][16 of D][16 pairs of keys][16][2]: the chunk's n V rows interleaved by pairs (zero past n, up
 * to width32) */
static void amx_pack_v(const tsterm_kv *kv, const int64_t *off, int64_t n, int64_t width32, uint16_t *vb) {
    const int64_t D = kv->head_dim, groups = D / 16;
    const uint16_t *v_cache = (const uint16_t *)kv->v_cache;
    const __m512i pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t j = 0; j < width32; j += 2) {
        uint16_t *dst = vb + j / 32 * groups * 512 + j % 32 / 2 * 32;
        for (int64_t g = 0; g < groups; g++) {
            const __m256i a = j < n ? _mm256_loadu_si256((const __m256i *)(v_cache + off[j] + g * 16))
                                    : _mm256_setzero_si256();
            const __m256i b = j + 1 < n ? _mm256_loadu_si256((const __m256i *)(v_cache + off[j + 1] + g * 16))
                                        : _mm256_setzero_si256();
            _mm512_storeu_si512(dst + g * 512, _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), pairs,
                                                                          _mm512_castsi256_si512(b)));
        }
    }
}

/* 32 float32 (16 at lo, 16 at hi; hi NULL: zeros) rounded to bfloat16 (to nearest even), stored at dst */
static inline void amx_round32(const float *lo, const float *hi, uint16_t *dst) {
    const __m512 b = hi ? _mm512_loadu_ps(hi) : _mm512_setzero_ps();
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, _mm512_loadu_ps(lo)));
}

static void attend_split_amx(const tsterm_kv *kv, int64_t h, const float *qs, int64_t R, int64_t G,
                             int64_t first_pos, int64_t k0, int64_t k1, float *scratch, float *m, float *l,
                             float *o) {
    const int64_t D = kv->head_dim, W = kv->window, d32 = (D + 31) / 32 * 32, r16 = (R + 15) / 16 * 16;
    const int64_t dtiles = d32 / 32, groups = D / 16;
    uint16_t *kb = (uint16_t *)scratch, *vb = kb + ATT_CHUNK * d32, *qa = vb + ATT_CHUNK * d32;
    uint16_t *pa = qa + r16 * d32;
    float *ot = (float *)(pa + 16 * ATT_CHUNK), *s = ot + 16 * d32;
    const int64_t rs = k0 > first_pos ? (k0 - first_pos) * G : 0;
    for (int64_t r = rs; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(o + r * D, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t r = 0; r < r16; r++) /* q (scaled) rounded to bfloat16, in A tiles [16 rows][32 of D] */
        for (int64_t dt = 0; dt < dtiles; dt++) {
            uint16_t *dst = qa + (r / 16 * dtiles + dt) * 512 + r % 16 * 32;
            if (r < R)
                amx_round32(qs + r * D + dt * 32, dt * 32 + 16 < D ? qs + r * D + dt * 32 + 16 : NULL, dst);
            else
                memset(dst, 0, 64);
        }
    tsterm_amx_config(8); /* tmm0-3: C; tmm4: A (q or P); tmm5-7: B (K or V) */
    const int64_t ws = tsterm_att_window_start(W, first_pos + rs / G);
    const int64_t c_first = ws > k0 ? k0 + (ws - k0) / ATT_CHUNK * ATT_CHUNK : k0;
    int64_t off[ATT_CHUNK];
    for (int64_t c0 = c_first; c0 < k1; c0 += ATT_CHUNK) {
        const int64_t n = slots(kv, h, c0, k1, ws, off), width16 = (n + 15) / 16 * 16, width32 = (n + 31) / 32 * 32;
        const int64_t r0 = r_first(c0, first_pos, G);
        amx_pack_k(kv, off, n, width16, d32, kb);
        amx_pack_v(kv, off, n, width32, vb);
        for (int64_t t = r0 / 16; t < r16 / 16; t++) /* scores: 16 rows x up to 4 key tiles at a time */
            for (int64_t kt = 0; kt < width16 / 16; kt += 4) {
                const int64_t nk = width16 / 16 - kt < 4 ? width16 / 16 - kt : 4;
                const uint16_t *kt0 = kb + kt * dtiles * 512;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t dt = 0; dt < dtiles; dt++) {
                    _tile_loadd(4, qa + (t * dtiles + dt) * 512, 64);
                    _tile_loadd(5, kt0 + dt * 512, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (nk > 1) {
                        _tile_loadd(6, kt0 + (dtiles + dt) * 512, 64);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                    if (nk > 2) {
                        _tile_loadd(7, kt0 + (2 * dtiles + dt) * 512, 64);
                        _tile_dpbf16ps(2, 4, 7);
                    }
                    if (nk > 3) {
                        _tile_loadd(5, kt0 + (3 * dtiles + dt) * 512, 64);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                float *st = s + t * 16 * ATT_CHUNK + kt * 16;
                _tile_stored(0, st, ATT_CHUNK * 4);
                if (nk > 1) _tile_stored(1, st + 16, ATT_CHUNK * 4);
                if (nk > 2) _tile_stored(2, st + 32, ATT_CHUNK * 4);
                if (nk > 3) _tile_stored(3, st + 48, ATT_CHUNK * 4);
            }
        online_softmax(s, r0, R, G, first_pos, c0, n, width32, W, D, m, l, o);
        for (int64_t t = r0 / 16; t < r16 / 16; t++) { /* O += P V, 16 rows x up to 4 groups of 16 outputs at a time */
            for (int64_t i = 0; i < 16; i++) {
                const int64_t r = t * 16 + i;
                uint16_t *pr = pa + i * ATT_CHUNK;
                if (r < r0 || r >= R) {
                    memset(pr, 0, sizeof(uint16_t) * (size_t)width32);
                    continue;
                }
                for (int64_t j = 0; j < width32; j += 32)
                    amx_round32(s + r * ATT_CHUNK + j, s + r * ATT_CHUNK + j + 16, pr + j);
            }
            for (int64_t g = 0; g < groups; g += 4) {
                const int64_t ng = groups - g < 4 ? groups - g : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kblk = 0; kblk < width32 / 32; kblk++) {
                    const uint16_t *vt = vb + (kblk * groups + g) * 512;
                    _tile_loadd(4, pa + kblk * 32, ATT_CHUNK * 2);
                    _tile_loadd(5, vt, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (ng > 1) {
                        _tile_loadd(6, vt + 512, 64);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                    if (ng > 2) {
                        _tile_loadd(7, vt + 1024, 64);
                        _tile_dpbf16ps(2, 4, 7);
                    }
                    if (ng > 3) {
                        _tile_loadd(5, vt + 1536, 64);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, ot + g * 16, d32 * 4);
                if (ng > 1) _tile_stored(1, ot + g * 16 + 16, d32 * 4);
                if (ng > 2) _tile_stored(2, ot + g * 16 + 32, d32 * 4);
                if (ng > 3) _tile_stored(3, ot + g * 16 + 48, d32 * 4);
            }
            for (int64_t i = 0; i < 16; i++) {
                const int64_t r = t * 16 + i;
                if (r < r0 || r >= R) continue;
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(o + r * D + d, _mm512_add_ps(_mm512_loadu_ps(ot + i * d32 + d),
                                                                  _mm512_loadu_ps(o + r * D + d)));
            }
        }
    }
    _tile_release();
}
#endif

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
        for (int64_t j = 0; j < width && !direct && !TILED; j++) { /* V panels [16 of D] x [width][16] */
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
#if TILED
        if (!direct) { /* K transposed into the V panels' place (P V reads V in place here) */
            k_transpose(kv, off, n, width, vp, bf16);
            SCORES(qs, D, vp, s, r0, R, width);
        } else
#endif
        for (int64_t j = 0; j < n; j += 8) { /* scores, 8 positions at a time, every row */
            const void *k[8]; /* past the chunk's end the first position again: its lanes are never read */
            for (int64_t i = 0; i < 8; i++) k[i] = KV_AT(kv->k_cache, off[j + i < n ? j + i : j], bf16);
            int64_t r = r0;
            for (; r + 2 <= R; r += 2)
                dot8x2(qs + r * D, qs + (r + 1) * D, k, D, s + r * ATT_CHUNK + j, s + (r + 1) * ATT_CHUNK + j, bf16);
            if (r < R) _mm256_storeu_ps(s + r * ATT_CHUNK + j, dot8(qs + r * D, k, D, bf16));
        }
        online_softmax(s, r0, R, G, first_pos, c0, n, width, W, D, m, l, o);
        for (int64_t j = 0; j < ahead; j++) /* during P V */
            prefetch_row(KV_AT(kv->k_cache, next[j], bf16), row_bytes, _MM_HINT_T1);
        if (direct) {
            const void *rows_v[ATT_CHUNK];
            for (int64_t j = 0; j < n; j++) rows_v[j] = KV_AT(kv->v_cache, off[j], bf16);
            for (int64_t r = r0; r < R; r++) pv_rows(s + r * ATT_CHUNK, rows_v, n, D, o + r * D, bf16);
            continue;
        }
#if TILED
        const void *rows_v[ATT_CHUNK];
        for (int64_t j = 0; j < n; j++) rows_v[j] = KV_AT(kv->v_cache, off[j], bf16);
        PV(s, rows_v, n, o, D, r0, R, bf16);
#else
        for (int64_t r = r0; r < R; r += MR) { /* O += P V */
            const int64_t mr = R - r < MR ? R - r : MR;
            for (int64_t d = 0; d < D; d += NR)
                tsterm_f32_tile(mr, width, s + r * ATT_CHUNK, ATT_CHUNK, vp + (d / NR) * ATT_CHUNK * NR, o + r * D + d,
                                D, 1);
        }
#endif
    }
}

void tsterm_attend_split(const tsterm_kv *kv, int64_t h, const float *qs, int64_t R, int64_t G, int64_t first_pos,
                         int64_t k0, int64_t k1, int64_t ahead_end, float *scratch, float *m, float *l, float *o) {
#if TSTERM_AMX
    if (kv->kv_bf16 == TSTERM_ATT_AMX) {
        attend_split_amx(kv, h, qs, R, G, first_pos, k0, k1, scratch, m, l, o);
        return;
    }
#endif
    if (kv->kv_bf16)
        attend_split(kv, h, qs, R, G, first_pos, k0, k1, ahead_end, scratch, m, l, o, 1);
    else
        attend_split(kv, h, qs, R, G, first_pos, k0, k1, ahead_end, scratch, m, l, o, 0);
}
