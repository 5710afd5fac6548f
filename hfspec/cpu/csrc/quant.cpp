// Linear layers over GGUF's quantized blocks: y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ b[N]), fp32 x, y and b.
//
// The weights stay as the file stores them, N rows of K / QK blocks each. Every output is what linear.cpp's fp32
// kernel computes on the dequantized weights, bit for bit: the same lane-wise FMAs over K in chunks of VW, in
// order, the same horizontal sum, then the bias. That holds because each weight is dequantized to exactly the
// float the gguf package's numpy code (what transformers loads) gives it: the same fp32 operations in the same
// order, e.g. Q4_K's dl = d * sc, ml = dmin * m, w = dl * q - ml. (Every product in those formulas is exact in
// fp32 -- an f16 times a code of at most 8 bits, or that times a code of at most 6 -- so a compiler that fuses
// `dl * q - ml` into one FMA rounds it exactly as the unfused pair does.)
//
// Each thread takes a contiguous range of output rows, P at a time (a panel), and walks K in slices of KC weights.
// Per slice it dequantizes the panel's rows once into a scratch buffer in L1, then runs an fp32 micro-kernel over
// it: every block of R input rows against every block of C weight rows, R * C FMAs per R + C loads, the
// accumulators kept in an L1 buffer between slices. So the weights stream from memory once per call and are
// dequantized once whatever the row count, and M rows cost about what one row costs until the FMAs fill the
// machine. For a few rows (the shapes with P = 0) each pass of rows dequantizes C weight rows in registers instead,
// which saves the scratch's stores and loads. The input rows are packed once per call, chunk by chunk, so that a
// block's R rows of a chunk are R consecutive aligned vectors.
//
// One small struct per block format says where its codes sit and what value a code stands for (ggml-quants.c's
// layouts; gguf/quants.py's arithmetic). On AVX-512 a format of at most 32 codes builds, per group of weights
// sharing a scale, the table of every value a code can take (the same fp32 operations on each code), and a weight
// vector is one permute of it. The 4-bit formats read their codes without a shuffle there, in a transposed lane
// order (``TRANSPOSED``) that the packed input rows share and that is undone before the horizontal sums: each lane
// still sums its own weights in order, so no bit changes.
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

