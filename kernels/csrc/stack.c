/* A decode step's whole stack of dense decoder layers in one call (float32 activations; float32, q8 or q4 weights):
 *
 *   for each layer: residual += h; x = RMSNorm(residual); qkv = x W_qkv (+ b); RoPE(q, k); K/V -> their slots;
 *                   a = attention(q, paged KV); h = a W_o (+ b); residual += h; x = RMSNorm(residual);
 *                   g, u = x W_gate_up; h = (silu(g) * u) W_down
 *
 * the same arithmetic as the model's layer-by-layer path (tsterm.model.decoder), which calls these files' kernels
 * one op at a time from Python. Batch-1 decode of a small model spends as long between those calls as in them
 * (a Python call and an OpenMP fork / join per op, ~10 per layer); here the threads are woken once per step and
 * meet at a barrier between the ops. Matmuls split their output rows over the threads; attention splits
 * (sequence, chunk) tasks; the per-row ops between them (norms, RoPE, the KV store, quantizing a row of x) are a
 * few microseconds on one thread. Each of `rows` sequences decodes one token.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tsterm.h"

typedef struct {
    int64_t kind;           /* TSTERM_F32, TSTERM_Q8 or TSTERM_Q4 */
    const void *data;       /* float32 [O, I], or the q8 / q4 codes (tsterm_kernels.quant) */
    const uint16_t *scales; /* q8 / q4: fp16 block scales */
    int64_t out_f, in_f;
} tsterm_weight;

typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    tsterm_weight qkv;                   /* [(Hq + 2 Hkv) D, H] */
    tsterm_weight o;                     /* [H, Hq D] */
    tsterm_weight gate_up;               /* [2 I, H]: gate rows, then up rows */
    tsterm_weight down;                  /* [H, I] */
    const float *qkv_bias, *o_bias;      /* or NULL */
    float *k_cache, *v_cache;            /* [num_blocks, B, Hkv, D] */
} tsterm_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const tsterm_layer *layers;
} tsterm_stack;

/* Rows of x [rows, I] (I = in_f) as int8 blocks, for a quantized weight; blocks [first, last) of each row. */
static void quantize_blocks(const float *x, int64_t rows, int64_t in_f, int64_t first, int64_t last, int8_t *qx,
                            float *dx, float *sx) {
    const int64_t nb = in_f / 32;
    for (int64_t r = 0; r < rows; r++)
        tsterm_quantize_row(x + r * in_f + first * 32, (last - first) * 32, qx + r * in_f + first * 32,
                            dx + r * nb + first, sx + r * nb + first);
}

/* This thread's share of y [rows, O] = x W^T (x as floats, or quantized in qx / dx / sx). */
static void matmul_share(const tsterm_weight *w, const float *x, const int8_t *qx, const float *dx, const float *sx,
                         int64_t rows, float *y) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t unit = w->kind == TSTERM_F32 ? 8 : 16, units = (w->out_f + unit - 1) / unit;
    const int64_t first = units * t / nt * unit;
    const int64_t last = units * (t + 1) / nt * unit < w->out_f ? units * (t + 1) / nt * unit : w->out_f;
    if (first >= last) return;
    if (w->kind == TSTERM_F32)
        tsterm_f32_rows(x, rows, w->in_f, w->data, first, last, w->out_f, y);
    else
        tsterm_quant_rows((int)w->kind, qx, dx, sx, rows, w->in_f, w->data, w->scales, first, last, w->out_f, y);
}

/* hidden [rows, H]: in, the step's embeddings; out, the last layer's MLP output. residual [rows, H]: out, the sum
 * the final norm adds it to. cos [rows, D], sin [rows, D/2]: each token's RoPE row; slots [rows]: each token's KV
 * slot (negative: not stored); block_tables [rows, max_blocks] and seq_lens [rows]: each sequence's context
 * (including this token). Returns 0; -1 when scratch memory ran out or there are more than MAX_HEADS heads. */
