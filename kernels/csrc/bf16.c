/* bfloat16 linears on the CPU: y[M, N] = x[M, K] @ w[N, K]^T, x rounded to bfloat16, w bfloat16, float32 sums.
 *
 * Three arithmetics, one per instruction set; a process uses one of them for a shape class, for every row count:
 *
 * - isa 2, AMX (tdpbf16ps): the weight is the tiles' A operand as it lies in memory (16 rows of w, 32 inputs: a
 *   row-major bfloat16 [N, K] tensor is already in that layout, so nothing is packed at load), x is the B operand,
 *   rounded to bfloat16 into the pair-interleaved layout B tiles want (rows of input pairs, one column per row of x,
 *   zero-padded to whole 16-row tiles). A tile of the result is 16 outputs by 16 rows of x, transposed into y.
 * - isa 1, AVX512-BF16 (vdpbf16ps): 16 lanes of pair sums per output over 32 inputs at a time, then one fixed
 *   reduction of the lanes.
 * - isa 0, plain C: 16 lanes of float32 products and sums (no FMA: -ffp-contract=off), then a fixed pairwise
 *   reduction; any CPU (the compiler vectorises the lanes).
 *
 * Why a row's result is the same bits whatever rows are beside it: each output y[m][n] is accumulated from zero over
 * the inputs in one fixed order (32 at a time, ascending; the tail zero-padded), from row m of x and row n of w
 * alone, by the same instructions; which tile, block or thread holds it, how many rows of x there are and how the
 * work is split over threads change nothing in that sequence (a zero row of padding adds nothing to another row's
 * sums: every output is its own). So one row alone, with 1,000 others, in a prefill chunk cut anywhere, gives the
 * same y. Different instruction sets round differently (AMX flushes denormals, the lanes sum in another order): a
 * shape class runs one of them (tsterm_kernels.cpu_select), and another machine may give other bits.
 *
 * AMX needs the OS's permission for the tile state (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
 * tsterm_bf16_isa() asks for it and reports AMX only where it is granted.
 *
 * The work is in two pieces the decode stack (stack.c) calls inside its own parallel region: tsterm_bf16_pack (x into
 * the form an instruction set reads) and tsterm_bf16_rows (a range of outputs over every row); tsterm_bf16_gemm is
 * the two in a parallel region of its own, so both give a row the same bits. */
#include "tsterm.h"

#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define BF16_AMX 2
#define BF16_AVX512 1
#define BF16_PLAIN 0

#define bf16_round tsterm_bf16_round /* (tsterm.h: round to nearest even, torch's .to(torch.bfloat16)) */
#define bf16_float tsterm_bf16_float

/* row m of x as bfloat16 bits: x is float32 (rounded here) or already bfloat16 */
static inline uint16_t x_at(const void *x, int64_t x_bf16, int64_t ldx, int64_t m, int64_t k) {
    return x_bf16 ? ((const uint16_t *)x)[m * ldx + k] : bf16_round(((const float *)x)[m * ldx + k]);
}

static int64_t round_up(int64_t n, int64_t unit) { return (n + unit - 1) / unit * unit; }

#if TSTERM_AMX
#define HAVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted(void) {
    /* asking again where it is granted is harmless; a refusal (old kernel, seccomp) means tile ops would fault */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* A 16 x 32 bfloat16 block of w (rows n0.., inputs k0..): in place where whole, else copied into `pad` with zeros
 * outside w. Sets *stride to the bytes between its rows. */
static inline const uint16_t *amx_a_block(const uint16_t *w, int64_t n_f, int64_t k_f, int64_t n0, int64_t k0,
                                          uint16_t *pad, int64_t *stride) {
    if (n0 + 16 <= n_f && k0 + 32 <= k_f) {
        *stride = k_f * 2;
        return w + n0 * k_f + k0;
    }
    memset(pad, 0, 16 * 32 * 2);
    for (int64_t i = 0; i < 16 && n0 + i < n_f; i++)
        for (int64_t k = 0; k < 32 && k0 + k < k_f; k++)
            pad[i * 32 + k] = w[(n0 + i) * k_f + k0 + k];
    *stride = 64;
    return pad;
}

/* y[m0 .. m0 + 16) x [n0 .. n0 + 16) from a C tile (rows: outputs, columns: rows of x), bounded by m_f, n_f: the
 * 16 x 16 block transposed in registers (tsterm_transpose16), then each row of y written at once */
