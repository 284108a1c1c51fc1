/* Multi-head Latent Attention's absorbed attention on the CPU (DeepSeek-V3, Kimi-K2: tsterm/model/mla.py), float32
 * arithmetic over the latent pool read in place through the block table (float32 rows, or bfloat16 ones converted a
 * chunk at a time), never gathered.
 *
 * Every query head shares one key row per position, c = [latent (R) | k_rope (DR)], W = R + DR values: head h of a
 * query row scores s = (scale q_lat[h]) . latent + (scale q_rope[h]) . k_rope (one dot of W values, q_lat = W_UK[h]^T
 * q_nope[h] absorbed by the caller) and takes out the softmax-weighted latents o[h] = sum p latent (R values; the
 * caller applies W_UV). So the context is a [keys, W] matrix that all heads read: the scores of a chunk of keys are a
 * small GEMM with the heads as its vector lanes (a panel of 32 heads, each lane a chain of fused multiply-adds over
 * the W values in order, from zero), and P C a second one with the latent dimensions as the lanes (each output value
 * a chain over the chunk's keys in position order, from zero, then added to the rescaled output). Each key row is
 * read from memory once per task, whatever the number of heads; the chunk stays in cache for the heads' panels.
 *
 * One order of arithmetic, whatever the batch (tsterm's promise: a row's bits do not depend on the rows beside it, on
 * how many rows its sequence brings, on the thread count or on the build): keys go in splits of MLA_SPLIT positions
 * and chunks of MLA_CHUNK, both at fixed positions (0, MLA_CHUNK, ...); a row sees the keys at or before its
 * position, in every chunk only those (its lanes never add a masked term); an online softmax (the maximum per head
 * kept as keys come, the output and sum rescaled when it grows; exponentials as tsterm_exp_sum takes them) runs over
 * a split's chunks, and the splits' partials are merged in split order (tsterm_att_merge), then scaled by 1 / sum.
 * A head's lane does the same operations in every tile shape and vector width, so the AVX-512 build, the AVX2 build
 * and the NEON one (through csrc/neon/immintrin.h, whose 256-bit operations round as x86's do) give the same bits.
 *
 * Two schedules, the same arithmetic: a sequence with one new row (a decode) runs its splits as parallel tasks (with
 * groups of heads as tasks too where the splits are fewer than the threads) whose partials are merged after; one with
 * several rows (a verify step, a short prompt chunk) runs tasks of MLA_ROWS rows x one panel of heads, each walking
 * its splits in order and merging each as it is done (a decode's splits would otherwise need a partial buffer per
 * row and split).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tsterm.h"

#define MLA_CHUNK 64  /* keys per chunk (scores, softmax, P C); the chunk's rows stay in L2 for every panel */
#define MLA_SPLIT 512 /* keys per split: a decode row's parallel tasks (a multiple of MLA_CHUNK) */
#define MLA_PANEL 32  /* heads per panel: the score tile's lanes */
#define MLA_ROWS 8    /* query rows per task of a sequence that brings several */
#define MLA_PARALLEL_WORK 4e6 /* multiply-adds from which a step wakes the threads (~40 us on one core) */

typedef struct {
    const float *q_lat, *q_rope;    /* [T, Hq, R], [T, Hq, DR]: unit last stride */
    int64_t ql_t, ql_h, qr_t, qr_h; /* their token and head strides (elements) */
    const float *cache32;           /* the pool [num_blocks, B, W] as float32, or NULL */
    const uint16_t *cache16;        /* ... or as bfloat16 */
    int64_t block_size, rank, rope, width;
    const int32_t *tables; /* [S, max_blocks] */
    int64_t max_blocks;
    const int32_t *seq_lens, *starts; /* [S] contexts (the new rows included), [S + 1] each sequence's first row */
    int64_t num_seqs, num_heads;
    float scale;
} mla_t;

typedef struct {
    int64_t seq, part, first; /* sequence; split (one row) or first row (several); first head */
    int64_t heads;            /* heads from `first` */
} mla_task;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t panels_of(int64_t heads) { return (heads + MLA_PANEL - 1) / MLA_PANEL; }
/* the position of the first new row of sequence s */
static inline int64_t first_pos(const mla_t *a, int64_t s) {
    return a->seq_lens[s] - (a->starts[s + 1] - a->starts[s]);
}

