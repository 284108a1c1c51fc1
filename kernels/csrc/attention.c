/* The arithmetic of one split of a query row's attention on the CPU, shared by prefill.c (many rows of one
 * sequence) and decode.c (one row per sequence, splits spread over the threads), float32, keys read in place from
 * the paged pool through the block table.
 *
 * Why one routine: a row's output must be the same bits whether its context came from the prefix cache or was just
 * computed, whether it ran in a prefill, an extend or a decode, alone or in a batch, on one thread or two. Float
 * sums depend on their order, so every path takes the same one: splits and chunks of keys at fixed positions (not
 * sized from the rows, the batch or the threads), within a chunk the scores s = (scale q) K^T as gemm.c's tile
 * computes them (one FMA chain over the head dimension), an online softmax over the split's chunks
 * (tsterm_exp_sum, the output rescaled when the maximum grows), P V as the tile's chain over the chunk's positions
 * added to the rescaled output; the splits' partials are then merged in order (tsterm_att_merge). A row's work
 * depends only on its position, its q and the keys at or before it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tsterm.h"

/* position pos's row of K or V for KV head h */
static inline const float *kv_row(const tsterm_kv *kv, const float *cache, int64_t pos, int64_t h) {
    const int64_t block = kv->table[pos / kv->block_size];
    return cache + ((block * kv->block_size + pos % kv->block_size) * kv->num_kv_heads + h) * kv->head_dim;
}

void tsterm_attend_split(const tsterm_kv *kv, int64_t h, const float *qs, int64_t R, int64_t G, int64_t first_pos,
                         int64_t k0, int64_t k1, float *scratch, float *m, float *l, float *o) {
    const int64_t D = kv->head_dim;
    float *kp = scratch, *vp = kp + ATT_CHUNK * D, *s = vp + ATT_CHUNK * D; /* K^T panels, V panels, scores */
    const int64_t rs = k0 > first_pos ? (k0 - first_pos) * G : 0;           /* rows before the split see none of it */
    for (int64_t r = rs; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(o + r * D, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t c0 = k0; c0 < k1; c0 += ATT_CHUNK) {
        const int64_t n = k1 - c0 < ATT_CHUNK ? k1 - c0 : ATT_CHUNK, panels = (n + NR - 1) / NR, width = panels * NR;
        const float *rows[NR];
        for (int64_t p = 0; p < panels; p++) { /* K^T panels [D][16] */
            const int64_t cnt = n - p * NR < NR ? n - p * NR : NR;
            for (int64_t j = 0; j < cnt; j++) rows[j] = kv_row(kv, kv->k_cache, c0 + p * NR + j, h);
            tsterm_pack16(rows, cnt, D, kp + p * D * NR);
        }
        for (int64_t j = 0; j < width; j++) { /* V panels [16 of D] x [width][16] */
            if (j < n) {
                const float *v = kv_row(kv, kv->v_cache, c0 + j, h);
                for (int64_t d = 0; d < D; d += NR) {
                    _mm256_store_ps(vp + (d / NR) * ATT_CHUNK * NR + j * NR, _mm256_loadu_ps(v + d));
                    _mm256_store_ps(vp + (d / NR) * ATT_CHUNK * NR + j * NR + 8, _mm256_loadu_ps(v + d + 8));
                }
            } else {
                for (int64_t d = 0; d < D; d += NR) memset(vp + (d / NR) * ATT_CHUNK * NR + j * NR, 0, sizeof(float) * NR);
            }
        }
        const int64_t r0 = c0 > first_pos ? (c0 - first_pos) * G : 0; /* rows before the chunk see none of it */
        for (int64_t r = r0; r < R; r += MR) {
            const int64_t mr = R - r < MR ? R - r : MR;
            for (int64_t p = 0; p < panels; p++)
                tsterm_f32_tile(mr, D, qs + r * D, D, kp + p * D * NR, s + r * ATT_CHUNK + p * NR, ATT_CHUNK, 0);
        }
        for (int64_t r = r0; r < R; r++) { /* online softmax: S -> P in place */
            float *sr = s + r * ATT_CHUNK;
            const int64_t visible = first_pos + r / G - c0 + 1 < n ? first_pos + r / G - c0 + 1 : n;
            __m256 mx = _mm256_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; j + 8 <= visible; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + j));
            float mc = hmax256(mx);
            for (; j < visible; j++) mc = sr[j] > mc ? sr[j] : mc;
            const float m_new = mc > m[r] ? mc : m[r];
            const float alpha = expf(m[r] - m_new); /* 0 on the split's first chunk (m = -inf) */
            const float lc = tsterm_exp_sum(sr, visible, m_new);
            for (j = visible; j < width; j++) sr[j] = 0.0f;
            l[r] = l[r] * alpha + lc;
            m[r] = m_new;
            if (alpha != 1.0f) {
                const __m256 av = _mm256_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(o + r * D + d, _mm256_mul_ps(av, _mm256_loadu_ps(o + r * D + d)));
            }
        }
        for (int64_t r = r0; r < R; r += MR) { /* O += P V */
            const int64_t mr = R - r < MR ? R - r : MR;
            for (int64_t d = 0; d < D; d += NR)
                tsterm_f32_tile(mr, width, s + r * ATT_CHUNK, ATT_CHUNK, vp + (d / NR) * ATT_CHUNK * NR, o + r * D + d,
                                D, 1);
        }
    }
}
