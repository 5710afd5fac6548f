// Vector helpers for the row-invariant kernels (attention.cpp, activation.cpp): one instruction sequence per element.
//
// A result stays the same bits wherever its element falls only if every element goes through the same instructions:
// so there are no scalar tails here. Loads and stores take a count of lanes (the last, partial vector of a row is
// loaded masked, computed like the others and stored masked), and the exponential is one polynomial for every lane
// (torch's own kernels switch between Sleef in the vector body and libm in the scalar remainder).
// The width is chosen when the file is compiled (-march=native): AVX-512, AVX2+FMA, or scalar code.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace hfspec_vec {

// The exponential's constants (Cephes' expf): exp(x) = 2^n exp(r), r = x - n ln 2 in two parts.
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;
constexpr float EXP_MIN = -87.3f;     // below it exp(x) would be subnormal: 0
constexpr float EXP_MAX = 88.7228f;   // above it exp(x) overflows: inf

#if defined(__AVX512F__)
constexpr int VW = 16;
typedef __m512 vec;
inline __mmask16 first(int n) { return (__mmask16)((1u << n) - 1); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
// Loads and stores of the first n <= VW lanes (the others read as 0 and are not written).
inline vec vload(const float* p, int n) { return n == VW ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(first(n), p); }
inline vec vload(const uint16_t* p, int n) {  // bfloat16 is the high half of a float32: widened exactly
    uint16_t buf[16] = {0};  // a tail through a zeroed buffer: a masked 16-bit load would need AVX512BW and VL
    if (n < VW) p = (const uint16_t*)memcpy(buf, p, n * sizeof(uint16_t));
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vec v, int n) {
    if (n == VW) _mm512_storeu_ps(p, v); else _mm512_mask_storeu_ps(p, first(n), v);
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vabs(vec a) { return _mm512_abs_ps(a); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vmaxall(vec a) { return _mm512_reduce_max_ps(a); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
// The first n lanes of a, the others fill.
inline vec vkeep(vec a, int n, float fill) { return _mm512_mask_mov_ps(vset(fill), first(n), a); }
inline vec vcopysign(vec magnitude, vec sign) {  // |magnitude| with the sign bit of sign
    const __m512i bit = _mm512_set1_epi32((int)0x80000000u);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(bit, _mm512_castps_si512(magnitude)),
                                               _mm512_and_si512(bit, _mm512_castps_si512(sign))));
}
// Lane j: the sum of acc[j]'s lanes, for j < VW, every one by the same pairing of lanes whatever its slot:
// (i, i + 8), then (i, i + 4), (i, i + 2), (0, 1). The sums of 16 vectors share their shuffles (a transpose).
inline vec vsums(const vec* acc) {
    vec x[8], y[4], z[2];
    for (int m = 0; m < 8; ++m)  // lanes 0-7: acc[2m]'s i + (i + 8); lanes 8-15: acc[2m + 1]'s
        x[m] = vadd(_mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int n = 0; n < 4; ++n)  // quarter k: acc[4n + k]'s i + (i + 4)
        y[n] = vadd(_mm512_shuffle_f32x4(x[2 * n], x[2 * n + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm512_shuffle_f32x4(x[2 * n], x[2 * n + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int p = 0; p < 2; ++p)  // quarter k, lanes 0-1: acc[8p + k]'s i + (i + 2); lanes 2-3: acc[8p + 4 + k]'s
        z[p] = vadd(_mm512_shuffle_ps(y[2 * p], y[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm512_shuffle_ps(y[2 * p], y[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // lane 4k + m: acc[k + 4m]'s 0 + 1
    vec e = vadd(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                 _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // lane j of the result: lane 4 (j % 4) + j / 4 of e
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}
inline vec vexp(vec x) {
    vec n = _mm512_roundscale_ps(vmul(x, vset(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vec r = vfnma(n, vset(LN2_LO), vfnma(n, vset(LN2_HI), x));
    vec p = vfma(vfma(vfma(vfma(vfma(vset(P0), r, vset(P1)), r, vset(P2)), r, vset(P3)), r, vset(P4)), r, vset(P5));
    vec y = _mm512_scalef_ps(vfma(p, vmul(r, r), vadd(r, vset(1.0f))), n);  // scalef overflows to inf itself
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, vset(EXP_MIN), _CMP_LT_OQ), vzero());
}
const char* const ISA = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
typedef __m256 vec;
inline __m256i first(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p, int n) { return n == VW ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(n)); }
inline vec vload(const uint16_t* p, int n) {
    uint16_t buf[8] = {0};
    memcpy(buf, p, (n == VW ? 8 : n) * sizeof(uint16_t));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)buf)), 16));
}
inline void vstore(float* p, vec v, int n) {
    if (n == VW) _mm256_storeu_ps(p, v); else _mm256_maskstore_ps(p, first(n), v);
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vabs(vec a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vmaxall(vec a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vec vkeep(vec a, int n, float fill) { return _mm256_blendv_ps(vset(fill), a, _mm256_castsi256_ps(first(n))); }
inline vec vcopysign(vec magnitude, vec sign) {
    const vec bit = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(bit, magnitude), _mm256_and_ps(bit, sign));
}
// Lane j: the sum of acc[j]'s lanes, for j < VW, every one by the same pairing of lanes whatever its slot:
// (i, i + 4), then (i, i + 2), (0, 1). The sums of 8 vectors share their shuffles (a transpose).
inline vec vsums(const vec* acc) {
    vec x[4], y[2];
    for (int m = 0; m < 4; ++m)  // half h = 0: acc[2m]'s i + (i + 4); h = 1: acc[2m + 1]'s
        x[m] = vadd(_mm256_permute2f128_ps(acc[2 * m], acc[2 * m + 1], 0x20),
                    _mm256_permute2f128_ps(acc[2 * m], acc[2 * m + 1], 0x31));
    for (int n = 0; n < 2; ++n)  // half h, lanes 0-1: acc[4n + h]'s i + (i + 2); lanes 2-3: acc[4n + 2 + h]'s
        y[n] = vadd(_mm256_shuffle_ps(x[2 * n], x[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm256_shuffle_ps(x[2 * n], x[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // lane 4h + m: acc[h + 2m]'s 0 + 1
    vec e = vadd(_mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                 _mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // lane j of the result (j = h + 2m): lane 4h + m of e
    return _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline vec vexp(vec x) {
    vec n = _mm256_round_ps(vmul(x, vset(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vec r = vfnma(n, vset(LN2_LO), vfnma(n, vset(LN2_HI), x));
    vec p = vfma(vfma(vfma(vfma(vfma(vset(P0), r, vset(P1)), r, vset(P2)), r, vset(P3)), r, vset(P4)), r, vset(P5));
    vec y = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
    // 2^n as exponent bits, n clamped to [-126, 127] (the lanes out of range are replaced below)
    vec clamped = _mm256_min_ps(_mm256_max_ps(n, vset(-126.0f)), vset(127.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(clamped), _mm256_set1_epi32(127)), 23);
    y = vmul(y, _mm256_castsi256_ps(e));
    y = _mm256_blendv_ps(y, vset(INFINITY), _mm256_cmp_ps(x, vset(EXP_MAX), _CMP_GT_OQ));
    return _mm256_blendv_ps(y, vzero(), _mm256_cmp_ps(x, vset(EXP_MIN), _CMP_LT_OQ));
}
const char* const ISA = "avx2";
#else
constexpr int VW = 1;
typedef float vec;
inline vec vzero() { return 0.0f; }
inline vec vset(float x) { return x; }
inline vec vload(const float* p, int) { return *p; }
inline vec vload(const uint16_t* p, int) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline void vstore(float* p, vec v, int) { *p = v; }
inline vec vfma(vec a, vec b, vec c) { return fmaf(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return fmaf(-a, b, c); }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vsub(vec a, vec b) { return a - b; }
inline vec vdiv(vec a, vec b) { return a / b; }
inline vec vabs(vec a) { return fabsf(a); }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline float vmaxall(vec a) { return a; }
inline float vsum(vec a) { return a; }
inline vec vkeep(vec a, int n, float fill) { return n > 0 ? a : fill; }
inline vec vcopysign(vec magnitude, vec sign) { return copysignf(magnitude, sign); }
inline vec vsums(const vec* acc) { return acc[0]; }
inline vec vexp(vec x) {
    if (x != x) return x;
    if (x < EXP_MIN) return 0.0f;
    if (x > EXP_MAX) return INFINITY;
    float n = nearbyintf(x * LOG2E);
    float r = vfnma(n, LN2_LO, vfnma(n, LN2_HI, x));
    float p = vfma(vfma(vfma(vfma(vfma(P0, r, P1), r, P2), r, P3), r, P4), r, P5);
    return ldexpf(vfma(p, r * r, r + 1.0f), (int)n);
}
const char* const ISA = "scalar";
#endif

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// float32 -> bfloat16, rounding to nearest even as torch does (a NaN stays a quiet NaN).
inline uint16_t narrow_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The first n <= VW lanes of v to p (float32, or bfloat16 rounded to nearest even).
inline void vstore_as(float* p, vec v, int n) { vstore(p, v, n); }
inline void vstore_as(uint16_t* p, vec v, int n) {
    float buf[VW];
    vstore(buf, v, VW);
    for (int i = 0; i < n; ++i) p[i] = narrow_bf16(buf[i]);
}

}  // namespace hfspec_vec
