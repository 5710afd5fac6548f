// Linear layers for a draft model in integer arithmetic: y[M, N] ~= x[M, K] @ w[N, K]^T (+ b[N]), fp32 x, y and b.
//
// Speculative sampling is lossless whatever the draft computes, as long as q is the distribution its token was drawn
// from (Leviathan et al., arXiv 2211.17192), so a draft needs no exact fp32 sums. Here the weights are 4-bit (or
// 8-bit) codes and each input row is quantized to int8 per call, so that one VNNI instruction (vpdpbusd) does 64
// multiply-adds where an fp32 FMA does 16, and a decoding step is bound by streaming the codes from memory.
//
// Weights (packed once at load, hfspec/cpu/draft_linear.py): blocks of QK = 32 weights along K, for LANES = 16
// output rows at a time, stored group by group (16 rows) and, within a group, block by block along K:
//   codes   16 * 32 * BITS / 8 bytes, in chunks of 64 bytes = 16 lanes of 4 bytes, lane j for row j:
//           4-bit: chunk c byte t of lane j holds k = 8c + t in its low nibble and k = 8c + 4 + t in its high one;
//           8-bit: chunk c byte t of lane j holds k = 4c + t;
//   d       16 fp16 scales, one per row;
//   m       16 fp16 offsets, one per row.
// Row j's weight k is d[j] * code + m[j] (codes unsigned). One 64-byte chunk is one vpdpbusd for 16 rows by 4 k
// against the 4 activation bytes broadcast, and the scales are a 16-lane vector. A matrix of N rows has
// ceil(N / 16) groups; the rows past N are zeros.
//
// Activations: each row is quantized per block of 32 to int8 with an fp32 scale dx = max|x| / 127 (round to nearest
// even), and the block's sum of codes sx kept, so that a block contributes
//     d * dx * sum(code * xq) + m * dx * sx.
// Each thread takes a contiguous range of groups and, for each, runs every pass of up to MAX_ROWS input rows over
// it: a block's codes are unpacked once per pass and used for every row in it, so 2-8 rows cost about what one
// row costs.
//
// Paths, each guarded by exactly the macros its intrinsics need: AVX-512 with VNNI; AVX2 with FMA and F16C, using
// AVX-VNNI where defined and maddubs/madd otherwise; scalar code. Every path gives every output the same integer
// dots; the fp32 sums over blocks differ between paths in rounding only.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "quant_rows.h"
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define HFSPEC_DRAFT_VNNI512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HFSPEC_DRAFT_AVX2 1
#endif
#if defined(HFSPEC_DRAFT_VNNI512) || defined(HFSPEC_DRAFT_AVX2)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int QK = 32;     // weights per block along K
constexpr int LANES = 16;  // weight rows per group
constexpr int CHUNK = 64;  // bytes of codes per chunk: LANES lanes of 4 codes' bytes
constexpr int code_bytes(int bits) { return LANES * QK * bits / 8; }
constexpr int block_bytes(int bits) { return code_bytes(bits) + 4 * LANES; }  // codes, then fp16 d and m

// -- the vector layer: V lanes of int32 or fp32; a group of 16 rows is H = 16 / V vectors -----------------------