static inline void amx_store(const float *c, float *y, int64_t ldy, int64_t m_f, int64_t n_f, int64_t m0, int64_t n0) {
    __m512 r[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_loadu_ps(c + 16 * i);
    tsterm_transpose16(r);
    const __mmask16 keep = n0 + 16 <= n_f ? (__mmask16)0xffff : (__mmask16)((1u << (n_f - n0)) - 1u);
    for (int64_t j = 0; j < 16 && m0 + j < m_f; j++)
        _mm512_mask_storeu_ps(y + (m0 + j) * ldy + n0, keep, r[j]);
}

/* x's 16-row tile mt as B tiles want it: rows of input pairs (kp / 2 of them), one column per row of x, zero past m_f
 * rows and k_f inputs */
static void amx_pack_tile(const void *x, int64_t x_bf16, int64_t ldx, int64_t m_f, int64_t k_f, int64_t mt,
                          uint32_t *xp) {
    const int64_t kp = round_up(k_f, 32);
    uint32_t *tile = xp + mt * (kp / 2) * 16;
    for (int64_t kk = 0; kk < kp / 2; kk++)
        for (int64_t j = 0; j < 16; j++) {
            const int64_t m = mt * 16 + j, k = 2 * kk;
            uint32_t lo = 0, hi = 0;
            if (m < m_f) {
                lo = k < k_f ? x_at(x, x_bf16, ldx, m, k) : 0;
                hi = k + 1 < k_f ? x_at(x, x_bf16, ldx, m, k + 1) : 0;
            }
            tile[kk * 16 + j] = lo | hi << 16;
        }
}

/* outputs [first, last) (first a multiple of 32) of every row of y from the packed tiles xp, this thread alone */
static void amx_rows(const uint32_t *xp, int64_t m_f, int64_t k_f, const uint16_t *w, int64_t first, int64_t last,
                     int64_t n_f, float *y, int64_t ldy) {
    const int64_t kp = round_up(k_f, 32), m_tiles = (m_f + 15) / 16;
    tsterm_amx_config(8); /* tmm0-3: C (16 outputs x 16 rows, float32); tmm4-5: w; tmm6-7: x pairs */
    uint16_t pad0[16 * 32], pad1[16 * 32];
    float c[16 * 16];
    for (int64_t n0 = first; n0 < last; n0 += 32) { /* pairs of output tiles */
        const int64_t two_n = n0 + 16 < last;
        for (int64_t m0 = 0; m0 < m_tiles * 16; m0 += 32) {
            const int two_m = m0 + 16 < m_f;
            const uint32_t *b0 = xp + (m0 / 16) * (kp / 2) * 16, *b1 = b0 + (kp / 2) * 16;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k0 = 0; k0 < kp; k0 += 32) {
                int64_t s0, s1;
                const uint16_t *a0 = amx_a_block(w, n_f, k_f, n0, k0, pad0, &s0);
                _tile_loadd(4, a0, s0);
                _tile_loadd(6, b0 + (k0 / 2) * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two_m) {
                    _tile_loadd(7, b1 + (k0 / 2) * 16, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_n) {
                    const uint16_t *a1 = amx_a_block(w, n_f, k_f, n0 + 16, k0, pad1, &s1);
                    _tile_loadd(5, a1, s1);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_m)
                        _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c, 64);
            amx_store(c, y, ldy, m_f, last, m0, n0);
            if (two_m) {
                _tile_stored(1, c, 64);
                amx_store(c, y, ldy, m_f, last, m0 + 16, n0);
            }
            if (two_n) {
                _tile_stored(2, c, 64);
                amx_store(c, y, ldy, m_f, last, m0, n0 + 16);
                if (two_m) {
                    _tile_stored(3, c, 64);
                    amx_store(c, y, ldy, m_f, last, m0 + 16, n0 + 16);
                }
            }
        }
    }
    _tile_release();
}
#else
#define HAVE_AMX 0
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512BF16 1
/* Outputs [n0, n0 + nn) x rows [m0, m0 + mm) of y (nn, mm <= 4): one accumulator of 16 lanes each, over the inputs
 * 32 at a time, then one reduction. Inlined with constant nn = mm = 4 for whole blocks (the accumulators stay in
 * registers), with the tails' sizes otherwise: the same instructions for each output either way. */
static inline __attribute__((always_inline)) void avx512bf16_block(const uint16_t *xb, int64_t kp, int64_t k_f,
                                                                   const uint16_t *w, float *y, int64_t ldy,
                                                                   int64_t n0, int64_t m0, int nn, int mm) {
    const __mmask32 tail = k_f % 32 ? (__mmask32)((1u << (k_f % 32)) - 1u) : (__mmask32)0xffffffffu;
    __m512 acc[4][4];
    for (int i = 0; i < nn; i++)
        for (int j = 0; j < mm; j++)
            acc[i][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < kp; k0 += 32) {
        const __mmask32 mask = k0 + 32 <= k_f ? (__mmask32)0xffffffffu : tail;
        __m512bh xv[4];
        for (int j = 0; j < mm; j++)
            xv[j] = (__m512bh)_mm512_loadu_si512(xb + (m0 + j) * kp + k0);
        for (int i = 0; i < nn; i++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + i) * k_f + k0);
            for (int j = 0; j < mm; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
        }
    }
    for (int j = 0; j < mm; j++)
        for (int i = 0; i < nn; i++)
            y[(m0 + j) * ldy + n0 + i] = _mm512_reduce_add_ps(acc[i][j]);
}

