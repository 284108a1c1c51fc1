/* A decode step's whole stack of dense decoder layers in one call (float32 activations; float32, q8 or q4 weights):
 *
 *   for each layer: residual += h; x = RMSNorm(residual); qkv = x W_qkv (+ b); (per-head RMSNorm of q, k);
 *                   RoPE(q, k); K/V -> their slots;
 *                   a = attention(q, paged KV); h = a W_o (+ b); residual += h; x = RMSNorm(residual);
 *                   dense: g, u = x W_gate_up; h = (silu(g) * u) W_down
 *                   routed experts: the top-k experts of softmax(x W_router) (renormalized over the k, or not),
 *                   h = sum over them of weight * expert(x), each expert a SwiGLU MLP as above (+ a shared expert
 *                   weighted by sigmoid(x . w_gate), Qwen2-MoE's)
 *
 * the same arithmetic as the model's layer-by-layer path (tsterm.model.decoder), which calls these files' kernels
 * one op at a time from Python. Batch-1 decode of a small model spends as long between those calls as in them
 * (a Python call and an OpenMP fork / join per op, ~10 per layer); here the threads are woken once per step and
 * meet at a barrier between the ops. Matmuls split their output rows over the threads; attention splits
 * (sequence, split) tasks; the per-row ops between them (norms, RoPE, the KV store, quantizing a row of x) are a
 * few microseconds on one thread. Each of `rows` sequences decodes one token. The routed experts of a step are
 * grouped by expert (each expert's weights read once for all its tokens), in the order the layer-by-layer path
 * (`tsterm_kernels.reference.fused_moe`) visits them.
 *
 * A bfloat16 model (tsterm_stack.bf16): hidden states, residual and KV pools in bfloat16, every weight bfloat16 and
 * run by bf16.c's arithmetic its shape class chose (each weight's isa); the ops between run in float32 on the exact
 * float32 values, rounded to bfloat16 where the layer-by-layer bfloat16 path (tsterm_kernels.torch_ops's
 * "bfloat16 on the CPU") rounds: the residual after each add, each norm's output, q/k/v after their bias (q and k
 * again after their norms and RoPE), o_proj's output after its bias, a dense MLP's output, the router's logits, the
 * shared expert's gate logit and its sigmoid, a token's routed experts' float32 sum, and that plus the shared expert's
 * weighted output; gate_up's sums and an expert's down sums stay float32. So its tokens are the layer path's bits.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tsterm.h"

#define TSTERM_BF16 3 /* a weight kind beside tsterm.h's: bfloat16 [O, I] through bf16.c */

typedef struct {
    int64_t kind;           /* TSTERM_F32, TSTERM_Q8, TSTERM_Q4 or TSTERM_BF16 */
    const void *data;       /* float32 [O, I], or the q8 / q4 codes (tsterm_kernels.quant); experts: [E, O, ...] */
    const uint16_t *scales; /* q8 / q4: fp16 block scales */
    int64_t out_f, in_f;    /* of one matrix (one expert's) */
    int64_t isa;            /* TSTERM_BF16: bf16.c's instruction set (2 AMX, 1 AVX512-BF16, 0 plain) */
} tsterm_weight;

static inline int quantized(int64_t kind) { return kind == TSTERM_Q8 || kind == TSTERM_Q4; }

typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    tsterm_weight qkv;                   /* [(Hq + 2 Hkv) D, H] */
    tsterm_weight o;                     /* [H, Hq D] */
    tsterm_weight gate_up;               /* [2 I, H]: gate rows, then up rows ([E, 2I, H] with a router) */
    tsterm_weight down;                  /* [H, I] ([E, H, I] with a router) */
    const float *qkv_bias, *o_bias;      /* or NULL */
    const float *qk_norm;                /* [Hq + Hkv, D]: per-head RMSNorm weights of q and k (Qwen3), or NULL */
    float *k_cache, *v_cache;            /* [num_blocks, B, Hkv, D] (bfloat16 in a bfloat16 stack) */
    const float *router;                 /* [E, H] float32 (bfloat16: router_isa): routed experts; NULL: dense */
    int64_t num_experts, top_k, renormalize;
    int64_t *expert_load;                /* [E]: (token, expert) pairs routed so far, or NULL */
    tsterm_weight shared_gate_up;        /* [2 Is, H]: a shared expert (with a router), or data NULL */
    tsterm_weight shared_down;           /* [H, Is] */
    const float *shared_gate;            /* [H] float32 (bfloat16: shared_gate_isa): its weight is sigmoid(x . gate) */
    int64_t router_isa, shared_gate_isa; /* a bfloat16 stack's: bf16.c's instruction sets for these two */
} tsterm_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, block_size;
    float eps, scale;
    const tsterm_layer *layers;
    int64_t bf16; /* 1: a bfloat16 model (see above): hidden, residual and the KV pools bfloat16, weights TSTERM_BF16;
                   * 2: the same, its attention in attention.c's AMX arithmetic (TSTERM_ATT_AMX) */
} tsterm_stack;

/* x quantized as int8 blocks: codes [rows, I], dx and sx [rows, I/32] */
typedef struct {
    int8_t *q;
    float *d, *s;
} qrows;

/* Rows of x [rows, I] (I = in_f) as int8 blocks, for a quantized weight; blocks [first, last) of each row. */
static void quantize_blocks(const float *x, int64_t rows, int64_t in_f, int64_t first, int64_t last, qrows out) {
    const int64_t nb = in_f / 32;
    for (int64_t r = 0; r < rows; r++)
        tsterm_quantize_row(x + r * in_f + first * 32, (last - first) * 32, out.q + r * in_f + first * 32,
                            out.d + r * nb + first, out.s + r * nb + first);
}

/* round n floats to bfloat16 values in place */
static void round_bf16(float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) v[i] = tsterm_bf16_rounded(v[i]);
}

/* Columns [first, last) of y [rows, O] = x W^T for a bfloat16 W, x [rows, I] float32 rounded into this thread's
 * packed scratch pk; round: the outputs rounded to bfloat16 (a linear whose output the layer path keeps in bf16). */
static void bf16_matmul(const tsterm_weight *w, const float *x, int64_t rows, int64_t first, int64_t last, float *y,
                        void *pk, int round) {
    tsterm_bf16_pack(w->isa, x, w->in_f, rows, w->in_f, pk);
    tsterm_bf16_rows(w->isa, pk, rows, w->in_f, w->data, first, last, w->out_f, y, w->out_f);
    for (int64_t r = 0; round && r < rows; r++) round_bf16(y + r * w->out_f + first, last - first);
}

/* This thread's scratch for packing x (bf16.c's form), in a region of them after `base` */
static void *thread_pack(void *base, size_t bytes) { return (char *)base + bytes * (size_t)omp_get_thread_num(); }

/* This thread's share of y [rows, O] = x W^T (x as floats, or quantized in qx; a bfloat16 W packs x into pk and
 * rounds the outputs to bfloat16 where round is set). */
static void matmul_share(const tsterm_weight *w, const float *x, qrows qx, int64_t rows, float *y, void *pk,
                         int round) {
    int64_t first, last;
    tsterm_thread_share(w->out_f, w->kind == TSTERM_BF16 ? 32 : w->kind == TSTERM_F32 ? 8 : 16, &first, &last);
    if (first >= last) return;
    if (w->kind == TSTERM_BF16)
        bf16_matmul(w, x, rows, first, last, y, pk, round);
    else if (w->kind == TSTERM_F32)
        tsterm_f32_rows(x, rows, w->in_f, w->data, first, last, w->out_f, y);
    else
        tsterm_quant_rows((int)w->kind, qx.q, qx.d, qx.s, rows, w->in_f, w->data, w->scales, first, last, w->out_f,
                          y);
}

