// AVX2 pieces of the int8 row quantizers (int8.cpp's Q8_0/Q8_1/Q8_K, draft.cpp's rows): the same codes and scales
// as their scalar loops, bit for bit, whatever the values (inf, NaN, subnormals included).
#pragma once
#if defined(__AVX2__)
#include <immintrin.h>

namespace hfspec_rows {

// The largest |x[j]| of n (a multiple of 8) floats, as a loop of fmaxf(amax, fabsf(x[j])) from 0 finds it: a NaN
// is passed over (max_ps returns its second operand when either is a NaN), and a maximum is exact in any order.
inline float abs_max(const float* x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// The low bytes of 32 int32s (4 vectors) in order, as (int8_t) casts them.
inline __m256i low_bytes(const __m256i* v) {
    const __m256i low = _mm256_set1_epi32(0xFF);
    const __m256i ab = _mm256_packus_epi32(_mm256_and_si256(v[0], low), _mm256_and_si256(v[1], low));
    const __m256i cd = _mm256_packus_epi32(_mm256_and_si256(v[2], low), _mm256_and_si256(v[3], low));
    return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 int8 codes summed by fours: int32 lanes 0-3 hold the first 16 codes' sums, lanes 4-7 the rest's.
inline __m256i code_sums(__m256i codes) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), codes), _mm256_set1_epi16(1));
}

// The sum of 4 int32 lanes.
inline int lane_sum(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}

// The sum of all 32 codes.
inline int code_total(__m256i codes) {
    const __m256i sums = code_sums(codes);
    return lane_sum(_mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1)));
}

}  // namespace hfspec_rows
#endif
