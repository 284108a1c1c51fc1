/* The part of <immintrin.h> that the C kernels' shared code uses (attention.c, decode.c, prefill.c, moe.c, the
 * 256-bit code of mxfp4.c and tsterm.h's helpers), for aarch64: cpu_native.py puts this folder on the include path
 * there, so those files build unchanged (x86-64 builds never see it). The hot kernels have their own NEON code
 * (gemv.c, gemm.c, tsterm.h's aarch64 blocks); this is for the rest.
 *
 * Each operation is x86's, lane for lane: __m256 is two NEON registers (lanes 0-3, 4-7), every sum, product and
 * fused multiply-add rounds once as the AVX instruction does, the horizontal adds pair the lanes AVX pairs, max keeps
 * x86's answer for NaN and signed zeros (the second operand unless the first is greater). So code written for AVX
 * gives the same bits here as on x86 (tests/kernels/test_neon_kernels.py runs it under qemu against the x86 build).
 * Only the intrinsics the sources use are here: a new one fails to compile on aarch64 until it is added. */
#pragma once
#if !defined(__aarch64__)
#error "kernels/csrc/neon/immintrin.h is the aarch64 stand-in for the x86 header; it is not for this target"
#endif
#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float32x4_t lo, hi; /* lanes 0-3, 4-7 */
} __m256;

#define TSTERM_NEON_INLINE static inline __attribute__((always_inline))

TSTERM_NEON_INLINE __m256 tsterm_m256(float32x4_t lo, float32x4_t hi) {
    __m256 r = {lo, hi};
    return r;
}

TSTERM_NEON_INLINE __m256 _mm256_setzero_ps(void) { return tsterm_m256(vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)); }
TSTERM_NEON_INLINE __m256 _mm256_set1_ps(float v) { return tsterm_m256(vdupq_n_f32(v), vdupq_n_f32(v)); }
TSTERM_NEON_INLINE __m256 _mm256_broadcast_ss(const float *p) { return _mm256_set1_ps(*p); }
TSTERM_NEON_INLINE __m256 _mm256_loadu_ps(const float *p) { return tsterm_m256(vld1q_f32(p), vld1q_f32(p + 4)); }
TSTERM_NEON_INLINE __m256 _mm256_load_ps(const float *p) { return _mm256_loadu_ps(p); }
TSTERM_NEON_INLINE void _mm256_storeu_ps(float *p, __m256 v) {
    vst1q_f32(p, v.lo);
    vst1q_f32(p + 4, v.hi);
}
TSTERM_NEON_INLINE void _mm256_store_ps(float *p, __m256 v) { _mm256_storeu_ps(p, v); }

TSTERM_NEON_INLINE __m256 _mm256_add_ps(__m256 a, __m256 b) {
    return tsterm_m256(vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi));
}
TSTERM_NEON_INLINE __m256 _mm256_sub_ps(__m256 a, __m256 b) {
    return tsterm_m256(vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi));
}
TSTERM_NEON_INLINE __m256 _mm256_mul_ps(__m256 a, __m256 b) {
    return tsterm_m256(vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi));
}
TSTERM_NEON_INLINE __m256 _mm256_div_ps(__m256 a, __m256 b) {
    return tsterm_m256(vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi));
}
/* a * b + c, one rounding (vfmaq_f32(c, a, b) is c + a * b fused) */
TSTERM_NEON_INLINE __m256 _mm256_fmadd_ps(__m256 a, __m256 b, __m256 c) {
    return tsterm_m256(vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi));
}
/* x86 maxps: a > b ? a : b (b when either is NaN, and for equal zeros of either sign) */
TSTERM_NEON_INLINE float32x4_t tsterm_max_x86(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
TSTERM_NEON_INLINE __m256 _mm256_max_ps(__m256 a, __m256 b) {
    return tsterm_m256(tsterm_max_x86(a.lo, b.lo), tsterm_max_x86(a.hi, b.hi));
}
TSTERM_NEON_INLINE __m256 _mm256_or_ps(__m256 a, __m256 b) {
    return tsterm_m256(vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(a.lo), vreinterpretq_u32_f32(b.lo))),
                       vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(a.hi), vreinterpretq_u32_f32(b.hi))));
}
/* b where mask's sign bit is set, else a */
TSTERM_NEON_INLINE float32x4_t tsterm_blendv4(float32x4_t a, float32x4_t b, float32x4_t mask) {
    return vbslq_f32(vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_f32(mask), 31)), b, a);
}
TSTERM_NEON_INLINE __m256 _mm256_blendv_ps(__m256 a, __m256 b, __m256 mask) {
    return tsterm_m256(tsterm_blendv4(a.lo, b.lo, mask.lo), tsterm_blendv4(a.hi, b.hi, mask.hi));
}
/* per 128-bit half: (a0 + a1, a2 + a3, b0 + b1, b2 + b3), as vhaddps pairs them */
TSTERM_NEON_INLINE __m256 _mm256_hadd_ps(__m256 a, __m256 b) {
    return tsterm_m256(vpaddq_f32(a.lo, b.lo), vpaddq_f32(a.hi, b.hi));
}
/* each result half: imm's nibble picks a.lo (0), a.hi (1), b.lo (2) or b.hi (3); bit 3 of the nibble zeroes it */
TSTERM_NEON_INLINE float32x4_t tsterm_pick128(__m256 a, __m256 b, int sel) {
    if (sel & 8) return vdupq_n_f32(0.0f);
    switch (sel & 3) {
    case 0: return a.lo;
    case 1: return a.hi;
    case 2: return b.lo;
    default: return b.hi;
    }
}
TSTERM_NEON_INLINE __m256 _mm256_permute2f128_ps(__m256 a, __m256 b, int imm) {
    return tsterm_m256(tsterm_pick128(a, b, imm & 15), tsterm_pick128(a, b, (imm >> 4) & 15));
}