#if defined(HFSPEC_DRAFT_VNNI512)
constexpr int V = 16;
constexpr int MAX_ROWS = 8;  // 32 registers: 8 codes, 2 scales, a sum and a dot per row
typedef __m512i ivec;
typedef __m512 fvec;
inline ivec iload(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec iset(int32_t v) { return _mm512_set1_epi32(v); }
inline ivec iand(ivec a, ivec b) { return _mm512_and_si512(a, b); }
inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline int32_t hsum(ivec a) { return _mm512_reduce_add_epi32(a); }
inline ivec isrl4(ivec a) { return _mm512_srli_epi32(a, 4); }
inline fvec fzero() { return _mm512_setzero_ps(); }
inline fvec fset(float v) { return _mm512_set1_ps(v); }
inline fvec fcvt(ivec a) { return _mm512_cvtepi32_ps(a); }
inline fvec fmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec fload_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void fstore(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline fvec fload(const float* p) { return _mm512_loadu_ps(p); }
inline fvec fadd(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec fsub(fvec a, fvec b) { return _mm512_sub_ps(a, b); }
inline fvec fdivide(fvec a, fvec b) { return _mm512_div_ps(a, b); }
inline fvec fvmin(fvec a, fvec b) { return _mm512_min_ps(a, b); }
inline fvec fvmax(fvec a, fvec b) { return _mm512_max_ps(a, b); }
inline fvec fround(fvec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec fless(fvec x, fvec y, fvec a, fvec b) {  // a where x < y, else b
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, y, _CMP_LT_OQ), b, a);
}
inline __m256i half_bits(fvec v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec fhalf(fvec v) { return _mm512_cvtph_ps(half_bits(v)); }  // v rounded to fp16 (nearest even)
inline void fstore_f16(uint8_t* p, fvec v) { _mm256_storeu_si256((__m256i*)p, half_bits(v)); }
// acc + per lane the sum of the 4 products of unsigned codes u and signed bytes s.
inline ivec dot(ivec acc, ivec u, ivec s) { return _mm512_dpbusd_epi32(acc, u, s); }
constexpr int CODE8_OFFSET = 0;  // 8-bit codes are read as stored
inline ivec codes8(ivec v) { return v; }
inline ivec dot8(ivec acc, ivec u, ivec s) { return dot(acc, u, s); }
const char* ISA = "avx512vnni";
#elif defined(HFSPEC_DRAFT_AVX2)
constexpr int V = 8;
constexpr int MAX_ROWS = 3;  // 16 registers: a sum and a dot per row and half
typedef __m256i ivec;
typedef __m256 fvec;
inline ivec iload(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline ivec izero() { return _mm256_setzero_si256(); }
inline ivec iset(int32_t v) { return _mm256_set1_epi32(v); }
inline ivec iand(ivec a, ivec b) { return _mm256_and_si256(a, b); }
inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline int32_t hsum(ivec a) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    return _mm_cvtsi128_si32(_mm_hadd_epi32(_mm_hadd_epi32(s, s), s));
}
inline ivec isrl4(ivec a) { return _mm256_srli_epi32(a, 4); }
inline fvec fzero() { return _mm256_setzero_ps(); }
inline fvec fset(float v) { return _mm256_set1_ps(v); }
inline fvec fcvt(ivec a) { return _mm256_cvtepi32_ps(a); }
inline fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec fload_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline void fstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline fvec fload(const float* p) { return _mm256_loadu_ps(p); }
inline fvec fadd(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec fsub(fvec a, fvec b) { return _mm256_sub_ps(a, b); }
inline fvec fdivide(fvec a, fvec b) { return _mm256_div_ps(a, b); }
inline fvec fvmin(fvec a, fvec b) { return _mm256_min_ps(a, b); }
inline fvec fvmax(fvec a, fvec b) { return _mm256_max_ps(a, b); }
inline fvec fround(fvec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec fless(fvec x, fvec y, fvec a, fvec b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, y, _CMP_LT_OQ)); }
inline __m128i half_bits(fvec v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec fhalf(fvec v) { return _mm256_cvtph_ps(half_bits(v)); }
inline void fstore_f16(uint8_t* p, fvec v) { _mm_storeu_si128((__m128i*)p, half_bits(v)); }
#if defined(__AVXVNNI__)
inline ivec dot(ivec acc, ivec u, ivec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
constexpr int CODE8_OFFSET = 0;
inline ivec codes8(ivec v) { return v; }
inline ivec dot8(ivec acc, ivec u, ivec s) { return dot(acc, u, s); }
const char* ISA = "avxvnni";
#else
// maddubs sums pairs of products into int16: 4-bit codes (at most 2 * 15 * 127) cannot saturate.
inline ivec dot(ivec acc, ivec u, ivec s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
// 8-bit codes could (2 * 255 * 127): they are read as c = code - 128 and multiplied as |c| * (s with the sign of
// c), at most 2 * 128 * 127; the offset 128 * d moves into m.
constexpr int CODE8_OFFSET = 128;
inline ivec codes8(ivec v) { return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)); }
inline ivec dot8(ivec acc, ivec c, ivec s) {
    const ivec pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(s, c));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
const char* ISA = "avx2";
#endif
#else
constexpr int V = 1;  // one lane: a group is 16 of them
constexpr int MAX_ROWS = 4;
typedef uint32_t ivec;  // 4 bytes (codes or activations) or an int32 sum
typedef float fvec;
inline ivec iload(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
inline ivec izero() { return 0; }
inline ivec iset(int32_t v) { return (uint32_t)v; }
inline ivec iand(ivec a, ivec b) { return a & b; }
inline ivec iadd(ivec a, ivec b) { return a + b; }
inline int32_t hsum(ivec a) { return (int32_t)a; }
inline ivec isrl4(ivec a) { return a >> 4; }
inline fvec fzero() { return 0.0f; }
inline fvec fset(float v) { return v; }
inline fvec fcvt(ivec a) { return (float)(int32_t)a; }
inline fvec fmul(fvec a, fvec b) { return a * b; }
inline fvec ffma(fvec a, fvec b, fvec c) { return fmaf(a, b, c); }
inline fvec fload_f16(const uint8_t* p) {  // IEEE half to float, exactly
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) {
        const float f = (float)man * (1.0f / 16777216.0f);  // zero or subnormal: man * 2^-24
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 0x1F ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
inline void fstore(float* p, fvec v) { *p = v; }
inline fvec fload(const float* p) { return *p; }
inline fvec fadd(fvec a, fvec b) { return a + b; }
inline fvec fsub(fvec a, fvec b) { return a - b; }
inline fvec fdivide(fvec a, fvec b) { return a / b; }
inline fvec fvmin(fvec a, fvec b) { return a < b ? a : b; }  // the vector min and max: b where either is NaN
inline fvec fvmax(fvec a, fvec b) { return a > b ? a : b; }
inline fvec fround(fvec a) { return nearbyintf(a); }  // to nearest even in the default rounding mode
inline fvec fless(fvec x, fvec y, fvec a, fvec b) { return x < y ? a : b; }
inline uint16_t half_bits(float f) {  // IEEE float to half, to nearest even (finite f)
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (x >> 16) & 0x8000;
    x &= 0x7FFFFFFFu;
    if (x >= 0x477FF000u) return sign | 0x7C00;  // 65520 and above round to infinity
    if (x < 0x38800000u) {                       // below 2^-14: a subnormal half, |f| * 2^24 rounded
        float a;
        memcpy(&a, &x, 4);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);
    }
    x += 0xFFFu + ((x >> 13) & 1);  // the 13 bits dropped, rounded to nearest even
    return sign | (uint16_t)((x - (112u << 23)) >> 13);
}
inline void fstore_f16(uint8_t* p, fvec v) {
    const uint16_t h = half_bits(v);
    memcpy(p, &h, 2);
}
inline fvec fhalf(fvec v) {
    uint8_t h[2];
    fstore_f16(h, v);
    return fload_f16(h);
}
inline ivec dot(ivec acc, ivec u, ivec s) {
    int32_t sum = (int32_t)acc;
    for (int t = 0; t < 4; ++t) sum += (int32_t)((u >> (8 * t)) & 0xFF) * (int32_t)(int8_t)((s >> (8 * t)) & 0xFF);
    return (uint32_t)sum;
}
constexpr int CODE8_OFFSET = 0;
inline ivec codes8(ivec v) { return v; }
inline ivec dot8(ivec acc, ivec u, ivec s) { return dot(acc, u, s); }
const char* ISA = "scalar";
#endif

constexpr int H = LANES / V;  // vectors per group of rows

#if defined(__GNUC__)
#define NOINLINE __attribute__((noinline))
#define UNROLL _Pragma("GCC unroll 16")
#else
#define NOINLINE
#define UNROLL
#endif

// Four activation codes as one int32 in every lane.
inline ivec broadcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return iset(v);
}

// -- activations -------------------------------------------------------------------------------------------------

// Rows of x quantized per block: q (M x K int8, K apart), and per block d = max|x| / 127 and c = d * sum(q)
// (M x K / QK each). Every path computes the same bits: max, one division, one product and a rounding to nearest
// even per element.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* c) {
    for (int64_t kb = 0; kb < K / QK; ++kb, x += QK, q += QK) {
#if defined(HFSPEC_DRAFT_VNNI512)
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)),
                                                              _mm512_abs_ps(_mm512_loadu_ps(x + 16))));
#elif defined(HFSPEC_DRAFT_AVX2)
        const float amax = hfspec_rows::abs_max(x, QK);
#else
        float amax = 0.0f;
        for (int e = 0; e < QK; ++e) amax = fmaxf(amax, fabsf(x[e]));
#endif
        const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        int32_t sum = 0;
#if defined(HFSPEC_DRAFT_VNNI512)
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inverse)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(q1));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(HFSPEC_DRAFT_AVX2)
        static_assert(QK == 32, "one block is four vectors");
        __m256i v[4];  // lrintf: to nearest even in the default rounding mode; then the low bytes, as the casts
        for (int i = 0; i < 4; ++i)
            v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(inverse)));
        const __m256i bytes = hfspec_rows::low_bytes(v);
        _mm256_storeu_si256((__m256i*)q, bytes);
        sum = hfspec_rows::code_total(bytes);
