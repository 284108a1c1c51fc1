/* The small per-token ops of CPU decode, each one call instead of a handful of torch ops (float32):
 *
 * - tsterm_decode_attention: one new query row per sequence attends over its context, read in place from the paged
 *   KV pool through the block table (any number of runs of blocks: a prefix cache hit leaves several). Work is
 *   split over (sequence, chunk of CHUNK positions), each thread a contiguous run of chunks, prefetching its next chunk
 *   into L2 while it computes the current one; for each KV head, the chunk's scores for the
 *   head's whole query group are computed, exponentiated against the chunk's max and summed into the chunk's own
 *   partial output; the partials are merged by their maxima at the end (flash-decoding).
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

#define CHUNK 64
#define PREFETCH 4

static inline void prefetch(const float *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
}

/* The T1 hint (into L2) for the next chunk's rows: measured on this EPYC (AVX2), T0 and NTA gave nothing (a chunk
 * ahead in L1 probably evicts the one being computed), T1 15-35% from memory; on KV already in L3 it costs 5-10%. */
static inline void prefetch_l2(const float *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T1);
}

/* 8 dot products q . k[j] (length D, a multiple of 8) as one vector: per-position accumulators, then a
 * transposing horizontal reduction (hadd tree) instead of 8 separate horizontal sums. */
static inline __m256 dot8(const float *q, const float *const k[8], int64_t D) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), a[j]);
    }
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline void axpy(float a, const float *x, float *y, int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

int64_t tsterm_attention_chunks(const int32_t *seq_lens, int64_t num_seqs) {
    int64_t max_chunks = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t c = (seq_lens[s] + CHUNK - 1) / CHUNK;
        if (c > max_chunks) max_chunks = c;
    }
    return max_chunks;
}

/* Task `task` of the first phase: a chunk of one sequence's positions, every KV head, into its partial. */
void tsterm_attention_task(const tsterm_attention *at, int64_t task) {
    const float *q = at->q, *k_cache = at->k_cache, *v_cache = at->v_cache;
    const int32_t *block_tables = at->block_tables, *seq_lens = at->seq_lens;
    const int64_t num_heads = at->num_heads, num_kv_heads = at->num_kv_heads, D = at->head_dim;
    const int64_t group = num_heads / num_kv_heads, max_chunks = at->max_chunks, block_size = at->block_size;
    const int64_t q_stride = at->q_stride, max_blocks = at->max_blocks;
    const float scale = at->scale;
    float *part = at->part;
    /* a chunk of one sequence's positions, every KV head: each position's K (and V) heads are contiguous */
    const int64_t s = task / max_chunks, chunk = task % max_chunks, first = chunk * CHUNK;
    int64_t n = seq_lens[s] - first;
    if (n > CHUNK) n = CHUNK;
    const int32_t *table = block_tables + s * max_blocks;
    const float *rows_k[CHUNK], *rows_v[CHUNK];
    for (int64_t i = 0, blk = first / block_size, off = first % block_size; i < n; i++) {  /* one division */
        const int64_t slot = (int64_t)table[blk] * block_size + off;
        rows_k[i] = k_cache + slot * num_kv_heads * D;
        rows_v[i] = v_cache + slot * num_kv_heads * D;
        if (++off == block_size) off = 0, blk++;
    }
    float *pt = part + task * num_heads * (D + 2);  /* [Hq, D + 2] */
    if (n <= 0) {
        for (int64_t r = 0; r < num_heads; r++) pt[r * (D + 2) + D] = -INFINITY, pt[r * (D + 2) + D + 1] = 0.0f;
        return;
    }
    const int64_t row_bytes = num_kv_heads * D * (int64_t)sizeof(float);
    float scores[MAX_HEADS][CHUNK] __attribute__((aligned(32)));
    const float *qs = q + s * q_stride;
    /* the next chunk's positions [next, next_end), at (block next_blk, offset next_off) */
    int64_t next = first + CHUNK, next_end = next < seq_lens[s] ? seq_lens[s] : next;
    next_end = next_end < next + CHUNK ? next_end : next + CHUNK;
    int64_t next_blk = next / block_size, next_off = next % block_size;
    for (int64_t i = 0; i < n; i += 8) {
        const int64_t m = n - i < 8 ? n - i : 8;
        for (int64_t j = 0; j < 8 && i + PREFETCH + j < n; j++) prefetch(rows_k[i + PREFETCH + j], row_bytes);
        /* The next chunk's K and V rows, 8 positions per step of this one: the hardware prefetcher loses the stream
         * at every block (a block table's blocks lie anywhere) and prefetching a few positions ahead hides little of
         * DRAM's latency, so without this the chunk's compute and its loads from memory took turns. */
        for (int64_t j = 0; j < 8 && next < next_end; j++, next++) {
            const int64_t slot = (int64_t)table[next_blk] * block_size + next_off;
            prefetch_l2(k_cache + slot * num_kv_heads * D, row_bytes);
            prefetch_l2(v_cache + slot * num_kv_heads * D, row_bytes);
            if (++next_off == block_size) next_off = 0, next_blk++;
        }
        for (int64_t r = 0; r < num_heads; r++) {
            const float *k[8];
            for (int64_t j = 0; j < 8; j++) k[j] = rows_k[i + (j < m ? j : 0)] + r / group * D;
            _mm256_store_ps(&scores[r][i], _mm256_mul_ps(dot8(qs + r * D, k, D), _mm256_set1_ps(scale)));
        }
    }
    for (int64_t r = 0; r < num_heads; r++) {
        float *sc = scores[r], *acc = pt + r * (D + 2);
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = sc[i] > mx ? sc[i] : mx;
        const float sum = tsterm_exp_sum(sc, n, mx);
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        acc[D] = mx, acc[D + 1] = sum;
    }
    for (int64_t r = 0; r < num_heads; r++) {
        const int64_t off = r / group * D;
        float *acc = pt + r * (D + 2);
        for (int64_t d0 = 0; d0 < D; d0 += 64) {  /* 8 accumulators in registers over the chunk's positions */
            const int64_t width = D - d0 < 64 ? D - d0 : 64;
            __m256 a[8];
            for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
            for (int64_t i = 0; i < n; i++) {
                const __m256 p = _mm256_set1_ps(scores[r][i]);
                const float *v = rows_v[i] + off + d0;
                if (width == 64) {
                    for (int k = 0; k < 8; k++) a[k] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * k), a[k]);
                } else {
                    for (int k = 0; k < width / 8; k++) a[k] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * k), a[k]);
                }
            }
            for (int k = 0; k < width / 8; k++) _mm256_storeu_ps(acc + d0 + 8 * k, a[k]);
        }
    }
}

