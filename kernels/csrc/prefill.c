/* Causal attention of one sequence's new tokens (prefill, or an extend over a cached prefix) on the CPU, read in
 * place from the paged KV pool through the block table: out = softmax(scale * q K^T, causal) V, float32.
 *
 * Why not torch's flash kernel: it runs these shapes at about half of what the two AVX2 cores can do (90 GFLOP/s
 * against a 180 peak; BENCHMARKS.md), and attention is a third of an agent trace's prefill. This is flash
 * attention on gemm.c's 6 x 16 register tile:
 *
 * - a task is one KV head and a block of query positions; its rows are (position, head of the KV head's group),
 *   position-major, so the group's heads share every pass over the keys (GQA);
 * - keys come CHUNK positions at a time: K's rows are packed transposed into [D][16] panels and the chunk's
 *   scores S = (scale q) K^T computed tile by tile; an online softmax turns S into P (exp against the running row
 *   maximum, earlier output rescaled when it grows); V's rows are packed into [CHUNK][16] panels and O += P V;
 * - the causal mask is positional: a row at position p keeps keys <= p, so chunks after a block's last position
 *   are never read and only the diagonal chunk masks anything.
 *
 * Tasks are handed to the OpenMP threads dynamically, longest (latest positions) first.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tsterm.h"

#define CHUNK 128     /* key positions per pass */
#define TASK_ROWS 192 /* query rows per task, about: (positions per task) * group */

typedef struct {
    const float *q, *k_cache, *v_cache;
    int64_t q_stride, out_stride;
    const int32_t *block_table;
    int64_t seq_len, num_q, num_heads, num_kv_heads, head_dim, block_size, positions; /* positions per task */
    float scale;
    float *out;
} prefill;

typedef struct { /* one thread's scratch, 32-byte aligned pieces */
    float *qs, *o, *s, *kp, *vp, *m, *l;
} scratch;

/* position pos's row of K or V for KV head h */
static inline const float *kv_row(const prefill *a, const float *cache, int64_t pos, int64_t h) {
    const int64_t block = a->block_table[pos / a->block_size];
    return cache + ((block * a->block_size + pos % a->block_size) * a->num_kv_heads + h) * a->head_dim;
}