namespace {

// -- the vector layer: linear.cpp's choice of ISA and its FMA and horizontal sum, and integer lanes -------------

#if defined(__AVX512F__)
constexpr int VW = 16;
typedef __m512 vec;
typedef __m512i ivec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec vset(float f) { return _mm512_set1_ps(f); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vcvt(ivec i) { return _mm512_cvtepi32_ps(i); }
inline ivec iload_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline ivec iload_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline ivec isrl(ivec v, int n) { return _mm512_srli_epi32(v, n); }
inline ivec isll(ivec v, int n) { return _mm512_slli_epi32(v, n); }
inline ivec iand(ivec v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
inline ivec ior(ivec a, ivec b) { return _mm512_or_si512(a, b); }
// Lane l: bit (first + l) of ``word``.
inline ivec ibits(uint32_t word, int first) {
    return _mm512_maskz_set1_epi32((__mmask16)(word >> first), 1);
}
inline vec iota(int start) {
    return _mm512_add_ps(_mm512_set1_ps((float)start),
                         _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
// The transposed lane order: lane l holds element 4 (l % 4) + l / 4 of a chunk (a 4 x 4 transpose, its own
// inverse). A 16-byte broadcast puts bytes 4 (l % 4) .. + 3 in lane l, so a shift by 8 (l / 4) brings the byte for
// that element down: bytes become codes without a shuffle, the port shuffles need being the permute's.
inline vec transpose_lanes(vec v) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}
// Lane j: the sum of acc[j]'s lanes held in the transposed order, paired as _mm512_reduce_add_ps pairs the lanes of
// the natural order -- (i, i + 8), (i, i + 4), (i, i + 2), (0, 1) -- which puts the first two steps inside 128-bit
// lanes and the last two across them (vec.h's vsums the other way round): the sums of 16 vectors share their shuffles.
inline vec transposed_sums(const vec* acc) {
    vec x[8], y[4], z[2];
    // elements 0, 1 of each 128-bit lane: acc[2m]'s natural i + (i + 8); elements 2, 3: acc[2m + 1]'s
    for (int m = 0; m < 8; ++m)
        x[m] = _mm512_add_ps(_mm512_shuffle_ps(acc[2 * m], acc[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(acc[2 * m], acc[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int n = 0; n < 4; ++n)  // 128-bit lane q, element k: acc[4n + k]'s natural q + (q + 4)
        y[n] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * n], x[2 * n + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(x[2 * n], x[2 * n + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int p = 0; p < 2; ++p)  // lanes 0, 1: y[2p]'s natural 0 + 2, 1 + 3; lanes 2, 3: y[2p + 1]'s
        z[p] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * p], y[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(y[2 * p], y[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // lane q, element k: acc[4q + k]'s 0 + 1
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
// Lane l: byte 4 (l % 4) + l / 4 of p[0, 16), shifted right by ``shift`` (bits above left set).
inline ivec transposed_bytes(const uint8_t* p, int shift) {
    const ivec by = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    return _mm512_srlv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p)),
                             _mm512_add_epi32(by, _mm512_set1_epi32(shift)));
}
const char* ISA = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
typedef __m256 vec;
typedef __m256i ivec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {  // linear.cpp's order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vec vset(float f) { return _mm256_set1_ps(f); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vcvt(ivec i) { return _mm256_cvtepi32_ps(i); }
inline ivec iload_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline ivec iload_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline ivec isrl(ivec v, int n) { return _mm256_srli_epi32(v, n); }
inline ivec isll(ivec v, int n) { return _mm256_slli_epi32(v, n); }
inline ivec iand(ivec v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
inline ivec ior(ivec a, ivec b) { return _mm256_or_si256(a, b); }
inline ivec ibits(uint32_t word, int first) {
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(word >> first)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                            _mm256_set1_epi32(1));
}
inline vec iota(int start) {
    return _mm256_add_ps(_mm256_set1_ps((float)start), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
}
const char* ISA = "avx2";
#else
constexpr int VW = 1;
typedef float vec;
typedef int32_t ivec;
inline vec vzero() { return 0.0f; }
inline vec vload(const float* p) { return *p; }
inline void vstore(float* p, vec v) { *p = v; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }  // linear.cpp's expression
inline float vsum(vec v) { return v; }
inline vec vset(float f) { return f; }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vsub(vec a, vec b) { return a - b; }
inline vec vcvt(ivec i) { return (float)i; }
inline ivec iload_u8(const uint8_t* p) { return *p; }
inline ivec iload_i8(const uint8_t* p) { return (int8_t)*p; }
inline ivec isrl(ivec v, int n) { return (int32_t)((uint32_t)v >> n); }
inline ivec isll(ivec v, int n) { return v << n; }
inline ivec iand(ivec v, int m) { return v & m; }
inline ivec ior(ivec a, ivec b) { return a | b; }
inline ivec ibits(uint32_t word, int first) { return (word >> first) & 1; }
inline vec iota(int start) { return (float)start; }
const char* ISA = "scalar";
#endif

#if defined(__GNUC__) && (defined(__AVX2__) || defined(__AVX512F__))
inline void keep_in_register(vec& v) { asm volatile("" : "+v"(v)); }  // see linear.cpp
#else
inline void keep_in_register(vec&) {}
#endif
#if defined(__GNUC__)
#define NOINLINE __attribute__((noinline))
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 32")
#else
#define NOINLINE
#define ALWAYS_INLINE inline
#define UNROLL
#endif

// IEEE half to float, exactly (numpy's astype(np.float32)).
inline float f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp == 0) {
        const float f = (float)man * (1.0f / 16777216.0f);  // subnormal: man * 2^-24, exact
        return sign ? -f : f;
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// -- the block formats ---------------------------------------------------------------------------------------------
// Each: QK weights in BYTES bytes; GROUP weights share a Scale (``scales(block)`` reads a block's, once, and
// ``at(scales, g)`` is group g's); ``codes(block, scales, g, c)`` are the integer codes of the c-th VW weights of
// group g (CODES values they can take), in the transposed lane order where TRANSPOSED is set; ``value(scale, q)``
// is the weight a code (as a float) stands for, in gguf/quants.py's order of operations. A format of one group per
// block has Scales = Scale.

#if defined(__AVX512F__)
constexpr bool TRANSPOSING = true;  // the 4-bit formats read their codes in the transposed lane order
#else
constexpr bool TRANSPOSING = false;
#endif

// The low 4 bits of each lane, as a code of a 16-code format. On AVX-512 such codes only index a permute, which
// reads the low 4 bits of its index anyway.
inline ivec low4(ivec v) {
#if defined(__AVX512F__)
    return v;
#else
    return iand(v, 0x0F);
#endif
}

// Element e of a 32-weight block of nibbles: the low nibble of byte e, then (e >= 16) the high nibble of byte e - 16
// (bits above the nibble left set where the caller masks them: ``low4``).
inline ivec nibbles32(const uint8_t* qs, int c) { return isrl(iload_u8(qs + (c * VW) % 16), 4 * ((c * VW) / 16)); }

// The codes of chunk c of a 32-weight block of nibbles as a 16-code format reads them: transposed on AVX-512.
inline ivec nibble_codes32(const uint8_t* qs, int c) {
#if defined(__AVX512F__)
    return transposed_bytes(qs, 4 * c);
#else
    return low4(nibbles32(qs, c));
#endif
}

// Codes with bit 4 set in lane l where bit (first + l) of ``word`` is (Q5_0, Q5_1): on AVX-512 one masked or.
inline ivec with_bit4(ivec codes, uint32_t word, int first) {
#if defined(__AVX512F__)
    return _mm512_mask_or_epi32(codes, (__mmask16)(word >> first), codes, _mm512_set1_epi32(16));
#else
    return ior(codes, isll(ibits(word, first), 4));
#endif
}

// Codes with bit 4 set in lane l where bit g of ``bytes`` lane l is (Q5_K).
inline ivec with_bit4_of(ivec codes, ivec bytes, int g) {
#if defined(__AVX512F__)
    return _mm512_mask_or_epi32(codes, _mm512_test_epi32_mask(bytes, _mm512_set1_epi32(1 << g)), codes,
                                _mm512_set1_epi32(16));
#else
    return ior(codes, isll(iand(isrl(bytes, g), 1), 4));
#endif
}

// out[i] = scale * (float)p[i] for 8 bytes.
inline void scaled_bytes8(const uint8_t* p, float scale, float* out) {
#if defined(__AVX2__)
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))),
                                        _mm256_set1_ps(scale)));
#else
    for (int i = 0; i < 8; ++i) out[i] = scale * (float)p[i];
#endif
}

// Q4_0: f16 d; 16 bytes of nibbles. w = d * (q - 8).
struct Q4_0 {
    static constexpr int TYPE = 2, QK = 32, BYTES = 18, GROUP = 32, CODES = 16;
    static constexpr bool TRANSPOSED = TRANSPOSING;
    struct Scale { float d; };
    using Scales = Scale;
    static Scales scales(const uint8_t* b) { return {f16(b)}; }
    static Scale at(const Scales& s, int) { return s; }
    static ivec codes(const uint8_t* b, const Scales&, int, int c) { return nibble_codes32(b + 2, c); }
    static vec value(const Scale& s, vec q) { return vmul(vset(s.d), vsub(q, vset(8.0f))); }
};

// Q4_1: f16 d, f16 m; 16 bytes of nibbles. w = d * q + m.
struct Q4_1 {
    static constexpr int TYPE = 3, QK = 32, BYTES = 20, GROUP = 32, CODES = 16;
    static constexpr bool TRANSPOSED = TRANSPOSING;
    struct Scale { float d, m; };
    using Scales = Scale;
    static Scales scales(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
    static Scale at(const Scales& s, int) { return s; }
    static ivec codes(const uint8_t* b, const Scales&, int, int c) { return nibble_codes32(b + 4, c); }
    static vec value(const Scale& s, vec q) { return vadd(vmul(vset(s.d), q), vset(s.m)); }
};

// Q5_0: f16 d; 32 high bits (bit e for weight e); 16 bytes of low nibbles. w = d * (q - 16).
struct Q5_0 {
    static constexpr int TYPE = 6, QK = 32, BYTES = 22, GROUP = 32, CODES = 32;
    static constexpr bool TRANSPOSED = false;
    struct Scale { float d; };
    using Scales = Scale;
    static Scales scales(const uint8_t* b) { return {f16(b)}; }
    static Scale at(const Scales& s, int) { return s; }
    static ivec codes(const uint8_t* b, const Scales&, int, int c) {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        return with_bit4(iand(nibbles32(b + 6, c), 0x0F), qh, c * VW);
    }
    static vec value(const Scale& s, vec q) { return vmul(vset(s.d), vsub(q, vset(16.0f))); }
};

// Q5_1: f16 d, f16 m; 32 high bits; 16 bytes of low nibbles. w = d * q + m.
struct Q5_1 {
    static constexpr int TYPE = 7, QK = 32, BYTES = 24, GROUP = 32, CODES = 32;
    static constexpr bool TRANSPOSED = false;
    struct Scale { float d, m; };
    using Scales = Scale;
    static Scales scales(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
    static Scale at(const Scales& s, int) { return s; }
    static ivec codes(const uint8_t* b, const Scales&, int, int c) {
        uint32_t qh;
        memcpy(&qh, b + 4, 4);
        return with_bit4(iand(nibbles32(b + 8, c), 0x0F), qh, c * VW);
    }
    static vec value(const Scale& s, vec q) { return vadd(vmul(vset(s.d), q), vset(s.m)); }
};

// Q8_0: f16 d; 32 int8. w = q * d.
struct Q8_0 {
    static constexpr int TYPE = 8, QK = 32, BYTES = 34, GROUP = 32, CODES = 256;
    static constexpr bool TRANSPOSED = false;
    struct Scale { float d; };
    using Scales = Scale;
    static Scales scales(const uint8_t* b) { return {f16(b)}; }
    static Scale at(const Scales& s, int) { return s; }
    static ivec codes(const uint8_t* b, const Scales&, int, int c) { return iload_i8(b + 2 + c * VW); }
    static vec value(const Scale& s, vec q) { return vmul(q, vset(s.d)); }
};

// The 6-bit scales (bytes 0-7 of the result) and minimums (bytes 8-15) of the 8 groups, from the 12 bytes Q4_K and
// Q5_K share: for g < 4, s[g] & 63 and s[g + 4] & 63; for g >= 4, (s[g + 4] & 15) | (s[g - 4] >> 6) << 4 and
// (s[g + 4] >> 4) | (s[g] >> 6) << 4 (ggml's get_scale_min_k4, four bytes at a time as ggml's dot products do).
inline void scale_min_k4(const uint8_t* s, uint8_t out[16]) {
    uint32_t u[4] = {0, 0, 0, 0};
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mins = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins;
    u[0] &= 0x3f3f3f3fu;
    memcpy(out, u, 16);
}

// Q4_K: f16 d, f16 dmin; 12 bytes of 6-bit scales and minimums for 8 groups of 32; 128 bytes of nibbles, each 32
// bytes holding two groups (low nibbles, then high). w = (d * sc) * q - (dmin * m).
struct Q4_K {
    static constexpr int TYPE = 12, QK = 256, BYTES = 144, GROUP = 32, CODES = 16;
    static constexpr bool TRANSPOSED = TRANSPOSING;
    struct Scale { float dl, ml; };
    struct Scales { float dl[8], ml[8]; };
    static Scales scales(const uint8_t* b) {
        Scales s;
        alignas(16) uint8_t sm[16];
        scale_min_k4(b + 4, sm);
#if defined(__AVX512F__)
        // d (8 lanes) and dmin (8), times the 16 codes as floats: dl = d * sc and ml = dmin * m as gguf's, at once.
        uint32_t dm;
        memcpy(&dm, b, 4);
        const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                               _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_cvtsi32_si128((int)dm))));
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)sm));
        _mm512_storeu_ps(s.dl, _mm512_mul_ps(d, _mm512_cvtepi32_ps(codes)));
#else
        scaled_bytes8(sm, f16(b), s.dl);  // dl = d * sc, in the order d * (float)sc as gguf's
        scaled_bytes8(sm + 8, f16(b + 2), s.ml);
#endif
        return s;
    }
#if defined(__AVX512F__)
    // ``scales`` of four blocks at once, one block a 128-bit lane: their first 16 bytes are d, dmin (dword 0) and the
    // 12 bytes of scale_min_k4 (dwords 1-3), whose four output dwords are (D1 & 63s), (D3 & 15s) | (D1 >> 2 & 48s),
    // (D2 & 63s), (D3 >> 4 & 15s) | (D2 >> 2 & 48s).
    static void scales4(const uint8_t* const* b, Scales* s) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)b[0]));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)b[1]), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)b[2]), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)b[3]), 3);
        const __m512i low = _mm512_srlv_epi32(_mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(3, 2, 3, 1)),
                                              _mm512_set4_epi32(4, 0, 0, 0));
        const __m512i high = _mm512_and_si512(
            _mm512_srli_epi32(_mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(2, 2, 1, 1)), 2),
            _mm512_set4_epi32(0x30303030, 0, 0x30303030, 0));
        alignas(64) uint8_t sm[64];  // block k's 8 scales and 8 minimums: bytes 16k .. 16k + 15
        const __m512i mask = _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f);
        _mm512_store_si512(sm, _mm512_ternarylogic_epi32(low, high, mask, 0xEC));  // (low & mask) | high
        // d, dmin of the four blocks as floats: [d0, dmin0, d1, dmin1, ...]
        const __m512 dm = _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm512_castsi512_si128(  // AVX-512F's own conversion
            _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v))));
        for (int k = 0; k < 4; ++k) {
            const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(2 * k),
                                                  _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
            const __m512i codes = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(sm + 16 * k)));
            _mm512_storeu_ps(s[k].dl, _mm512_mul_ps(_mm512_permutexvar_ps(pick, dm), _mm512_cvtepi32_ps(codes)));
        }
    }