/* qp [panels][W][32] <- row t's queries for heads [h0, h0 + nh), scaled, transposed (head i: lane i % 32 of panel
 * i / 32); the lanes of a last panel's missing heads are zero */
static void pack_q(const mla_t *a, int64_t t, int64_t h0, int64_t nh, float *qp) {
    const int64_t W = a->width, R = a->rank;
    memset(qp, 0, sizeof(float) * (size_t)(panels_of(nh) * W * MLA_PANEL));
    for (int64_t i = 0; i < nh; i++) {
        const float *ql = a->q_lat + t * a->ql_t + (h0 + i) * a->ql_h, *qr = a->q_rope + t * a->qr_t + (h0 + i) * a->qr_h;
        float *dst = qp + (i / MLA_PANEL) * W * MLA_PANEL + i % MLA_PANEL;
        for (int64_t d = 0; d < R; d++) dst[d * MLA_PANEL] = a->scale * ql[d];
        for (int64_t d = 0; d < a->rope; d++) dst[(R + d) * MLA_PANEL] = a->scale * qr[d];
    }
}

/* rows[j] <- the key row of position c0 + j of sequence s (j < n): a pointer into a float32 pool, or the bfloat16
 * row converted (exactly) into conv [n][W] */
static void chunk_rows(const mla_t *a, int64_t s, int64_t c0, int64_t n, float *conv, const float **rows) {
    const int64_t B = a->block_size, W = a->width;
    const int32_t *table = a->tables + s * a->max_blocks;
    for (int64_t j = 0; j < n; j++) {
        const int64_t p = c0 + j, slot = (int64_t)table[p / B] * B + p % B;
        if (a->cache32) {
            rows[j] = a->cache32 + slot * W;
            continue;
        }
        const uint16_t *src = a->cache16 + slot * W;
        uint32_t *dst = (uint32_t *)(conv + j * W);
        for (int64_t d = 0; d < W; d++) dst[d] = (uint32_t)src[d] << 16;
        rows[j] = conv + j * W;
    }
}

/* s [n][32] <- each key row's dot with the panel's 32 queries qp [W][32] (lanes [0, 16) only, when `half`: a panel
 * of 16 heads or fewer): lane h of key j is the chain fma(qp[d][h], rows[j][d], .) over d = 0 .. W - 1 from zero.
 * Keys in tiles (past n: the first key of the tile again, its lanes never stored); the values d in blocks of
 * MLA_DBLOCK (a block of qp stays in L1 for every tile of keys), the chains carried from block to block through s
 * (stored and loaded: exact). */
#define MLA_DBLOCK 128
#ifdef __AVX512F__
#define SK 8  /* keys per tile: 16 accumulators of 16 heads */
#define SKH 16 /* (half a panel: 16 keys of 16 heads) */
#define SV 16 /* lanes per vector */
typedef __m512 mla_vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vbroadcast(p) _mm512_set1_ps(*(p))
#define vfmadd _mm512_fmadd_ps
#else
#define SK 3 /* keys per tile: 12 accumulators of 8 heads */
#define SKH 6
#define SV 8
typedef __m256 mla_vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vbroadcast _mm256_broadcast_ss
#define vfmadd _mm256_fmadd_ps
#endif

/* one tile: keys j .. j + K - 1 (those before n), V vectors of heads, values [d0, d1) */
#define SCORE_TILE(K, V)                                                                                               \
    do {                                                                                                               \
        const float *r[K];                                                                                             \
        mla_vec acc[K][V];                                                                                             \
        for (int i = 0; i < K; i++) {                                                                                  \
            r[i] = rows[j + i < n ? j + i : j];                                                                        \
            const int carried = d0 > 0 && j + i < n;                                                                   \
            for (int v = 0; v < V; v++) acc[i][v] = carried ? vload(s + (j + i) * MLA_PANEL + SV * v) : vzero();       \
        }                                                                                                              \
        for (int64_t d = d0; d < d1; d++) {                                                                            \
            mla_vec q[V];                                                                                              \
            for (int v = 0; v < V; v++) q[v] = vload(qp + d * MLA_PANEL + SV * v);                                     \
            for (int i = 0; i < K; i++) {                                                                              \
                const mla_vec c = vbroadcast(r[i] + d);                                                                \
                for (int v = 0; v < V; v++) acc[i][v] = vfmadd(q[v], c, acc[i][v]);                                    \
            }                                                                                                          \
        }                                                                                                              \
        for (int i = 0; i < K && j + i < n; i++)                                                                       \
            for (int v = 0; v < V; v++) vstore(s + (j + i) * MLA_PANEL + SV * v, acc[i][v]);                           \
    } while (0)

