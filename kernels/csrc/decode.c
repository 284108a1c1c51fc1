/* The small per-token ops of CPU decode, each one call instead of a handful of torch ops (float32):
 *
 * - tsterm_decode_attention: one new query row per sequence attends over its context, read in place from the paged
 *   KV pool (float32, or bfloat16 widened as it is read: tsterm_decode_attention_bf16) through the block table (any
 *   number of runs of blocks: a prefix cache hit leaves several), in
 *   attention.c's order, the one prefill.c follows: tasks are (sequence, split of ATT_SPLIT positions, KV head),
 *   handed to the threads; each split's partial is merged in order per query row. A decode row is thus the same bits as the same
 *   row computed in a prefill or an extend, whatever the batch and the thread count. With a sliding window the
 *   splits before a row's window are neither run nor merged; a sink joins only the final normalisation.
 * - tsterm_add_rms_norm: residual += x (when given), then out = residual * rsqrt(mean(residual^2) + eps) * w.
 * - tsterm_rope: rotate-half RoPE of q and k in place; tsterm_store_kv: the new tokens' K/V rows into their slots.
 * - tsterm_swiglu: silu(gate) * up of a dense MLP's gate_up projection.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tsterm.h"

/* The first split sequence s's row reads: the one holding its window's first key (0 without a window). Partials are
 * kept from there on (`part` index split - first_split), so a window's decode holds a few splits, not the context's. */
static inline int64_t first_split(const tsterm_attention *a, int64_t s) {
    return tsterm_att_window_start(a->window, a->seq_lens[s] - 1) / ATT_SPLIT;
}

/* the most splits any sequence's row reads (at least 1) */
static int64_t window_splits(const int32_t *seq_lens, int64_t num_seqs, int64_t window) {
    int64_t most = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t first = tsterm_att_window_start(window, seq_lens[s] - 1) / ATT_SPLIT;
        const int64_t c = (seq_lens[s] + ATT_SPLIT - 1) / ATT_SPLIT - first;
        most = c > most ? c : most;
    }
    return most;
}

int64_t tsterm_attention_splits(const int32_t *seq_lens, int64_t num_seqs) {
    return window_splits(seq_lens, num_seqs, 0);
}

/* Split `split` of sequence s for KV head h: its G query rows (scaled) through tsterm_attend_split, their partials
 * into `part` (at `rel`, the split's index from the sequence's first_split). w: this thread's scratch. */
static void split_task(const tsterm_attention *a, int64_t s, int64_t split, int64_t rel, int64_t h, float *w) {
    const int64_t Hq = a->num_heads, Hkv = a->num_kv_heads, D = a->head_dim, G = Hq / Hkv, len = a->seq_lens[s];
    const int64_t k0 = split * ATT_SPLIT, k1 = len - k0 < ATT_SPLIT ? len : k0 + ATT_SPLIT;
    const tsterm_kv kv = {a->k_cache, a->v_cache, a->block_tables + s * a->max_blocks, a->block_size, Hkv, D,
                          a->window, a->kv_bf16};
    float *sc = w, *qs = sc + tsterm_att_scratch_floats(G, D), *o = qs + G * D, *m = o + G * D, *l = m + G;
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int64_t g = 0; g < G; g++) {
        const float *src = a->q + s * a->q_stride + (h * G + g) * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(qs + g * D + d, _mm256_mul_ps(scale, _mm256_loadu_ps(src + d)));
    }
    tsterm_attend_split(&kv, h, qs, G, G, len - 1, k0, k1, len, sc, m, l, o);
    for (int64_t g = 0; g < G; g++) {
        float *pt = a->part + ((s * a->max_splits + rel) * Hq + h * G + g) * (D + 2);
        memcpy(pt, o + g * D, sizeof(float) * (size_t)D);
        pt[D] = m[g], pt[D + 1] = l[g];
    }
}

/* Every (sequence, split, KV head) task, inside the caller's parallel region, each thread an even contiguous share;
 * ends at the loop's barrier. A split's KV heads run one after another on one thread: the pool holds a position's
 * heads side by side ([block][position][head][D]), so the lines the hardware fetches around one head's rows are the
 * next tasks' (1.3x on a 5K-token context, one thread, against a head's splits in a row). Which thread takes which
 * task changes nothing in the result: each partial is one split's own. */