#endif
    static Scale at(const Scales& s, int g) { return {s.dl[g], s.ml[g]}; }
    static ivec codes(const uint8_t* b, const Scales&, int g, int c) {
#if defined(__AVX512F__)
        return transposed_bytes(b + 16 + (g / 2) * 32 + c * 16, 4 * (g % 2));
#else
        return low4(isrl(iload_u8(b + 16 + (g / 2) * 32 + c * VW), 4 * (g % 2)));
#endif
    }
    static vec value(const Scale& s, vec q) { return vsub(vmul(vset(s.dl), q), vset(s.ml)); }
};

// Q5_K: Q4_K's scales; 32 bytes of high bits (bit g of byte l for weight l of group g); 128 bytes of nibbles.
struct Q5_K {
    static constexpr int TYPE = 13, QK = 256, BYTES = 176, GROUP = 32, CODES = 32;
    static constexpr bool TRANSPOSED = false;
    using Scale = Q4_K::Scale;
    using Scales = Q4_K::Scales;
    static Scales scales(const uint8_t* b) { return Q4_K::scales(b); }
#if defined(__AVX512F__)
    static void scales4(const uint8_t* const* b, Scales* s) { Q4_K::scales4(b, s); }
#endif
    static Scale at(const Scales& s, int g) { return Q4_K::at(s, g); }
    static ivec codes(const uint8_t* b, const Scales&, int g, int c) {
        const ivec low = iand(isrl(iload_u8(b + 48 + (g / 2) * 32 + c * VW), 4 * (g % 2)), 0x0F);
        return with_bit4_of(low, iload_u8(b + 16 + c * VW), g);
    }
    static vec value(const Scale& s, vec q) { return Q4_K::value(s, q); }
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 weights), f16 d.
// Weight e: h = e / 128, r = e % 128; low nibble of byte h*64 + r%64 (shifted by 4 * (r / 64)); high bits of byte
// 128 + h*32 + r%32 (shifted by 2 * (r / 32)). w = (d * sc) * (q - 32). A block's 256 codes minus 32 are
// assembled once per block as bytes, 64 at a time on AVX-512 and 32 on AVX2 (``six_bit_codes``), and widened per
// chunk.
inline void six_bit_codes(const uint8_t* b, int8_t* q) {
#if defined(__AVX512BW__)
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3), bias = _mm512_set1_epi8(32);
    // 16-bit lanes 0-15 shift by a, 16-31 by b: each 32-byte half of the codes reads its own bit pair.
    const __m512i shifts_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shifts_hi = _mm512_add_epi16(shifts_lo, _mm512_set1_epi16(4));
    for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512((const void*)(b + h * 64));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + h * 32)));
        const __m512i hi_lo = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shifts_lo), m2), 4);
        const __m512i hi_hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shifts_hi), m2), 4);
        const __m512i low = _mm512_or_si512(_mm512_and_si512(ql, m4), hi_lo);
        const __m512i high = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), hi_hi);
        _mm512_storeu_si512((void*)(q + h * 128), _mm512_sub_epi8(low, bias));
        _mm512_storeu_si512((void*)(q + h * 128 + 64), _mm512_sub_epi8(high, bias));
    }