/* Expert e's matrix of a stack of them. */
static tsterm_weight expert(const tsterm_weight *w, int64_t e) {
    tsterm_weight x = *w;
    const int64_t n = w->out_f * w->in_f;
    if (w->kind == TSTERM_BF16) {
        x.data = (const uint16_t *)w->data + e * n;
    } else if (w->kind == TSTERM_F32) {
        x.data = (const float *)w->data + e * n;
    } else if (w->kind == TSTERM_Q8) {
        x.data = (const int8_t *)w->data + e * n, x.scales = w->scales + e * (n / 32);
    } else {
        x.data = (const uint8_t *)w->data + e * (n / 2), x.scales = w->scales + e * (n / 32 * 2);
    }
    return x;
}

/* rows [first row, +n) of qrows, as its own qrows */
static qrows qrows_at(qrows q, int64_t row, int64_t in_f) {
    return (qrows){q.q + row * in_f, q.d + row * (in_f / 32), q.s + row * (in_f / 32)};
}

/* softmax over n logits into p (max subtracted; expf) */
static void softmax(const float *l, int64_t n, float *p) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) mx = l[i] > mx ? l[i] : mx;
    for (int64_t i = 0; i < n; i++) sum += p[i] = expf(l[i] - mx);
    for (int64_t i = 0; i < n; i++) p[i] /= sum;
}

/* Routing of one token (tsterm_kernels.reference.moe_route): the top k of softmax(logits), weights renormalized
 * over the k (= softmax of the k largest logits) or not. Ties go to the lower expert id. probs: [E] scratch. */
static void route(const float *logits, int64_t E, int64_t k, int64_t renormalize, float *probs, int64_t *ids,
                  float *weights) {
    const float *v = logits;
    if (!renormalize) softmax(logits, E, probs), v = probs;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        ids[j] = best;
        weights[j] = v[best];
    }
    if (renormalize) {
        float top[k];
        for (int64_t j = 0; j < k; j++) top[j] = logits[ids[j]];
        softmax(top, k, weights);
    }
}

/* Routing of T tokens (logits [T, E]) for the layer-by-layer path, the decode stack's arithmetic: ids [T, k] int64,
 * weights [T, k]. probs: [E] scratch per call. */
void tsterm_moe_route(const float *logits, int64_t tokens, int64_t E, int64_t k, int64_t renormalize, int64_t *ids,
                      float *weights) {
#pragma omp parallel for schedule(static) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        float probs[E];
        route(logits + t * E, E, k, renormalize, probs, ids + t * k, weights + t * k);
    }
}

/* Routing of one token by a sigmoid router (tsterm_kernels.routing, GLM-4.5 / MiniMax-M2 / DeepSeek-V3): scores
 * s = sigmoid(logits), choices c = s + bias (bias NULL: none); with groups > 1 the E experts are `groups` equal
 * groups in id order, a group's score the sum of its two best choices, and only the experts of the `topk_groups`
 * best groups stay candidates; ids = the top k candidates by choice, weights = their s (divided by their sum + 1e-20
 * when renormalised), times scale. Ties go to the lower id (and the lower group). scratch: [E + groups]. */
static void route_scored(const float *logits, int64_t E, int64_t k, int64_t renormalize, const float *bias,
                         int64_t groups, int64_t topk_groups, float scale, float *scratch, int64_t *ids,
                         float *weights) {
    float *choice = scratch, *group_score = scratch + E;
    for (int64_t e = 0; e < E; e++) choice[e] = 1.0f / (1.0f + expf(-logits[e])) + (bias ? bias[e] : 0.0f);
    if (groups > 1) {
        int64_t size = E / groups;
        for (int64_t g = 0; g < groups; g++) {
            const float *c = choice + g * size;
            int64_t first = 0;
            for (int64_t e = 1; e < size; e++) if (c[e] > c[first]) first = e;
            int64_t second = first == 0 ? 1 : 0;
            for (int64_t e = 0; e < size; e++) if (e != first && c[e] > c[second]) second = e;
            group_score[g] = c[first] + c[second];
        }
        for (int64_t kept = 0; kept < topk_groups; kept++) {  /* the best groups' scores marked +inf, in turn */
            int64_t best = -1;
            for (int64_t g = 0; g < groups; g++)
                if (group_score[g] != INFINITY && (best < 0 || group_score[g] > group_score[best])) best = g;
            group_score[best] = INFINITY;
        }
        for (int64_t e = 0; e < E; e++) if (group_score[e / size] != INFINITY) choice[e] = -INFINITY;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
        }
        ids[j] = best;
        sum += weights[j] = 1.0f / (1.0f + expf(-logits[best]));
    }
    for (int64_t j = 0; j < k; j++) {
        if (renormalize) weights[j] /= sum + 1e-20f;
        weights[j] *= scale;
    }
}