/* Every task of the first phase, inside the caller's parallel region; ends at a barrier. Each thread takes an even,
 * contiguous share of the chunks that hold positions, so the next chunk, which each task prefetches, is its own
 * (under a dynamic schedule the other thread would take it and the prefetch would only double the traffic); then
 * the chunks past a sequence's end, which only mark their partial empty. */
void tsterm_attention_tasks(const tsterm_attention *a) {
    const int32_t *seq_lens = a->seq_lens;
    int64_t busy = 0, lo, hi, s = 0, c = 0;
    for (int64_t i = 0; i < a->num_seqs; i++) busy += (seq_lens[i] + CHUNK - 1) / CHUNK;
    tsterm_thread_share(busy, 1, &lo, &hi);
    for (int64_t idx = 0; idx < hi; idx++) { /* (sequence s, chunk c) of busy chunk idx */
        while (seq_lens[s] <= 0) s++;
        if (idx >= lo) tsterm_attention_task(a, s * a->max_chunks + c);
        if (++c * CHUNK >= seq_lens[s]) c = 0, s++;
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < a->num_seqs * a->max_chunks; task++)
        if (task % a->max_chunks * CHUNK >= seq_lens[task / a->max_chunks]) tsterm_attention_task(a, task);
}

/* Query row `row` (sequence row / Hq, head row % Hq) of the second phase: the chunks' partials merged by their
 * maxima into out [D]. */
void tsterm_attention_merge(const tsterm_attention *at, int64_t row, float *out) {
    const int64_t num_heads = at->num_heads, D = at->head_dim, max_chunks = at->max_chunks;
    const float *part = at->part;
    const int64_t s = row / num_heads, hq = row % num_heads;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t c = 0; c < max_chunks; c++) {
        const float m = part[((s * max_chunks + c) * num_heads + hq) * (D + 2) + D];
        mx = m > mx ? m : mx;
    }
    float *o = out;
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t c = 0; c < max_chunks; c++) {
        const float *pt = part + ((s * max_chunks + c) * num_heads + hq) * (D + 2);
        if (pt[D + 1] == 0.0f) continue;
        const float w = expf(pt[D] - mx);
        sum += w * pt[D + 1];
        axpy(w, pt, o, D);
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
}

/* q: [S, Hq, D] rows q_stride apart (elements between sequences' rows); caches: [num_blocks, B, Hkv, D];
 * block_tables: [S, max_blocks]; seq_lens: [S]; out: [S, Hq, D] contiguous. Returns -1 when scratch memory ran out
 * or there are more than MAX_HEADS query heads, else 0. */
int tsterm_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                            float *out) {
    if (num_heads > MAX_HEADS) return -1;
    tsterm_attention a = {q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs, num_heads,
                          num_kv_heads, head_dim, block_size, scale, tsterm_attention_chunks(seq_lens, num_seqs), NULL};
    a.part = malloc(tsterm_attention_part_bytes(&a));
    if (!a.part) return -1;
#pragma omp parallel  /* one parallel region for both phases: the threads are woken once */
    {
        tsterm_attention_tasks(&a);
#pragma omp for schedule(static)  /* after the implicit barrier: every chunk's partial is written */
        for (int64_t row = 0; row < num_seqs * num_heads; row++) tsterm_attention_merge(&a, row, out + row * head_dim);
    }
    free(a.part);
    return 0;
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
