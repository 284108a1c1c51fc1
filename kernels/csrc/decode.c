/* The small per-token ops of CPU decode, each one call instead of a handful of torch ops (float32):
 *
 * - tsterm_decode_attention: one new query row per sequence attends over its context, read in place from the paged
 *   KV pool through the block table (any number of runs of blocks: a prefix cache hit leaves several). Work is
 *   split over (sequence, chunk of CHUNK positions), each thread a contiguous run of chunks; a chunk's scores for
 *   every query head are computed (Q K), exponentiated against the running max of the thread's chunks of that
 *   sequence and summed into their one partial output (P V; online softmax, the partial rescaled when the max
 *   grows); the threads' partials are merged by their maxima at the end (flash-decoding). While Q K runs, the
 *   chunk's V rows are prefetched into L2, and while P V runs, the next chunk's K rows, so that the loads from memory
 *   are spread evenly over the compute.
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

/* Measured on the 2-core EPYC (AVX2) with the bench model's heads (16 / 4 x 64): 32 positions per chunk read 10-15%
 * faster from memory than 64 (16 was slower: more partials to write and merge). */
#define CHUNK 32

/* The T1 hint (into L2): measured on this EPYC, T0 and NTA gave nothing (rows ahead in L1 probably evict the ones
 * being computed), T1 15-35% from memory. */
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

/* acc[0..64) = (add: acc +) sum over the chunk's positions i of p[i] * rows[i][off..off + 64): 8 accumulators in
 * registers. (Spelled out for a width of 64: with the width a variable, gcc kept flags and a bound in memory in the
 * loop, and P V ran 10-20% slower.) */
static inline void pv64(const float *p, const float *const *rows, int64_t n, int64_t off, float *acc, int add) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    if (add) {
        a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8), a2 = _mm256_loadu_ps(acc + 16);
        a3 = _mm256_loadu_ps(acc + 24), a4 = _mm256_loadu_ps(acc + 32), a5 = _mm256_loadu_ps(acc + 40);
        a6 = _mm256_loadu_ps(acc + 48), a7 = _mm256_loadu_ps(acc + 56);
    }
    for (int64_t i = 0; i < n; i++) {
        const __m256 pi = _mm256_broadcast_ss(p + i);
        const float *v = rows[i] + off;
        a0 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v), a0);
        a1 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 8), a1);
        a2 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 16), a2);
        a3 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 24), a3);
        a4 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 32), a4);
        a5 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 40), a5);
        a6 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 48), a6);
        a7 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 56), a7);
    }
    _mm256_storeu_ps(acc, a0), _mm256_storeu_ps(acc + 8, a1), _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3), _mm256_storeu_ps(acc + 32, a4), _mm256_storeu_ps(acc + 40, a5);
    _mm256_storeu_ps(acc + 48, a6), _mm256_storeu_ps(acc + 56, a7);
}

/* the same for a head's last width < 64 (a multiple of 8) */
static void pv_narrow(const float *p, const float *const *rows, int64_t n, int64_t off, int64_t width, float *acc,
                      int add) {
    __m256 a[7];
    for (int k = 0; k < width / 8; k++) a[k] = add ? _mm256_loadu_ps(acc + 8 * k) : _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const __m256 pi = _mm256_broadcast_ss(p + i);
        for (int k = 0; k < width / 8; k++) a[k] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(rows[i] + off + 8 * k), a[k]);
    }
    for (int k = 0; k < width / 8; k++) _mm256_storeu_ps(acc + 8 * k, a[k]);
}

int64_t tsterm_attention_chunks(const int32_t *seq_lens, int64_t num_seqs) {
    int64_t max_chunks = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t c = (seq_lens[s] + CHUNK - 1) / CHUNK;
        if (c > max_chunks) max_chunks = c;
    }
    return max_chunks;
}

/* Task `task` of the first phase: a chunk of one sequence's positions, every KV head, into the partial `run` (fresh:
 * the run starts here; else the chunk's softmax continues the run's, online). A chunk that does not start its run
 * marks its own partial empty. */