/* Routing of T tokens by a sigmoid router (route_scored), the layer-by-layer path's: ids [T, k], weights [T, k] */
void tsterm_moe_route_sigmoid(const float *logits, int64_t tokens, int64_t E, int64_t k, int64_t renormalize,
                              const float *bias, int64_t groups, int64_t topk_groups, float scale, int64_t *ids,
                              float *weights) {
#pragma omp parallel for schedule(static) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        float scratch[E + groups];
        route_scored(logits + t * E, E, k, renormalize, bias, groups, topk_groups, scale, scratch, ids + t * k,
                     weights + t * k);
    }
}

/* out[i] = 1 / (1 + e^-x[i]): a shared expert's gate, in both paths */
void tsterm_sigmoid(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = 1.0f / (1.0f + expf(-x[i]));
}

/* The step's (token, expert) pairs grouped by expert, experts in order of first appearance (token by token, each
 * token's experts in top-k order), tokens in order within an expert. */
typedef struct {
    int64_t *row, *group;                      /* [P]: each pair's token and group */
    int64_t *pair_of;                          /* [rows * k]: the pair of (token, j-th of its top k) */
    int64_t *group_expert, *group_start;       /* per group: its expert, its first pair (and one past the last) */
    float *weight;                             /* [P] */
    int64_t num_groups;
} pairs_t;

static void group_pairs(const int64_t *ids, const float *weights, int64_t rows, int64_t k, pairs_t *p) {
    int64_t count[rows * k];
    p->num_groups = 0;
    for (int64_t i = 0; i < rows * k; i++) {
        int64_t g = 0;
        while (g < p->num_groups && p->group_expert[g] != ids[i]) g++;
        if (g == p->num_groups) p->group_expert[p->num_groups++] = ids[i], count[g] = 0;
        count[g]++;
    }
    for (int64_t g = 0, start = 0; g < p->num_groups; start += count[g], g++) p->group_start[g] = start;
    int64_t fill[p->num_groups > 0 ? p->num_groups : 1];
    for (int64_t g = 0; g < p->num_groups; g++) fill[g] = p->group_start[g];
    for (int64_t i = 0; i < rows * k; i++) {
        int64_t g = 0;
        while (p->group_expert[g] != ids[i]) g++;
        p->row[fill[g]] = i / k, p->group[fill[g]] = g, p->weight[fill[g]] = weights[i];
        p->pair_of[i] = fill[g]++;
    }
    p->group_start[p->num_groups] = rows * k;
}

/* silu(gate) * up of gu [n, 2I] into act [n, I], each thread a share of the blocks of 32 (quantized as it goes
 * when qa.q is set). */
static void swiglu_share(const float *gu, int64_t n, int64_t I, float *act, qrows qa) {
    int64_t begin, end;
    tsterm_thread_share(I, 32, &begin, &end);
    for (int64_t r = 0; r < n && begin < end; r++)
        tsterm_swiglu_row(gu + r * 2 * I + begin, gu + r * 2 * I + I + begin, end - begin, act + r * I + begin);
    if (qa.q) quantize_blocks(act, n, I, begin / 32, (end + 31) / 32, qa);
}

/* a bfloat16 K or V row into its slot of a bfloat16 pool (the values are bfloat16 already: rounded, they are exact) */
static void store_kv_bf16(const float *k, const float *v, int64_t row_len, uint16_t *k_cache, uint16_t *v_cache,
                          int64_t slot) {
    if (slot < 0) return;
    for (int64_t i = 0; i < row_len; i++) {
        k_cache[slot * row_len + i] = tsterm_bf16_round(k[i]);
        v_cache[slot * row_len + i] = tsterm_bf16_round(v[i]);
    }
}