int tsterm_decode_stack(const tsterm_stack *m, int64_t rows, float *hidden, float *residual, const float *cos,
                        const float *sin, const int64_t *slots, const int32_t *block_tables, int64_t max_blocks,
                        const int32_t *seq_lens) {
    const int64_t H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, I = m->intermediate;
    const int64_t qkv_f = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    if (Hq > MAX_HEADS) return -1;
    int64_t widest = H > I ? H : I;
    widest = widest > Hq * D ? widest : Hq * D;
    tsterm_attention att = {NULL, qkv_f, NULL, NULL, block_tables, max_blocks, seq_lens, rows, Hq, Hkv, D,
                            m->block_size, m->scale, tsterm_attention_chunks(seq_lens, rows), NULL};
    /* scratch: x (a matmul's float input) [rows, widest], qkv [rows, qkv_f], attention output [rows, Hq D],
     * gate_up [rows, 2I], x quantized (dx, sx [rows, widest / 32]; codes [rows, widest]), attention partials */
    const size_t floats = (size_t)(rows * (widest + qkv_f + Hq * D + 2 * I + 2 * (widest / 32 + 1)));
    float *x = malloc(sizeof(float) * floats + (size_t)(rows * widest) + tsterm_attention_part_bytes(&att));
    if (!x) return -1;
    float *qkv = x + rows * widest, *attn = qkv + rows * qkv_f, *gu = attn + rows * Hq * D;
    float *dx = gu + rows * 2 * I, *sx = dx + rows * (widest / 32 + 1);
    att.part = sx + rows * (widest / 32 + 1);
    int8_t *qx = (int8_t *)(att.part + tsterm_attention_part_bytes(&att) / sizeof(float));
    const int64_t tasks = rows * att.max_chunks;
#pragma omp parallel
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tsterm_layer *L = &m->layers[l];
#pragma omp single
        for (int64_t r = 0; r < rows; r++) { /* residual += h; x = norm(residual) */
            float *res = residual + r * H;
            const float *h = hidden + r * H;
            if (l == 0)
                memcpy(res, h, sizeof(float) * (size_t)H);
            else
                for (int64_t i = 0; i < H; i++) res[i] += h[i];
            tsterm_rms_norm_row(res, L->input_norm, H, m->eps, x + r * H);
            if (L->qkv.kind != TSTERM_F32) quantize_blocks(x + r * H, 1, H, 0, H / 32, qx + r * H, dx + r * (H / 32), sx + r * (H / 32));
        }
        matmul_share(&L->qkv, x, qx, dx, sx, rows, qkv);
#pragma omp barrier
#pragma omp single
        for (int64_t r = 0; r < rows; r++) { /* bias, RoPE on q and k, the new K/V into their slots */
            float *row = qkv + r * qkv_f;
            if (L->qkv_bias)
                for (int64_t i = 0; i < qkv_f; i++) row[i] += L->qkv_bias[i];
            tsterm_rope_row(row, Hq + Hkv, D, cos + r * D, sin + r * (D / 2));
            if (slots[r] >= 0) {
                memcpy(L->k_cache + slots[r] * kv_row, row + Hq * D, sizeof(float) * (size_t)kv_row);
                memcpy(L->v_cache + slots[r] * kv_row, row + (Hq + Hkv) * D, sizeof(float) * (size_t)kv_row);
            }
        }
        tsterm_attention a = att;
        a.q = qkv, a.k_cache = L->k_cache, a.v_cache = L->v_cache;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) tsterm_attention_task(&a, task);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows * Hq; row++) tsterm_attention_merge(&a, row, attn + row * D);
        if (L->o.kind != TSTERM_F32) {
#pragma omp single
            quantize_blocks(attn, rows, Hq * D, 0, Hq * D / 32, qx, dx, sx);
        }
        matmul_share(&L->o, attn, qx, dx, sx, rows, hidden);
#pragma omp barrier
#pragma omp single
        for (int64_t r = 0; r < rows; r++) { /* (+ bias), residual += h; x = norm(residual) */
            float *res = residual + r * H, *h = hidden + r * H;
            if (L->o_bias)
                for (int64_t i = 0; i < H; i++) h[i] += L->o_bias[i];
            for (int64_t i = 0; i < H; i++) res[i] += h[i];
            tsterm_rms_norm_row(res, L->post_norm, H, m->eps, x + r * H);
            if (L->gate_up.kind != TSTERM_F32) quantize_blocks(x + r * H, 1, H, 0, H / 32, qx + r * H, dx + r * (H / 32), sx + r * (H / 32));
        }
        matmul_share(&L->gate_up, x, qx, dx, sx, rows, gu);
#pragma omp barrier
        { /* silu(gate) * up into x [rows, I], each thread a share of the blocks of 32 (quantized as it goes) */
            const int nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t nb = (I + 31) / 32, first = nb * t / nt, last = nb * (t + 1) / nt;
            const int64_t begin = first * 32, end = last * 32 < I ? last * 32 : I;
            for (int64_t r = 0; r < rows && begin < end; r++)
                tsterm_swiglu_row(gu + r * 2 * I + begin, gu + r * 2 * I + I + begin, end - begin, x + r * I + begin);
            if (L->down.kind != TSTERM_F32) quantize_blocks(x, rows, I, first, last, qx, dx, sx);
        }
#pragma omp barrier
        matmul_share(&L->down, x, qx, dx, sx, rows, hidden);
#pragma omp barrier
    }
    free(x);
    return 0;
}
