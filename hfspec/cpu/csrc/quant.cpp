// Linear layers over GGUF's quantized blocks: y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ b[N]), fp32 x, y and b.
//
// The weights stay as the file stores them, N rows of K / QK blocks each. Every output is what linear.cpp's fp32
// kernel computes on the dequantized weights, bit for bit: the same lane-wise FMAs over K in chunks of VW, in
// order, the same horizontal sum, then the bias. That holds because each weight is dequantized in registers to
// exactly the float the gguf package's numpy code (what transformers loads) gives it: the same fp32 operations in
// the same order, e.g. Q4_K's dl = d * sc, ml = dmin * m, w = dl * q - ml. (Every product in those formulas is
// exact in fp32 -- an f16 times a code of at most 8 bits, or that times a code of at most 6 -- so a compiler
// that fuses `dl * q - ml` into one FMA rounds it exactly as the unfused pair does.)
//
// The loops are linear.cpp's: each thread takes a contiguous range of output rows and, for each block of C weight
// rows, runs every block of R input rows over it, so the weights stream from memory once per call and M rows
// cost about what one row costs. A weight block is dequantized once per pass of rows and used for all of them
// while in registers. With more rows than one pass holds (prompts), the C weight rows are dequantized once into a
// per-thread scratch buffer and the fp32 loop runs every pass over it.
//
// One small struct per block format says where its codes sit and what value a code stands for (ggml-quants.c's
// layouts; gguf/quants.py's arithmetic). On AVX-512 a format of at most 32 codes builds, per group of weights
// sharing a scale, the table of every value a code can take (the same fp32 operations on each code), and a weight
// vector is one permute of it.
#include <stdint.h>
#include <string.h>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

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
#define UNROLL _Pragma("GCC unroll 16")
#else
#define NOINLINE
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
// group g
// (CODES values they can take); ``value(scale, q)`` is the weight a code (as a float) stands for, in
// gguf/quants.py's order of operations. A format of one group per block has Scales = Scale.

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
    struct Scale { float d; };
    using Scales = Scale;
    static Scales scales(const uint8_t* b) { return {f16(b)}; }
    static Scale at(const Scales& s, int) { return s; }
    static ivec codes(const uint8_t* b, const Scales&, int, int c) { return low4(nibbles32(b + 2, c)); }
    static vec value(const Scale& s, vec q) { return vmul(vset(s.d), vsub(q, vset(8.0f))); }
};