/* hidden [rows, H]: in, the step's embeddings; out, the last layer's MLP output. residual [rows, H]: out, the sum
 * the final norm adds it to. Both float32, or bfloat16 bits in a bfloat16 stack. cos [rows, D], sin [rows, D/2]: each
 * token's RoPE row; slots [rows]: each token's KV slot (negative: not stored); block_tables [rows, max_blocks] and
 * seq_lens [rows]: each sequence's context (including this token). Returns 0; -1 when scratch memory ran out or there
 * are more than MAX_HEADS heads. */
int tsterm_decode_stack(const tsterm_stack *m, int64_t rows, void *hidden_io, void *residual_io, const float *cos,
                        const float *sin, const int64_t *slots, const int32_t *block_tables, int64_t max_blocks,
                        const int32_t *seq_lens) {
    const int64_t H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, bf16 = m->bf16 != 0;
    const int64_t qkv_f = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    if (Hq > MAX_HEADS) return -1;
    int64_t I = 1, E = 1, P = rows; /* the widest MLP, the most experts, the most (token, expert) pairs */
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tsterm_layer *L = &m->layers[l];
        I = L->gate_up.out_f / 2 > I ? L->gate_up.out_f / 2 : I;
        if (L->shared_gate_up.data) I = L->shared_gate_up.out_f / 2 > I ? L->shared_gate_up.out_f / 2 : I;
        const int64_t pairs_l = rows * (L->top_k + (L->shared_gate_up.data != NULL)); /* the shared expert: k + 1 */
        if (L->router) E = L->num_experts > E ? L->num_experts : E, P = pairs_l > P ? pairs_l : P;
    }
    int64_t widest = H > I ? H : I;
    widest = widest > Hq * D ? widest : Hq * D;
    const int64_t nbw = widest / 32 + 1;
    tsterm_attention att = {NULL, qkv_f, NULL, NULL, block_tables, max_blocks, seq_lens, rows, Hq, Hkv, D,
                            m->block_size, m->scale, tsterm_attention_splits(seq_lens, rows), NULL, NULL, 0, m->bf16};
    /* a bfloat16 stack: each thread's scratch for packing a matmul's x (the most any instruction set takes) */
    size_t pack = 0;
    for (int64_t isa = 0; bf16 && isa <= 2; isa++) {
        const size_t b = (tsterm_bf16_packed_bytes(isa, P, widest) + 63) / 64 * 64;
        pack = b > pack ? b : pack;
    }
    /* scratch (floats): x [P, widest] (a matmul's float input), qkv [rows, qkv_f], attention output [rows, Hq D],
     * gate_up [P, 2I], expert outputs [P, H], router logits and probabilities [rows, 2E], pair weights [P], two
     * sets of quantized rows' scales [P, nbw] x 2 each, a bfloat16 stack's hidden and residual [rows, H] x 2,
     * attention partials; then (int64) pairs' rows and groups, groups' experts and starts, routed ids [P] each (+1);
     * then (int8) two sets of quantized rows [P, widest]; then the threads' packing scratch, 64-byte aligned. */
    const size_t floats = (size_t)(P * widest + rows * (qkv_f + Hq * D) + P * (2 * I + H) + rows * 2 * E + P +
                                   4 * P * nbw + (bf16 ? 2 * rows * H : 0)) + tsterm_attention_part_bytes(&att) / sizeof(float);
    const size_t before_pack = sizeof(float) * floats + sizeof(int64_t) * (size_t)(6 * (P + 1)) + (size_t)(2 * P * widest);
    float *x = malloc(before_pack + 64 + pack * (size_t)omp_get_max_threads());
    if (!x) return -1;
    void *packs = (void *)(((uintptr_t)x + before_pack + 63) & ~(uintptr_t)63);
    float *qkv = x + P * widest, *attn = qkv + rows * qkv_f, *gu = attn + rows * Hq * D, *y = gu + P * 2 * I;
    float *logits = y + P * H, *probs = logits + rows * E, *pair_w = probs + rows * E, *scales = pair_w + P;
    float *hidden = hidden_io, *residual = residual_io;
    if (bf16) { /* the layers' float32 hidden and residual (bfloat16 values); the embeddings widened */
        hidden = scales + 4 * P * nbw, residual = hidden + rows * H;
        for (int64_t i = 0; i < rows * H; i++) hidden[i] = tsterm_bf16_float(((const uint16_t *)hidden_io)[i]);
    }
    att.part = scales + 4 * P * nbw + (bf16 ? 2 * rows * H : 0);
    int64_t *ints = (int64_t *)(x + floats);
    pairs_t pairs = {ints, ints + (P + 1), ints + 5 * (P + 1), ints + 2 * (P + 1), ints + 3 * (P + 1), pair_w, 0};
    int64_t *ids = ints + 4 * (P + 1);
    int8_t *codes = (int8_t *)(ints + 6 * (P + 1));
    const qrows qa = {codes, scales, scales + P * nbw}, qb = {codes + P * widest, scales + 2 * P * nbw, scales + 3 * P * nbw};