static void tsterm_attention_task(const tsterm_attention *at, int64_t task, float *run, int fresh) {
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
    float *own = part + task * num_heads * (D + 2), *pt = run;  /* [Hq, D + 2] */
    if (own != run || n <= 0)
        for (int64_t r = 0; r < num_heads; r++) own[r * (D + 2) + D] = -INFINITY, own[r * (D + 2) + D + 1] = 0.0f;
    if (n <= 0) return;
    const int64_t row_bytes = num_kv_heads * D * (int64_t)sizeof(float);
    float scores[MAX_HEADS][CHUNK] __attribute__((aligned(32)));
    const float *qs = q + s * q_stride;
    const float *next_k[CHUNK];  /* the next chunk's K rows (nn of them), prefetched during this chunk's P V */
    int64_t nn = seq_lens[s] - first - CHUNK;
    nn = nn < 0 ? 0 : nn > CHUNK ? CHUNK : nn;
    for (int64_t i = 0, p = first + CHUNK, blk = p / block_size, off = p % block_size; i < nn; i++) {
        next_k[i] = k_cache + ((int64_t)table[blk] * block_size + off) * num_kv_heads * D;
        if (++off == block_size) off = 0, blk++;
    }
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 8) {  /* Q K, 8 positions at a time */
        const int64_t m = n - i < 8 ? n - i : 8;
        for (int64_t j = 0; j < m; j++) prefetch_l2(rows_v[i + j], row_bytes);
        const float *k[8];  /* past the chunk's end the first position again: its lanes are never read as scores */
        for (int64_t j = 0; j < 8; j++) k[j] = rows_k[i + (j < m ? j : 0)];
        for (int64_t h = 0, r = 0; h < num_kv_heads; h++, r += group) {
            for (int64_t g = 0; g < group; g++)
                _mm256_store_ps(&scores[r + g][i], _mm256_mul_ps(dot8(qs + (r + g) * D, k, D), scale8));
            for (int64_t j = 0; j < 8; j++) k[j] += D;
        }
    }
    for (int64_t r = 0; r < num_heads; r++) {
        float *sc = scores[r], *acc = pt + r * (D + 2);
        /* a max over whole steps of 8 is exact: the last step's extra lanes repeat one of its positions' score */
        __m256 m8 = _mm256_load_ps(sc);
        for (int64_t i = 8; i < n; i += 8) m8 = _mm256_max_ps(m8, _mm256_load_ps(sc + i));
        const float chunk_max = hmax256(m8);
        const float old = fresh ? -INFINITY : acc[D], mx = chunk_max > old ? chunk_max : old;
        const float sum = tsterm_exp_sum(sc, n, mx);
        if (fresh) {
            acc[D + 1] = sum;
        } else { /* the run so far, rescaled when this chunk raised its maximum */
            const float alpha = expf(old - mx);
            if (alpha != 1.0f)
                for (int64_t d = 0; d < D; d++) acc[d] *= alpha;
            acc[D + 1] = acc[D + 1] * alpha + sum;
        }
        acc[D] = mx;
    }
    for (int64_t r = 0, pf = 0; r < num_heads; r++) {  /* P V, one query head at a time */
        const int64_t off = r / group * D;
        float *acc = pt + r * (D + 2);
        for (const int64_t pf_end = nn * (r + 1) / num_heads; pf < pf_end; pf++) prefetch_l2(next_k[pf], row_bytes);
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) pv64(scores[r], rows_v, n, off + d0, acc + d0, !fresh);
        if (d0 < D) pv_narrow(scores[r], rows_v, n, off + d0, D - d0, acc + d0, !fresh);
    }
}

/* Every task of the first phase, inside the caller's parallel region; ends at a barrier. Each thread takes an even,
 * contiguous share of the chunks that hold positions, so the next chunk, which each task prefetches, is its own
 * (under a dynamic schedule the other thread would take it and the prefetch would only double the traffic); its
 * chunks of one sequence make one run with one partial (with a partial per chunk, 2 MB of them at 16K positions
 * written and then merged, the kernel read the KV up to 20% slower from memory, 7% on average); then the chunks past
 * a sequence's end, which only mark their partial empty. */
void tsterm_attention_tasks(const tsterm_attention *a) {
    const int32_t *seq_lens = a->seq_lens;
    const int64_t part_floats = a->num_heads * (a->head_dim + 2);
    int64_t busy = 0, lo, hi, s = 0, c = 0, run_seq = -1;
    float *run = NULL;
    for (int64_t i = 0; i < a->num_seqs; i++) busy += (seq_lens[i] + CHUNK - 1) / CHUNK;
    tsterm_thread_share(busy, 1, &lo, &hi);
    for (int64_t idx = 0; idx < hi; idx++) { /* (sequence s, chunk c) of busy chunk idx */
        while (seq_lens[s] <= 0) s++;
        if (idx >= lo) {
            const int64_t task = s * a->max_chunks + c;
            const int fresh = s != run_seq;
            if (fresh) run = a->part + task * part_floats, run_seq = s;
            tsterm_attention_task(a, task, run, fresh);
        }
        if (++c * CHUNK >= seq_lens[s]) c = 0, s++;
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < a->num_seqs * a->max_chunks; task++)
        if (task % a->max_chunks * CHUNK >= seq_lens[task / a->max_chunks])
            tsterm_attention_task(a, task, a->part + task * part_floats, 1);
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
 * block_tables: [S, max_blocks]; seq_lens: [S]; out: [S, Hq, D] contiguous. Returns -1 when scratch memory ran out,
 * -2 for more than MAX_HEADS query heads or a head size not a multiple of 8, else 0. */
int tsterm_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                            float *out) {
    if (num_heads > MAX_HEADS || head_dim % 8) return -2;
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
