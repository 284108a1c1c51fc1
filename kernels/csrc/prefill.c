/* Causal attention of one sequence's new tokens (prefill, or an extend over a cached prefix) on the CPU, read in
 * place from the paged KV pool through the block table: out = softmax(scale * q K^T, causal) V, float32.
 *
 * Why not torch's flash kernel: it runs these shapes at about half of what the two AVX2 cores can do (90 GFLOP/s
 * against a 180 peak; BENCHMARKS.md), and attention is a third of an agent trace's prefill. This is flash
 * attention on gemm.c's 6 x 16 register tile (built for AVX-512: attention.c's 512-bit tiles, the same bits), in
 * attention.c's order (the order decode.c follows too):
 *
 * - a task is one KV head and a block of query positions; its rows are (position, head of the KV head's group),
 *   position-major, so the group's heads share every pass over the keys (GQA);
 * - keys go split by split (ATT_SPLIT positions), each split chunk by chunk (tsterm_attend_split), and each row's
 *   split partials are merged into its running result in order;
 * - the causal mask is positional: a row at position p keeps keys <= p, so chunks after a block's last position
 *   are never read and only the diagonal chunk masks anything; a sliding window (keys > p - window) likewise
 *   leaves the splits and chunks before a block's first window unread.
 *
 * Tasks are handed to the OpenMP threads dynamically, longest (latest positions) first. A bfloat16 pool
 * (tsterm_prefill_attention_bf16) is read in place, widened to float32 as it is read: the float32 kernel's bits on the
 * converted pool.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tsterm.h"

#define TASK_ROWS 192 /* query rows per task, about: (positions per task) * group */
#define AMX_TASK_ROWS 384 /* AMX (attention.c's tiles): a chunk's gathered K and V shared by twice the rows */

typedef struct {
    const float *q;
    int64_t q_stride, out_stride;
    tsterm_kv kv;
    int64_t seq_len, num_q, num_heads, positions; /* positions per task */
    float scale;
    float *out;
    const float *sinks; /* [Hq] sink logits, or NULL */
} prefill;

typedef struct { /* one thread's scratch, 32-byte aligned pieces */
    float *qs, *o, *O, *m, *l, *M, *L, *split;
} scratch;

static void run_task(const prefill *a, const scratch *w, int64_t h, int64_t first) {
    const int64_t D = a->kv.head_dim, G = a->num_heads / a->kv.num_kv_heads;
    const int64_t positions = a->num_q - first < a->positions ? a->num_q - first : a->positions;
    const int64_t R = positions * G, first_pos = a->seq_len - a->num_q + first; /* row r: position first_pos + r/G */
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int64_t r = 0; r < R; r++) { /* q rows scaled, position-major */
        const float *src = a->q + (first + r / G) * a->q_stride + (h * G + r % G) * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(w->qs + r * D + d, _mm256_mul_ps(scale, _mm256_loadu_ps(src + d)));
    }
    const int64_t end = first_pos + positions, W = a->kv.window; /* keys [0, end) are visible to some row */
    /* the splits before the first row's window are read by no row; a row merges the splits from the one holding its
     * window's first key on */
    for (int64_t k0 = tsterm_att_window_start(W, first_pos) / ATT_SPLIT * ATT_SPLIT; k0 < end; k0 += ATT_SPLIT) {
        tsterm_attend_split(&a->kv, h, w->qs, R, G, first_pos, k0, end - k0 < ATT_SPLIT ? end : k0 + ATT_SPLIT, end,
                            w->split, w->m, w->l, w->o);
        for (int64_t r = k0 > first_pos ? (k0 - first_pos) * G : 0; r < R; r++) {
            const int64_t ws = tsterm_att_window_start(W, first_pos + r / G);
            if (ws >= k0 + ATT_SPLIT) continue; /* the split lies before the row's window */
            tsterm_att_merge(w->M + r, w->L + r, w->O + r * D, w->m[r], w->l[r], w->o + r * D, D, k0 <= ws);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = a->out + (first + r / G) * a->out_stride + (h * G + r % G) * D;
        const float *sink = a->sinks ? a->sinks + h * G + r % G : NULL;
        const __m256 inv = _mm256_set1_ps(tsterm_att_norm(w->M[r], w->L[r], sink));
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(inv, _mm256_load_ps(w->O + r * D + d)));
    }
}