#elif defined(__AVX2__)
    // Codes r of a half: r < 32 low nibbles of ql[0, 32) with qh bits 0-1; < 64 of ql[32, 64) with bits 2-3; < 96
    // high nibbles of ql[0, 32) with bits 4-5; < 128 of ql[32, 64) with bits 6-7. (16-bit shifts: what crosses a
    // byte is masked off.)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(b + h * 64));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i*)(b + h * 64 + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + h * 32));
        const __m256i codes[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2))};
        for (int k = 0; k < 4; ++k)
            _mm256_storeu_si256((__m256i*)(q + h * 128 + 32 * k), _mm256_sub_epi8(codes[k], bias));
    }
#else
    for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128;
        const int low = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        const int high = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
        q[e] = (int8_t)((low | (high << 4)) - 32);
    }
#endif
}

struct Q6_K {
    static constexpr int TYPE = 14, QK = 256, BYTES = 210, GROUP = 16, CODES = 256;  // codes minus 32, as int8
    static constexpr bool TRANSPOSED = false;
    struct Scale { float dl; };
    struct Scales { float dl[16]; int8_t q[256]; };
    static Scales scales(const uint8_t* b) {
        Scales s;
        const vec d = vset(f16(b + 208));
        for (int g = 0; g < 16; g += VW) vstore(s.dl + g, vmul(d, vcvt(iload_i8(b + 192 + g))));  // d * (float)sc
        six_bit_codes(b, s.q);
        return s;
    }
    static Scale at(const Scales& s, int g) { return {s.dl[g]}; }
    static ivec codes(const uint8_t*, const Scales& s, int g, int c) {
        return iload_i8((const uint8_t*)s.q + g * 16 + c * VW);
    }
    static vec value(const Scale& s, vec q) { return vmul(vset(s.dl), q); }  // q - 32 is exact in fp32
};