#else
        for (int e = 0; e < QK; ++e) {
            q[e] = (int8_t)lrintf(x[e] * inverse);  // |x * inverse| <= 127 (rounded), nearest even by default
            sum += q[e];
        }
#endif
        d[kb] = scale;
        c[kb] = scale * (float)sum;
    }
}

// -- the weights -------------------------------------------------------------------------------------------------

// The codes this far on are prefetched (into L2) as a block streams in: without, one thread read 896 -> 4864 and
// 4864 -> 896 layers from memory at 65-70% of a plain read's speed, with 4 KB ahead at 85-95% (8 and 16 KB alike).
// The stream runs on across groups, so the last blocks of a group prefetch the next group's.
constexpr int PREFETCH_BYTES = 4096;

// out[r * 16 + j] = sum over blocks of d * dx * dot + m * c, for R input rows (their codes ldq apart, their scales
// lds apart) over one group of 16 weight rows (K / QK blocks from w).
template <int BITS, int R>
NOINLINE void group_rows(const uint8_t* w, int64_t blocks, const int8_t* xq, int64_t ldq, const float* xd,
                         const float* xc, int64_t lds, float* out) {
    fvec acc[R][H];
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) acc[r][h] = fzero();
    const ivec low = iset(0x0F0F0F0F);
    constexpr int chunks = code_bytes(BITS) / CHUNK;
    for (int64_t kb = 0; kb < blocks; ++kb, w += block_bytes(BITS)) {
        for (int off = 0; off < block_bytes(BITS); off += 64) __builtin_prefetch(w + PREFETCH_BYTES + off, 0, 2);
        ivec dots[R][H];
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < H; ++h) dots[r][h] = izero();
        UNROLL for (int c = 0; c < chunks; ++c) {
            UNROLL for (int h = 0; h < H; ++h) {
                const ivec v = iload(w + c * CHUNK + h * V * 4);
                if constexpr (BITS == 4) {
                    const ivec lo = iand(v, low), hi = iand(isrl4(v), low);
                    for (int r = 0; r < R; ++r) {
                        const int8_t* x = xq + r * ldq + kb * QK + 8 * c;
                        dots[r][h] = dot(dot(dots[r][h], lo, broadcast4(x)), hi, broadcast4(x + 4));
                    }
                } else {
                    const ivec u = codes8(v);
                    for (int r = 0; r < R; ++r)
                        dots[r][h] = dot8(dots[r][h], u, broadcast4(xq + r * ldq + kb * QK + 4 * c));
                }
            }
        }
        UNROLL for (int h = 0; h < H; ++h) {
            const fvec d = fload_f16(w + code_bytes(BITS) + h * V * 2);
            fvec m = fload_f16(w + code_bytes(BITS) + 2 * LANES + h * V * 2);
            if constexpr (BITS == 8 && CODE8_OFFSET != 0) m = ffma(d, fset((float)CODE8_OFFSET), m);
            for (int r = 0; r < R; ++r) {
                acc[r][h] = ffma(fcvt(dots[r][h]), fmul(d, fset(xd[r * lds + kb])), acc[r][h]);
                acc[r][h] = ffma(m, fset(xc[r * lds + kb]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) fstore(out + r * LANES + h * V, acc[r][h]);
}

template <int BITS, int R = MAX_ROWS>
void group_rows_at(int rows, const uint8_t* w, int64_t blocks, const int8_t* xq, int64_t ldq, const float* xd,
                   const float* xc, int64_t lds, float* out) {
    if constexpr (R > 1)
        if (rows < R) return group_rows_at<BITS, R - 1>(rows, w, blocks, xq, ldq, xd, xc, lds, out);
    group_rows<BITS, R>(w, blocks, xq, ldq, xd, xc, lds, out);
}

template <int BITS>
void linear(const float* x, int64_t ldx, const uint8_t* w, const float* b, float* y, int64_t ldy, int64_t M,
            int64_t N, int64_t K, int threads) {
    const int64_t blocks = K / QK, groups = (N + LANES - 1) / LANES;
    std::vector<int8_t> xq(M * K);
    std::vector<float> xd(M * blocks), xc(M * blocks);
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K >= 1 << 16)
    for (int64_t i = 0; i < M; ++i)
        quantize_row(x + i * ldx, K, xq.data() + i * K, xd.data() + i * blocks, xc.data() + i * blocks);
    const int64_t passes = (M + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* wg = w + g * blocks * block_bytes(BITS);
        const int64_t n0 = g * LANES;
        const int valid = (int)(N - n0 < LANES ? N - n0 : LANES);
        float out[MAX_ROWS * LANES];
        for (int64_t p = 0, m0 = 0; p < passes; ++p) {
            const int rows = (int)((M - m0 + (passes - p) - 1) / (passes - p));  // passes of about equal size
            group_rows_at<BITS>(rows, wg, blocks, xq.data() + m0 * K, K, xd.data() + m0 * blocks,
                                xc.data() + m0 * blocks, blocks, out);
            for (int r = 0; r < rows; ++r)
                for (int j = 0; j < valid; ++j) y[(m0 + r) * ldy + n0 + j] = out[r * LANES + j] + (b ? b[n0 + j] : 0.0f);
            m0 += rows;
        }
    }
}

// -- packing ----------------------------------------------------------------------------------------------------

// A block's scale and offset: its codes are first set from its minimum and a scale of (top + delta) / (max - min) for
// each of SEARCH deltas from -1 to 1, then the scale and offset that fit those codes best (least squares, rounded to
// fp16) are priced by their squared error (from the sums, without a second pass); the cheapest pair is kept and
// every weight gets its nearest code under it (ggml's make_qkx2_quants, with 21 deltas). The search matters for the
// draft's tokens: with all of Qwen2.5-Coder-0.5B's linears at 4 bits, its greedy next tokens agreed with the
// unquantized model's at 85% of 600 positions on the plain min/max grid and at 90% with 9 deltas. More buy little:
// the RMS error of its layers was 7.5% of the weights' with 3 deltas, 7.3% with 9 and with 21 (which packs the
// model in 2.3 s rather than 1.3 s on one thread here).
constexpr int SEARCH = 9;

// The blocks of one group: ``rows`` (at most 16) rows of w, ldw floats apart (the others zero), into ``out``.
template <int BITS>
void pack_group(const float* w, int64_t ldw, int rows, int64_t K, uint8_t* out) {
    constexpr float top = (1 << BITS) - 1;
    alignas(64) float tile[QK][LANES];   // element e of every row: lanes are rows
    alignas(64) float codes[QK][LANES];
    for (int64_t kb = 0; kb < K / QK; ++kb, out += block_bytes(BITS)) {
        for (int j = 0; j < LANES; ++j)
            for (int e = 0; e < QK; ++e) tile[e][j] = j < rows ? w[j * ldw + kb * QK + e] : 0.0f;
        for (int h = 0; h < H; ++h) {
            fvec lo = fload(tile[0] + h * V), hi = lo, sw = fzero(), sww = fzero();
            for (int e = 0; e < QK; ++e) {
                const fvec x = fload(tile[e] + h * V);
                lo = fvmin(lo, x);
                hi = fvmax(hi, x);
                sw = fadd(sw, x);
                sww = ffma(x, x, sww);
            }
            const fvec range = fsub(hi, lo), zero = fzero(), n = fset((float)QK);
            const fvec inverse = fless(zero, range, fdivide(fset(1.0f), range), zero);
            const fvec even = fmul(range, fset(1.0f / top));  // the scale of an all-equal block: 0
            fvec best_d = fhalf(even), best_m = fhalf(lo), best_err = fset(INFINITY);
            for (int s = 0; s < SEARCH; ++s) {
                const fvec iscale = fmul(fset(top - 1.0f + 2.0f * s / (SEARCH - 1)), inverse);
                fvec sq = zero, sqq = zero, swq = zero;
                for (int e = 0; e < QK; ++e) {
                    const fvec x = fload(tile[e] + h * V);
                    const fvec q = fvmin(fvmax(fround(fmul(fsub(x, lo), iscale)), zero), fset(top));
                    sq = fadd(sq, q);
                    sqq = ffma(q, q, sqq);
                    swq = ffma(x, q, swq);
                }
                const fvec det = fsub(fmul(n, sqq), fmul(sq, sq));  // 0 when all codes are equal
                const fvec d = fhalf(fless(zero, det, fdivide(fsub(fmul(n, swq), fmul(sq, sw)), det), even));
                const fvec m = fhalf(fmul(fsub(sw, fmul(d, sq)), fset(1.0f / QK)));
                // sum (d q + m - x)^2 = d^2 sqq + 2 d m sq + n m^2 - 2 d swq - 2 m sw + sww
                fvec err = ffma(fmul(d, d), sqq, sww);
                err = ffma(fmul(fset(2.0f), fmul(d, m)), sq, err);
                err = ffma(fmul(n, m), m, err);
                err = fsub(err, fmul(fset(2.0f), fadd(fmul(d, swq), fmul(m, sw))));
                best_d = fless(err, best_err, d, best_d);
                best_m = fless(err, best_err, m, best_m);
                best_err = fless(err, best_err, err, best_err);
            }
            const fvec id = fless(zero, best_d, fdivide(fset(1.0f), best_d), zero);
            for (int e = 0; e < QK; ++e)
                fstore(codes[e] + h * V, fvmin(fvmax(fround(fmul(fsub(fload(tile[e] + h * V), best_m), id)), zero),
                                              fset(top)));
            fstore_f16(out + code_bytes(BITS) + h * V * 2, best_d);
            fstore_f16(out + code_bytes(BITS) + 2 * LANES + h * V * 2, best_m);
        }
        for (int c = 0; c < code_bytes(BITS) / CHUNK; ++c)
            for (int j = 0; j < LANES; ++j)
                for (int t = 0; t < 4; ++t)
                    out[c * CHUNK + j * 4 + t] = BITS == 4 ? (uint8_t)((int)codes[8 * c + t][j] | (int)codes[8 * c + 4 + t][j] << 4)
                                                           : (uint8_t)codes[4 * c + t][j];
    }
}

}  // namespace

