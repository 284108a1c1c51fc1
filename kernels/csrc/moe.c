/* A mixture of SwiGLU experts over a prefill's tokens on the CPU, float32, in one call:
 * out[t] += sum_k weights[t, k] * expert_{ids[t, k]}(x[t]).
 *
 * The torch path (tsterm_kernels.reference.fused_moe) runs each expert that got tokens as a handful of torch ops
 * around two GEMMs (gather its rows, gate_up, SwiGLU, down, scale, index_add); this is the same arithmetic in one
 * OpenMP region, the experts in order and each step split over the threads: the expert's rows gathered, gate_up
 * and down as csrc/gemm.c's threads' shares, SwiGLU and the weighted add into out by rows (an expert holds a token
 * at most once, so its rows of out are distinct). The weighted add rounds w * y before adding it, as
 * `out.index_add_(0, tokens, y.mul_(w))` does, so both paths give the same bits.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tsterm.h"

/* This thread's share of y [rows, O] = x [rows, I] @ W^T by the kernel `tsterm_kernels.reference.linear` picks
 * for that many rows (the GEMV up to 4, else the GEMM), split as its calls split it: the same bits. */
static void matmul_share(const float *x, int64_t rows, int64_t in_f, const float *w, int64_t out_f, float *y) {
    if (rows > 4 || in_f % 8) {
        tsterm_f32_gemm_share(x, in_f, rows, in_f, w, out_f, y);
        return;
    }
    int64_t first, last;
    tsterm_thread_share(out_f, 8, &first, &last);
    tsterm_f32_rows(x, rows, in_f, w, first, last, out_f, y);
}

/* x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; ids, weights [T, k] (an id outside [0, E) adds nothing: another rank's
 * expert); out [T, H]. Returns 0, or -1 when its scratch cannot be allocated. */
int tsterm_moe_prefill(const float *x, int64_t tokens, int64_t hidden, const float *w13, const float *w2,
                       int64_t experts, int64_t inter, const int64_t *ids, const float *weights, int64_t top_k,
                       float *out) {
    int64_t *count = calloc(2 * ((size_t)experts + 1), sizeof(int64_t)), *fill = count + experts + 1;
    int64_t *pair_token = malloc(sizeof(int64_t) * (size_t)(tokens * top_k + 1));
    float *pair_weight = malloc(sizeof(float) * (size_t)(tokens * top_k + 1));
    if (!count || !pair_token || !pair_weight) {
        free(count), free(pair_token), free(pair_weight);
        return -1;
    }
    for (int64_t p = 0; p < tokens * top_k; p++)
        if (ids[p] >= 0 && ids[p] < experts) count[ids[p] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < experts; e++) {
        most = count[e + 1] > most ? count[e + 1] : most;
        count[e + 1] += count[e]; /* count[e]: where expert e's pairs start */
    }
    float *scratch = malloc(sizeof(float) * (size_t)(most * (2 * hidden + 3 * inter) + 1)); /* xs, gu, act, y */
    if (!scratch) {
        free(count), free(pair_token), free(pair_weight);
        return -1;
    }
    memcpy(fill, count, sizeof(int64_t) * (size_t)(experts + 1));
    for (int64_t t = 0; t < tokens; t++) /* tokens in order within each expert, as a stable sort leaves them */
        for (int64_t k = 0; k < top_k; k++) {
            const int64_t e = ids[t * top_k + k];
            if (e < 0 || e >= experts) continue;
            pair_token[fill[e]] = t;
            pair_weight[fill[e]++] = weights[t * top_k + k];
        }
    float *xs = scratch, *gu = xs + most * hidden, *act = gu + most * 2 * inter, *y = act + most * inter;
#pragma omp parallel
    for (int64_t e = 0; e < experts; e++) {
        const int64_t first = count[e], n = count[e + 1] - count[e];
        if (n == 0) continue;
        int64_t lo, hi;
        tsterm_thread_share(n, 1, &lo, &hi);
        for (int64_t j = lo; j < hi; j++) memcpy(xs + j * hidden, x + pair_token[first + j] * hidden, sizeof(float) * hidden);
#pragma omp barrier
        matmul_share(xs, n, hidden, w13 + e * 2 * inter * hidden, 2 * inter, gu);
#pragma omp barrier
        for (int64_t j = lo; j < hi; j++) tsterm_swiglu_row(gu + j * 2 * inter, gu + j * 2 * inter + inter, inter, act + j * inter);
#pragma omp barrier
        matmul_share(act, n, inter, w2 + e * hidden * inter, hidden, y);
#pragma omp barrier
        for (int64_t j = lo; j < hi; j++) {
            float *o = out + pair_token[first + j] * hidden;
            const float *src = y + j * hidden;
            const __m256 w = _mm256_set1_ps(pair_weight[first + j]);
            int64_t i = 0;
            for (; i + 8 <= hidden; i += 8)
                _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(o + i), _mm256_mul_ps(w, _mm256_loadu_ps(src + i))));
            for (; i < hidden; i++) o[i] += pair_weight[first + j] * src[i];
        }
        /* no barrier: the next expert's first write of y comes after three of them */
    }
    free(count), free(pair_token), free(pair_weight), free(scratch);
    return 0;
}
