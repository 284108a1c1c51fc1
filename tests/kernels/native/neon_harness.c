/* A command-line driver of tsterm's CPU kernels (kernels/csrc, linked in whole) for tests/kernels/test_neon_kernels.py,
 * which cross-compiles it for aarch64 and runs it under qemu-aarch64 (the NEON code, checked on an x86 machine).
 *
 *   neon_harness isa                      prints tsterm_isa() (bit 2: NEON, bit 3: sdot)
 *   neon_harness q4 ROWS IN OUT           stdin: x f32 [ROWS, IN], codes u8 [OUT, IN/2], scales fp16 [OUT, IN/32, 2]
 *   neon_harness q8 ROWS IN OUT           stdin: x f32 [ROWS, IN], codes s8 [OUT, IN], scales fp16 [OUT, IN/32]
 *     stdout (f32): the row matmul of all rows, then of each row alone; tsterm_q_gemm of all rows, then of each row
 *     alone; the dequantized weight [OUT, IN]; tsterm_f32_gemm of all rows with that weight
 *   neon_harness mx4 ROWS IN OUT          stdin: x f32 [ROWS, IN], codes u8 [OUT, IN/2], scales e8m0 [OUT, IN/32]
 *     stdout (f32): tsterm_mxfp4_matmul of all rows, then of each row alone; tsterm_mxfp4_dequantize's weight
 *   neon_harness f32 ROWS IN OUT          stdin: x f32 [ROWS, IN], w f32 [OUT, IN]
 *     stdout (f32): tsterm_f32_matmul (the few-rows path) of all rows, then of each row alone; tsterm_f32_gemm of all
 *     rows, then of each row alone
 *   neon_harness ops ROWS N               stdin: g, u, x, residual f32 [ROWS, N] each, weight f32 [N]
 *     stdout (f32): tsterm_swiglu of [g | u] rows, then tsterm_add_rms_norm's out and residual (eps 1e-6)
 *   neon_harness attn S HQ HKV D BS LEN   stdin: q f32 [LEN, HQ, D], k, v f32 [LEN, HKV, D] (one sequence; the
 *     blocks of its table in reverse order): stdout (f32): tsterm_prefill_attention of its LEN rows, then
 *     tsterm_decode_attention of S sequences that share those blocks, with lengths LEN, LEN - 1, ... (row of query
 *     LEN - 1 - s for sequence s), scale 1 / sqrt(D)
 *
 * Exit status 2 with a message on stderr for bad arguments or short input; 3 when a kernel reports an error. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int tsterm_isa(void);
int tsterm_q4_matmul(const float *x, int64_t rows, int64_t in_f, const uint8_t *codes, const uint16_t *scales,
                     int64_t out_f, float *y);
int tsterm_q8_matmul(const float *x, int64_t rows, int64_t in_f, const int8_t *codes, const uint16_t *scales,
                     int64_t out_f, float *y);
void tsterm_q4_dequantize(const uint8_t *codes, const uint16_t *scales, int64_t out_f, int64_t in_f, float *w);
void tsterm_q8_dequantize(const int8_t *codes, const uint16_t *scales, int64_t out_f, int64_t in_f, float *w);
void tsterm_q_gemm(const float *x, int64_t ldx, int64_t rows, int64_t in_f, int kind, const void *codes,
                   const uint16_t *scales, int64_t out_f, float *y);
int tsterm_mxfp4_matmul(const float *x, int64_t rows, int64_t in_f, const uint8_t *codes, const uint8_t *scales,
                        int64_t out_f, float *y);
void tsterm_mxfp4_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t out_f, int64_t in_f, float *w);
void tsterm_f32_matmul(const float *x, int64_t rows, int64_t in_f, const float *w, int64_t out_f, float *y);
void tsterm_f32_gemm(const float *x, int64_t ldx, int64_t rows, int64_t in_f, const float *w, int64_t out_f,
                     float *y);
void tsterm_swiglu(const float *h, int64_t rows, int64_t inter, float *out);
void tsterm_add_rms_norm(const float *x, float *residual, const float *weight, int64_t rows, int64_t hidden, float eps,
                         float *out);
int tsterm_prefill_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                             const int32_t *block_table, int64_t seq_len, int64_t num_q, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                             int64_t out_stride);
int tsterm_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                            float *out);

static void fail(const char *what) {
    fprintf(stderr, "neon_harness: %s\n", what);
    exit(2);
}

static void *read_exact(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) fail("out of memory");
    if (fread(p, 1, bytes, stdin) != bytes) fail("short input on stdin");
    return p;
}

static float *alloc_f32(int64_t n) {
    float *p = calloc((size_t)(n ? n : 1), sizeof(float));
    if (!p) fail("out of memory");
    return p;
}

static void emit(const float *p, int64_t n) {
    if (fwrite(p, sizeof(float), (size_t)n, stdout) != (size_t)n) fail("short write on stdout");
}

static int64_t arg(char **argv, int i) {
    char *end;
    const long long v = strtoll(argv[i], &end, 10);
    if (*end || v <= 0) fail("sizes must be positive integers");
    return (int64_t)v;
}

static void quant(int q4, int64_t rows, int64_t in_f, int64_t out_f) {
    if (in_f % 32) fail("IN must be a multiple of 32");
    const int64_t nb = in_f / 32;
    float *x = read_exact(sizeof(float) * (size_t)(rows * in_f));
    void *codes = read_exact((size_t)(q4 ? out_f * in_f / 2 : out_f * in_f));
    uint16_t *scales = read_exact(sizeof(uint16_t) * (size_t)(out_f * nb * (q4 ? 2 : 1)));
    float *y = alloc_f32(rows * out_f), *w = alloc_f32(out_f * in_f);
    int rc = q4 ? tsterm_q4_matmul(x, rows, in_f, codes, scales, out_f, y)
                : tsterm_q8_matmul(x, rows, in_f, codes, scales, out_f, y);
    emit(y, rows * out_f);
    for (int64_t r = 0; r < rows; r++)
        rc |= q4 ? tsterm_q4_matmul(x + r * in_f, 1, in_f, codes, scales, out_f, y + r * out_f)
                 : tsterm_q8_matmul(x + r * in_f, 1, in_f, codes, scales, out_f, y + r * out_f);
    if (rc) exit(3);
    emit(y, rows * out_f);
    const int kind = q4 ? 2 : 1; /* tsterm.h's TSTERM_Q4, TSTERM_Q8 */
    tsterm_q_gemm(x, in_f, rows, in_f, kind, codes, scales, out_f, y);
    emit(y, rows * out_f);
    for (int64_t r = 0; r < rows; r++)
        tsterm_q_gemm(x + r * in_f, in_f, 1, in_f, kind, codes, scales, out_f, y + r * out_f);
    emit(y, rows * out_f);
    if (q4)
        tsterm_q4_dequantize(codes, scales, out_f, in_f, w);
    else
        tsterm_q8_dequantize(codes, scales, out_f, in_f, w);
    emit(w, out_f * in_f);
    tsterm_f32_gemm(x, in_f, rows, in_f, w, out_f, y);
    emit(y, rows * out_f);
}