static void panel_scores(const float *qp, const float *const *rows, int64_t n, int64_t W, float *s, int half) {
    for (int64_t d0 = 0; d0 < W; d0 += MLA_DBLOCK) {
        const int64_t d1 = min64(W, d0 + MLA_DBLOCK);
        if (half)
            for (int64_t j = 0; j < n; j += SKH) SCORE_TILE(SKH, 16 / SV);
        else
            for (int64_t j = 0; j < n; j += SK) SCORE_TILE(SK, MLA_PANEL / SV);
    }
}
#undef SCORE_TILE
#undef SK
#undef SKH
#undef SV
#undef vzero
#undef vload
#undef vstore
#undef vbroadcast
#undef vfmadd

/* The online softmax's step over a panel's scores s [n][32] (n >= 1; its first `lanes` lanes, a multiple of 8): m [32] <- max(m, the chunk's max), s <- e^(s -
 * m) in place (tsterm_exp_sum's arithmetic: 2^(s log2e - m log2e) in one fused multiply-add), alpha [32] <- e^(m_old -
 * m) (0 where m_old was -inf), l [32] <- l alpha + the chunk's sum (keys added in order). */
static void panel_softmax(float *s, int64_t n, int64_t lanes, float *m, float *l, float *alpha) {
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), neg_log2e = _mm256_set1_ps(-1.44269504088896341f);
    for (int v = 0; v < lanes; v += 8) {
        __m256 mx = _mm256_loadu_ps(s + v);
        for (int64_t j = 1; j < n; j++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j * MLA_PANEL + v));
        const __m256 m_old = _mm256_loadu_ps(m + v), m_new = _mm256_max_ps(m_old, mx);
        const __m256 neg_mv = _mm256_mul_ps(m_new, neg_log2e); /* -(m log2e), exactly */
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const __m256 e = exp2_256(_mm256_fmadd_ps(_mm256_loadu_ps(s + j * MLA_PANEL + v), log2e, neg_mv));
            _mm256_storeu_ps(s + j * MLA_PANEL + v, e);
            sum = _mm256_add_ps(sum, e);
        }
        float mo[8], mn[8];
        _mm256_storeu_ps(mo, m_old);
        _mm256_storeu_ps(mn, m_new);
        for (int i = 0; i < 8; i++) alpha[v + i] = expf(mo[i] - mn[i]);
        _mm256_storeu_ps(l + v, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(l + v), _mm256_loadu_ps(alpha + v)), sum));
        _mm256_storeu_ps(m + v, m_new);
    }
}

/* o[i][0..R) <- o[i] alpha[i] + sum over keys j < n of p[j][i] rows[j][0..R), for the panel's heads i < nh (o rows
 * os apart): each value's sum a chain of fused multiply-adds over the keys in order from zero, then one product and
 * one sum. Tiles of PV_MH heads x PV_DB values (every head tile of a block of values while its rows are in L1), then
 * tiles of 8 values, then one at a time (fmaf: the same fused operation). */