#pragma omp parallel
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tsterm_layer *L = &m->layers[l];
        void *pk = thread_pack(packs, pack);
#pragma omp single
        for (int64_t r = 0; r < rows; r++) { /* residual += h; x = norm(residual) */
            float *res = residual + r * H;
            const float *h = hidden + r * H;
            if (l == 0)
                memcpy(res, h, sizeof(float) * (size_t)H);
            else
                for (int64_t i = 0; i < H; i++) res[i] += h[i];
            if (bf16) round_bf16(res, H);
            tsterm_rms_norm_row(res, L->input_norm, H, m->eps, x + r * H);
            if (bf16) round_bf16(x + r * H, H);
            if (quantized(L->qkv.kind)) quantize_blocks(x + r * H, 1, H, 0, H / 32, qrows_at(qa, r, H));
        }
        matmul_share(&L->qkv, x, qa, rows, qkv, pk, 0);
#pragma omp barrier
#pragma omp single
        for (int64_t r = 0; r < rows; r++) { /* bias, q/k norms, RoPE on q and k, the new K/V into their slots */
            float *row = qkv + r * qkv_f;
            if (L->qkv_bias)
                for (int64_t i = 0; i < qkv_f; i++) row[i] += L->qkv_bias[i];
            if (bf16) round_bf16(row, qkv_f);
            if (L->qk_norm)
                for (int64_t h = 0; h < Hq + Hkv; h++)
                    tsterm_rms_norm_row(row + h * D, L->qk_norm + h * D, D, m->eps, row + h * D);
            tsterm_rope_row(row, Hq + Hkv, D, cos + r * D, sin + r * (D / 2));
            if (bf16) {
                round_bf16(row, (Hq + Hkv) * D);
                store_kv_bf16(row + Hq * D, row + (Hq + Hkv) * D, kv_row, (uint16_t *)L->k_cache,
                              (uint16_t *)L->v_cache, slots[r]);
            } else {
                tsterm_store_kv(row + Hq * D, 0, row + (Hq + Hkv) * D, 0, 1, kv_row, L->k_cache, L->v_cache, slots + r);
            }
        }
        tsterm_attention a = att;
        a.q = qkv, a.k_cache = L->k_cache, a.v_cache = L->v_cache;
        tsterm_attention_tasks(&a);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows * Hq; row++) tsterm_attention_merge(&a, row, attn + row * D);
        if (quantized(L->o.kind)) {
#pragma omp single
            quantize_blocks(attn, rows, Hq * D, 0, Hq * D / 32, qa);
        }
        matmul_share(&L->o, attn, qa, rows, hidden, pk, 0); /* (bf16: its input rounded as it is packed) */
