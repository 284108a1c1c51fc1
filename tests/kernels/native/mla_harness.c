/* A command-line driver of csrc/mla.c (linked with it alone) for tests/kernels/test_cpu_mla.py, which cross-compiles
 * it for aarch64 (csrc/neon/ on the include path) and runs it under qemu-aarch64, and builds it for x86 too.
 *
 *   mla_harness T HQ R DR BS NB S MAXB BF16
 *     stdin: q_lat f32 [T, HQ, R], q_rope f32 [T, HQ, DR], the pool [NB, BS, R + DR] (f32, or bf16 bits when BF16 is
 *     1), block tables i32 [S, MAXB], seq_lens i32 [S], starts i32 [S + 1], scale f32
 *     stdout (f32): tsterm_mla_attention's out [T, HQ, R]
 *
 * Exit status 2 with a message on stderr for bad arguments or short input; 3 when the kernel reports an error. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int tsterm_mla_attention(const float *q_lat, int64_t ql_t, int64_t ql_h, const float *q_rope, int64_t qr_t,
                         int64_t qr_h, const void *cache, int64_t cache_bf16, int64_t num_blocks, int64_t block_size,
                         int64_t rank, int64_t rope, const int32_t *block_tables, int64_t max_blocks,
                         const int32_t *seq_lens, const int32_t *starts, int64_t num_seqs, int64_t num_heads,
                         float scale, float *out);

static void *read_all(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, stdin) != bytes) {
        fprintf(stderr, "short input (%zu bytes expected)\n", bytes);
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: mla_harness T HQ R DR BS NB S MAXB BF16\n");
        return 2;
    }
    int64_t v[9];
    for (int i = 0; i < 9; i++) v[i] = atoll(argv[i + 1]);
    const int64_t T = v[0], H = v[1], R = v[2], DR = v[3], B = v[4], NB = v[5], S = v[6], MAXB = v[7], bf16 = v[8];
    float *q_lat = read_all(sizeof(float) * (size_t)(T * H * R)), *q_rope = read_all(sizeof(float) * (size_t)(T * H * DR));
    void *cache = read_all((bf16 ? 2 : 4) * (size_t)(NB * B * (R + DR)));
    int32_t *tables = read_all(sizeof(int32_t) * (size_t)(S * MAXB)), *lens = read_all(sizeof(int32_t) * (size_t)S);
    int32_t *starts = read_all(sizeof(int32_t) * (size_t)(S + 1));
    float *scale = read_all(sizeof(float)), *out = malloc(sizeof(float) * (size_t)(T * H * R + 1));
    const int rc = tsterm_mla_attention(q_lat, H * R, R, q_rope, H * DR, DR, cache, bf16, NB, B, R, DR, tables, MAXB,
                                        lens, starts, S, H, *scale, out);
    if (rc != 0) {
        fprintf(stderr, "tsterm_mla_attention: %d\n", rc);
        return 3;
    }
    fwrite(out, sizeof(float), (size_t)(T * H * R), stdout);
    return 0;
}