#ifdef __AVX512F__
#define PV_MH 8  /* heads x 32 values: 16 accumulators */
#define PV_DB 32
static inline void pv_tile(const float *p, const float *const *rows, int64_t n, int64_t d, int64_t hb, int64_t hn,
                           const float *alpha, float *o, int64_t os) {
    __m512 x0[PV_MH], x1[PV_MH];
    for (int i = 0; i < PV_MH; i++) x0[i] = x1[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const __m512 c0 = _mm512_loadu_ps(rows[j] + d), c1 = _mm512_loadu_ps(rows[j] + d + 16);
        const float *pj = p + j * MLA_PANEL + hb;
        for (int i = 0; i < PV_MH; i++) {
            const __m512 w = _mm512_set1_ps(pj[i]);
            x0[i] = _mm512_fmadd_ps(w, c0, x0[i]);
            x1[i] = _mm512_fmadd_ps(w, c1, x1[i]);
        }
    }
    for (int64_t i = 0; i < hn; i++) {
        float *y = o + (hb + i) * os + d;
        const __m512 al = _mm512_set1_ps(alpha[hb + i]);
        _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(y), al), x0[i]));
        _mm512_storeu_ps(y + 16, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(y + 16), al), x1[i]));
    }
}
#else
#define PV_MH 4 /* heads x 24 values: 12 accumulators */
#define PV_DB 24
static inline void pv_tile(const float *p, const float *const *rows, int64_t n, int64_t d, int64_t hb, int64_t hn,
                           const float *alpha, float *o, int64_t os) {
    __m256 x[PV_MH][3];
    for (int i = 0; i < PV_MH; i++) x[i][0] = x[i][1] = x[i][2] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const __m256 c0 = _mm256_loadu_ps(rows[j] + d), c1 = _mm256_loadu_ps(rows[j] + d + 8);
        const __m256 c2 = _mm256_loadu_ps(rows[j] + d + 16);
        const float *pj = p + j * MLA_PANEL + hb;
        for (int i = 0; i < PV_MH; i++) {
            const __m256 w = _mm256_broadcast_ss(pj + i);
            x[i][0] = _mm256_fmadd_ps(w, c0, x[i][0]);
            x[i][1] = _mm256_fmadd_ps(w, c1, x[i][1]);
            x[i][2] = _mm256_fmadd_ps(w, c2, x[i][2]);
        }
    }
    for (int64_t i = 0; i < hn; i++) {
        float *y = o + (hb + i) * os + d;
        const __m256 al = _mm256_set1_ps(alpha[hb + i]);
        for (int v = 0; v < 3; v++)
            _mm256_storeu_ps(y + 8 * v, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(y + 8 * v), al), x[i][v]));
    }
}
#endif

/* pv_tile's chains for 8 values (one 256-bit vector per head) */
static inline void pv_tile8(const float *p, const float *const *rows, int64_t n, int64_t d, int64_t hb, int64_t hn,
                            const float *alpha, float *o, int64_t os) {
    __m256 x[PV_MH];
    for (int i = 0; i < PV_MH; i++) x[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const __m256 c = _mm256_loadu_ps(rows[j] + d);
        for (int i = 0; i < PV_MH; i++) x[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j * MLA_PANEL + hb + i), c, x[i]);
    }
    for (int64_t i = 0; i < hn; i++) {
        float *y = o + (hb + i) * os + d;
        _mm256_storeu_ps(y, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(y), _mm256_set1_ps(alpha[hb + i])), x[i]));
    }
}

static void panel_pv(const float *p, const float *const *rows, int64_t n, int64_t R, const float *alpha, int64_t nh,
                     float *o, int64_t os) {
    int64_t d = 0;
    for (; d + PV_DB <= R; d += PV_DB)
        for (int64_t hb = 0; hb < nh; hb += PV_MH) pv_tile(p, rows, n, d, hb, min64(PV_MH, nh - hb), alpha, o, os);
    for (; d + 8 <= R; d += 8)
        for (int64_t hb = 0; hb < nh; hb += PV_MH) pv_tile8(p, rows, n, d, hb, min64(PV_MH, nh - hb), alpha, o, os);
    for (; d < R; d++)
        for (int64_t i = 0; i < nh; i++) {
            float x = 0.0f;
            for (int64_t j = 0; j < n; j++) x = fmaf(p[j * MLA_PANEL + i], rows[j][d], x);
            float *y = o + i * os + d;
            *y = *y * alpha[i] + x; /* -ffp-contract=off: one product, one sum */
        }
}

/* The split [k0, k1) of sequence s for its query rows t0 .. t0 + nr - 1 and heads h0 .. h0 + nh - 1: every row at or
 * after k0 gets its partial over the keys of the split it sees: m, l [row][panels * 32] (max, sum of exponentials,
 * per head lane) and o (unnormalized output: head i of row r at o + (r nh + i) os, R values); rows before k0 are left
 * alone. qp: the rows' packed queries [nr][panels][W][32]; sbuf [MLA_CHUNK][32], conv [MLA_CHUNK][W] scratch. */