// What a group of weights needs before its codes are read: its scale and, where a permute can look it up (AVX-512,
// at most 32 codes), the value of every code.
template <class F>
struct Prepared {
    typename F::Scale s;
#if defined(__AVX512F__)
    vec t0, t1;
#endif
};

template <class F>
inline Prepared<F> prepare(const typename F::Scales& scales, int g) {
    Prepared<F> p;
    p.s = F::at(scales, g);
#if defined(__AVX512F__)
    if constexpr (F::CODES <= 32) p.t0 = F::value(p.s, iota(0));
    if constexpr (F::CODES > 16 && F::CODES <= 32) p.t1 = F::value(p.s, iota(16));
#endif
    return p;
}

// The c-th VW weights of group g of block b, as floats, in the format's lane order.
template <class F>
inline vec weights(const uint8_t* b, const typename F::Scales& s, int g, int c, const Prepared<F>& p) {
#if defined(__AVX512F__)
    if constexpr (F::CODES <= 16) return _mm512_permutexvar_ps(F::codes(b, s, g, c), p.t0);
    if constexpr (F::CODES <= 32) return _mm512_permutex2var_ps(p.t0, F::codes(b, s, g, c), p.t1);
#endif
    return F::value(p.s, vcvt(F::codes(b, s, g, c)));
}

// Scales kept in memory: the group tables then broadcast them from there (a load) rather than from a register (a
// shuffle, on the port the permutes need).
template <class T>
inline void in_memory(const T& s) {
#if defined(__GNUC__)
    asm volatile("" : : "r"(&s) : "memory");
#endif
}

template <class F, class = void>
struct has_scales4 : std::false_type {};
template <class F>
struct has_scales4<F, std::void_t<decltype(&F::scales4)>> : std::true_type {};

// The scales of the n blocks at b[0, n) into s[0, n): four at a time where the format decodes them so.
template <class F>
inline void decode_scales(const uint8_t* const* b, int n, typename F::Scales* s) {
    int k = 0;
    if constexpr (has_scales4<F>::value)
        for (; k + 4 <= n; k += 4) F::scales4(b + k, s + k);
    for (; k < n; ++k) s[k] = F::scales(b[k]);
}

// Block ``w`` (its scales decoded) to out[c * stride] for its chunks c, in the format's lane order.
template <class F>
ALWAYS_INLINE void dequantize_block(const uint8_t* __restrict w, const typename F::Scales& scales,
                                    float* __restrict out, int64_t stride) {
    UNROLL for (int g = 0; g < F::QK / F::GROUP; ++g) {
        const Prepared<F> p = prepare<F>(scales, g);
        UNROLL for (int c = 0; c < F::GROUP / VW; ++c)
            vstore(out + (g * F::GROUP / VW + c) * stride, weights<F>(w, scales, g, c, p));
    }
}

// Blocks [0, blocks) of weight row ``w`` to out[c * stride] for their chunks c, in the format's lane order.
template <class F>
void dequantize_blocks(const uint8_t* w, int64_t blocks, float* out, int64_t stride) {
    for (int64_t blk = 0; blk < blocks; ++blk, w += F::BYTES, out += F::QK / VW * stride) {
        const typename F::Scales scales = F::scales(w);
        in_memory(scales);
        dequantize_block<F>(w, scales, out, stride);
    }
}

// Row ``w`` (K / QK blocks) dequantized into ``out`` (K floats), in the natural order.
template <class F>
void dequantize_row(const uint8_t* w, int64_t K, float* out) {
    dequantize_blocks<F>(w, K / F::QK, out, VW);
#if defined(__AVX512F__)
    if constexpr (F::TRANSPOSED)
        for (int64_t k = 0; k < K; k += VW) vstore(out + k, transpose_lanes(vload(out + k)));
#endif
}