/* integer vectors (as bits; the lanes' type is the operation's) */
typedef int32x4_t __m128i;
typedef struct {
    int32x4_t lo, hi;
} __m256i;

TSTERM_NEON_INLINE __m256i tsterm_m256i(int32x4_t lo, int32x4_t hi) {
    __m256i r = {lo, hi};
    return r;
}
TSTERM_NEON_INLINE __m128i _mm_loadu_si128(const __m128i *p) {
    return vreinterpretq_s32_u8(vld1q_u8((const uint8_t *)p));
}
/* 8 bytes into the low half, the high half zero */
TSTERM_NEON_INLINE __m128i _mm_loadl_epi64(const __m128i *p) {
    return vreinterpretq_s32_u8(vcombine_u8(vld1_u8((const uint8_t *)p), vdup_n_u8(0)));
}
/* the low 8 bytes, zero-extended to 8 int32 lanes */
TSTERM_NEON_INLINE __m256i _mm256_cvtepu8_epi32(__m128i a) {
    const uint16x8_t w = vmovl_u8(vget_low_u8(vreinterpretq_u8_s32(a)));
    return tsterm_m256i(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(w))),
                        vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(w))));
}
TSTERM_NEON_INLINE __m256i _mm256_set1_epi32(int v) { return tsterm_m256i(vdupq_n_s32(v), vdupq_n_s32(v)); }
TSTERM_NEON_INLINE __m256i _mm256_and_si256(__m256i a, __m256i b) {
    return tsterm_m256i(vandq_s32(a.lo, b.lo), vandq_s32(a.hi, b.hi));
}
/* logical shifts of each 32-bit lane (a count above 31 gives 0, as on x86) */
TSTERM_NEON_INLINE int32x4_t tsterm_shift_u32(int32x4_t a, int n) {
    if (n > 31 || n < -31) return vdupq_n_s32(0);
    return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(n)));
}
TSTERM_NEON_INLINE __m256i _mm256_slli_epi32(__m256i a, int n) {
    return tsterm_m256i(tsterm_shift_u32(a.lo, n), tsterm_shift_u32(a.hi, n));
}
TSTERM_NEON_INLINE __m256i _mm256_srli_epi32(__m256i a, int n) {
    return tsterm_m256i(tsterm_shift_u32(a.lo, -n), tsterm_shift_u32(a.hi, -n));
}
TSTERM_NEON_INLINE __m256 _mm256_castsi256_ps(__m256i a) {
    return tsterm_m256(vreinterpretq_f32_s32(a.lo), vreinterpretq_f32_s32(a.hi));
}
TSTERM_NEON_INLINE __m256 _mm256_xor_ps(__m256 a, __m256 b) {
    return tsterm_m256(vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(a.lo), vreinterpretq_u32_f32(b.lo))),
                       vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(a.hi), vreinterpretq_u32_f32(b.hi))));
}
/* result lane i = a's lane (idx lane i & 7): a byte table lookup of lane * 4 + (0, 1, 2, 3) */
TSTERM_NEON_INLINE uint8x16_t tsterm_lane_bytes(int32x4_t idx) {
    const uint32x4_t base = vshlq_n_u32(vandq_u32(vreinterpretq_u32_s32(idx), vdupq_n_u32(7)), 2);
    return vreinterpretq_u8_u32(vaddq_u32(vmulq_n_u32(base, 0x01010101u), vdupq_n_u32(0x03020100u)));
}
TSTERM_NEON_INLINE __m256 _mm256_permutevar8x32_ps(__m256 a, __m256i idx) {
    const uint8x16x2_t table = {{vreinterpretq_u8_f32(a.lo), vreinterpretq_u8_f32(a.hi)}};
    return tsterm_m256(vreinterpretq_f32_u8(vqtbl2q_u8(table, tsterm_lane_bytes(idx.lo))),
                       vreinterpretq_f32_u8(vqtbl2q_u8(table, tsterm_lane_bytes(idx.hi))));
}

/* fp16 bits -> float (exact, as F16C's vcvtph2ps) */
TSTERM_NEON_INLINE float _cvtsh_ss(unsigned short bits) {
    __fp16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

enum { _MM_HINT_NTA = 0, _MM_HINT_T2 = 1, _MM_HINT_T1 = 2, _MM_HINT_T0 = 3 };
/* a read prefetch; the locality must be a constant for the builtin, hence the two calls */
#define _mm_prefetch(p, hint)                                                                                        \
    ((hint) == _MM_HINT_T0 ? __builtin_prefetch((const void *)(p), 0, 3) : __builtin_prefetch((const void *)(p), 0, 1))