static void mla_split(const mla_t *a, int64_t s, int64_t t0, int64_t nr, int64_t nh, int64_t k0, int64_t k1,
                      const float *qp, float *sbuf, float *conv, float *m, float *l, float *o, int64_t os) {
    const int64_t W = a->width, R = a->rank, panels = panels_of(nh), lanes = panels * MLA_PANEL;
    const int64_t pos0 = first_pos(a, s) + (t0 - a->starts[s]);
    for (int64_t r = 0; r < nr; r++) {
        if (pos0 + r < k0) continue;
        for (int64_t i = 0; i < lanes; i++) m[r * lanes + i] = -INFINITY, l[r * lanes + i] = 0.0f;
        for (int64_t i = 0; i < nh; i++) memset(o + (r * nh + i) * os, 0, sizeof(float) * (size_t)R);
    }
    const int64_t end = min64(k1, pos0 + nr); /* the last row's keys end there */
    const float *rows[MLA_CHUNK];
    float alpha[MLA_PANEL];
    for (int64_t c0 = k0; c0 < end; c0 += MLA_CHUNK) {
        const int64_t n = min64(MLA_CHUNK, end - c0);
        chunk_rows(a, s, c0, n, conv, rows);
        if (c0 + MLA_CHUNK < end && a->cache32) { /* the next chunk's rows on their way */
            const int32_t *table = a->tables + s * a->max_blocks;
            for (int64_t p = c0 + MLA_CHUNK, stop = min64(end, c0 + 2 * MLA_CHUNK); p < stop; p++) {
                const float *row = a->cache32 + ((int64_t)table[p / a->block_size] * a->block_size + p % a->block_size) * W;
                for (int64_t d = 0; d < W; d += 16) _mm_prefetch((const char *)(row + d), _MM_HINT_T1);
            }
        }
        for (int64_t r = 0; r < nr; r++) {
            const int64_t visible = min64(n, pos0 + r + 1 - c0); /* the row's keys in this chunk: at or before it */
            if (visible <= 0) continue;
            for (int64_t pan = 0; pan < panels; pan++) {
                const int64_t lane0 = r * lanes + pan * MLA_PANEL;
                const int64_t heads = min64(MLA_PANEL, nh - pan * MLA_PANEL);
                panel_scores(qp + (r * panels + pan) * W * MLA_PANEL, rows, visible, W, sbuf, heads <= 16);
                panel_softmax(sbuf, visible, (heads + 7) / 8 * 8, m + lane0, l + lane0, alpha);
                panel_pv(sbuf, rows, visible, R, alpha, heads, o + (r * nh + pan * MLA_PANEL) * os, os);
            }
        }
    }
}

/* the per-thread scratch (floats, each part a multiple of 16): packed queries, scores, converted rows, m, l, alpha;
 * then, for the several-rows tasks, each row's split partial o and its running merge O (with M, L) */
typedef struct {
    int64_t qp, sbuf, conv, ml, o;
} mla_scratch;

static inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

static inline int64_t scratch_floats(const mla_scratch *z) {
    return z->qp + z->sbuf + z->conv + 4 * z->ml + 2 * z->o;
}

/* One decode row's task: split `split` of sequence s for heads [h0, h0 + nh), its partials into part (row-major
 * [split][Hq][R + 2]: o, then m and l). */
static void decode_task(const mla_t *a, const mla_task *task, float *part, int64_t part_row, const mla_scratch *z,
                        float *w) {
    const int64_t R = a->rank, H = a->num_heads, s = task->seq, t = a->starts[s], h0 = task->first, nh = task->heads;
    float *qp = w, *sbuf = qp + z->qp, *conv = sbuf + z->sbuf, *m = conv + z->conv, *l = m + z->ml;
    pack_q(a, t, h0, nh, qp);
    float *pt = part + ((part_row + task->part) * H + h0) * (R + 2);
    mla_split(a, s, t, 1, nh, task->part * MLA_SPLIT, (task->part + 1) * MLA_SPLIT, qp, sbuf, conv, m, l, pt, R + 2);
    for (int64_t i = 0; i < nh; i++) pt[i * (R + 2) + R] = m[i], pt[i * (R + 2) + R + 1] = l[i];
}

/* One task of a sequence with several new rows: rows [task->part, + MLA_ROWS) (within the sequence's), one panel of
 * heads; each split in order, merged into the rows' running results as it is done, then normalised into out. */