static void run_task(const prefill *a, const scratch *w, int64_t h, int64_t first) {
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    const int64_t positions = a->num_q - first < a->positions ? a->num_q - first : a->positions;
    const int64_t R = positions * G, first_pos = a->seq_len - a->num_q + first; /* row r: position first_pos + r/G */
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int64_t r = 0; r < R; r++) { /* q rows scaled, position-major */
        const float *src = a->q + (first + r / G) * a->q_stride + (h * G + r % G) * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(w->qs + r * D + d, _mm256_mul_ps(scale, _mm256_loadu_ps(src + d)));
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * R * D);
    const int64_t end = first_pos + positions; /* keys [0, end) are visible to some row */
    for (int64_t c0 = 0; c0 < end; c0 += CHUNK) {
        const int64_t n = end - c0 < CHUNK ? end - c0 : CHUNK, panels = (n + NR - 1) / NR, width = panels * NR;
        const float *rows[NR];
        for (int64_t p = 0; p < panels; p++) { /* K^T panels [D][16] */
            const int64_t cnt = n - p * NR < NR ? n - p * NR : NR;
            for (int64_t j = 0; j < cnt; j++) rows[j] = kv_row(a, a->k_cache, c0 + p * NR + j, h);
            tsterm_pack16(rows, cnt, D, w->kp + p * D * NR);
        }
        for (int64_t j = 0; j < width; j++) { /* V panels [16 of D] x [width][16] */
            if (j < n) {
                const float *v = kv_row(a, a->v_cache, c0 + j, h);
                for (int64_t d = 0; d < D; d += NR) {
                    _mm256_store_ps(w->vp + (d / NR) * CHUNK * NR + j * NR, _mm256_loadu_ps(v + d));
                    _mm256_store_ps(w->vp + (d / NR) * CHUNK * NR + j * NR + 8, _mm256_loadu_ps(v + d + 8));
                }
            } else {
                for (int64_t d = 0; d < D; d += NR) memset(w->vp + (d / NR) * CHUNK * NR + j * NR, 0, sizeof(float) * NR);
            }
        }
        /* rows at positions before the chunk see none of its keys */
        const int64_t r0 = c0 > first_pos ? (c0 - first_pos) * G : 0;
        for (int64_t r = r0; r < R; r += MR) {
            const int64_t mr = R - r < MR ? R - r : MR;
            for (int64_t p = 0; p < panels; p++)
                tsterm_f32_tile(mr, D, w->qs + r * D, D, w->kp + p * D * NR, w->s + r * CHUNK + p * NR, CHUNK, 0);
        }
        for (int64_t r = r0; r < R; r++) { /* online softmax: S -> P in place */
            float *s = w->s + r * CHUNK;
            const int64_t visible = first_pos + r / G - c0 + 1 < n ? first_pos + r / G - c0 + 1 : n;
            __m256 mx = _mm256_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; j + 8 <= visible; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
            float m = hmax256(mx);
            for (; j < visible; j++) m = s[j] > m ? s[j] : m;
            const float m_new = m > w->m[r] ? m : w->m[r];
            const float alpha = expf(w->m[r] - m_new); /* 0 on the first chunk (m = -inf) */
            const float l = tsterm_exp_sum(s, visible, m_new);
            for (j = visible; j < width; j++) s[j] = 0.0f;
            w->l[r] = w->l[r] * alpha + l;
            w->m[r] = m_new;
            if (alpha != 1.0f) {
                const __m256 av = _mm256_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_store_ps(w->o + r * D + d, _mm256_mul_ps(av, _mm256_load_ps(w->o + r * D + d)));
            }
        }
        for (int64_t r = r0; r < R; r += MR) { /* O += P V */
            const int64_t mr = R - r < MR ? R - r : MR;
            for (int64_t d = 0; d < D; d += NR)
                tsterm_f32_tile(mr, width, w->s + r * CHUNK, CHUNK, w->vp + (d / NR) * CHUNK * NR, w->o + r * D + d, D, 1);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = a->out + (first + r / G) * a->out_stride + (h * G + r % G) * D;
        const __m256 inv = _mm256_set1_ps(1.0f / w->l[r]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(inv, _mm256_load_ps(w->o + r * D + d)));
    }
}

/* 0 on success; -1 when the scratch cannot be allocated; -2 for a shape the kernel does not take (head_dim not a
 * multiple of 16, query heads not a multiple of KV heads, more queries than the context). */
int tsterm_prefill_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                             const int32_t *block_table, int64_t seq_len, int64_t num_q, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                             int64_t out_stride) {
    if (head_dim % NR || head_dim <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || num_q > seq_len ||
        num_q <= 0 || block_size <= 0)
        return -2;
    const int64_t G = num_heads / num_kv_heads;
    const int64_t positions = TASK_ROWS / G > 0 ? TASK_ROWS / G : 1;
    const int64_t blocks = (num_q + positions - 1) / positions, tasks = blocks * num_kv_heads;
    const prefill a = {q, k_cache, v_cache, q_stride, out_stride, block_table, seq_len, num_q, num_heads,
                       num_kv_heads, head_dim, block_size, positions, scale, out};
    const int64_t R = positions * G;
    const size_t floats = (size_t)(3 * R * head_dim + R * CHUNK + 2 * CHUNK * head_dim + 2 * R + 64);
    int failed = 0;
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            scratch w;
            w.qs = buf;
            w.o = w.qs + R * head_dim;
            w.s = w.o + R * head_dim;
            w.kp = w.s + R * CHUNK;
            w.vp = w.kp + CHUNK * head_dim;
            w.m = w.vp + CHUNK * head_dim;
            w.l = w.m + R;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tasks; t++) { /* latest query blocks first: they read the most keys */
                const int64_t block = blocks - 1 - t / num_kv_heads, h = t % num_kv_heads;
                run_task(&a, &w, h, block * positions);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