/* outputs [first, last) of every row of y; xb: [m_f, kp] bfloat16 rows, zero-padded to kp (whole 32s) */
static void avx512bf16_rows(const uint16_t *xb, int64_t m_f, int64_t k_f, const uint16_t *w, int64_t first,
                            int64_t last, float *y, int64_t ldy) {
    const int64_t kp = round_up(k_f, 32);
    for (int64_t n0 = first; n0 < last; n0 += 4) {
        const int nn = last - n0 < 4 ? (int)(last - n0) : 4;
        for (int64_t m0 = 0; m0 < m_f; m0 += 4) {
            const int mm = m_f - m0 < 4 ? (int)(m_f - m0) : 4;
            if (nn == 4 && mm == 4)
                avx512bf16_block(xb, kp, k_f, w, y, ldy, n0, m0, 4, 4);
            else if (nn == 4 && mm == 1)  /* one row of x: a decode step */
                avx512bf16_block(xb, kp, k_f, w, y, ldy, n0, m0, 4, 1);
            else
                avx512bf16_block(xb, kp, k_f, w, y, ldy, n0, m0, nn, mm);
        }
    }
}
#else
#define HAVE_AVX512BF16 0
#endif

/* outputs [first, last) of every row of y; xf: [m_f, kp] float32 (the bfloat16-rounded inputs), zero-padded to kp
 * (whole 16s) */
static void plain_rows(const float *xf, int64_t m_f, int64_t k_f, const uint16_t *w, int64_t first, int64_t last,
                       float *y, int64_t ldy) {
    const int64_t kp = round_up(k_f, 16);
    float wf[16];
    for (int64_t n = first; n < last; n++) {
        for (int64_t m = 0; m < m_f; m++) {
            const float *xr = xf + m * kp;
            float acc[16] = {0};
            for (int64_t k0 = 0; k0 < kp; k0 += 16) {
                for (int j = 0; j < 16; j++)
                    wf[j] = k0 + j < k_f ? bf16_float(w[n * k_f + k0 + j]) : 0.0f;
                for (int j = 0; j < 16; j++)
                    acc[j] += xr[k0 + j] * wf[j];
            }
            for (int width = 8; width >= 1; width /= 2) /* 16 lanes -> 1, pairwise, in a fixed order */
                for (int j = 0; j < width; j++)
                    acc[j] += acc[j + width];
            y[m * ldy + n] = acc[0];
        }
    }
}

/* Bits: 1 = AVX512-BF16 code built, 2 = AMX code built and the tile state granted by the OS. */
int tsterm_bf16_isa(void) {
    int isa = 0;
#if HAVE_AVX512BF16
    isa |= 1;
#endif
#if HAVE_AMX
    if (amx_granted())
        isa |= 2;
#endif
    return isa;
}

size_t tsterm_bf16_packed_bytes(int64_t isa, int64_t rows, int64_t in_f) {
    if (isa == BF16_AMX) return (size_t)(round_up(rows, 16) * round_up(in_f, 32) * 2);
    if (isa == BF16_AVX512) return (size_t)(rows * round_up(in_f, 32) * 2);
    return (size_t)(rows * round_up(in_f, 16) * 4);
}