// A buffer of at least n floats on a cache line's boundary. Each thread keeps its buffers from call to call (a
// decoding step is too short to pay for allocating and zeroing them every time), those of up to KEEP_LINES lines.
struct alignas(64) Line { float f[16]; };
constexpr size_t KEEP_LINES = 1 << 16;  // 4 MB
thread_local std::vector<Line> packed_rows, panel_scratch, panel_sums;
inline float* lines(std::vector<Line>& buf, int64_t n) {
    const size_t need = (size_t)(n + 15) / 16;
    if (buf.size() < need) {
        buf.resize(need);
    } else if (buf.size() > KEEP_LINES && buf.size() > need) {
        buf.resize(need);
        buf.shrink_to_fit();
    }
    return buf[0].f;
}

// x[i, kc * VW + l] to xp[(kc * M + i) * VW + l] for the chunks kc in [c0, c1), in F's lane order.
template <class F>
void pack_rows(const float* x, int64_t ldx, int64_t M, int64_t c0, int64_t c1, float* xp) {
    for (int64_t kc = c0; kc < c1; ++kc)
        for (int64_t i = 0; i < M; ++i) {
            vec v = vload(x + i * ldx + kc * VW);
#if defined(__AVX512F__)
            if constexpr (F::TRANSPOSED) v = transpose_lanes(v);
#endif
            vstore(xp + (kc * M + i) * VW, v);
        }
}

// The R * C accumulators of a tile, to and from acc[(i * C + j) * VW]; and one chunk's FMAs: a[i][j] += packed row i
// times weight vector j, for R rows one input register at a time (R * C + C + 1 registers in all).
template <int R, int C>
ALWAYS_INLINE void load_acc(vec (&a)[R][C], const float* acc) {
    UNROLL for (int i = 0; i < R; ++i)
        UNROLL for (int j = 0; j < C; ++j) a[i][j] = vload(acc + (i * C + j) * VW);
}
template <int R, int C>
ALWAYS_INLINE void store_acc(const vec (&a)[R][C], float* acc) {
    UNROLL for (int i = 0; i < R; ++i)
        UNROLL for (int j = 0; j < C; ++j) vstore(acc + (i * C + j) * VW, a[i][j]);
}
template <int R, int C>
ALWAYS_INLINE void fma_rows(vec (&a)[R][C], const float* xp, const vec (&wv)[C]) {
    UNROLL for (int i = 0; i < R; ++i) {
        vec xv = vload(xp + i * VW);
        keep_in_register(xv);
        UNROLL for (int j = 0; j < C; ++j) a[i][j] = vfma(xv, wv[j], a[i][j]);
    }
}

// acc[(i * C + j) * VW] += the lane-wise products of packed rows i < R (xs floats from one chunk to the next) and
// scratch rows j < C (C * VW floats a chunk) over ``chunks`` chunks: R * C FMAs per R + C loads.
template <int R, int C>
NOINLINE void tile(const float* xp, int64_t xs, const float* w, int64_t chunks, float* acc) {
    vec a[R][C];
    load_acc(a, acc);
    for (int64_t kc = 0; kc < chunks; ++kc, xp += xs, w += C * VW) {
        vec wv[C];
        UNROLL for (int j = 0; j < C; ++j) wv[j] = vload(w + j * VW);
        fma_rows(a, xp, wv);
    }
    store_acc(a, acc);
}

// The tile for r <= R rows.
template <int C, int R>
void tile_rows(int r, const float* xp, int64_t xs, const float* w, int64_t chunks, float* acc) {
    if constexpr (R > 1)
        if (r < R) return tile_rows<C, R - 1>(r, xp, xs, w, chunks, acc);
    tile<R, C>(xp, xs, w, chunks, acc);
}

// ``tile`` over C weight rows of F's blocks (ldw bytes apart, ``blocks`` of them), dequantized in registers: for a
// pass of few rows, where a scratch's stores and loads cost more than they save. The rows ``next`` on are prefetched
// block by block alongside.
template <int R, int C, class F>
NOINLINE void tile_blocks(const float* xp, int64_t xs, const uint8_t* w, int64_t ldw, int64_t blocks, float* acc,
                          const uint8_t* next) {
    vec a[R][C];
    load_acc(a, acc);
    for (int64_t blk = 0; blk < blocks; ++blk, w += F::BYTES) {
        if (next) {
            for (int j = 0; j < C; ++j)
                for (int off = 0; off < F::BYTES; off += 64)
                    __builtin_prefetch(next + j * ldw + blk * F::BYTES + off, 0, 2);
        }
        typename F::Scales scales[C];
        const uint8_t* rows[C];
        UNROLL for (int j = 0; j < C; ++j) rows[j] = w + j * ldw;
        decode_scales<F>(rows, C, scales);
        in_memory(scales);
        UNROLL for (int g = 0; g < F::QK / F::GROUP; ++g) {
            Prepared<F> p[C];
            UNROLL for (int j = 0; j < C; ++j) p[j] = prepare<F>(scales[j], g);
            UNROLL for (int c = 0; c < F::GROUP / VW; ++c, xp += xs) {
                vec wv[C];
                UNROLL for (int j = 0; j < C; ++j) wv[j] = weights<F>(w + j * ldw, scales[j], g, c, p[j]);
                fma_rows(a, xp, wv);
            }
        }
    }
    store_acc(a, acc);
}