#pragma omp barrier
        const tsterm_weight *sgu = L->shared_gate_up.data ? &L->shared_gate_up : NULL, *sdown = &L->shared_down;
        const int quant_ffn = quantized(L->gate_up.kind) || (sgu && quantized(sgu->kind));
        const int quant_down = quantized(L->down.kind);
        const int64_t I_l = L->gate_up.out_f / 2;
#pragma omp single
        for (int64_t r = 0; r < rows; r++) { /* (+ bias), residual += h; x = norm(residual) */
            float *res = residual + r * H, *h = hidden + r * H;
            if (L->o_bias)
                for (int64_t i = 0; i < H; i++) h[i] += L->o_bias[i];
            if (bf16) round_bf16(h, H);
            for (int64_t i = 0; i < H; i++) res[i] += h[i];
            if (bf16) round_bf16(res, H);
            tsterm_rms_norm_row(res, L->post_norm, H, m->eps, x + r * H);
            if (bf16) round_bf16(x + r * H, H);
            if (quant_ffn) quantize_blocks(x + r * H, 1, H, 0, H / 32, qrows_at(qa, r, H));
        }
        if (!L->router) { /* dense: g, u = x W_gate_up; h = swiglu W_down (bf16: gate_up's sums float32, h rounded) */
            matmul_share(&L->gate_up, x, qa, rows, gu, pk, 0);
#pragma omp barrier
            swiglu_share(gu, rows, I_l, x, quant_down ? qa : (qrows){0});
#pragma omp barrier
            matmul_share(&L->down, x, qa, rows, hidden, pk, (int)bf16);
#pragma omp barrier
            continue;
        }
        const int64_t k = L->top_k, n = rows * k, ne = L->num_experts, Is = sgu ? sgu->out_f / 2 : 0;
        const tsterm_weight router = bf16 ? (tsterm_weight){TSTERM_BF16, L->router, NULL, ne, H, L->router_isa}
                                          : (tsterm_weight){TSTERM_F32, L->router, NULL, ne, H, 0};
        matmul_share(&router, x, qa, rows, logits, pk, (int)bf16); /* (bf16: the logits rounded, then routed) */
#pragma omp barrier
#pragma omp single
        { /* route, group the pairs by expert, gather each pair's row of x (as the gate_up weights read it) */
            float w[n]; /* each token's top-k weights, before group_pairs orders them into pairs.weight */
            for (int64_t r = 0; r < rows; r++)
                route(logits + r * ne, ne, k, L->renormalize, probs + r * ne, ids + r * k, w + r * k);
            if (L->expert_load)
                for (int64_t i = 0; i < n; i++) L->expert_load[ids[i]]++;
            group_pairs(ids, w, rows, k, &pairs);
            for (int64_t r = 0; sgu && r < rows; r++) { /* the shared expert's weight: sigmoid(x . w_gate) */
                float z;
                if (bf16) { /* the gate's logit rounded, its sigmoid rounded (the layer path's two bf16 ops) */
                    const tsterm_weight g = {TSTERM_BF16, L->shared_gate, NULL, 1, H, L->shared_gate_isa};
                    bf16_matmul(&g, x + r * H, 1, 0, 1, &z, pk, 1);
                } else {
                    tsterm_f32_rows(x + r * H, 1, H, L->shared_gate, 0, 1, 1, &z);
                }
                tsterm_sigmoid(&z, 1, &pairs.weight[n + r]);
                if (bf16) pairs.weight[n + r] = tsterm_bf16_rounded(pairs.weight[n + r]);
                pairs.row[n + r] = r;
            }
            for (int64_t i = 0; i < n; i++) {
                const int64_t r = pairs.row[i];
                if (pairs.group_start[pairs.group[i] + 1] - pairs.group_start[pairs.group[i]] == 1) continue;
                if (quantized(L->gate_up.kind)) { /* an expert with several tokens: their rows side by side */
                    memcpy(qb.q + i * H, qa.q + r * H, (size_t)H);
                    memcpy(qb.d + i * (H / 32), qa.d + r * (H / 32), sizeof(float) * (size_t)(H / 32));
                    memcpy(qb.s + i * (H / 32), qa.s + r * (H / 32), sizeof(float) * (size_t)(H / 32));
                } else {
                    memcpy(y + i * H, x + r * H, sizeof(float) * (size_t)H); /* y: free until the down matmuls */
                }
            }
        }
        for (int64_t g = 0; g < pairs.num_groups; g++) { /* each expert's gate_up over its pairs' rows */
            const int64_t first = pairs.group_start[g], count = pairs.group_start[g + 1] - first;
            const tsterm_weight w = expert(&L->gate_up, pairs.group_expert[g]);
            const int64_t r = pairs.row[first]; /* an expert with one token reads its row in place (batch-1 decode) */
            matmul_share(&w, count == 1 ? x + r * H : y + first * H,
                         count == 1 ? qrows_at(qa, r, H) : qrows_at(qb, first, H), count, gu + first * 2 * I_l, pk, 0);
        }
        /* the shared expert reads x as it is (rows, not gathered); its rows of gu, act and y follow the routed */
        float *sgu_out = gu + n * 2 * I_l, *sact = x + n * I_l;
        const qrows sq = qrows_at(qa, n, I_l); /* its quantized act: rows of Is from there */
        if (sgu) matmul_share(sgu, x, qa, rows, sgu_out, pk, 0);