static void mx4(int64_t rows, int64_t in_f, int64_t out_f) {
    if (in_f % 32) fail("IN must be a multiple of 32");
    float *x = read_exact(sizeof(float) * (size_t)(rows * in_f));
    uint8_t *codes = read_exact((size_t)(out_f * in_f / 2)), *scales = read_exact((size_t)(out_f * in_f / 32));
    float *y = alloc_f32(rows * out_f), *w = alloc_f32(out_f * in_f);
    int rc = tsterm_mxfp4_matmul(x, rows, in_f, codes, scales, out_f, y);
    emit(y, rows * out_f);
    for (int64_t r = 0; r < rows; r++) rc |= tsterm_mxfp4_matmul(x + r * in_f, 1, in_f, codes, scales, out_f, y + r * out_f);
    if (rc) exit(3);
    emit(y, rows * out_f);
    tsterm_mxfp4_dequantize(codes, scales, out_f, in_f, w);
    emit(w, out_f * in_f);
}

static void f32(int64_t rows, int64_t in_f, int64_t out_f) {
    float *x = read_exact(sizeof(float) * (size_t)(rows * in_f));
    float *w = read_exact(sizeof(float) * (size_t)(out_f * in_f));
    float *y = alloc_f32(rows * out_f);
    tsterm_f32_matmul(x, rows, in_f, w, out_f, y);
    emit(y, rows * out_f);
    for (int64_t r = 0; r < rows; r++) tsterm_f32_matmul(x + r * in_f, 1, in_f, w, out_f, y + r * out_f);
    emit(y, rows * out_f);
    tsterm_f32_gemm(x, in_f, rows, in_f, w, out_f, y);
    emit(y, rows * out_f);
    for (int64_t r = 0; r < rows; r++) tsterm_f32_gemm(x + r * in_f, in_f, 1, in_f, w, out_f, y + r * out_f);
    emit(y, rows * out_f);
}