template <int C, class F, int R>
void tile_blocks_rows(int r, const float* xp, int64_t xs, const uint8_t* w, int64_t ldw, int64_t blocks, float* acc,
                      const uint8_t* next) {
    if constexpr (R > 1)
        if (r < R) return tile_blocks_rows<C, F, R - 1>(r, xp, xs, w, ldw, blocks, acc, next);
    tile_blocks<R, C, F>(xp, xs, w, ldw, blocks, acc, next);
}

// y[i, n0 + j] = the horizontal sum of accumulator (i, j) (+ b[n0 + j]) for i < M, j < rows, from the panel's
// accumulators acc[((j / C) * M + i) * C + j % C]: VW consecutive ones at a time, each paired as linear.cpp pairs a
// vector's lanes (vec.h's vsums, or ``transposed_sums``). ``acc`` holds VW vectors past the panel's.
template <class F, int C>
void store_sums(const float* acc, int panel, int rows, int64_t M, const float* b, float* y, int64_t ldy, int64_t n0) {
    alignas(64) float sums[VW];
    int64_t i = 0;
    int j0 = 0, jc = 0;  // accumulator t is (i, j0 + jc)
    for (int64_t t0 = 0; t0 < panel * M; t0 += VW) {
        const hfspec_vec::vec* v = (const hfspec_vec::vec*)(acc + t0 * VW);
#if defined(__AVX512F__)
        if constexpr (F::TRANSPOSED)
            vstore(sums, transposed_sums(v));
        else
#endif
            vstore(sums, hfspec_vec::vsums(v));
        for (int u = 0; u < VW && j0 < rows; ++u) {
            if (j0 + jc < rows) y[i * ldy + n0 + j0 + jc] = sums[u] + (b ? b[n0 + j0 + jc] : 0.0f);
            if (++jc == C) {
                jc = 0;
                if (++i == M) i = 0, j0 += C;
            }
        }
    }
}

constexpr int KC = 512;  // weights per slice: a multiple of every format's block
// Weight rows further on are prefetched as they stream, into L2 as linear.cpp does: a short row (K = 1536 is 864
// bytes of Q4_K) ends before the hardware's stream prefetcher has ramped up.
constexpr int PREFETCH_ROWS_AHEAD = 8;

// The linear in shape (R, C, P): panels of P weight rows dequantized slice by slice into a scratch, or (P = 0) blocks
// of C weight rows dequantized in registers by every pass of rows.
template <int R, int C, int P, class F>
void linear_panels(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const float* b, float* y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, int threads) {
    constexpr int PN = P ? P : C;  // weight rows per panel
    static_assert(PN % C == 0 && KC % F::QK == 0, "a panel holds whole blocks of weight rows, a slice whole blocks");
    const int64_t chunks = K / VW, panels = (N + PN - 1) / PN, passes = (M + R - 1) / R;
    constexpr int64_t AHEAD = (PREFETCH_ROWS_AHEAD + PN - 1) / PN * PN;
    float* xp = lines(packed_rows, chunks * M * VW);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < chunks; c0 += 64)
            pack_rows<F>(x, ldx, M, c0, c0 + 64 < chunks ? c0 + 64 : chunks, xp);
        float* scratch = P ? lines(panel_scratch, P * KC) : nullptr;  // [P / C][KC / VW][C][VW]
        float* acc = lines(panel_sums, (PN * M + VW) * VW);           // [P / C][M][C][VW], then VW zeros
        memset(acc + PN * M * VW, 0, sizeof(float) * VW * VW);
        const uint8_t* blocks[P ? P * KC / F::QK : 1];                  // a slice's blocks, row by row
        std::vector<typename F::Scales> scales(P ? P * KC / F::QK : 0);  // and their scales
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < panels; ++pn) {
            const int64_t n0 = pn * PN;
            const int rows = (int)(N - n0 < PN ? N - n0 : PN);
            const int ahead = (int)(N - n0 - AHEAD < PN ? N - n0 - AHEAD : PN);  // rows of the panel prefetched
            memset(acc, 0, sizeof(float) * PN * M * VW);
            if constexpr (P == 0) {
                // A short last block repeats its last row (summed, never stored).
                const uint8_t* rows_w = w + n0 * ldw;
                std::vector<uint8_t> padded;
                if (rows < C) {
                    padded.resize(C * ldw);
                    for (int j = 0; j < C; ++j)
                        memcpy(padded.data() + j * ldw, rows_w + (j < rows ? j : rows - 1) * ldw, ldw);
                    rows_w = padded.data();
                }
                for (int64_t p = 0, m0 = 0; p < passes; ++p) {
                    const int r = (int)((M - m0 + (passes - p) - 1) / (passes - p));
                    tile_blocks_rows<C, F, R>(r, xp + m0 * VW, M * VW, rows_w, ldw, K / F::QK, acc + m0 * C * VW,
                                              p == 0 && ahead == PN ? w + (n0 + AHEAD) * ldw : nullptr);
                    m0 += r;
                }
            } else {
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kn = K - k0 < KC ? K - k0 : KC, from = k0 / F::QK * F::BYTES;
                    const int64_t bytes = kn / F::QK * F::BYTES;
                    for (int j = 0; j < ahead; ++j)
                        for (int64_t o = 0; o < bytes; o += 64)
                            __builtin_prefetch(w + (n0 + AHEAD + j) * ldw + from + o, 0, 2);
                    // Every block's scales first (a short last panel repeats its last row in the slots past it,
                    // summed, never stored), then the weights.
                    const int nb = (int)(kn / F::QK);
                    for (int j = 0; j < P; ++j)
                        for (int k = 0; k < nb; ++k)
                            blocks[j * nb + k] = w + (n0 + (j < rows ? j : rows - 1)) * ldw + from + k * F::BYTES;
                    decode_scales<F>(blocks, P * nb, scales.data());
                    for (int j = 0; j < P; ++j)
                        for (int k = 0; k < nb; ++k)
                            dequantize_block<F>(blocks[j * nb + k], scales[j * nb + k],
                                                scratch + ((j / C) * (KC / VW) * C + k * F::QK / VW * C + j % C) * VW,
                                                C * VW);
                    for (int blk = 0; blk < P / C; ++blk)
                        for (int64_t p = 0, m0 = 0; p < passes; ++p) {
                            // Passes of about equal size (9 rows in passes of up to 8: 5 + 4).
                            const int r = (int)((M - m0 + (passes - p) - 1) / (passes - p));
                            tile_rows<C, R>(r, xp + (k0 / VW * M + m0) * VW, M * VW,
                                            scratch + blk * (KC / VW) * C * VW, kn / VW, acc + (blk * M + m0) * C * VW);
                            m0 += r;
                        }
                }
            }
            store_sums<F, C>(acc, PN, rows, M, b, y, ldy, n0);
        }
    }
}