#pragma omp barrier
        swiglu_share(gu, n, I_l, x, quant_down ? qa : (qrows){0});
        if (sgu) swiglu_share(sgu_out, rows, Is, sact, quantized(sdown->kind) ? sq : (qrows){0});
#pragma omp barrier
        for (int64_t g = 0; g < pairs.num_groups; g++) {
            const int64_t first = pairs.group_start[g], count = pairs.group_start[g + 1] - first;
            const tsterm_weight w = expert(&L->down, pairs.group_expert[g]);
            matmul_share(&w, x + first * I_l, qrows_at(qa, first, I_l), count, y + first * H, pk, 0);
        }
        if (sgu) matmul_share(sdown, sact, sq, rows, y + n * H, pk, 0);
#pragma omp barrier
#pragma omp single
        { /* h = sum of each token's experts' outputs, weighted (w * y rounded, then added), in ascending expert id
           * and the shared expert last: the layer path's order (reference.fused_moe, csrc/moe.c), whatever the
           * other tokens of the step chose. bf16: the routed sum rounded, then the shared expert's w * y added to it
           * and rounded again (the layer path's two fused_moe calls into a bfloat16 output) */
            memset(hidden, 0, sizeof(float) * (size_t)(rows * H));
            for (int64_t r = 0; r < rows; r++) {
                int64_t order[k + 1];
                for (int64_t j = 0; j < k; j++) { /* insertion sort of the token's k pairs by expert id */
                    int64_t at = j;
                    for (; at > 0 && ids[r * k + order[at - 1]] > ids[r * k + j]; at--) order[at] = order[at - 1];
                    order[at] = j;
                }
                float *h = hidden + r * H;
                for (int64_t j = 0; j < k; j++) {
                    const int64_t i = pairs.pair_of[r * k + order[j]];
                    const float *yi = y + i * H, wi = pairs.weight[i];
                    for (int64_t c = 0; c < H; c++) h[c] += wi * yi[c];
                }
                if (bf16) round_bf16(h, H);
                if (!sgu) continue;
                const float *ys = y + (n + r) * H, ws = pairs.weight[n + r];
                for (int64_t c = 0; c < H; c++) h[c] = bf16 ? tsterm_bf16_rounded(h[c] + (0.0f + ws * ys[c]))
                                                            : h[c] + ws * ys[c];
            }
        }
    }
    if (bf16) /* out: the last MLP output and the residual, as bfloat16 */
        for (int64_t i = 0; i < rows * H; i++) {
            ((uint16_t *)hidden_io)[i] = tsterm_bf16_round(hidden[i]);
            ((uint16_t *)residual_io)[i] = tsterm_bf16_round(residual[i]);
        }
    free(x);
    return 0;
}