void tsterm_attention_tasks(const tsterm_attention *a) {
    const size_t partials = (size_t)(a->num_seqs * a->max_splits * a->num_heads * (a->head_dim + 2));
    float *base = (float *)(((uintptr_t)(a->part + partials) + 31) & ~(uintptr_t)31); /* 32-byte aligned */
    float *w = base + tsterm_attention_thread_floats(a) * (size_t)omp_get_thread_num();
    const int64_t Hkv = a->num_kv_heads;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a->num_seqs * Hkv * a->max_splits; t++) {
        const int64_t s = t / (Hkv * a->max_splits), rel = t / Hkv % a->max_splits, split = first_split(a, s) + rel;
        if (split * ATT_SPLIT < a->seq_lens[s]) split_task(a, s, split, rel, t % Hkv, w);
    }
}

/* Query row `row` (sequence row / Hq, head row % Hq) of the second phase: its splits' partials merged in order, as
 * prefill.c merges a row's splits, into out [D]. */
void tsterm_attention_merge(const tsterm_attention *a, int64_t row, float *out) {
    const int64_t Hq = a->num_heads, D = a->head_dim, s = row / Hq, hq = row % Hq;
    const int64_t splits = (a->seq_lens[s] + ATT_SPLIT - 1) / ATT_SPLIT;
    if (splits <= 0) {
        memset(out, 0, sizeof(float) * (size_t)D);
        return;
    }
    float M = 0.0f, L = 0.0f;
    const int64_t c0 = first_split(a, s); /* (the splits before its window's are neither run nor merged) */
    for (int64_t c = c0; c < splits; c++) {
        const float *pt = a->part + ((s * a->max_splits + c - c0) * Hq + hq) * (D + 2);
        tsterm_att_merge(&M, &L, out, pt[D], pt[D + 1], pt, D, c == c0);
    }
    const __m256 inv = _mm256_set1_ps(tsterm_att_norm(M, L, a->sinks ? a->sinks + hq : NULL));
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(inv, _mm256_loadu_ps(out + d)));
}

/* q: [S, Hq, D] rows q_stride apart (elements between sequences' rows); caches: [num_blocks, B, Hkv, D] of float32
 * (kv_bf16 = 0) or bfloat16 (kv_bf16 = 1); block_tables: [S, max_blocks]; seq_lens: [S]; out: [S, Hq, D] contiguous;
 * sinks: [Hq] each head's sink logit, or NULL; window: each row sees its last `window` positions only (0: all).
 * Returns -1 when scratch memory ran out, -2 for more than MAX_HEADS query heads, a head size not a multiple of 16,
 * query heads not a multiple of KV heads or a negative window, else 0. */
static int decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                            float *out, const float *sinks, int64_t window, int64_t kv_bf16) {
    if (num_heads > MAX_HEADS || head_dim % 16 || num_kv_heads <= 0 || num_heads % num_kv_heads || window < 0)
        return -2;
    tsterm_attention a = {q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs, num_heads,
                          num_kv_heads, head_dim, block_size, scale, window_splits(seq_lens, num_seqs, window), NULL,
                          sinks, window, kv_bf16};
    a.part = malloc(tsterm_attention_part_bytes(&a));
    if (!a.part) return -1;
#pragma omp parallel  /* one parallel region for both phases: the threads are woken once */
    {
        tsterm_attention_tasks(&a);
#pragma omp for schedule(static)  /* after the loop's barrier: every split's partial is written */
        for (int64_t row = 0; row < num_seqs * num_heads; row++) tsterm_attention_merge(&a, row, out + row * head_dim);
    }
    free(a.part);
    return 0;
}

/* decode_attention over float32 caches */
int tsterm_decode_attention_sw(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale, float *out, const float *sinks, int64_t window) {
    return decode_attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs, num_heads,
                            num_kv_heads, head_dim, block_size, scale, out, sinks, window, 0);
}

/* decode_attention over bfloat16 caches (uint16 bits), read in place: the bits tsterm_decode_attention_sw gives on
 * the same caches converted to float32 */
int tsterm_decode_attention_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                                 const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, float *out, const float *sinks, int64_t window) {
    return decode_attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs, num_heads,
                            num_kv_heads, head_dim, block_size, scale, out, sinks, window, 1);
}