/* the pack's units: 16-row tiles (AMX) or rows */
static int64_t pack_units(int64_t isa, int64_t rows) { return isa == BF16_AMX ? (rows + 15) / 16 : rows; }

/* units [first, last) of x's packed form (x float32, rounded here, or bfloat16 bits: x_bf16) */
static void pack_units_range(int64_t isa, const void *x, int64_t x_bf16, int64_t ldx, int64_t rows, int64_t in_f,
                             int64_t first, int64_t last, void *packed) {
    for (int64_t u = first; u < last; u++) {
        if (isa == BF16_AMX) {
#if HAVE_AMX
            amx_pack_tile(x, x_bf16, ldx, rows, in_f, u, packed);
#endif
        } else if (isa == BF16_AVX512) {
            const int64_t kp = round_up(in_f, 32);
            uint16_t *xb = (uint16_t *)packed + u * kp;
            for (int64_t k = 0; k < kp; k++) xb[k] = k < in_f ? x_at(x, x_bf16, ldx, u, k) : 0;
        } else {
            const int64_t kp = round_up(in_f, 16);
            float *xf = (float *)packed + u * kp;
            for (int64_t k = 0; k < kp; k++) xf[k] = k < in_f ? bf16_float(x_at(x, x_bf16, ldx, u, k)) : 0.0f;
        }
    }
}

void tsterm_bf16_pack(int64_t isa, const float *x, int64_t ldx, int64_t rows, int64_t in_f, void *packed) {
    pack_units_range(isa, x, 0, ldx, rows, in_f, 0, pack_units(isa, rows), packed);
}

void tsterm_bf16_rows(int64_t isa, const void *packed, int64_t rows, int64_t in_f, const uint16_t *w, int64_t first,
                      int64_t last, int64_t out_f, float *y, int64_t ldy) {
    if (first >= last || rows <= 0) return;
    if (isa == BF16_AMX) {
#if HAVE_AMX
        amx_rows(packed, rows, in_f, w, first, last, out_f, y, ldy);
#endif
    } else if (isa == BF16_AVX512) {
#if HAVE_AVX512BF16
        avx512bf16_rows(packed, rows, in_f, w, first, last, y, ldy);
#endif
    } else {
        plain_rows(packed, rows, in_f, w, first, last, y, ldy);
    }
    (void)out_f;
}

/* y[m * ldy + n] = sum_k bf16(x[m][k]) * w[n][k] (float32 sums), m < rows, n < out_f. x: float32 (x_bf16 = 0,
 * rounded to bfloat16 here) or bfloat16 bits (x_bf16 = 1), rows ldx elements apart; w: [out_f, in_f] bfloat16,
 * contiguous. isa: 2 AMX, 1 AVX512-BF16, 0 plain. Returns 0; -1 out of memory; -2 the isa is not available. */
int tsterm_bf16_gemm(const void *x, int64_t x_bf16, int64_t ldx, int64_t rows, int64_t in_f, const uint16_t *w,
                     int64_t out_f, float *y, int64_t ldy, int64_t isa) {
    if (rows <= 0 || out_f <= 0)
        return 0;
    if (isa == BF16_AMX) {
#if HAVE_AMX
        if (!amx_granted())
            return -2;
#else
        return -2;
#endif
    } else if (isa == BF16_AVX512) {
        if (!HAVE_AVX512BF16)
            return -2;
    } else if (isa != BF16_PLAIN) {
        return -2;
    }
    void *packed = aligned_alloc(64, (tsterm_bf16_packed_bytes(isa, rows, in_f) + 63) / 64 * 64);
    if (packed == NULL)
        return -1;
    const int64_t units = pack_units(isa, rows), unit = isa == BF16_AMX ? 32 : isa == BF16_AVX512 ? 4 : 1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) pack_units_range(isa, x, x_bf16, ldx, rows, in_f, u, u + 1, packed);
        /* (the loop's barrier: every row of x is packed) */
        int64_t first, last;
        tsterm_thread_share(out_f, unit, &first, &last);
        tsterm_bf16_rows(isa, packed, rows, in_f, w, first, last, out_f, y, ldy);
    }
    free(packed);
    return 0;
}