/* 0 on success; -1 when the scratch cannot be allocated; -2 for a shape the kernel does not take (head_dim not a
 * multiple of 16, query heads not a multiple of KV heads, more queries than the context, a negative window).
 * caches: float32 (kv_bf16 = 0) or bfloat16 (kv_bf16 = 1). sinks: [Hq] each head's sink logit, or NULL; window: each
 * row sees its last `window` positions only (0: all). */
static int prefill_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                             const int32_t *block_table, int64_t seq_len, int64_t num_q, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                             int64_t out_stride, const float *sinks, int64_t window, int64_t kv_bf16) {
    if (head_dim % NR || head_dim <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || num_q > seq_len ||
        num_q <= 0 || block_size <= 0 || window < 0)
        return -2;
    const int64_t G = num_heads / num_kv_heads;
    const int64_t task_rows = kv_bf16 == TSTERM_ATT_AMX ? AMX_TASK_ROWS : TASK_ROWS;
    const int64_t positions = task_rows / G > 0 ? task_rows / G : 1;
    const int64_t blocks = (num_q + positions - 1) / positions, tasks = blocks * num_kv_heads;
    const prefill a = {q, q_stride, out_stride,
                       {k_cache, v_cache, block_table, block_size, num_kv_heads, head_dim, window, kv_bf16},
                       seq_len, num_q, num_heads, positions, scale, out, sinks};
    const int64_t R = positions * G, RD = (R * head_dim + 7) / 8 * 8, R8 = (R + 7) / 8 * 8;
    const size_t floats = (size_t)(3 * RD + 4 * R8) + tsterm_att_scratch_floats(R, head_dim) + 64;
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
            w.qs = buf, w.o = w.qs + RD, w.O = w.o + RD;
            w.m = w.O + RD, w.l = w.m + R8, w.M = w.l + R8, w.L = w.M + R8, w.split = w.L + R8;
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

/* prefill_attention over float32 caches */
int tsterm_prefill_attention_sw(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                const int32_t *block_table, int64_t seq_len, int64_t num_q, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                                int64_t out_stride, const float *sinks, int64_t window) {
    return prefill_attention(q, q_stride, k_cache, v_cache, block_table, seq_len, num_q, num_heads, num_kv_heads,
                             head_dim, block_size, scale, out, out_stride, sinks, window, 0);
}

/* prefill_attention over bfloat16 caches (uint16 bits), read in place: the bits tsterm_prefill_attention_sw gives on
 * the same caches converted to float32 */
int tsterm_prefill_attention_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                                  const int32_t *block_table, int64_t seq_len, int64_t num_q, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                                  int64_t out_stride, const float *sinks, int64_t window) {
    return prefill_attention(q, q_stride, k_cache, v_cache, block_table, seq_len, num_q, num_heads, num_kv_heads,
                             head_dim, block_size, scale, out, out_stride, sinks, window, 1);
}

/* prefill_attention over bfloat16 caches with attention.c's AMX arithmetic (bfloat16 products on AMX tiles): -2 where
 * this build has no AMX code (the caller checks tsterm_bf16_isa() first: the OS must grant the tile state) */
int tsterm_prefill_attention_amx(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                                 const int32_t *block_table, int64_t seq_len, int64_t num_q, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                                 int64_t out_stride, const float *sinks, int64_t window) {
    if (!TSTERM_AMX) return -2;
    return prefill_attention(q, q_stride, k_cache, v_cache, block_table, seq_len, num_q, num_heads, num_kv_heads,
                             head_dim, block_size, scale, out, out_stride, sinks, window, TSTERM_ATT_AMX);
}

/* tsterm_prefill_attention_sw without sinks or a window */
int tsterm_prefill_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                             const int32_t *block_table, int64_t seq_len, int64_t num_q, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                             int64_t out_stride) {
    return tsterm_prefill_attention_sw(q, q_stride, k_cache, v_cache, block_table, seq_len, num_q, num_heads,
                                       num_kv_heads, head_dim, block_size, scale, out, out_stride, NULL, 0);
}