extern "C" {

const char* hfspec_draft_isa() { return ISA; }

// y = x @ w^T + b for w packed as above with ``bits`` per code (4 or 8), N rows and K a multiple of 32; x is M rows
// ldx floats apart, y M rows ldy floats apart, b N floats or null. Returns 0 (and computes nothing) for other bits.
int hfspec_draft_linear(int bits, const float* x, int64_t ldx, const uint8_t* w, const float* b, float* y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if (bits == 4)
        linear<4>(x, ldx, w, b, y, ldy, M, N, K, threads);
    else if (bits == 8)
        linear<8>(x, ldx, w, b, y, ldy, M, N, K, threads);
    else
        return 0;
    return 1;
}

// Packs w (N rows of K floats, ldw apart; K a multiple of 32) at ``bits`` per code into ``out``: ceil(N / 16) groups of
// K / 32 blocks, as above. Returns 0 (and writes nothing) for other bits.
int hfspec_draft_pack(int bits, const float* w, int64_t ldw, int64_t N, int64_t K, uint8_t* out, int threads) {
    if (bits != 4 && bits != 8) return 0;
    const int64_t groups = (N + LANES - 1) / LANES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int rows = (int)(N - g * LANES < LANES ? N - g * LANES : LANES);
        uint8_t* dst = out + g * (K / QK) * block_bytes(bits);
        if (bits == 4)
            pack_group<4>(w + g * LANES * ldw, ldw, rows, K, dst);
        else
            pack_group<8>(w + g * LANES * ldw, ldw, rows, K, dst);
    }
    return 1;
}

// A plain read of ``bytes`` bytes (a multiple of 64) on ``threads`` threads, with the kernel's loads and split: the
// bound a call is measured against (scripts/draft_speed.py). Returns a checksum, so that the reads happen.
int64_t hfspec_draft_read(const uint8_t* p, int64_t bytes, int threads) {
    constexpr int64_t step = 2 * V * 4;  // two loads
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        ivec a = izero(), b = izero();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < bytes / step; ++i) {
            a = iadd(a, iload(p + i * step));
            b = iadd(b, iload(p + i * step + V * 4));
        }
        total += hsum(iadd(a, b));
    }
    return total;
}

}