// Q4_1: f16 d, f16 m; 16 bytes of nibbles. w = d * q + m.
struct Q4_1 {
    static constexpr int TYPE = 3, QK = 32, BYTES = 20, GROUP = 32, CODES = 16;
    struct Scale { float d, m; };
    using Scales = Scale;
    static Scales scales(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
    static Scale at(const Scales& s, int) { return s; }
    static ivec codes(const uint8_t* b, const Scales&, int, int c) { return low4(nibbles32(b + 4, c)); }
    static vec value(const Scale& s, vec q) { return vadd(vmul(vset(s.d), q), vset(s.m)); }
};

// Q5_0: f16 d; 32 high bits (bit e for weight e); 16 bytes of low nibbles. w = d * (q - 16).
struct Q5_0 {
    static constexpr int TYPE = 6, QK = 32, BYTES = 22, GROUP = 32, CODES = 32;
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
    struct Scale { float dl, ml; };
    struct Scales { float dl[8], ml[8]; };
    static Scales scales(const uint8_t* b) {
        Scales s;
        uint8_t sm[16];
        scale_min_k4(b + 4, sm);
        scaled_bytes8(sm, f16(b), s.dl);  // dl = d * sc, in the order d * (float)sc as gguf's
        scaled_bytes8(sm + 8, f16(b + 2), s.ml);
        return s;
    }
    static Scale at(const Scales& s, int g) { return {s.dl[g], s.ml[g]}; }
    static ivec codes(const uint8_t* b, const Scales&, int g, int c) {
        return low4(isrl(iload_u8(b + 16 + (g / 2) * 32 + c * VW), 4 * (g % 2)));
    }
    static vec value(const Scale& s, vec q) { return vsub(vmul(vset(s.dl), q), vset(s.ml)); }
};

// Q5_K: Q4_K's scales; 32 bytes of high bits (bit g of byte l for weight l of group g); 128 bytes of nibbles.
struct Q5_K {
    static constexpr int TYPE = 13, QK = 256, BYTES = 176, GROUP = 32, CODES = 32;
    using Scale = Q4_K::Scale;
    using Scales = Q4_K::Scales;
    static Scales scales(const uint8_t* b) { return Q4_K::scales(b); }
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
// assembled once per block as bytes, 64 at a time on AVX-512 (``six_bit_codes``), and widened per chunk.
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
    struct Scale { float dl; };
    struct Scales { float dl[16]; int8_t q[256]; };
    static Scales scales(const uint8_t* b) {
        Scales s;
        const float d = f16(b + 208);
        for (int g = 0; g < 16; ++g) s.dl[g] = d * (float)(int8_t)b[192 + g];
        six_bit_codes(b, s.q);
        return s;
    }
    static Scale at(const Scales& s, int g) { return {s.dl[g]}; }
    static ivec codes(const uint8_t*, const Scales& s, int g, int c) {
        return iload_i8((const uint8_t*)s.q + g * 16 + c * VW);
    }
    static vec value(const Scale& s, vec q) { return vmul(vset(s.dl), q); }  // q - 32 is exact in fp32
};

// fp32 weights (the scratch rows of a many-row call): VW floats per "block", loaded as they are.
struct F32 {
    static constexpr int TYPE = 0, QK = VW, BYTES = VW * 4, GROUP = VW, CODES = 0;
    struct Scale {};
    using Scales = Scale;
    static Scales scales(const uint8_t*) { return {}; }
    static Scale at(const Scales&, int) { return {}; }
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
    if constexpr (F::TYPE != 0) {
        p.s = F::at(scales, g);
#if defined(__AVX512F__)
        if constexpr (F::CODES <= 32) p.t0 = F::value(p.s, iota(0));
        if constexpr (F::CODES > 16 && F::CODES <= 32) p.t1 = F::value(p.s, iota(16));
#endif
    }
    return p;
}

// The c-th VW weights of group g of block b, as floats.
template <class F>
inline vec weights(const uint8_t* b, const typename F::Scales& s, int g, int c, const Prepared<F>& p) {
    if constexpr (F::TYPE == 0) {
        return vload((const float*)b + g * F::GROUP + c * VW);
    } else {
#if defined(__AVX512F__)
        if constexpr (F::CODES <= 16) return _mm512_permutexvar_ps(F::codes(b, s, g, c), p.t0);
        if constexpr (F::CODES <= 32) return _mm512_permutex2var_ps(p.t0, F::codes(b, s, g, c), p.t1);
#endif
        return F::value(p.s, vcvt(F::codes(b, s, g, c)));
    }
}

// Row ``w`` (K / QK blocks) dequantized into ``out`` (K floats).
template <class F>
void dequantize_row(const uint8_t* w, int64_t K, float* out) {
    for (int64_t blk = 0; blk < K / F::QK; ++blk, w += F::BYTES, out += F::QK) {
        const typename F::Scales scales = F::scales(w);
        UNROLL for (int g = 0; g < F::QK / F::GROUP; ++g) {
            const Prepared<F> p = prepare<F>(scales, g);
            UNROLL for (int c = 0; c < F::GROUP / VW; ++c)
                vstore(out + g * F::GROUP + c * VW, weights<F>(w, scales, g, c, p));
        }
    }
}

// Weight rows further on are prefetched as a block streams in (into L2, as linear.cpp does): a short row (K = 1536
// is 864 bytes of Q4_K) ends before the hardware's stream prefetcher has ramped up. One thread streamed 8960 such
// rows at 4.1 GB/s without, 6.6 with the rows 4 on (8 and 16 on: 6.4); Q6_K, Q5_0 and Q8_0 gained alike.
constexpr int PREFETCH_ROWS_AHEAD = 4;

// sums[i * NB + j] = dot(x row i, dequantized w row j) over K, for R input rows and C weight rows (ldw bytes apart).
// With ``next`` set, the NB rows from there are prefetched, block by block, alongside.
template <int R, int C, int NB, class F>
NOINLINE void block(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t K, float* sums,
                    const uint8_t* next) {
    vec acc[R][C];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) acc[i][j] = vzero();
    for (int64_t blk = 0; blk < K / F::QK; ++blk, w += F::BYTES, x += F::QK) {
        if (next) {
            for (int j = 0; j < NB; ++j)
                for (int off = 0; off < F::BYTES; off += 64) __builtin_prefetch(next + j * ldw + blk * F::BYTES + off, 0, 2);
        }
        typename F::Scales scales[C];
        for (int j = 0; j < C; ++j) scales[j] = F::scales(w + j * ldw);
        UNROLL for (int g = 0; g < F::QK / F::GROUP; ++g) {
            Prepared<F> p[C];
            for (int j = 0; j < C; ++j) p[j] = prepare<F>(scales[j], g);
            UNROLL for (int c = 0; c < F::GROUP / VW; ++c) {
                vec wv[C];
                for (int j = 0; j < C; ++j) wv[j] = weights<F>(w + j * ldw, scales[j], g, c, p[j]);
                for (int i = 0; i < R; ++i) {
                    vec xv = vload(x + i * ldx + g * F::GROUP + c * VW);
                    keep_in_register(xv);
                    for (int j = 0; j < C; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) sums[i * NB + j] = vsum(acc[i][j]);
}

// The block for r <= R rows (all C weight rows: a short last block of weight rows repeats its last row instead).
template <int C, int NB, class F, int R>
void block_rows(int r, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t K, float* sums,
                const uint8_t* next) {
    if constexpr (R > 1)
        if (r < R) return block_rows<C, NB, F, R - 1>(r, x, ldx, w, ldw, K, sums, next);
    block<R, C, NB, F>(x, ldx, w, ldw, K, sums, next);
}

template <int MB, int NB, class F>
void linear_shaped(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const float* b, float* y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t blocks = (N + NB - 1) / NB;
    const int64_t passes = (M + MB - 1) / MB;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scratch(passes > 1 ? NB * K : 0);  // the fp32 rows of one weight block, per thread
        float sums[MB * NB];
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; ++nb) {
            const int64_t n0 = nb * NB;
            const int C = (int)(N - n0 < NB ? N - n0 : NB);
            // A short last block runs over the last NB rows (the first NB - C of them the block before's, summed
            // again to the same bits and not stored); a matrix of fewer than NB rows repeats its last row.
            const uint8_t* rows = w + n0 * ldw;
            int skip = 0;
            std::vector<uint8_t> padded;
            if (C < NB && N >= NB) {
                rows = w + (N - NB) * ldw;
                skip = NB - C;
            } else if (C < NB) {
                padded.resize(NB * ldw);
                for (int j = 0; j < NB; ++j) memcpy(padded.data() + j * ldw, w + (j < C ? j : C - 1) * ldw, ldw);
                rows = padded.data();
            }
            // The rows PREFETCH_ROWS_AHEAD on (in whole blocks of NB), prefetched during the first pass.
            const int64_t ahead = (PREFETCH_ROWS_AHEAD + NB - 1) / NB * NB;
            const uint8_t* next = n0 + ahead + NB <= N ? w + (n0 + ahead) * ldw : nullptr;
            if (passes > 1)
                for (int j = 0; j < NB; ++j) dequantize_row<F>(rows + j * ldw, K, scratch.data() + j * K);
            for (int64_t p = 0, m0 = 0; p < passes; ++p) {
                // Passes of about equal size, as linear.cpp's (9 rows in blocks of 8: 5 + 4).
                const int R = (int)((M - m0 + (passes - p) - 1) / (passes - p));
                if (passes > 1)
                    block_rows<NB, NB, F32, MB>(R, x + m0 * ldx, ldx, (const uint8_t*)scratch.data(), K * 4, K, sums,
                                                nullptr);
                else
                    block_rows<NB, NB, F, MB>(R, x + m0 * ldx, ldx, rows, ldw, K, sums, next);
                for (int i = 0; i < R; ++i)
                    for (int j = 0; j < C; ++j)
                        y[(m0 + i) * ldy + n0 + j] = sums[i * NB + skip + j] + (b ? b[n0 + j] : 0.0f);
                m0 += R;
            }
        }
    }
}

// Block shapes (rows, weight rows) a caller chooses from by index, timed per machine by hfspec/cpu/plan.py as the
// fp32 kernel's are. Enough independent sums to cover the FMA latency even for one row (R * C >= 4), and room
// for the value tables of C weight rows. (A 16 x 1 shape on AVX-512 streamed 12 and 16 rows slower than two
// passes of 8 x 2 over the scratch rows, and doubled the build time.)
#if defined(__AVX512F__)
constexpr int SHAPES[][2] = {{8, 2}, {4, 4}};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int SHAPES[][2] = {{8, 1}, {4, 2}, {2, 4}};
#else
constexpr int SHAPES[][2] = {{4, 1}};
#endif
constexpr int SHAPE_COUNT = sizeof(SHAPES) / sizeof(SHAPES[0]);

template <int I, class F>
void linear_at(int shape, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const float* b, float* y,
               int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if constexpr (I + 1 < SHAPE_COUNT)
        if (shape != I) return linear_at<I + 1, F>(shape, x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
    linear_shaped<SHAPES[I][0], SHAPES[I][1], F>(x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
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

void hfspec_quant_shape(int i, int* mb, int* nb) {
    *mb = SHAPES[i][0];
    *nb = SHAPES[i][1];
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