static void rows_task(const mla_t *a, const mla_task *task, float *out, const mla_scratch *z, float *w) {
    const int64_t W = a->width, R = a->rank, H = a->num_heads, s = task->seq, t0 = task->part;
    const int64_t h0 = task->first, nh = task->heads, nr = min64(MLA_ROWS, a->starts[s + 1] - t0);
    float *qp = w, *sbuf = qp + z->qp, *conv = sbuf + z->sbuf, *m = conv + z->conv, *l = m + z->ml;
    float *M = l + z->ml, *L = M + z->ml, *o = L + z->ml, *O = o + z->o;
    for (int64_t r = 0; r < nr; r++) pack_q(a, t0 + r, h0, nh, qp + r * W * MLA_PANEL);
    const int64_t pos0 = first_pos(a, s) + (t0 - a->starts[s]), splits = (pos0 + nr - 1) / MLA_SPLIT + 1;
    for (int64_t c = 0; c < splits; c++) {
        const int64_t k0 = c * MLA_SPLIT;
        mla_split(a, s, t0, nr, nh, k0, k0 + MLA_SPLIT, qp, sbuf, conv, m, l, o, R);
        for (int64_t r = 0; r < nr; r++) {
            if (pos0 + r < k0) continue; /* (a row sees every split up to its own position's) */
            for (int64_t i = 0; i < nh; i++) {
                const int64_t x = r * MLA_PANEL + i;
                tsterm_att_merge(M + x, L + x, O + (r * nh + i) * R, m[x], l[x], o + (r * nh + i) * R, R, c == 0);
            }
        }
    }
    for (int64_t r = 0; r < nr; r++)
        for (int64_t i = 0; i < nh; i++) {
            const int64_t x = r * MLA_PANEL + i;
            const float inv = tsterm_att_norm(M[x], L[x], NULL), *src = O + (r * nh + i) * R;
            float *dst = out + ((t0 + r) * H + h0 + i) * R;
            for (int64_t d = 0; d < R; d++) dst[d] = src[d] * inv;
        }
}

/* Absorbed MLA attention of every sequence's new rows over its context (read in place from the pool). q_lat [T, Hq,
 * R] and q_rope [T, Hq, DR] float32 with unit last strides (token, head strides given); cache [num_blocks, B, R + DR]
 * contiguous, float32 (cache_bf16 = 0) or bfloat16 (1), already holding the new rows'; block_tables [S, max_blocks]
 * int32; seq_lens [S] (each context, its new rows included); starts [S + 1] (sequence s owns rows starts[s] ..
 * starts[s + 1] - 1, the last positions of its context). out [T, Hq, R] float32: each head's softmax-weighted latents.
 * Returns 0; -1 when scratch memory ran out; -2 for a bad size (heads, rank, RoPE width, block size); -3 for bad
 * metadata (rows not in order, more rows than context, a block table too short or naming a block outside the pool). */