// Block shapes (rows R, weight rows C, panel P) a caller chooses from by index, timed per machine by
// hfspec/cpu/plan.py as the fp32 kernel's are. A tile holds R * C accumulators, C weight registers and one input
// register (dequantized in registers, P = 0: C value tables besides, on AVX-512). Few rows take the P = 0 shapes
// (one row: 8 weight rows at once, enough chains of FMAs to hide their latency), more rows a panel: measured on one
// Sapphire Rapids core, 8 rows over Q4_K 8960x1536 ran 6.9 cycles per 16 weights and row in panels, 8.4 in registers.
#if defined(__AVX512F__)
constexpr int SHAPES[][3] = {{1, 8, 0}, {4, 4, 0}, {4, 6, 6}, {8, 3, 6}, {6, 4, 8}};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int SHAPES[][3] = {{4, 2, 0}, {2, 4, 0}, {4, 3, 6}, {6, 2, 6}};
#else
constexpr int SHAPES[][3] = {{2, 2, 0}, {4, 2, 4}};
#endif
constexpr int SHAPE_COUNT = sizeof(SHAPES) / sizeof(SHAPES[0]);

template <int I, class F>
void linear_at(int shape, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const float* b, float* y,
               int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if constexpr (I + 1 < SHAPE_COUNT)
        if (shape != I) return linear_at<I + 1, F>(shape, x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
    linear_panels<SHAPES[I][0], SHAPES[I][1], SHAPES[I][2], F>(x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
}

// Calls ``fn.template operator()<F>()`` for the format with ggml type id ``type``; false if there is none.
template <class Fn>
bool with_format(int type, Fn&& fn) {
    switch (type) {
        case Q4_0::TYPE: fn(Q4_0{}); return true;
        case Q4_1::TYPE: fn(Q4_1{}); return true;
        case Q5_0::TYPE: fn(Q5_0{}); return true;
        case Q5_1::TYPE: fn(Q5_1{}); return true;
        case Q8_0::TYPE: fn(Q8_0{}); return true;
        case Q4_K::TYPE: fn(Q4_K{}); return true;
        case Q5_K::TYPE: fn(Q5_K{}); return true;
        case Q6_K::TYPE: fn(Q6_K{}); return true;
        default: return false;
    }
}

}  // namespace

extern "C" {

const char* hfspec_quant_isa() { return ISA; }

int hfspec_quant_shape_count() { return SHAPE_COUNT; }

// Shape ``i``: rows per pass, weight rows per tile, weight rows per panel (0: dequantized in registers).
void hfspec_quant_shape(int i, int* rows, int* cols, int* panel) {
    *rows = SHAPES[i][0];
    *cols = SHAPES[i][1];
    *panel = SHAPES[i][2];
}

// Whether ggml type ``type`` is read here (the rest are dequantized at load by the caller).
int hfspec_quant_supports(int type) {
    return with_format(type, [](auto) {});
}

// y = x @ dequant(w)^T + b for w of ggml type ``type`` (N rows of ldw bytes, K a multiple of its block size);
// ``shape`` indexes SHAPES (out of range: the last). Returns 0 for a type it does not read.
int hfspec_quant_linear(int type, int shape, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw,
                        const float* b, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    return with_format(type, [&](auto f) {
        linear_at<0, decltype(f)>(shape, x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
    });
}

// out[i, :] = dequant(w row rows[i]) (or row i, where ``rows`` is null) for i < n; ldo floats between out rows.
int hfspec_quant_rows(int type, const uint8_t* w, int64_t ldw, const int64_t* rows, int64_t n, int64_t K, float* out,
                      int64_t ldo, int threads) {
    return with_format(type, [&](auto f) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 16)
        for (int64_t i = 0; i < n; ++i)
            dequantize_row<decltype(f)>(w + (rows ? rows[i] : i) * ldw, K, out + i * ldo);
    });
}

}