static void ops(int64_t rows, int64_t n) {
    float *g = read_exact(sizeof(float) * (size_t)(rows * n)), *u = read_exact(sizeof(float) * (size_t)(rows * n));
    float *x = read_exact(sizeof(float) * (size_t)(rows * n)), *res = read_exact(sizeof(float) * (size_t)(rows * n));
    float *weight = read_exact(sizeof(float) * (size_t)n);
    float *h = alloc_f32(rows * 2 * n), *out = alloc_f32(rows * n);
    for (int64_t r = 0; r < rows; r++) {
        memcpy(h + r * 2 * n, g + r * n, sizeof(float) * (size_t)n);
        memcpy(h + r * 2 * n + n, u + r * n, sizeof(float) * (size_t)n);
    }
    tsterm_swiglu(h, rows, n, out);
    emit(out, rows * n);
    tsterm_add_rms_norm(x, res, weight, rows, n, 1e-6f, out);
    emit(out, rows * n);
    emit(res, rows * n);
}

static void attn(int64_t seqs, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t len) {
    if (seqs > len) fail("S must be at most LEN");
    const int64_t blocks = (len + bs - 1) / bs, row = hkv * d;
    float *q = read_exact(sizeof(float) * (size_t)(len * hq * d));
    float *k = read_exact(sizeof(float) * (size_t)(len * row)), *v = read_exact(sizeof(float) * (size_t)(len * row));
    float *kc = alloc_f32(blocks * bs * row), *vc = alloc_f32(blocks * bs * row), *out = alloc_f32(len * hq * d);
    int32_t *table = malloc(sizeof(int32_t) * (size_t)(blocks * seqs)), *lens = malloc(sizeof(int32_t) * (size_t)seqs);
    if (!table || !lens) fail("out of memory");
    for (int64_t b = 0; b < blocks; b++) table[b] = (int32_t)(blocks - 1 - b); /* pool blocks in reverse order */
    for (int64_t p = 0; p < len; p++) {
        const int64_t slot = (int64_t)table[p / bs] * bs + p % bs;
        memcpy(kc + slot * row, k + p * row, sizeof(float) * (size_t)row);
        memcpy(vc + slot * row, v + p * row, sizeof(float) * (size_t)row);
    }
    const float scale = 1.0f / sqrtf((float)d);
    if (tsterm_prefill_attention(q, hq * d, kc, vc, table, len, len, hq, hkv, d, bs, scale, out, hq * d)) exit(3);
    emit(out, len * hq * d);
    float *qd = alloc_f32(seqs * hq * d);
    for (int64_t s = 0; s < seqs; s++) {
        memcpy(table + s * blocks, table, sizeof(int32_t) * (size_t)blocks);
        lens[s] = (int32_t)(len - s);
        memcpy(qd + s * hq * d, q + (len - 1 - s) * hq * d, sizeof(float) * (size_t)(hq * d));
    }
    if (tsterm_decode_attention(qd, hq * d, kc, vc, table, blocks, lens, seqs, hq, hkv, d, bs, scale, out)) exit(3);
    emit(out, seqs * hq * d);
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: neon_harness isa | q4 | q8 | mx4 | f32 ROWS IN OUT | ops ROWS N | attn S HQ HKV D BS LEN");
    const char *op = argv[1];
    if (!strcmp(op, "isa")) {
        printf("%d\n", tsterm_isa());
    } else if ((!strcmp(op, "q4") || !strcmp(op, "q8") || !strcmp(op, "f32") || !strcmp(op, "mx4")) && argc == 5) {
        const int64_t rows = arg(argv, 2), in_f = arg(argv, 3), out_f = arg(argv, 4);
        if (!strcmp(op, "f32"))
            f32(rows, in_f, out_f);
        else if (!strcmp(op, "mx4"))
            mx4(rows, in_f, out_f);
        else
            quant(!strcmp(op, "q4"), rows, in_f, out_f);
    } else if (!strcmp(op, "ops") && argc == 4) {
        ops(arg(argv, 2), arg(argv, 3));
    } else if (!strcmp(op, "attn") && argc == 8) {
        attn(arg(argv, 2), arg(argv, 3), arg(argv, 4), arg(argv, 5), arg(argv, 6), arg(argv, 7));
    } else {
        fail("unknown operation or wrong number of sizes");
    }
    return fflush(stdout) ? 2 : 0;
}