int tsterm_mla_attention(const float *q_lat, int64_t ql_t, int64_t ql_h, const float *q_rope, int64_t qr_t,
                         int64_t qr_h, const void *cache, int64_t cache_bf16, int64_t num_blocks, int64_t block_size,
                         int64_t rank, int64_t rope, const int32_t *block_tables, int64_t max_blocks,
                         const int32_t *seq_lens, const int32_t *starts, int64_t num_seqs, int64_t num_heads,
                         float scale, float *out) {
    if (num_heads < 1 || rank < 1 || rope < 0 || block_size < 1 || num_seqs < 0 || num_blocks < 0 ||
        (cache_bf16 != 0 && cache_bf16 != 1))
        return -2;
    if (num_seqs > 0 && starts[0] != 0) return -3;
    const int64_t threads = omp_get_max_threads(), panels = panels_of(num_heads), W = rank + rope;
    int64_t decode_splits = 0, row_tasks = 0;
    double work = 0.0; /* fused multiply-adds, roughly: a step this small runs on the calling thread */
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t rows = (int64_t)starts[s + 1] - starts[s], len = seq_lens[s], blocks = (len + block_size - 1) / block_size;
        if (rows < 0 || len < rows || blocks > max_blocks) return -3;
        for (int64_t b = 0; b < blocks && rows > 0; b++) {
            const int32_t id = block_tables[s * max_blocks + b];
            if (id < 0 || id >= num_blocks) return -3;
        }
        work += (double)rows * (double)len * (double)num_heads * (double)(W + rank);
        if (rows == 1) decode_splits += (len + MLA_SPLIT - 1) / MLA_SPLIT;
        if (rows > 1) row_tasks += (rows + MLA_ROWS - 1) / MLA_ROWS * panels;
    }
    /* a decode row's heads in groups of whole panels where its splits alone are fewer than twice the threads */
    const int64_t want = decode_splits ? (2 * threads + decode_splits - 1) / decode_splits : 1;
    const int64_t groups0 = want < 1 ? 1 : want > panels ? panels : want;
    const int64_t group_heads = (panels + groups0 - 1) / groups0 * MLA_PANEL;
    const int64_t groups = (num_heads + group_heads - 1) / group_heads, group_panels = group_heads / MLA_PANEL;
    const int64_t tasks = row_tasks + decode_splits * groups;
    if (tasks == 0) return 0;
    mla_scratch z = {round16(group_panels * W * MLA_PANEL), MLA_CHUNK * MLA_PANEL, cache_bf16 ? round16(MLA_CHUNK * W) : 0,
                     round16(group_panels * MLA_PANEL), 0};
    if (row_tasks) {
        z.qp = z.qp > MLA_ROWS * W * MLA_PANEL ? z.qp : round16(MLA_ROWS * W * MLA_PANEL);
        z.ml = z.ml > MLA_ROWS * MLA_PANEL ? z.ml : MLA_ROWS * MLA_PANEL;
        z.o = round16(MLA_ROWS * MLA_PANEL * rank);
    }
    const mla_t a = {q_lat, q_rope, ql_t, ql_h, qr_t, qr_h, cache_bf16 ? NULL : (const float *)cache,
                     cache_bf16 ? (const uint16_t *)cache : NULL, block_size, rank, rope, W, block_tables, max_blocks,
                     seq_lens, starts, num_seqs, num_heads, scale};
    const size_t part_floats = (size_t)round16(decode_splits * num_heads * (rank + 2));
    const size_t bytes = sizeof(float) * (part_floats + (size_t)scratch_floats(&z) * (size_t)threads);
    float *part = aligned_alloc(64, (bytes + 63) / 64 * 64);
    mla_task *list = malloc(sizeof(mla_task) * (size_t)tasks);
    int64_t *part_row = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1)); /* a decode row's first split in part */
    if (!part || !list || !part_row) {
        free(part), free(list), free(part_row);
        return -1;
    }
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; s++) /* the several-rows tasks first: each is longer */
        for (int64_t t = starts[s]; starts[s + 1] - starts[s] > 1 && t < starts[s + 1]; t += MLA_ROWS)
            for (int64_t p = 0; p < panels; p++)
                list[n++] = (mla_task){s, t, p * MLA_PANEL, min64(MLA_PANEL, num_heads - p * MLA_PANEL)};
    for (int64_t s = 0, row = 0; s < num_seqs; s++) {
        part_row[s] = row;
        if (starts[s + 1] - starts[s] != 1) continue;
        const int64_t splits = (seq_lens[s] + MLA_SPLIT - 1) / MLA_SPLIT;
        for (int64_t c = 0; c < splits; c++)
            for (int64_t g = 0; g < groups; g++)
                list[n++] = (mla_task){s, c, g * group_heads, min64(group_heads, num_heads - g * group_heads)};
        row += splits;
    }
    float *scratch = part + part_floats;
#pragma omp parallel if (work >= MLA_PARALLEL_WORK) /* (which thread runs a task changes no bit) */
    {
        float *w = scratch + (size_t)scratch_floats(&z) * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tasks; i++) {
            if (i < row_tasks) rows_task(&a, list + i, out, &z, w);
            else decode_task(&a, list + i, part, part_row[list[i].seq], &z, w);
        }
        /* (the loop's barrier: every split's partial is written) each decode row's splits merged in order */
#pragma omp for schedule(static)
        for (int64_t x = 0; x < num_seqs * num_heads; x++) {
            const int64_t s = x / num_heads, h = x % num_heads;
            if (starts[s + 1] - starts[s] != 1) continue;
            float *dst = out + ((int64_t)starts[s] * num_heads + h) * rank, M = 0.0f, L = 0.0f;
            const int64_t splits = (seq_lens[s] + MLA_SPLIT - 1) / MLA_SPLIT;
            for (int64_t c = 0; c < splits; c++) {
                const float *pt = part + ((part_row[s] + c) * num_heads + h) * (rank + 2);
                tsterm_att_merge(&M, &L, dst, pt[rank], pt[rank + 1], pt, rank, c == 0);
            }
            const float inv = tsterm_att_norm(M, L, NULL);
            for (int64_t d = 0; d < rank; d++) dst[d] *= inv;
        }
    }
    free(part), free(list), free(part_row);
    return 0;
}