/* decode_attention over bfloat16 caches with attention.c's AMX arithmetic: the bits tsterm_prefill_attention_amx gives
 * the same rows; -2 where this build has no AMX code */
int tsterm_decode_attention_amx(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, float *out, const float *sinks, int64_t window) {
    if (!TSTERM_AMX) return -2;
    return decode_attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs, num_heads,
                            num_kv_heads, head_dim, block_size, scale, out, sinks, window, TSTERM_ATT_AMX);
}

/* tsterm_decode_attention_sw without sinks or a window */
int tsterm_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                            float *out) {
    return tsterm_decode_attention_sw(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs,
                                      num_heads, num_kv_heads, head_dim, block_size, scale, out, NULL, 0);
}

void tsterm_rms_norm_row(const float *src, const float *weight, int64_t hidden, float eps, float *out) {
    double ss = 0.0;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8) {
        const __m256 v = _mm256_loadu_ps(src + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum256(acc);
    for (; i < hidden; i++) ss += src[i] * src[i];
    const float inv = 1.0f / sqrtf((float)(ss / (double)hidden) + eps);
    for (int64_t j = 0; j < hidden; j++) out[j] = src[j] * inv * weight[j];
}

/* x, residual, out: [T, H] contiguous; residual may be NULL (then the norm is of x). residual is updated in place. */
void tsterm_add_rms_norm(const float *x, float *residual, const float *weight, int64_t rows, int64_t hidden,
                         float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t t = 0; t < rows; t++) {
        const float *src = x + t * hidden;
        if (residual) {
            float *r = residual + t * hidden;
            for (int64_t i = 0; i < hidden; i++) r[i] += src[i];
            src = r;
        }
        tsterm_rms_norm_row(src, weight, hidden, eps, out + t * hidden);
    }
}

void tsterm_rope_row(float *x, int64_t heads, int64_t head_dim, const float *c, const float *s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * head_dim, *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[half + i] + a * s[i];
        }
    }
}

/* Per-head RMSNorm in place (Qwen3's q / k norms): x [T, heads, D] rows x_stride apart (each token's heads
 * contiguous), weight [heads, D]. */
void tsterm_head_rms_norm(float *x, int64_t tokens, int64_t x_stride, int64_t heads, int64_t head_dim,
                          const float *weight, float eps) {
#pragma omp parallel for schedule(static) if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            float *row = x + t * x_stride + h * head_dim;
            tsterm_rms_norm_row(row, weight + h * head_dim, head_dim, eps, row);
        }
}

/* Rotate-half RoPE in place: x [T, H, D] rows x_stride apart (each token's H * D values contiguous);
 * cos [T, D], sin [T, D/2]: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (the halves of each head). */
void tsterm_rope(float *x, int64_t tokens, int64_t x_stride, int64_t heads, int64_t head_dim, const float *cos,
                 const float *sin) {
#pragma omp parallel for schedule(static) if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++)
        tsterm_rope_row(x + t * x_stride, heads, head_dim, cos + t * head_dim, sin + t * (head_dim / 2));
}

/* silu(g) * u = g * sigmoid(g) * u, 8 lanes at a time; the sigmoid from e = e^-|g| (exp256 takes x <= 0):
 * 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0. */
void tsterm_swiglu_row(const float *g, const float *u, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp256(_mm256_or_ps(gv, _mm256_set1_ps(-0.0f)));
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, gv), _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* SwiGLU of a gate_up projection: h [T, 2I] (gate columns, then up) -> out [T, I] = silu(gate) * up. */
void tsterm_swiglu(const float *h, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t t = 0; t < rows; t++) tsterm_swiglu_row(h + t * 2 * inter, h + t * 2 * inter + inter, inter, out + t * inter);
}

/* The new tokens' K and V rows (row_len = Hkv * D floats each, rows k_stride / v_stride apart) into their slots of
 * the paged pools [num_slots, row_len]; a negative slot writes nothing. */
void tsterm_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens,
                     int64_t row_len, float *k_cache, float *v_cache, const int64_t *slots) {
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row_len, k + t * k_stride, sizeof(float) * (size_t)row_len);
        memcpy(v_cache + slots[t] * row_len, v + t * v_stride, sizeof(float) * (size_t)row_len);
    }
}
