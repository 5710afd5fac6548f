// Linear layers over GGUF blocks in llama.cpp's integer arithmetic: y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]), fp32 x,
// y and b, the weights as the file stores them (N rows of K / QK blocks).
//
// What is computed is defined by hfspec/cpu/int8_reference.py, bit for bit: each input row is quantized on its own
// into ggml's activation format (Q8_K beside the K-quants, Q8_0 beside Q4_0/Q5_0/Q8_0, Q8_1 beside Q4_1/Q5_1),
// every block's integer dot product is taken exactly, and the fp32 steps per output run in the reference's order,
// one rounding each:
//   32-weight formats:  R = R + float(S) * (dw * da)   [Q4_1/Q5_1: R = R + (float(S) * (dw * da) + mw * sa)]
//   K-quants:           R = R + float(A) * (d * da)    [Q4_K/Q5_K: then R = R - float(M) * (dmin * da)]
// R starting at 0 and walking the blocks in order; then y = R + b. This file is compiled with -ffp-contract=off
// (kernels.py), so no product and sum are fused into an FMA. The integer sums are exact, so their lanes, order and
// instructions are free: a row's output depends only on that row, whatever the row count, the thread count (threads
// split the output columns, never K) or the ISA.
//
// Integer dots: weight codes are read as unsigned bytes u (Q6_K's 0..63, Q4_K's 0..15, ...), multiplied by the
// signed activation codes a (|a| <= 127) with maddubs into int16 pairs -- at most 2 * 63 * 127 = 16002, so never
// saturated -- then scaled per sub-block and summed into int32 with madd (AVX2) or vpdpwssd (AVX-512 VNNI). A code
// offset (Q6_K's 32) comes off as 32 * sum_j sc_j * bsum_j. Each super-block's codes and scales are unpacked once and
// used for every input row. On AVX-512 the per-output sums of 16 outputs are gathered into the lanes of one vector by
// a transposing reduction, so the float steps run 16 outputs per instruction, each lane in the reference's order:
// up to 16 rows take 16 output columns as lanes (the bsum terms then also 16 columns per instruction), more rows take
// 16 rows as lanes. On AVX2 (no AVX-512) the same is done 8 output columns per vector for every row count: each
// column's super-blocks are read in runs and unpacked once for every row, one hadd-based reduction gives the 8
// columns' sums in the lanes, and the float steps run 8 columns per instruction. On AVX-512 the next tile's weight
// rows are prefetched into L2 as a tile is read. (Tried and measured slower
// on a Xeon with AVX-512 VNNI: transposing each super-block's codes of 16 columns so that vpdpbusd with a row's
// broadcast codes sums 16 columns per instruction, with one vpmulld by the scales per sub-block -- the transpose,
// the scales' gathering and vpmulld's latency cost more than the horizontal sums they save, at 4-16 rows. Also no
// faster there (measured on a shared, loaded machine), at 1-16 rows: the rows' codes permuted so that each 32-bit lane
// of the four 64-byte pieces holds one sub-block's codes, vpdpbusd summing a lane over the pieces, then one vpmaddwd
// (Q4_K, Q5_K: the lane sums fit in int16) or vpmulld (Q6_K) by the lanes' scales in place of four maddubs and four
// vpdpwssd.)
//
// The 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) read their codes as unsigned bytes too: Q4_0's and Q5_0's
// offsets (8, 16) come off as offset * (the row's code sum per block, kept beside the activations). On AVX-512 one
// block of 16 output columns is transposed once (four 16-byte loads per vector, a 4 x 4 dword transpose in each
// 128-bit lane) into eight vectors whose lane c holds four codes of column c, so that vpdpbusd with a row's four
// codes broadcast sums 16 columns per instruction and no horizontal sum is left; Q8_0 adds 128 to its codes (vpdpbusd
// sums four products in int32, never saturating) and takes 128 * the code sum off. Its float steps run 16 columns
// per instruction. On AVX2 (no AVX-512) 8 output columns of a block are unpacked once for every row, maddubs and madd
// give the sums (Q8_0 with ggml's sign trick: |w| times the codes given w's sign, at most 2 * 128 * 127 per int16),
// one reduction puts the 8 columns' sums in the lanes of one vector and the float steps run 8 columns per
// instruction; with F16C the layers are repacked at load instead (pack32: 8 columns interleaved, no reduction).
// Without AVX2 the integer loops (k_dots, block_dots) are left to the compiler.
//
// Where the CPU has AMX (and Linux grants the tile state), a K-quant tile of enough rows (amx_min) goes to tile_amx:
// tdpbusd per sub-block (two sub-blocks of up to 8 rows each per multiply), 16 columns by 16 lanes, then the same
// integer scales and float steps (see there).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "quant_rows.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX2__)
#define HFSPEC_INT8_AVX512 1
#elif defined(__AVX2__)
#define HFSPEC_INT8_AVX2 1
#endif
#if defined(HFSPEC_INT8_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define HFSPEC_INT8_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#endif
#if defined(HFSPEC_INT8_AVX512) || defined(HFSPEC_INT8_AVX2)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

enum Type { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr bool is_k(int t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
inline int block_elements(int t) { return is_k(t) ? 256 : 32; }
inline int block_bytes(int t) {
    switch (t) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
    }
    return 0;
}

// IEEE half to float, exactly (subnormals included).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) {
        const float f = (float)man * (1.0f / 16777216.0f);  // zero or subnormal: man * 2^-24, exact
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 0x1F ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
inline float half_at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__) && (defined(HFSPEC_INT8_AVX512) || defined(HFSPEC_INT8_AVX2))
    return _cvtsh_ss(h);  // exact, as half_to_float
#else
    return half_to_float(h);
#endif
}
// Float to half, to nearest even (finite f), and back: what torch's .to(float16) gives.
inline float round_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (x >> 16) & 0x8000;
    x &= 0x7FFFFFFFu;
    uint16_t h;
    if (x >= 0x477FF000u) {
        h = sign | 0x7C00;  // 65520 and above round to infinity
    } else if (x < 0x38800000u) {  // below 2^-14: a subnormal half, |f| * 2^24 rounded to nearest even
        float a;
        memcpy(&a, &x, 4);
        h = sign | (uint16_t)nearbyintf(a * 16777216.0f);
    } else {
        x += 0xFFFu + ((x >> 13) & 1);
        h = sign | (uint16_t)((x - (112u << 23)) >> 13);
    }
    return half_to_float(h);
}

// The next tile's block b (its 16 weight rows from ``next``, ldw apart; nothing where ``next`` is null), into L2 as
// this tile's block b is read: a short row (K = 1536 is 864 bytes of Q4_K) ends before the hardware's stream
// prefetcher has ramped up. Always inlined: as a function of its own GCC finds it "looping const" (a prefetch has no
// result) and drops the calls.
template <int NB>
__attribute__((always_inline)) inline void prefetch_block(const uint8_t* next, int64_t ldw, int64_t b) {
    if (!next) return;
    for (int c = 0; c < 16; ++c)
        for (int off = 0; off < NB; off += 64) __builtin_prefetch(next + c * ldw + b * NB + off, 0, 2);
}

// -- activations: each row on its own ---------------------------------------------------------------------------

// The quantized rows of one call: codes (M x K, K apart, in the layout the weight format's dots read), per block
// the fp32 scale d and (Q8_1) the fp32 value of s, and per 16 codes their sum (Q8_K's bsums).
struct Acts {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int16_t> bsums;
    std::vector<int32_t> sums;  // 32-weight formats: per block the sum of its codes (the code offsets' terms)
    // AVX-512, K-quants: per group of 16 rows and super-block, the rows' d in 16 lanes and 8 int32 lanes-vectors of
    // int16 pairs (Q6_K: bsums 2i, 2i + 1; Q4_K/Q5_K: the 32-code sums 2i, 2i + 1 for i < 4), rows as lanes.
    std::vector<float> dg;
    std::vector<int32_t> pairs;
    std::vector<int32_t> tiles;  // AMX, K-quants: the rows' codes in tile B's layout (amx_rows); empty: no AMX
    int tile_subs = 1;           // AMX: sub-blocks per tile multiply (amx_subs)
};

constexpr int GROUP = 16;  // rows per lane-vector in the grouped layout
constexpr int ROWS = 32;   // input rows per pass: their codes of one super-block (8 KB) stay in L1
constexpr int GROUPED_MIN = 17;  // from this many rows on, AVX-512 sums K-quant rows 16 at a time

#if defined(__AVX2__)
using hfspec_rows::abs_max, hfspec_rows::code_sums, hfspec_rows::code_total, hfspec_rows::lane_sum,
    hfspec_rows::low_bytes;
#endif

// Q8_K, as ggml's quantize_row_q8_K_ref.
void quantize_q8_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsums) {
    for (int64_t b = 0; b < K / 256; ++b, x += 256, q += 256, bsums += 16) {
        float amax = 0.0f, top = 0.0f;
#if defined(__AVX2__)
        amax = abs_max(x, 256);
        for (int j = 0; j < 256; ++j)  // the first element of that magnitude, as the strict > below picks it
            if (fabsf(x[j]) == amax) {
                top = x[j];
                break;
            }
#else
        for (int j = 0; j < 256; ++j) {
            const float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                top = x[j];
            }
        }
#endif
        if (amax == 0.0f) {
            d[b] = 0.0f;
            memset(q, 0, 256);
            memset(bsums, 0, 32);
            continue;
        }
        const float iscale = -127.0f / top;
#if defined(__AVX2__)
        const __m256 scale = _mm256_set1_ps(iscale);
        for (int j = 0; j < 256; j += 32) {
            __m256i v[4];  // to nearest even in the default rounding mode, as nearbyintf; then min(v, 127)
            for (int i = 0; i < 4; ++i)
                v[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(x + j + 8 * i))),
                                        _mm256_set1_epi32(127));
            const __m256i codes = low_bytes(v);
            _mm256_storeu_si256((__m256i*)(q + j), codes);
            const __m256i sums = code_sums(codes);
            bsums[j / 16] = (int16_t)lane_sum(_mm256_castsi256_si128(sums));
            bsums[j / 16 + 1] = (int16_t)lane_sum(_mm256_extracti128_si256(sums, 1));
        }
#else
        for (int j = 0; j < 256; ++j) {
            const int v = (int)nearbyintf(iscale * x[j]);  // to nearest even in the default rounding mode
            q[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int g = 0; g < 16; ++g) {
            int sum = 0;
            for (int j = 0; j < 16; ++j) sum += q[16 * g + j];
            bsums[g] = (int16_t)sum;
        }
#endif
        d[b] = 1.0f / iscale;
    }
}

// Q8_0 as ggml's x86 quantizer makes it (d = amax / 127 stored as fp16; codes from 127 / amax, nearest even), and
// for Q8_1 s = fp16(d * sum(q)) with the unrounded d. d and s are kept widened to fp32.
void quantize_q8_0(const float* x, int64_t K, bool with_s, int8_t* q, float* d, float* s, int32_t* sums) {
    for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
#if defined(__AVX2__)
        const float amax = abs_max(x, 32);
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
#endif
        const float scale = amax / 127.0f, inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
#if defined(__AVX2__)
        __m256i v[4];  // to nearest even in the default rounding mode, as nearbyintf
        for (int i = 0; i < 4; ++i)
            v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(inverse)));
        const __m256i codes = low_bytes(v);
        _mm256_storeu_si256((__m256i*)q, codes);
        sum = code_total(codes);
#else
        for (int j = 0; j < 32; ++j) {
            q[j] = (int8_t)(int)nearbyintf(x[j] * inverse);
            sum += q[j];
        }
#endif
        d[b] = round_half(scale);
        sums[b] = sum;
        if (with_s) s[b] = round_half(scale * (float)sum);
    }
}

#if defined(HFSPEC_INT8_AVX512)
// Q4_K/Q5_K codes of 64 bytes hold elements [64c, +32) in their low nibbles and [64c + 32, +32) in their high ones
// for c = 2i, 2i + 1; their rows' codes are stored so that one 64-byte load meets each: per 128 elements,
// [0, 32), [64, 96), [32, 64), [96, 128).
constexpr bool PAIRED_K4 = true;
#else
constexpr bool PAIRED_K4 = false;
#endif

void pair_k4(int8_t* q, int64_t K) {
    int8_t tmp[128];
    for (int64_t o = 0; o < K; o += 128) {
        memcpy(tmp, q + o, 128);
        memcpy(q + o + 32, tmp + 64, 32);
        memcpy(q + o + 64, tmp + 32, 32);
    }
}

void quantize(int type, const float* x, int64_t ldx, int64_t M, int64_t K, Acts& a, int threads) {
    const int64_t blocks = K / block_elements(type);
    a.q.resize(M * K);
    a.d.resize(M * blocks);
    if (is_k(type))
        a.bsums.resize(M * blocks * 16);
    else
        a.s.resize(M * blocks), a.sums.resize(M * blocks);
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K >= 1 << 16)
    for (int64_t i = 0; i < M; ++i) {
        int8_t* q = a.q.data() + i * K;
        if (is_k(type)) {
            quantize_q8_k(x + i * ldx, K, q, a.d.data() + i * blocks, a.bsums.data() + i * blocks * 16);
            if (PAIRED_K4 && type != Q6_K) pair_k4(q, K);
        } else {
            quantize_q8_0(x + i * ldx, K, type == Q4_1 || type == Q5_1, q, a.d.data() + i * blocks,
                          a.s.data() + i * blocks, a.sums.data() + i * blocks);
        }
    }
#if defined(HFSPEC_INT8_AVX512) || defined(HFSPEC_INT8_AVX2)
    if (!is_k(type)) return;
    const int64_t groups = (M + GROUP - 1) / GROUP;
    a.dg.assign(groups * blocks * GROUP, 0.0f);
    a.pairs.assign(groups * blocks * 8 * GROUP, 0);
    for (int64_t i = 0; i < M; ++i) {
        const int64_t g = i / GROUP, lane = i % GROUP;
        for (int64_t b = 0; b < blocks; ++b) {
            const int16_t* bs = a.bsums.data() + (i * blocks + b) * 16;
            a.dg[(g * blocks + b) * GROUP + lane] = a.d[i * blocks + b];
            int32_t* out = a.pairs.data() + (g * blocks + b) * 8 * GROUP + lane;
            for (int j = 0; j < 8; ++j) {
                int16_t pair[2];
                if (type == Q6_K) {
                    pair[0] = bs[2 * j];
                    pair[1] = bs[2 * j + 1];
                } else {
                    pair[0] = j < 4 ? (int16_t)(bs[4 * j] + bs[4 * j + 1]) : 0;
                    pair[1] = j < 4 ? (int16_t)(bs[4 * j + 2] + bs[4 * j + 3]) : 0;
                }
                memcpy(out + j * GROUP, pair, 4);
            }
        }
    }
#endif
}

// -- K-quants: A (and M) of one super-block for every row -------------------------------------------------------

// Q4_K/Q5_K's eight 6-bit scales and mins (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* s, int* sc, int* mn) {
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
}

#if defined(HFSPEC_INT8_AVX512)
// One super-block's codes as unsigned bytes and its sub-block scales as int16 lanes, for four 64-byte pieces that
// meet a row's codes at offsets 0, 64, 128 and 192 (Q6_K in natural order; Q4_K/Q5_K in the paired order), and the
// int16 pairs of multipliers for the grouped sums (Q6_K: sc 2i, 2i + 1; Q4_K/Q5_K: m 2i, 2i + 1, i < 4).
struct KBlock {
    __m512i u[4], s[4];
    alignas(32) int32_t mult[8];  // int16 pairs: Q6_K sc 2i, 2i + 1; Q4_K/Q5_K m 2i, 2i + 1 (i < 4, then 0)
    // The 16 int32 lanes whose sum is sum_j sc_j * sum over sub-block j of u * a.
    inline __m512i dot(const int8_t* a) const {
        __m512i acc = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p)
            acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(u[p], _mm512_loadu_si512((const void*)(a + 64 * p))),
                                      s[p]);
        return acc;
    }
};

alignas(64) const int16_t SUB16[2][2][32] = {  // [t][low/high]: lane k -> scale 8t + 4 high + k / 8 (Q6_K)
    {{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
     {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}},
    {{8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
     {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13,
      14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}}};
alignas(64) const int16_t SUB32[4][32] = {  // piece p: lanes 0-15 scale a, 16-31 scale b (Q4_K/Q5_K, paired)
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2},
    {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6},
    {5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}};

template <int T>
inline void kblock(const uint8_t* w, KBlock& kb) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    if constexpr (T == Q6_K) {
        const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 192))));
        const __m512i three = _mm512_set1_epi8(3);
        const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
        for (int t = 0; t < 2; ++t) {
            const __m512i v = _mm512_loadu_si512((const void*)(w + 64 * t));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + 128 + 32 * t)));
            // low nibbles: elements 128t + [0, 64), their bits 4-5 from qh bits 0-1 (first 32) and 2-3 (next 32)
            const __m512i hl = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_lo), three), 4);
            const __m512i hh = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_hi), three), 4);
            kb.u[2 * t] = _mm512_or_si512(_mm512_and_si512(v, nib), hl);
            kb.u[2 * t + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), nib), hh);
            kb.s[2 * t] = _mm512_permutexvar_epi16(_mm512_load_si512((const void*)SUB16[t][0]), sc);
            kb.s[2 * t + 1] = _mm512_permutexvar_epi16(_mm512_load_si512((const void*)SUB16[t][1]), sc);
        }
        _mm256_store_si256((__m256i*)kb.mult, _mm512_castsi512_si256(sc));
    } else {
        // ggml's unpacking of the 6-bit scales and mins, into registers (8 bytes each): a vector load of bytes
        // just stored piecewise would wait for the stores to retire
        uint32_t m[3];
        memcpy(m, w + 4, 12);
        const uint64_t scales = (uint64_t)(m[0] & 0x3F3F3F3Fu) |
                                (uint64_t)((m[2] & 0x0F0F0F0Fu) | (((m[0] >> 6) & 0x03030303u) << 4)) << 32;
        const uint64_t mins = (uint64_t)(m[1] & 0x3F3F3F3Fu) |
                              (uint64_t)(((m[2] >> 4) & 0x0F0F0F0Fu) | (((m[1] >> 6) & 0x03030303u) << 4)) << 32;
        const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales)));
        const uint8_t* qs = w + (T == Q4_K ? 16 : 48);
        __m512i qh = _mm512_setzero_si512();
        if constexpr (T == Q5_K) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + 16)));
        const __m512i sixteen = _mm512_set1_epi8(16);
        for (int i = 0; i < 2; ++i) {
            const __m512i v = _mm512_loadu_si512((const void*)(qs + 64 * i));
            kb.u[2 * i] = _mm512_and_si512(v, nib);
            kb.u[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            if constexpr (T == Q5_K) {  // bit 2c of qh[l]: element 64c + l; bit 2c + 1: element 64c + 32 + l
                const __m512i bl = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * i))),
                                                      _mm256_set1_epi8((char)(1 << (4 * i + 2))), 1);
                const __m512i bh = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * i + 1))),
                                                      _mm256_set1_epi8((char)(1 << (4 * i + 3))), 1);
                kb.u[2 * i] = _mm512_or_si512(kb.u[2 * i], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bl), sixteen));
                kb.u[2 * i + 1] =
                    _mm512_or_si512(kb.u[2 * i + 1], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bh), sixteen));
            }
            kb.s[2 * i] = _mm512_permutexvar_epi16(_mm512_load_si512((const void*)SUB32[2 * i]), sc);
            kb.s[2 * i + 1] = _mm512_permutexvar_epi16(_mm512_load_si512((const void*)SUB32[2 * i + 1]), sc);
        }
        _mm256_store_si256((__m256i*)kb.mult, _mm256_zextsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mins))));
    }
}

// Lane r: the sum of v[r]'s 16 lanes (integer adds: exact in any order).
inline __m512i reduce16(__m512i* v) {
    __m512i b[8], c[4];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]),
                                _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
    const __m512i e01 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88), _mm512_shuffle_i32x4(c[0], c[1], 0xDD));
    const __m512i e23 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], 0x88), _mm512_shuffle_i32x4(c[2], c[3], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(e01, e23, 0x88), _mm512_shuffle_i32x4(e01, e23, 0xDD));
}

// acc[c][r] += the reference's steps for super-block b, output column c < C, rows r < R (m0 a multiple of GROUP):
// A, M and the float steps for 16 rows at a time, rows as lanes; each lane runs the reference's order.
template <int T>
void k_block_grouped(const uint8_t* w, int64_t ldw, int C, const Acts& a, int64_t m0, int R, int64_t K,
                     int64_t b, float (*acc)[ROWS], const uint8_t* next) {
    const int64_t blocks = K / 256;
    prefetch_block<T == Q4_K ? 144 : T == Q5_K ? 176 : 210>(next, ldw, b);
    for (int c = 0; c < C; ++c) {
        const uint8_t* wb = w + c * ldw + b * (T == Q4_K ? 144 : T == Q5_K ? 176 : 210);
        KBlock kb;
        kblock<T>(wb, kb);
        const __m512 d = _mm512_set1_ps(half_at(wb + (T == Q6_K ? 208 : 0)));
        const __m512 dmin = _mm512_set1_ps(T == Q6_K ? 0.0f : half_at(wb + 2));
        for (int g0 = 0; g0 < R; g0 += GROUP) {
            const int rows = R - g0 < GROUP ? R - g0 : GROUP;
            const int64_t g = (m0 + g0) / GROUP;
            __m512i v[GROUP];
            for (int r = 0; r < GROUP; ++r)
                v[r] = r < rows ? kb.dot(a.q.data() + (m0 + g0 + r) * K + b * 256) : _mm512_setzero_si512();
            __m512i dots = reduce16(v), mins = _mm512_setzero_si512();
            const int32_t* pairs = a.pairs.data() + (g * blocks + b) * 8 * GROUP;
            for (int j = 0; j < (T == Q6_K ? 8 : 4); ++j)
                mins = _mm512_add_epi32(mins, _mm512_madd_epi16(_mm512_loadu_si512((const void*)(pairs + j * GROUP)),
                                                                _mm512_set1_epi32(kb.mult[j])));
            if constexpr (T == Q6_K) dots = _mm512_sub_epi32(dots, _mm512_slli_epi32(mins, 5));
            const __m512 da = _mm512_loadu_ps(a.dg.data() + (g * blocks + b) * GROUP);
            float* out = acc[c] + g0;
            __m512 sum = _mm512_loadu_ps(out);
            sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d, da)));
            if constexpr (T != Q6_K)
                sum = _mm512_sub_ps(sum, _mm512_mul_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, da)));
            _mm512_storeu_ps(out, sum);
        }
    }
}

// The whole tile for up to 16 rows (R < GROUPED_MIN): output columns as lanes, 16 at a time, so one transposing
// reduction serves 16 columns and the float steps run 16 columns per instruction, each lane in the reference's order.
template <int T>
void tile_columns(const uint8_t* w, int64_t ldw, int C, const Acts& a, int64_t m0, int R, int64_t K,
                  float (*acc)[ROWS], const uint8_t* next) {
    constexpr int NB = T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
    const int64_t blocks = K / 256;
    __m512 sum[GROUPED_MIN - 1];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
    constexpr int J = T == Q6_K ? 8 : 4;  // int16 pairs of multipliers of the bsum terms
    for (int64_t b = 0; b < blocks; ++b) {
        prefetch_block<NB>(next, ldw, b);
        __m512i v[GROUPED_MIN - 1][GROUP];
        alignas(64) int32_t mult[J][GROUP] = {};  // column c's multiplier pairs in lane c
        alignas(64) float d[GROUP] = {}, dmin[GROUP] = {};
        for (int c = 0; c < GROUP; ++c) {
            if (c >= C) {
                for (int r = 0; r < R; ++r) v[r][c] = _mm512_setzero_si512();
                continue;
            }
            const uint8_t* wb = w + c * ldw + b * NB;
            KBlock kb;
            kblock<T>(wb, kb);
            d[c] = half_at(wb + (T == Q6_K ? 208 : 0));
            if constexpr (T != Q6_K) dmin[c] = half_at(wb + 2);
            for (int j = 0; j < J; ++j) mult[j][c] = kb.mult[j];
            for (int r = 0; r < R; ++r) v[r][c] = kb.dot(a.q.data() + (m0 + r) * K + b * 256);
        }
        const __m512 dv = _mm512_load_ps(d), dminv = _mm512_load_ps(dmin);
        for (int r = 0; r < R; ++r) {
            // The bsum terms of 16 columns at once (as k_block_grouped, with columns as lanes): Q6_K's offset 32
            // * sum_j sc_j * bsum_j, Q4_K/Q5_K's M = sum_j m_j * (the codes' sum over sub-block j).
            const int64_t row = m0 + r;
            const int32_t* pairs = a.pairs.data() + ((row / GROUP) * blocks + b) * 8 * GROUP + row % GROUP;
            __m512i mins = _mm512_setzero_si512();
            for (int j = 0; j < J; ++j)
                mins = _mm512_add_epi32(
                    mins, _mm512_madd_epi16(_mm512_load_si512((const void*)mult[j]), _mm512_set1_epi32(pairs[j * GROUP])));
            __m512i dots = reduce16(v[r]);
            if constexpr (T == Q6_K) dots = _mm512_sub_epi32(dots, _mm512_slli_epi32(mins, 5));
            const __m512 da = _mm512_set1_ps(a.d[row * blocks + b]);
            sum[r] = _mm512_add_ps(sum[r], _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(dv, da)));
            if constexpr (T != Q6_K)
                sum[r] = _mm512_sub_ps(sum[r], _mm512_mul_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dminv, da)));
        }
    }
    for (int r = 0; r < R; ++r) {
        alignas(64) float out[GROUP];
        _mm512_store_ps(out, sum[r]);
        for (int c = 0; c < C; ++c) acc[c][r] = out[c];
    }
}
#endif

#if defined(HFSPEC_INT8_AMX)
// -- K-quants on AMX (Sapphire Rapids and later): several rows per tile multiply ----------------------------------
//
// Up to 16 output columns and 16 input rows per tile: per sub-block (32 weights of Q4_K/Q5_K, 16 of Q6_K; with up
// to 8 rows, per two sub-blocks: amx_subs) one tdpbusd multiplies the 16 columns' unsigned codes (tile A, a column
// per tile row: the codes kblock unpacks, in the order the rows' codes are stored) with the rows' signed codes (tile
// B, ggml's VNNI layout built once per call: per 4 codes a row of 16 rows' dwords) into 16 x 16 exact int32 sums,
// which are stored and scaled by the column's sub-block scale in int32, columns as tile rows and input rows (and
// sub-blocks) as lanes. Q6_K's codes go in signed, u - 32 (tdpbssd), so its offset term is in the sums already. The
// integer sums are exact, so A = sum_j sc_j * dot_j and M come out as the other paths give them, and the float steps
// run in the reference's order (as k_block_grouped). Rows past R are zero codes in B and never written.
// Linux grants a process the tile state on request (arch_prctl); where it does not, this path is off.
//
// From this many rows on, a K-quant tile goes to AMX (the crossover measured on a Sapphire Rapids Xeon, 2 threads,
// AMX against AVX-512 VNNI: Q4_K 8960 x 1536 at 5 rows 0.60 against 0.61 ms, at 6 0.63 against 0.69, at 8 0.64
// against 0.86; Q4_K 1536 x 1536 at 5 rows 0.125 against 0.119, at 6 0.132 against 0.138; Q6_K 151936 x 1536, a
// head with twice the sub-blocks, at 5 rows 14.9 against 14.8, at 6 16.7 against 18.6).
constexpr int amx_min() { return 6; }
bool amx_granted() {
    static const bool ok = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}
std::atomic<bool> amx_wanted{true};
inline bool amx_on() { return amx_wanted.load(std::memory_order_relaxed) && amx_granted(); }

// Tiles 0-3: the sums of four multiplies (16 columns x 16 lanes of int32 each); tiles 4, 5: the codes of 16
// columns (KT bytes each); tiles 6, 7: the rows' codes (KT / 4 rows of 16 dwords). Four sums in flight, two operand
// pairs alternating, so that one multiply does not wait for the last one's store.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
template <int KT>
void configure_tiles() {
    TileConfig cfg;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = KT;
    for (int t = 6; t < 8; ++t) cfg.rows[t] = KT / 4, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// Sub-blocks per tile multiply: with up to 8 rows, two sub-blocks of 8 rows each share the 16 lanes (tile B is
// block-diagonal: lane 8h + r holds row r's codes where the dword lies in the multiply's sub-block h, zero
// elsewhere), so that one multiply, one store and one scaling serve two sub-blocks (K = 2S <= 64 bytes).
constexpr int amx_subs(int64_t M) { return M <= GROUP / 2 ? 2 : 1; }

// The rows' codes in tile B's layout: per group of 16 / G rows, per 4 codes (kk, in the stored order), 16 dword
// lanes, lane h * (16 / G) + r row r's where kk lies in sub-block h of its multiply (rows past M, other lanes zero).
void amx_rows(Acts& a, int64_t M, int64_t K, int S, int G) {
    const int RG = GROUP / G;
    const int64_t groups = (M + RG - 1) / RG, dwords = K / 4;
    a.tiles.assign(groups * dwords * GROUP, 0);
    a.tile_subs = G;
    const int32_t* q = (const int32_t*)a.q.data();
    for (int64_t i = 0; i < M; ++i) {
        int32_t* out = a.tiles.data() + (i / RG) * dwords * GROUP + i % RG;
        const int32_t* row = q + i * dwords;
        for (int64_t s = 0; s < K / S; ++s) {
            int32_t* lanes = out + (s % G) * RG;
            for (int64_t kk = s * (S / 4); kk < (s + 1) * (S / 4); ++kk) lanes[kk * GROUP] = row[kk];
        }
    }
}

// One column's super-block for the tiles: its codes as kblock unpacks them (Q4_K here directly: two loads, no
// scale lanes), in the stored order of the rows' codes; Q6_K's also its 16 signed sub-block scales (Q4_K/Q5_K's come
// from amx_heads for 16 columns at once).
template <int T>
inline void amx_column(const uint8_t* w, uint8_t* codes, int8_t* sc) {
    if constexpr (T == Q6_K) {
        KBlock kb;
        kblock<T>(w, kb);
        const __m512i offset = _mm512_set1_epi8(32);  // signed codes u - 32: no bsum term (tdpbssd)
        for (int p = 0; p < 4; ++p) _mm512_store_si512((void*)(codes + 64 * p), _mm512_sub_epi8(kb.u[p], offset));
        memcpy(sc, w + 192, 16);
    } else if constexpr (T == Q4_K) {
        (void)sc;
        const __m512i nib = _mm512_set1_epi8(0x0F);
        for (int i = 0; i < 2; ++i) {
            const __m512i v = _mm512_loadu_si512((const void*)(w + 16 + 64 * i));
            _mm512_store_si512((void*)(codes + 128 * i), _mm512_and_si512(v, nib));
            _mm512_store_si512((void*)(codes + 128 * i + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
        }
    } else {
        (void)sc;
        KBlock kb;
        kblock<T>(w, kb);
        for (int p = 0; p < 4; ++p) _mm512_store_si512((void*)(codes + 64 * p), kb.u[p]);
    }
}

// Q4_K/Q5_K: the first 16 bytes of super-block b (d, dmin and the 6-bit scales and mins) of 16 columns at once, a
// column per 128-bit lane, columns past C zero: sc[c] its 8 sub-block scales in the stored order of the codes (per
// 128 elements [0, 32), [64, 96), [32, 64), [96, 128), i.e. sub-blocks 4i, 4i + 2, 4i + 1, 4i + 3), then its mins;
// mult[c] the mins' int16 pairs, the bsum terms' multipliers (as KBlock::mult); d and dmin in fp32.
inline void amx_heads(const uint8_t* w, int64_t ldw, int C, int64_t at, int8_t (*sc)[16], int32_t (*mult)[4], float* d,
                      float* dmin) {
    __m512i head[4];
    for (int q = 0; q < 4; ++q) {
        __m128i lane[4];
        for (int i = 0; i < 4; ++i) {
            const int c = 4 * q + i;
            lane[i] = c < C ? _mm_loadu_si128((const __m128i*)(w + c * ldw + at)) : _mm_setzero_si128();
        }
        head[q] = _mm512_inserti32x4(
            _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(lane[0]), lane[1], 1), lane[2], 2), lane[3], 3);
    }
    // ggml's get_scale_min_k4 on dwords [d dmin, m0, m1, m2] of each lane: [m0 & 63s, (m2 & 15s) | (m0 >> 2 & 48s),
    // m1 & 63s, (m2 >> 4 & 15s) | (m1 >> 2 & 48s)], the scales 0-7 then the mins 0-7
    const __m512i low = _mm512_set4_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F);
    const __m512i shift = _mm512_set4_epi32(4, 0, 0, 0);
    const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i widen = _mm512_broadcast_i32x4(
        _mm_setr_epi8(8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1));  // mins to int16
    for (int q = 0; q < 4; ++q) {
        const __m512i p = _mm512_srlv_epi32(_mm512_shuffle_epi32(head[q], (_MM_PERM_ENUM)0xED), shift);  // m0 m2 m1 m2
        const __m512i hi = _mm512_maskz_shuffle_epi32(0xAAAA, head[q], (_MM_PERM_ENUM)0x84);           // 0 m0 0 m1
        const __m512i sm = _mm512_or_si512(_mm512_and_si512(p, low),
                                           _mm512_and_si512(_mm512_srli_epi32(hi, 2), _mm512_set1_epi8(0x30)));
        _mm512_storeu_si512((void*)sc[4 * q], _mm512_shuffle_epi8(sm, order));
        _mm512_storeu_si512((void*)mult[4 * q], _mm512_shuffle_epi8(sm, widen));
    }
    const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);  // dword 0 of lanes
    const __m512i dd = _mm512_inserti64x4(_mm512_permutex2var_epi32(head[0], first, head[1]),
                                          _mm512_castsi512_si256(_mm512_permutex2var_epi32(head[2], first, head[3])), 1);
    _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)));
    _mm512_storeu_ps(dmin, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16))));
}

// Four multiplies from t0 on (KT bytes of codes each): their sums into out[0..3] ([column][lane], 64 bytes a
// column).
template <int T, int KT>
inline void tile_round(const uint8_t* codes, const int32_t* rows, int t0, int32_t (*out)[16][16]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, codes + t0 * KT, 256);
    _tile_loadd(6, rows + t0 * (KT / 4) * GROUP, 64);
    if constexpr (T == Q6_K) _tile_dpbssd(0, 4, 6); else _tile_dpbusd(0, 4, 6);
    _tile_loadd(5, codes + (t0 + 1) * KT, 256);
    _tile_loadd(7, rows + (t0 + 1) * (KT / 4) * GROUP, 64);
    if constexpr (T == Q6_K) _tile_dpbssd(1, 5, 7); else _tile_dpbusd(1, 5, 7);
    _tile_loadd(4, codes + (t0 + 2) * KT, 256);
    _tile_loadd(6, rows + (t0 + 2) * (KT / 4) * GROUP, 64);
    if constexpr (T == Q6_K) _tile_dpbssd(2, 4, 6); else _tile_dpbusd(2, 4, 6);
    _tile_loadd(5, codes + (t0 + 3) * KT, 256);
    _tile_loadd(7, rows + (t0 + 3) * (KT / 4) * GROUP, 64);
    if constexpr (T == Q6_K) _tile_dpbssd(3, 5, 7); else _tile_dpbusd(3, 5, 7);
    _tile_stored(0, out[0], 64);
    _tile_stored(1, out[1], 64);
    _tile_stored(2, out[2], 64);
    _tile_stored(3, out[3], 64);
}

// Two sub-blocks per multiply (up to 8 rows): the bsum terms and the float steps of two columns per vector, lanes
// 0-7 column c's rows and 8-15 column c + 1's, each lane in the reference's order. dots[c]: lanes r and 8 + r hold
// row r's sums of the two sub-blocks of each multiply; mult[c]: column c's int16 pairs of mins; acc rows from 0.
template <int T>
inline void float_steps_paired(const __m512i* dots, const float* d, const float* dmin, const int32_t (*mult)[4],
                               const int32_t* pairs, __m512 da, int C, float (*acc)[ROWS]) {
    const __m512 da2 = _mm512_shuffle_f32x4(da, da, 0x44);  // rows 0-7 twice
    const __m512 dv = _mm512_loadu_ps(d);
    __m512 dminv = _mm512_setzero_ps();
    __m512i pairs2[4], multv[4];  // the rows' pairs twice; lane c: column c's pair j
    if constexpr (T != Q6_K) {
        dminv = _mm512_loadu_ps(dmin);
        const __m512i m01 = _mm512_loadu_si512((const void*)mult[0]), m23 = _mm512_loadu_si512((const void*)mult[4]);
        const __m512i m45 = _mm512_loadu_si512((const void*)mult[8]), m67 = _mm512_loadu_si512((const void*)mult[12]);
        const __m512i column = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
        for (int j = 0; j < 4; ++j) {
            const __m512i p = _mm512_loadu_si512((const void*)(pairs + j * GROUP));
            pairs2[j] = _mm512_shuffle_i32x4(p, p, 0x44);
            const __m512i idx = _mm512_add_epi32(column, _mm512_set1_epi32(j));  // pair j of 8 columns' 4
            const __m512i lo = _mm512_permutex2var_epi32(m01, idx, m23), hi = _mm512_permutex2var_epi32(m45, idx, m67);
            multv[j] = _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1);
        }
    }
    for (int c = 0; c < C; c += 2) {
        const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(c), _mm256_set1_epi32(c + 1), 1);
        const __m512i both = _mm512_add_epi32(_mm512_shuffle_i32x4(dots[c], dots[c + 1], 0x44),
                                              _mm512_shuffle_i32x4(dots[c], dots[c + 1], 0xEE));
        float* o0 = acc[c];
        float* o1 = acc[c + 1];  // c + 1 == C < 16: a column never written out
        __m512 sum = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(o0)), _mm256_loadu_ps(o1), 1);
        sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(_mm512_permutexvar_ps(pick, dv), da2)));
        if constexpr (T != Q6_K) {
            __m512i mins = _mm512_setzero_si512();
            for (int j = 0; j < 4; ++j)
                mins = _mm512_dpwssd_epi32(mins, pairs2[j], _mm512_permutexvar_epi32(pick, multv[j]));
            sum = _mm512_sub_ps(
                sum, _mm512_mul_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(_mm512_permutexvar_ps(pick, dminv), da2)));
        }
        _mm256_storeu_ps(o0, _mm512_castps512_ps256(sum));
        _mm256_storeu_ps(o1, _mm512_extractf32x8_ps(sum, 1));
    }
}

template <int T, int G>
void tile_amx(const uint8_t* w, int64_t ldw, int C, const Acts& a, int64_t m0, int R, int64_t K, float (*acc)[ROWS],
              const uint8_t* next) {
    constexpr int NB = T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
    constexpr int S = T == Q6_K ? 16 : 32, SUBS = 256 / S, KT = G * S, MULS = SUBS / G, RG = GROUP / G;
    const int64_t blocks = K / 256, dwords = K / 4;
    // One super-block of the 16 columns, unpacked for the tiles; two, so that the next block is unpacked while the
    // tiles multiply this one (the tile loads of codes just stored would otherwise wait for the stores).
    struct Unpacked {
        alignas(64) uint8_t codes[16][256];
        alignas(64) int8_t sc[16][16];
        alignas(64) int32_t mult[16][4];  // Q4_K/Q5_K: the mins' int16 pairs
        float d[16], dmin[16];
    };
    Unpacked unpacked[2];
    alignas(64) int32_t sums[2][4][16][16];  // two rounds of four multiplies' sums, [column][lane]
    if (C < 16)  // columns past C: zero, never written
        for (Unpacked& u : unpacked) memset((void*)&u, 0, sizeof u);
    const auto unpack = [&](int64_t b, Unpacked& u) {
        for (int c = 0; c < C; ++c) {
            const uint8_t* wb = w + c * ldw + b * NB;
            amx_column<T>(wb, u.codes[c], u.sc[c]);
            if constexpr (T == Q6_K) u.d[c] = half_at(wb + 208);  // no dmin: never read
        }
        if constexpr (T != Q6_K) amx_heads(w, ldw, C, b * NB, u.sc, u.mult, u.d, u.dmin);
    };
    // lane h * RG + r of multiply t's scale vector: sub-block t * G + h's scale
    __m512i pick[MULS];
    for (int t = 0; t < MULS; ++t) {
        alignas(64) int32_t idx[16];
        for (int l = 0; l < 16; ++l) idx[l] = t * G + l / RG;
        pick[t] = _mm512_load_si512((const void*)idx);
    }
    unpack(0, unpacked[0]);
    for (int64_t b = 0; b < blocks; ++b) {
        prefetch_block<NB>(next, ldw, b);
        const Unpacked& u = unpacked[b & 1];
        for (int g0 = 0; g0 < R; g0 += RG) {
            const int64_t g = (m0 + g0) / RG;
            const int32_t* rows = a.tiles.data() + (g * dwords + b * 64) * GROUP;
            __m512i dots[16], scale[16];
            for (int c = 0; c < 16; ++c) {
                dots[c] = _mm512_setzero_si512();
                if constexpr (G > 1)
                    scale[c] = _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)u.sc[c]));
            }
            // Rounds of four multiplies; a round's sums are read after the next round's multiplies are issued, so
            // that the vector loads do not wait on the tile stores just made.
            for (int round = 0; round <= MULS / 4; ++round) {
                if (round < MULS / 4) tile_round<T, KT>(u.codes[0], rows, round * 4, sums[round & 1]);
                if (round == 0) {
                    if (g0 == 0 && b + 1 < blocks) unpack(b + 1, unpacked[(b + 1) & 1]);  // beside the multiplies
                    continue;
                }
                const int t0 = (round - 1) * 4;
                for (int t = 0; t < 4; ++t)
                    for (int c = 0; c < 16; ++c) {
                        const __m512i s = G > 1 ? _mm512_permutexvar_epi32(pick[t0 + t], scale[c])
                                                : _mm512_set1_epi32(u.sc[c][t0 + t]);
                        dots[c] = _mm512_add_epi32(
                            dots[c], _mm512_mullo_epi32(_mm512_load_si512((const void*)sums[(round - 1) & 1][t][c]), s));
                    }
            }
            // The bsum terms and the float steps, rows as lanes, each in the reference's order.
            const int64_t g16 = (m0 + g0) / GROUP;  // G = 2: one group of at most RG rows
            const int32_t* pairs = a.pairs.data() + (g16 * blocks + b) * 8 * GROUP;
            const __m512 da = _mm512_loadu_ps(a.dg.data() + (g16 * blocks + b) * GROUP);
            if constexpr (G == 2) {
                float_steps_paired<T>(dots, u.d, u.dmin, u.mult, pairs, da, C, acc);
                continue;
            }
            for (int c = 0; c < C; ++c) {
                __m512i mins = _mm512_setzero_si512();
                if constexpr (T != Q6_K)  // Q6_K's offset is in its signed codes already
                    for (int j = 0; j < 4; ++j)
                        mins = _mm512_dpwssd_epi32(mins, _mm512_loadu_si512((const void*)(pairs + j * GROUP)),
                                                   _mm512_set1_epi32(u.mult[c][j]));
                const __m512i dv = dots[c];
                float* out = acc[c] + g0;
                __m512 sum = _mm512_loadu_ps(out);
                sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_cvtepi32_ps(dv), _mm512_mul_ps(_mm512_set1_ps(u.d[c]), da)));
                if constexpr (T != Q6_K)
                    sum = _mm512_sub_ps(
                        sum, _mm512_mul_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(_mm512_set1_ps(u.dmin[c]), da)));
                _mm512_storeu_ps(out, sum);
            }
        }
    }
}
#endif

#if defined(HFSPEC_INT8_AVX2)
// One super-block's codes as unsigned bytes (natural order: u[p] meets a row's codes [32p, 32p + 32)) and its
// sub-block scales as int16 lanes, and the int16 pairs of multipliers of the bsum terms (as KBlock's).
struct KBlock8 {
    __m256i u[8], s[8];
    alignas(32) int32_t mult[8];
    // The 8 int32 lanes whose sum is sum_j sc_j * sum over sub-block j of u * a.
    inline __m256i dot(const int8_t* a) const {
        __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
        for (int p = 0; p < 8; p += 2) {
            acc0 = _mm256_add_epi32(
                acc0, _mm256_madd_epi16(_mm256_maddubs_epi16(u[p], _mm256_loadu_si256((const __m256i*)(a + 32 * p))),
                                        s[p]));
            acc1 = _mm256_add_epi32(
                acc1,
                _mm256_madd_epi16(_mm256_maddubs_epi16(u[p + 1], _mm256_loadu_si256((const __m256i*)(a + 32 * p + 32))),
                                  s[p + 1]));
        }
        return _mm256_add_epi32(acc0, acc1);
    }
};

// Every int16 lane of a 128-bit half takes int16 lane ``lo`` (low half) or ``hi`` (high half) of its half.
inline __m256i pick16(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(((2 * hi + 1) << 8) | (2 * hi))),
                            _mm_set1_epi16((short)(((2 * lo + 1) << 8) | (2 * lo))));
}

template <int T>
inline void kblock8(const uint8_t* w, KBlock8& kb) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    if constexpr (T == Q6_K) {
        const __m256i three = _mm256_set1_epi8(3);
        for (int t = 0; t < 2; ++t) {
            const __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * t));
            for (int g = 0; g < 2; ++g) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 64 * t + 32 * g));
                const __m256i hl = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), three), 4);
                const __m256i hh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4 + 2 * g), three), 4);
                kb.u[4 * t + g] = _mm256_or_si256(_mm256_and_si256(v, nib), hl);
                kb.u[4 * t + 2 + g] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), hh);
            }
        }
        // scales 16 codes each: u[p]'s low half takes sc[2p], its high half sc[2p + 1]
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 192)));
        const __m256i lo = _mm256_permute2x128_si256(sc, sc, 0x00), hi = _mm256_permute2x128_si256(sc, sc, 0x11);
        for (int p = 0; p < 8; ++p)
            kb.s[p] = _mm256_shuffle_epi8(p < 4 ? lo : hi, pick16(2 * (p % 4), 2 * (p % 4) + 1));
        _mm256_store_si256((__m256i*)kb.mult, sc);
    } else {
        uint32_t m[3];  // ggml's unpacking of the 6-bit scales and mins, into registers (as kblock)
        memcpy(m, w + 4, 12);
        const uint64_t scales = (uint64_t)(m[0] & 0x3F3F3F3Fu) |
                                (uint64_t)((m[2] & 0x0F0F0F0Fu) | (((m[0] >> 6) & 0x03030303u) << 4)) << 32;
        const uint64_t mins = (uint64_t)(m[1] & 0x3F3F3F3Fu) |
                              (uint64_t)(((m[2] >> 4) & 0x0F0F0F0Fu) | (((m[1] >> 6) & 0x03030303u) << 4)) << 32;
        const __m128i sc8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales));
        const __m256i sc = _mm256_set_m128i(sc8, sc8);
        const uint8_t* qs = w + (T == Q4_K ? 16 : 48);
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 16));
        const __m256i one = _mm256_set1_epi8(1);
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
            kb.u[2 * c] = _mm256_and_si256(v, nib);
            kb.u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            if constexpr (T == Q5_K) {
                kb.u[2 * c] = _mm256_or_si256(
                    kb.u[2 * c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                kb.u[2 * c + 1] = _mm256_or_si256(
                    kb.u[2 * c + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
            }
        }
        for (int p = 0; p < 8; ++p) kb.s[p] = _mm256_shuffle_epi8(sc, pick16(p, p));
        _mm256_store_si256((__m256i*)kb.mult, _mm256_zextsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mins))));
    }
}

// The partial sums of one pass of the AVX2 tiles that read each column's blocks in runs: this many vectors (10 KB),
// so that they stay in L1; blocks per pass for R rows of 8 columns: as many as that holds, from 1 to ``most``.
constexpr int PASS = 320;
static_assert(PASS >= 8 * ROWS, "a pass holds at least one block of every row");
inline int run_length(int R, int most) {
    const int fit = PASS / (8 * R);
    return fit > most ? most : fit < 1 ? 1 : fit;
}

// The tile's float sums, 8 columns as lanes per vector, zero for its R rows.
inline void zero_sums(__m256 (*sum)[ROWS], int R) {
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) sum[h][r] = _mm256_setzero_ps();
}

// Column c's dots of a pass (bk blocks of R rows, laid out as in the run tiles' v) set to zero.
inline void zero_lane(__m256i* v, int bk, int R, int c) {
    for (int bb = 0; bb < bk; ++bb)
        for (int r = 0; r < R; ++r) v[(bb * R + r) * 8 + c] = _mm256_setzero_si256();
}

// acc[c][r] = lane c % 8 of sum[c / 8][r], for the tile's C columns and R rows.
inline void store_lanes(const __m256 (*sum)[ROWS], int C, int R, float (*acc)[ROWS]) {
    for (int h = 0; h < 2 && 8 * h < C; ++h)
        for (int r = 0; r < R; ++r) {
            alignas(32) float out[8];
            _mm256_store_ps(out, sum[h][r]);
            for (int c = 0; c < 8 && 8 * h + c < C; ++c) acc[8 * h + c][r] = out[c];
        }
}

// Lane c: the sum of v[c]'s 8 lanes (integer adds: exact in any order).
inline __m256i reduce8(const __m256i* v) {
    const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The whole tile, any row count up to ROWS: output columns as lanes, 8 at a time, so one reduction serves 8 columns
// and the float steps run 8 columns per instruction, each lane in the reference's order. A super-block of 8 columns
// is unpacked once for every row.
template <int T>
void tile_columns8(const uint8_t* w, int64_t ldw, int C, const Acts& a, int64_t m0, int R, int64_t K,
                   float (*acc)[ROWS]) {
    constexpr int NB = T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
    constexpr int J = T == Q6_K ? 8 : 4;  // int16 pairs of multipliers of the bsum terms
    // Super-blocks per pass: a column's blocks are read in runs of up to BK, so that the weights stream through
    // memory nearly in order (a one-row step is bound by that stream), fewer as rows grow (run_length). The hardware
    // prefetcher follows that stream: prefetching the next tile as the AVX-512 tiles do measured slower here (AMD
    // EPYC, Zen 3: 0.81 against 0.64 ms at one row).
    constexpr int BK = 40;
    const int run = run_length(R, BK);
    const int64_t blocks = K / 256;
    __m256 sum[2][ROWS];
    zero_sums(sum, R);
    __m256i v[PASS];  // block bb, row r, column c at (bb * R + r) * 8 + c: 8 int32 lanes summing to A
    alignas(32) int32_t mult[BK][J][8];  // column c's multiplier pairs in lane c
    alignas(32) float d[BK][8], dmin[BK][8];
    for (int64_t b0 = 0; b0 < blocks; b0 += run) {
        const int bk = blocks - b0 < run ? (int)(blocks - b0) : run;
        for (int h = 0; h < 2 && 8 * h < C; ++h) {
            const int cn = C - 8 * h < 8 ? C - 8 * h : 8;
            for (int c = 0; c < 8; ++c) {
                if (c >= cn) {  // past the matrix: a lane of zeros
                    for (int bb = 0; bb < bk; ++bb) {
                        d[bb][c] = dmin[bb][c] = 0.0f;
                        for (int j = 0; j < J; ++j) mult[bb][j][c] = 0;
                    }
                    zero_lane(v, bk, R, c);
                    continue;
                }
                for (int bb = 0; bb < bk; ++bb) {  // column c's blocks b0.. in the order they lie in memory
                    const uint8_t* wb = w + (8 * h + c) * ldw + (b0 + bb) * NB;
                    KBlock8 kb;
                    kblock8<T>(wb, kb);
                    d[bb][c] = half_at(wb + (T == Q6_K ? 208 : 0));
                    dmin[bb][c] = T == Q6_K ? 0.0f : half_at(wb + 2);
                    for (int j = 0; j < J; ++j) mult[bb][j][c] = kb.mult[j];
                    for (int r = 0; r < R; ++r)
                        v[(bb * R + r) * 8 + c] = kb.dot(a.q.data() + (m0 + r) * K + (b0 + bb) * 256);
                }
            }
            for (int bb = 0; bb < bk; ++bb) {  // the float steps block by block, in order
                const int64_t b = b0 + bb;
                const __m256 dv = _mm256_load_ps(d[bb]), dminv = _mm256_load_ps(dmin[bb]);
                for (int r = 0; r < R; ++r) {
                    const int64_t row = m0 + r;
                    // the bsum terms of 8 columns at once: Q6_K's offset 32 * sum_j sc_j * bsum_j, Q4_K/Q5_K's M
                    const int32_t* pairs = a.pairs.data() + ((row / GROUP) * blocks + b) * 8 * GROUP + row % GROUP;
                    __m256i mins = _mm256_setzero_si256();
                    for (int j = 0; j < J; ++j)
                        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(_mm256_load_si256((const __m256i*)mult[bb][j]),
                                                                        _mm256_set1_epi32(pairs[j * GROUP])));
                    __m256i dots = reduce8(v + (bb * R + r) * 8);
                    if constexpr (T == Q6_K) dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(mins, 5));
                    const __m256 da = _mm256_set1_ps(a.d[row * blocks + b]);
                    sum[h][r] =
                        _mm256_add_ps(sum[h][r], _mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(dv, da)));
                    if constexpr (T != Q6_K)
                        sum[h][r] = _mm256_sub_ps(sum[h][r],
                                                  _mm256_mul_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dminv, da)));
                }
            }
        }
    }
    store_lanes(sum, C, R, acc);
}
#endif

// For rows r < R of a super-block: A[r] = sum_j sc_j * S_j (signed weights) and, Q4_K/Q5_K, M[r] = sum_j m_j *
// (sum of the row's codes over sub-block j). q: the rows' codes of this super-block, K apart; bs: their bsums,
// ldb apart.
template <int T>
void k_dots(const uint8_t* w, int R, const int8_t* q, int64_t K, const int16_t* bs, int64_t ldb, int32_t* A,
            int32_t* M) {
    int sc[16], mn[8] = {0};
    if constexpr (T == Q6_K) {
        for (int j = 0; j < 16; ++j) sc[j] = (int8_t)w[192 + j];
    } else {
        scale_min_k4(w + 4, sc, mn);
    }
    if constexpr (T != Q6_K) {
        for (int r = 0; r < R; ++r) {
            const int16_t* b = bs + r * ldb;
            int32_t m = 0;
            for (int j = 0; j < 8; ++j) m += mn[j] * (b[2 * j] + b[2 * j + 1]);
            M[r] = m;
        }
    }
    int8_t wv[256];
    if constexpr (T == Q6_K) {
        for (int t = 0; t < 2; ++t)
            for (int l = 0; l < 32; ++l) {
                const uint8_t* ql = w + 64 * t;
                const uint8_t qh = w[128 + 32 * t + l];
                wv[128 * t + l] = (int8_t)(((ql[l] & 15) | ((qh & 3) << 4)) - 32);
                wv[128 * t + l + 32] = (int8_t)(((ql[l + 32] & 15) | (((qh >> 2) & 3) << 4)) - 32);
                wv[128 * t + l + 64] = (int8_t)(((ql[l] >> 4) | (((qh >> 4) & 3) << 4)) - 32);
                wv[128 * t + l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh >> 6) & 3) << 4)) - 32);
            }
    } else {
        const uint8_t* qs = w + (T == Q4_K ? 16 : 48);
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
                int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
                if constexpr (T == Q5_K) {
                    lo |= ((w[16 + l] >> (2 * c)) & 1) << 4;
                    hi |= ((w[16 + l] >> (2 * c + 1)) & 1) << 4;
                }
                wv[64 * c + l] = (int8_t)lo;
                wv[64 * c + 32 + l] = (int8_t)hi;
            }
    }
    constexpr int sub = T == Q6_K ? 16 : 32;
    for (int r = 0; r < R; ++r) {
        const int8_t* a = q + r * K;
        int32_t total = 0;
        for (int j = 0; j < 256 / sub; ++j) {
            int32_t dot = 0;
            for (int e = 0; e < sub; ++e) dot += wv[sub * j + e] * a[sub * j + e];
            total += sc[j] * dot;
        }
        A[r] = total;
    }
}

constexpr int COLS = 16;  // output columns per tile: each block of activations is used for all of them

template <int T>
constexpr int nbytes() {
    return T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : T == Q8_0 ? 34 : T == Q4_K ? 144
         : T == Q5_K ? 176 : 210;
}

// -- 32-weight formats: S of one block for every row -------------------------------------------------------------

// Where a block keeps its codes, its high bits (Q5_0/Q5_1) and the offset its codes carry (w = u - offset).
template <int T>
constexpr int codes_at() {
    return T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : T == Q5_1 ? 8 : 2;
}
template <int T>
constexpr int high_at() {
    return T == Q5_0 ? 2 : 4;
}
template <int T>
constexpr int code_offset() {
    return T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;
}

#if defined(HFSPEC_INT8_AVX512)
// Four codes at p in every 32-bit lane (a broadcast from memory).
inline __m512i broadcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// The whole tile at once, any row count: output columns as lanes. Each block's codes of the 16 columns are
// transposed once into eight vectors u[k] whose lane c holds column c's codes 4k..4k+3 as unsigned bytes (Q4_0/Q5_0
// without their offset, Q8_0 plus 128), so that vpdpbusd with a row's four codes 4k..4k+3 broadcast sums 16 columns
// per instruction and no horizontal sum is needed; the offset comes off as offset * (the row's code sum), the float
// steps run 16 columns per instruction, each lane in the reference's order.
template <int T>
void tile32(const uint8_t* w, int64_t ldw, int C, const Acts& a, int64_t m0, int R, int64_t K, float (*acc)[ROWS],
            const uint8_t* next) {
    constexpr int NB = nbytes<T>(), OFF = T == Q8_0 ? 128 : code_offset<T>();
    constexpr bool with_m = T == Q4_1 || T == Q5_1, five = T == Q5_0 || T == Q5_1;
    const int64_t blocks = K / 32;
    alignas(64) float sum[ROWS][GROUP];
    for (int r = 0; r < R; ++r) _mm512_store_ps(sum[r], _mm512_setzero_ps());
    const uint8_t* col[GROUP];  // columns past C read column 0 (their lanes are dropped)
    for (int c = 0; c < GROUP; ++c) col[c] = w + (c < C ? c : 0) * ldw;
    const __m512i nib = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    // Q5: lane c's byte e of u[k] takes bit 4k + e of column c's high bits: byte k / 2 of the dword, bit 4(k % 2) + e
    const __m512i dword_bytes = _mm512_broadcast_i32x4(_mm_set_epi64x(0x0C0C0C0C08080808LL, 0x0404040400000000LL));
    const __m512i bits_lo = _mm512_set1_epi32(0x08040201), bits_hi = _mm512_set1_epi32((int)0x80402010u);
    for (int64_t b = 0; b < blocks; ++b) {
        prefetch_block<NB>(next, ldw, b);
        __m512i u[8];
        for (int half = 0; half < (T == Q8_0 ? 2 : 1); ++half) {
            // z[i]'s 128-bit lane j: column 4j + i's 16 code bytes; a 4 x 4 transpose of dwords within each lane
            // then gives t[k], lane c (= 4j + i) its dword k.
            __m512i z[4];
            for (int i = 0; i < 4; ++i) {
                const int at = b * NB + codes_at<T>() + 16 * half;
                __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(col[i] + at)));
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(col[4 + i] + at)), 1);
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(col[8 + i] + at)), 2);
                z[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(col[12 + i] + at)), 3);
            }
            const __m512i p0 = _mm512_unpacklo_epi32(z[0], z[1]), p1 = _mm512_unpackhi_epi32(z[0], z[1]);
            const __m512i p2 = _mm512_unpacklo_epi32(z[2], z[3]), p3 = _mm512_unpackhi_epi32(z[2], z[3]);
            const __m512i t[4] = {_mm512_unpacklo_epi64(p0, p2), _mm512_unpackhi_epi64(p0, p2),
                                  _mm512_unpacklo_epi64(p1, p3), _mm512_unpackhi_epi64(p1, p3)};
            for (int k = 0; k < 4; ++k) {
                if constexpr (T == Q8_0) {
                    u[4 * half + k] = _mm512_xor_si512(t[k], _mm512_set1_epi8((char)0x80));
                } else {  // low nibbles: codes 4k..4k+3; high nibbles: codes 16 + 4k..
                    u[k] = _mm512_and_si512(t[k], nib);
                    u[4 + k] = _mm512_and_si512(_mm512_srli_epi16(t[k], 4), nib);
                }
            }
        }
        alignas(64) uint32_t head[GROUP], high[GROUP];  // each column's first dword (d, m) and its 32 high bits
        for (int c = 0; c < GROUP; ++c) {
            memcpy(head + c, col[c] + b * NB, 4);
            if constexpr (five) memcpy(high + c, col[c] + b * NB + high_at<T>(), 4);
        }
        const __m512i hv = _mm512_load_si512((const void*)head);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hv));
        __m512 m = _mm512_setzero_ps();
        if constexpr (with_m) m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hv, 16)));
        if constexpr (five) {
            const __m512i h = _mm512_load_si512((const void*)high);
            for (int k = 0; k < 8; ++k) {
                const __m512i bytes = _mm512_shuffle_epi8(h, _mm512_add_epi8(dword_bytes, _mm512_set1_epi8(k / 2)));
                const __mmask64 set = _mm512_test_epi8_mask(bytes, k % 2 ? bits_hi : bits_lo);
                u[k] = _mm512_mask_add_epi8(u[k], set, u[k], sixteen);
            }
        }
        for (int r = 0; r < R; ++r) {
            const int64_t row = (m0 + r) * blocks + b;
            const int8_t* q = a.q.data() + (m0 + r) * K + b * 32;
            __m512i s0 = _mm512_set1_epi32(-OFF * a.sums[row]), s1 = _mm512_setzero_si512();
            for (int k = 0; k < 8; k += 2) {
                s0 = _mm512_dpbusd_epi32(s0, u[k], broadcast4(q + 4 * k));
                s1 = _mm512_dpbusd_epi32(s1, u[k + 1], broadcast4(q + 4 * k + 4));
            }
            const __m512i s = _mm512_add_epi32(s0, s1);
            __m512 step = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(a.d[row])));
            if constexpr (with_m) step = _mm512_add_ps(step, _mm512_mul_ps(m, _mm512_set1_ps(a.s[row])));
            _mm512_store_ps(sum[r], _mm512_add_ps(_mm512_load_ps(sum[r]), step));
        }
    }
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) acc[c][r] = sum[r][c];
}
#endif

#if defined(HFSPEC_INT8_AVX2)
// A 32-weight block's codes as unsigned bytes (Q4_0/Q5_0 without their offset; Q8_0: |w|, its signs in ``sg``,
// else zero), as block_dots reads them.
template <int T>
inline void unpack32(const uint8_t* wb, __m256i& u, __m256i& sg) {
    sg = _mm256_setzero_si256();
    if constexpr (T == Q8_0) {
        sg = _mm256_loadu_si256((const __m256i*)(wb + 2));
        u = _mm256_sign_epi8(sg, sg);
    } else {
        const __m128i v = _mm_loadu_si128((const __m128i*)(wb + codes_at<T>())), nib = _mm_set1_epi8(0x0F);
        u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nib), _mm_and_si128(v, nib));
        if constexpr (T == Q5_0 || T == Q5_1) {  // bit j of the high bits: code j, as ggml's bytes_from_bits_32
            uint32_t qh;
            memcpy(&qh, wb + high_at<T>(), 4);
            const __m256i spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32((int)qh),
                _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFELL)),
                                                  _mm256_set1_epi64x(-1));
            u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
    }
}

// 8 int32 lanes whose sum is the block's u · a (Q8_0: |w| times the codes given w's sign, at most 2 * 128 * 127 per
// int16 of maddubs).
template <int T>
inline __m256i dot32(__m256i u, __m256i sg, __m256i qa) {
    const __m256i pairs = T == Q8_0 ? _mm256_maddubs_epi16(u, _mm256_sign_epi8(qa, sg)) : _mm256_maddubs_epi16(u, qa);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// sum + the reference's step of one block for 8 columns as lanes (v: their partial sums; row: the row's block index
// into the activations), each lane in the reference's order: S minus the code offset's term, S * (d * da), plus
// m * s (Q4_1/Q5_1).
template <int T>
inline __m256 step32(__m256 sum, __m256i dots, const Acts& a, int64_t row, __m256 dv, __m256 mv) {
    if constexpr (code_offset<T>() != 0)
        dots = _mm256_sub_epi32(dots, _mm256_set1_epi32(code_offset<T>() * a.sums[row]));
    __m256 step = _mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(dv, _mm256_set1_ps(a.d[row])));
    if constexpr (T == Q4_1 || T == Q5_1) step = _mm256_add_ps(step, _mm256_mul_ps(mv, _mm256_set1_ps(a.s[row])));
    return _mm256_add_ps(sum, step);
}

template <int T>
inline __m256 add_step32(__m256 sum, const __m256i* v, const Acts& a, int64_t row, __m256 dv, __m256 mv) {
    return step32<T>(sum, reduce8(v), a, row, dv, mv);
}

// The whole tile, any row count up to ROWS: output columns as lanes, 8 at a time. Each block of 8 columns is unpacked
// once for every row (as block_dots); maddubs and madd give each column's 8 int32 partial sums, one reduction gives
// the 8 columns' S in the lanes, and the float steps run 8 columns per instruction, each lane in the reference's
// order.
template <int T>
void tile32_rows8(const uint8_t* w, int64_t ldw, int C, const Acts& a, int64_t m0, int R, int64_t K,
                  float (*acc)[ROWS]) {
    constexpr int NB = nbytes<T>();
    constexpr bool with_m = T == Q4_1 || T == Q5_1;
    const int64_t blocks = K / 32;
    __m256 sum[2][ROWS];
    zero_sums(sum, R);
    for (int64_t b = 0; b < blocks; ++b) {
        for (int h = 0; h < 2 && 8 * h < C; ++h) {
            const int cn = C - 8 * h < 8 ? C - 8 * h : 8;
            __m256i u[8], sg[8];  // the codes as unsigned bytes (Q8_0: |w|) and, Q8_0, the weights' signs
            alignas(32) float dh[8] = {}, mh[8] = {};  // the columns' d and m (half_at: F16C only where built in)
            for (int c = 0; c < 8; ++c) {
                if (c >= cn) {
                    u[c] = sg[c] = _mm256_setzero_si256();
                    continue;
                }
                const uint8_t* wb = w + (8 * h + c) * ldw + b * NB;
                dh[c] = half_at(wb);
                if constexpr (with_m) mh[c] = half_at(wb + 2);
                unpack32<T>(wb, u[c], sg[c]);
            }
            const __m256 dv = _mm256_load_ps(dh), mv = _mm256_load_ps(mh);
            for (int r = 0; r < R; ++r) {
                const int64_t row = (m0 + r) * blocks + b;
                const __m256i qa = _mm256_loadu_si256((const __m256i*)(a.q.data() + (m0 + r) * K + b * 32));
                __m256i v[8];
                for (int c = 0; c < 8; ++c) v[c] = dot32<T>(u[c], sg[c], qa);
                sum[h][r] = add_step32<T>(sum[h][r], v, a, row, dv, mv);
            }
        }
    }
    store_lanes(sum, C, R, acc);
}

// The same for up to 3 rows, each column's blocks read in runs (as tile_columns8) so that the weights stream in
// order: a one-row step is bound by that stream. (With more rows, tile32_rows8's 8 columns held in registers for
// every row is faster.)
template <int T>
void tile32_runs8(const uint8_t* w, int64_t ldw, int C, const Acts& a, int64_t m0, int R, int64_t K,
                  float (*acc)[ROWS]) {
    constexpr int NB = nbytes<T>();
    constexpr bool with_m = T == Q4_1 || T == Q5_1;
    constexpr int BK = 64;  // blocks per pass, as tile_columns8: a column's blocks read in runs
    const int run = run_length(R, BK);
    const int64_t blocks = K / 32;
    __m256 sum[2][ROWS];
    zero_sums(sum, R);
    __m256i v[PASS];  // block bb, row r, column c at (bb * R + r) * 8 + c
    alignas(32) float dh[BK][8], mh[BK][8];  // the columns' d and m
    for (int64_t b0 = 0; b0 < blocks; b0 += run) {
        const int bk = blocks - b0 < run ? (int)(blocks - b0) : run;
        for (int h = 0; h < 2 && 8 * h < C; ++h) {
            const int cn = C - 8 * h < 8 ? C - 8 * h : 8;
            for (int c = 0; c < 8; ++c) {
                if (c >= cn) {  // past the matrix: a lane of zeros
                    for (int bb = 0; bb < bk; ++bb) dh[bb][c] = mh[bb][c] = 0.0f;
                    zero_lane(v, bk, R, c);
                    continue;
                }
                for (int bb = 0; bb < bk; ++bb) {  // column c's blocks b0.. in the order they lie in memory
                    const uint8_t* wb = w + (8 * h + c) * ldw + (b0 + bb) * NB;
                    dh[bb][c] = half_at(wb);
                    mh[bb][c] = with_m ? half_at(wb + 2) : 0.0f;
                    __m256i u, sg;
                    unpack32<T>(wb, u, sg);
                    for (int r = 0; r < R; ++r) {
                        const __m256i qa =
                            _mm256_loadu_si256((const __m256i*)(a.q.data() + (m0 + r) * K + (b0 + bb) * 32));
                        v[(bb * R + r) * 8 + c] = dot32<T>(u, sg, qa);
                    }
                }
            }
            for (int bb = 0; bb < bk; ++bb) {  // the float steps block by block, in order
                const int64_t b = b0 + bb;
                const __m256 dv = _mm256_load_ps(dh[bb]), mv = _mm256_load_ps(mh[bb]);
                for (int r = 0; r < R; ++r) {
                    const int64_t row = (m0 + r) * blocks + b;
                    sum[h][r] = add_step32<T>(sum[h][r], v + (bb * R + r) * 8, a, row, dv, mv);
                }
            }
        }
    }
    store_lanes(sum, C, R, acc);
}
#endif

// One block's 32 codes in element order (Q8_0: its signed codes as bytes), as block_dots and pack32 read them.
template <int T>
void codes32(const uint8_t* wb, uint8_t* code) {
    if constexpr (T == Q8_0) {
        memcpy(code, wb + 2, 32);
    } else {
        const uint8_t* qs = wb + codes_at<T>();
        uint32_t qh = 0;
        if constexpr (T == Q5_0 || T == Q5_1) memcpy(&qh, wb + high_at<T>(), 4);
        for (int j = 0; j < 16; ++j) {
            code[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
            code[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
    }
}

// S[r] for rows r < R of the block at w: the rows' codes at q, K apart; their code sums at sums, ldb apart.
template <int T>
void block_dots(const uint8_t* w, int R, const int8_t* q, int64_t K, const int32_t* sums, int64_t ldb, int32_t* S) {
    (void)sums, (void)ldb;
    uint8_t code[32];
    codes32<T>(w, code);
    int8_t wv[32];
    for (int j = 0; j < 32; ++j) wv[j] = (int8_t)(code[j] - code_offset<T>());  // Q8_0: its own signed bytes
    for (int r = 0; r < R; ++r) {
        const int8_t* a = q + r * K;
        int32_t dot = 0;
        for (int e = 0; e < 32; ++e) dot += wv[e] * a[e];
        S[r] = dot;
    }
}

// -- the layer ---------------------------------------------------------------------------------------------------

// acc[c][r] = the reference's R for output column c < C of the tile at w (ldw bytes apart) and input row m0 + r.
template <int T>
void tile(const uint8_t* w, int64_t ldw, int C, const Acts& a, int64_t m0, int R, int64_t K, float (*acc)[ROWS],
          const uint8_t* next) {
    constexpr bool k = T == Q4_K || T == Q5_K || T == Q6_K;
    constexpr int E = k ? 256 : 32;
    const int64_t blocks = K / E;
    int32_t dots[ROWS], mins[ROWS];
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < ROWS; ++r) acc[c][r] = 0.0f;
#if defined(HFSPEC_INT8_AMX)
    if constexpr (k)
        if (R >= amx_min() && !a.tiles.empty()) {
            if (a.tile_subs == 1) return tile_amx<T, 1>(w, ldw, C, a, m0, R, K, acc, next);
            if (a.tile_subs == 2) return tile_amx<T, 2>(w, ldw, C, a, m0, R, K, acc, next);
        }
#endif
#if defined(HFSPEC_INT8_AVX512)
    if constexpr (k) {
        if (R < GROUPED_MIN) return tile_columns<T>(w, ldw, C, a, m0, R, K, acc, next);
    } else {
        return tile32<T>(w, ldw, C, a, m0, R, K, acc, next);
    }
#elif defined(HFSPEC_INT8_AVX2)
    if constexpr (k) {
        return tile_columns8<T>(w, ldw, C, a, m0, R, K, acc);
    } else {
        return R <= 3 ? tile32_runs8<T>(w, ldw, C, a, m0, R, K, acc) : tile32_rows8<T>(w, ldw, C, a, m0, R, K, acc);
    }
#endif
    for (int64_t b = 0; b < blocks; ++b) {
#if defined(HFSPEC_INT8_AVX512)
        if constexpr (k)
            if (R >= GROUPED_MIN) {
                k_block_grouped<T>(w, ldw, C, a, m0, R, K, b, acc, next);
                continue;
            }
#endif
        prefetch_block<nbytes<T>()>(next, ldw, b);
        const int8_t* q = a.q.data() + m0 * K + b * E;
        const float* da = a.d.data() + b;
        for (int c = 0; c < C; ++c) {
            const uint8_t* wb = w + c * ldw + b * nbytes<T>();
            float* out = acc[c];
            if constexpr (k) {
                k_dots<T>(wb, R, q, K, a.bsums.data() + (m0 * blocks + b) * 16, blocks * 16, dots, mins);
                const float d = half_at(wb + (T == Q6_K ? 208 : 0));
                const float dmin = T == Q6_K ? 0.0f : half_at(wb + 2);
                for (int r = 0; r < R; ++r) {
                    const float row_d = da[(m0 + r) * blocks];
                    const float scale = d * row_d;
                    const float step = (float)dots[r] * scale;
                    out[r] = out[r] + step;
                    if constexpr (T != Q6_K) {
                        const float mscale = dmin * row_d;
                        const float mstep = (float)mins[r] * mscale;
                        out[r] = out[r] - mstep;
                    }
                }
            } else {
                block_dots<T>(wb, R, q, K, a.sums.data() + m0 * blocks + b, blocks, dots);
                const float d = half_at(wb);
                const float m = T == Q4_1 || T == Q5_1 ? half_at(wb + 2) : 0.0f;
                for (int r = 0; r < R; ++r) {
                    const float scale = d * da[(m0 + r) * blocks];
                    float step = (float)dots[r] * scale;
                    if constexpr (T == Q4_1 || T == Q5_1) {
                        const float mstep = m * a.s[(m0 + r) * blocks + b];
                        step = step + mstep;
                    }
                    out[r] = out[r] + step;
                }
            }
        }
    }
}

// y[r][n0 + c] = acc[c][r] (+ bias[n0 + c]) for a tile's C columns and R rows: the reference's last step, y = R + b.
inline void write_out(const float (*acc)[ROWS], int C, int R, const float* bias, int64_t n0, float* y, int64_t ldy) {
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) y[r * ldy + n0 + c] = bias ? acc[c][r] + bias[n0 + c] : acc[c][r];
}

template <int T>
void linear(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const float* bias, float* y, int64_t ldy,
            int64_t M, int64_t N, int64_t K, int threads) {
    Acts a;
    quantize(T, x, ldx, M, K, a, threads);
    const int64_t tiles = (N + COLS - 1) / COLS;
#if defined(HFSPEC_INT8_AMX)
    if constexpr (is_k(T))
        if (M >= amx_min() && amx_on()) amx_rows(a, M, K, T == Q6_K ? 16 : 32, amx_subs(M));
    const bool amx = !a.tiles.empty();
#endif
#pragma omp parallel num_threads(threads)
    {
#if defined(HFSPEC_INT8_AMX)
    if constexpr (is_k(T))
        if (amx) {  // tile_amx's shapes, once per thread and call
            constexpr int S = T == Q6_K ? 16 : 32;
            if (a.tile_subs == 1) configure_tiles<S>();
            if (a.tile_subs == 2) configure_tiles<2 * S>();
        }
#endif
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * COLS;
        const int C = (int)(N - n0 < COLS ? N - n0 : COLS);
        float acc[COLS][ROWS];
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int R = (int)(M - m0 < ROWS ? M - m0 : ROWS);
            // the next tile's weights are prefetched by the first pass of rows over this one
            const uint8_t* next = m0 == 0 && n0 + 2 * COLS <= N ? w + (n0 + COLS) * ldw : nullptr;
            tile<T>(w + n0 * ldw, ldw, C, a, m0, R, K, acc, next);
            write_out(acc, C, R, bias, n0, y + m0 * ldy, ldy);
        }
    }
#if defined(HFSPEC_INT8_AMX)
    if (amx) _tile_release();
#endif
    }
}

// -- K-quants repacked for AVX2: 8 output columns interleaved ----------------------------------------------------
//
// A one-row step is bound by the instructions per weight block, not by memory, when each block is unpacked as the
// file stores it (scales in 6 bits, fp16 d, codes of one column per vector, then a horizontal sum). At load each
// group of 8 output columns is rewritten once, per super-block (PACKED<T> bytes):
//   Q4_K, Q5_K  [0, 32)      d of the 8 columns, fp32 (the fp16 widened: the same value)
//               [32, 64)     dmin of the 8 columns, fp32
//               [64, 128)    sc[j][c]: sub-block j's 6-bit scale of column c, a byte
//               [128, 192)   mn[p][c][2]: column c's mins of sub-blocks 2p and 2p + 1, bytes
//               [192, 1216)  the low nibbles (below)
//   Q5_K        [1216, 1472) hi[j][32]: byte 4c + e holds the top bit of the codes of nibble vector t of chunk j
//                            (below) in bit t
//   Q6_K  [0, 32)      d, fp32
//         [32, 160)    sc[i][c]: 16-weight sub-block i's signed scale of column c
//         [160, 1184)  the low nibbles
//         [1184, 1696) hi[j][h][32]: byte 4c + e holds the top 2 bits of the codes of nibble vectors 4h .. 4h + 3
//                      of chunk j (below), vector 4h + t in bits 2t, 2t + 1
// The low nibbles, nib[j][v][32] for each chunk j of 32 elements and v < 4: byte 4c + e holds column c's code of
// element 32j + 4v + e in its low nibble and of element 32j + 16 + 4v + e in its high one. A row's 4 activation codes
// broadcast so meet 4 codes of each of the 8 columns in one maddubs, and the 8 columns' sums come out in the 8 int32
// lanes with no horizontal sum. Int16 sums stay below 2^15: a Q4_K sub-block's (16 * 15 * 128 = 30720) takes its
// scale in one madd, Q5_K's every four maddubs (8 * 31 * 128 = 31744), Q6_K's every two (4 * 63 * 128 = 32256). Integer sums are exact, the fp32
// steps are the reference's, lane by lane.
#if defined(HFSPEC_INT8_AVX2)
template <int T>
constexpr int PACKED = T == Q4_K ? 1216 : T == Q5_K ? 1472 : 1696;
// Maddubs whose int16 sums stay below 2^15 (see above): then one madd takes them to int32 with their scale.
template <int T>
constexpr int SUMS16 = T == Q4_K ? 8 : T == Q5_K ? 4 : 2;
// Super-blocks ahead that the packed kernel prefetches: one group's blocks lie in one stream, and the hardware's
// prefetcher alone left a one-row step at 0.42 against 0.31-0.38 ms (Q4_K 8960 x 1536, 2 threads, AMD EPYC Zen 3).
constexpr int PACKED_AHEAD = 4;

// One super-block's 256 codes in element order (Q6_K's with their offset 32: 0 .. 63), as ggml dequantizes them.
template <int T>
void codes_of(const uint8_t* wb, uint8_t* code) {
    if constexpr (T == Q4_K || T == Q5_K) {
        const uint8_t *qs = wb + (T == Q4_K ? 16 : 48), *qh = wb + 16;
        for (int h = 0; h < 4; ++h)
            for (int l = 0; l < 32; ++l) {
                code[64 * h + l] = qs[32 * h + l] & 15;
                code[64 * h + 32 + l] = qs[32 * h + l] >> 4;
                if constexpr (T == Q5_K) {
                    code[64 * h + l] |= ((qh[l] >> (2 * h)) & 1) << 4;
                    code[64 * h + 32 + l] |= ((qh[l] >> (2 * h + 1)) & 1) << 4;
                }
            }
    } else {
        for (int n = 0; n < 2; ++n) {
            const uint8_t *ql = wb + 64 * n, *qh = wb + 128 + 32 * n;
            for (int l = 0; l < 32; ++l) {
                code[128 * n + l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
                code[128 * n + l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
                code[128 * n + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                code[128 * n + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
    }
}

template <int T>
void pack(const uint8_t* w, int64_t ldw, int64_t N, int64_t K, uint8_t* out, int threads) {
    constexpr int NB = T == Q4_K ? 144 : T == Q5_K ? 176 : 210, NIB = T == Q6_K ? 160 : 192;
    const int64_t blocks = K / 256, groups = (N + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        memset(out + g * blocks * PACKED<T>, 0, blocks * PACKED<T>);
        for (int c = 0; c < 8 && 8 * g + c < N; ++c)
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* wb = w + (8 * g + c) * ldw + b * NB;
                uint8_t* pb = out + (g * blocks + b) * PACKED<T>;
                if constexpr (T != Q6_K) {
                    const float d = half_at(wb), dmin = half_at(wb + 2);
                    memcpy(pb + 4 * c, &d, 4);
                    memcpy(pb + 32 + 4 * c, &dmin, 4);
                    int sc[8], mn[8];
                    scale_min_k4(wb + 4, sc, mn);
                    for (int j = 0; j < 8; ++j) {
                        pb[64 + 8 * j + c] = (uint8_t)sc[j];
                        pb[128 + 16 * (j / 2) + 2 * c + j % 2] = (uint8_t)mn[j];
                    }
                } else {
                    const float d = half_at(wb + 208);
                    memcpy(pb + 4 * c, &d, 4);
                    for (int i = 0; i < 16; ++i) pb[32 + 8 * i + c] = wb[192 + i];
                }
                uint8_t code[256];
                codes_of<T>(wb, code);
                for (int j = 0; j < 8; ++j)
                    for (int v = 0; v < 4; ++v)
                        for (int e = 0; e < 4; ++e) {
                            const uint8_t low = code[32 * j + 4 * v + e], high = code[32 * j + 16 + 4 * v + e];
                            pb[NIB + 128 * j + 32 * v + 4 * c + e] = (uint8_t)((low & 15) | ((high & 15) << 4));
                            // nibble vectors 0-3: the low nibbles of v = 0-3; 4-7: the high ones
                            if constexpr (T == Q5_K)
                                pb[1216 + 32 * j + 4 * c + e] |= (uint8_t)(((low >> 4) << v) | ((high >> 4) << (4 + v)));
                            if constexpr (T == Q6_K) {
                                pb[1184 + 64 * j + 4 * c + e] |= (uint8_t)((low >> 4) << (2 * v));
                                pb[1184 + 64 * j + 32 + 4 * c + e] |= (uint8_t)((high >> 4) << (2 * v));
                            }
                        }
            }
    }
}

inline __m256i broadcast_codes(const int8_t* a) {
    int32_t four;
    memcpy(&four, a, 4);
    return _mm256_set1_epi32(four);
}

// 8 int16 scales (bytes, signed for Q6_K) at s, each in the two int16 lanes of its column: lanes 2c, 2c + 1.
template <bool SIGNED>
inline __m256i column_pairs(const uint8_t* s0, const uint8_t* s1) {
    const __m128i a = _mm_loadl_epi64((const __m128i*)s0), b = _mm_loadl_epi64((const __m128i*)s1);
    const __m128i both = _mm_unpacklo_epi8(a, b);
    return SIGNED ? _mm256_cvtepi8_epi16(both) : _mm256_cvtepu8_epi16(both);
}

// Code vector t's fifth bits, bit t of each byte of hb, to bit 4 of u[t] (16-bit shifts: what crosses a byte is masked
// off).
inline void add_fifth_bits(__m256i hb, __m256i* u) {
    const __m256i top = _mm256_set1_epi8(0x10);
    u[0] = _mm256_or_si256(u[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
    u[1] = _mm256_or_si256(u[1], _mm256_and_si256(_mm256_slli_epi16(hb, 3), top));
    u[2] = _mm256_or_si256(u[2], _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
    u[3] = _mm256_or_si256(u[3], _mm256_and_si256(_mm256_slli_epi16(hb, 1), top));
    u[4] = _mm256_or_si256(u[4], _mm256_and_si256(hb, top));
    u[5] = _mm256_or_si256(u[5], _mm256_and_si256(_mm256_srli_epi16(hb, 1), top));
    u[6] = _mm256_or_si256(u[6], _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
    u[7] = _mm256_or_si256(u[7], _mm256_and_si256(_mm256_srli_epi16(hb, 3), top));
}

// Column c's code vectors of chunk j: u[v] the 4 codes of elements 32j + 4v + e, u[4 + v] of 32j + 16 + 4v + e.
template <int T>
inline void unpack_chunk(const uint8_t* pb, int j, __m256i* u) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const uint8_t* cj = pb + (T == Q6_K ? 160 : 192) + 128 * j;
    for (int v = 0; v < 4; ++v) {
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(cj + 32 * v));
        u[v] = _mm256_and_si256(packed, nib);
        u[4 + v] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nib);
    }
    if constexpr (T == Q5_K) add_fifth_bits(_mm256_loadu_si256((const __m256i*)(pb + 1216 + 32 * j)), u);
    if constexpr (T == Q6_K) {
        const __m256i top = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; ++h) {
            const __m256i hb = _mm256_loadu_si256((const __m256i*)(pb + 1184 + 64 * j + 32 * h));
            // bits 2t, 2t + 1 to bits 4, 5 (16-bit shifts: what crosses a byte is masked off)
            u[4 * h + 0] = _mm256_or_si256(u[4 * h + 0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
            u[4 * h + 1] = _mm256_or_si256(u[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
            u[4 * h + 2] = _mm256_or_si256(u[4 * h + 2], _mm256_and_si256(hb, top));
            u[4 * h + 3] = _mm256_or_si256(u[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
        }
    }
}

// Rows m0 .. m0 + R (R <= ROWS) of the 8 columns of one group: acc[c][r] as the reference sums them. RF: R known at
// compile time (the few-row steps keep their sums in registers), or 0.
template <int T, int RF>
void packed_group(const uint8_t* pg, const Acts& a, int64_t m0, int R_, int64_t K, float (*acc)[ROWS]) {
    const int R = RF ? RF : R_;
    const int64_t blocks = K / 256;
    __m256 sum[ROWS];
    __m256i dots[ROWS];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* pb = pg + b * PACKED<T>;
        for (int off = 0; off < PACKED<T>; off += 64) __builtin_prefetch(pb + PACKED_AHEAD * PACKED<T> + off, 0, 0);
        for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            __m256i u[8];
            unpack_chunk<T>(pb, j, u);
            // the scales of the code vectors u[0..3] and u[4..7]: one sub-block (Q4_K, Q5_K) or two (Q6_K)
            const __m256i s0 = T == Q6_K ? column_pairs<true>(pb + 32 + 16 * j, pb + 32 + 16 * j)
                                         : column_pairs<false>(pb + 64 + 8 * j, pb + 64 + 8 * j);
            const __m256i s1 = T == Q6_K ? column_pairs<true>(pb + 40 + 16 * j, pb + 40 + 16 * j) : s0;
            for (int r = 0; r < R; ++r) {
                const int8_t* q = a.q.data() + (m0 + r) * K + b * 256 + 32 * j;
                __m256i t = dots[r];
                for (int v0 = 0; v0 < 8; v0 += SUMS16<T>) {  // SUMS16 maddubs summed in int16, then scaled
                    __m256i s = _mm256_maddubs_epi16(u[v0], broadcast_codes(q + 4 * (v0 % 4) + 16 * (v0 / 4)));
                    for (int v = v0 + 1; v < v0 + SUMS16<T>; ++v)
                        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[v], broadcast_codes(q + 4 * (v % 4) + 16 * (v / 4))));
                    t = _mm256_add_epi32(t, _mm256_madd_epi16(s, v0 < 4 ? s0 : s1));
                }
                dots[r] = t;
            }
        }
        // the bsum terms' multipliers, column c's pair p in lanes 2c, 2c + 1: Q4_K's mins, Q6_K's scales
        constexpr int J = T == Q6_K ? 8 : 4;
        __m256i mult[J];
        for (int p = 0; p < J; ++p)
            mult[p] = T != Q6_K ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(pb + 128 + 16 * p)))
                                : column_pairs<true>(pb + 32 + 16 * p, pb + 40 + 16 * p);
        const __m256 dv = _mm256_loadu_ps((const float*)pb);
        const __m256 dminv = T != Q6_K ? _mm256_loadu_ps((const float*)(pb + 32)) : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r) {
            const int64_t row = m0 + r;
            const int32_t* pairs = a.pairs.data() + ((row / GROUP) * blocks + b) * 8 * GROUP + row % GROUP;
            __m256i mins = _mm256_setzero_si256();
            for (int p = 0; p < J; ++p)
                mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mult[p], _mm256_set1_epi32(pairs[p * GROUP])));
            const __m256 da = _mm256_set1_ps(a.d[row * blocks + b]);
            __m256i A = dots[r];
            if constexpr (T == Q6_K) A = _mm256_sub_epi32(A, _mm256_slli_epi32(mins, 5));
            sum[r] = _mm256_add_ps(sum[r], _mm256_mul_ps(_mm256_cvtepi32_ps(A), _mm256_mul_ps(dv, da)));
            if constexpr (T != Q6_K)
                sum[r] = _mm256_sub_ps(sum[r], _mm256_mul_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dminv, da)));
        }
    }
    store_lanes(&sum, 8, R, acc);
}

// -- 32-weight formats repacked for AVX2 (F16C): 8 output columns interleaved --------------------------------------
//
// The file's layout needs a horizontal sum per block, column and row (tile32_rows8's reduce8), which bound the
// kernel at a few rows. At load each group of 8 output columns is rewritten once, per block of 32 weights, in as
// many bytes as the file holds them (PACKED32<T>):
//   [0, 16)    d of the 8 columns, fp16 as stored (widened with F16C: the same value)
//   [16, 32)   m of the 8 columns, fp16 (Q4_1, Q5_1 only)
//   then       Q4_0, Q4_1, Q5_0, Q5_1: nib[v][32] for v < 4: byte 4c + e holds column c's code of element 4v + e in
//              its low nibble and of element 16 + 4v + e in its high one;
//              Q5_0, Q5_1: hi[32]: byte 4c + e holds the top bit of the code of nibble vector t (below) in bit t;
//              Q8_0: w[v][32] for v < 8: byte 4c + e holds column c's signed code of element 4v + e.
// Code vector v < 4 is the low nibbles of nib[v], 4 + v the high ones. A row's 4 activation codes broadcast so meet 4
// codes of each of the 8 columns in one maddubs, and the 8 columns' S come out in the 8 int32 lanes: no horizontal
// sum. Int16 sums stay below 2^15: 8 maddubs of 4-bit codes (8 * 2 * 15 * 127 = 30480), 4 of 5-bit ones (31496), one
// of Q8_0's (|w| times the codes given w's sign: 2 * 128 * 127). The fp32 steps are the reference's, lane by lane.
template <int T>
constexpr int PACKED32 = 8 * nbytes<T>();
template <int T>
constexpr int NIB32 = T == Q4_1 || T == Q5_1 ? 32 : 16;  // where the codes start

template <int T>
void pack32(const uint8_t* w, int64_t ldw, int64_t N, int64_t K, uint8_t* out, int threads) {
    constexpr int NB = nbytes<T>(), PB = PACKED32<T>, NIB = NIB32<T>;
    const int64_t blocks = K / 32, groups = (N + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        memset(out + g * blocks * PB, 0, blocks * PB);
        for (int c = 0; c < 8 && 8 * g + c < N; ++c)
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* wb = w + (8 * g + c) * ldw + b * NB;
                uint8_t* pb = out + (g * blocks + b) * PB;
                memcpy(pb + 2 * c, wb, 2);
                if constexpr (T == Q4_1 || T == Q5_1) memcpy(pb + 16 + 2 * c, wb + 2, 2);
                uint8_t code[32];
                codes32<T>(wb, code);
                if constexpr (T == Q8_0) {
                    for (int v = 0; v < 8; ++v)
                        for (int e = 0; e < 4; ++e) pb[NIB + 32 * v + 4 * c + e] = code[4 * v + e];
                } else {
                    for (int v = 0; v < 4; ++v)
                        for (int e = 0; e < 4; ++e) {
                            const uint8_t low = code[4 * v + e], high = code[16 + 4 * v + e];
                            pb[NIB + 32 * v + 4 * c + e] = (uint8_t)((low & 15) | ((high & 15) << 4));
                            if constexpr (T == Q5_0 || T == Q5_1)
                                pb[NIB + 128 + 4 * c + e] |= (uint8_t)(((low >> 4) << v) | ((high >> 4) << (4 + v)));
                        }
                }
            }
    }
}

// Rows m0 .. m0 + R (R <= ROWS) of the 8 columns of one group: acc[c][r] as the reference sums them. RF: R known at
// compile time, or 0.
template <int T, int RF>
void packed32_group(const uint8_t* pg, const Acts& a, int64_t m0, int R_, int64_t K, float (*acc)[ROWS]) {
    constexpr int PB = PACKED32<T>, NIB = NIB32<T>;
    const int R = RF ? RF : R_;
    const int64_t blocks = K / 32;
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 sum[ROWS];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* pb = pg + b * PB;
        for (int off = 0; off < PB; off += 64) __builtin_prefetch(pb + 4 * PACKED_AHEAD * PB + off, 0, 0);
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)pb));
        const __m256 mv = T == Q4_1 || T == Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(pb + 16)))
                                                 : _mm256_setzero_ps();
        __m256i u[8], sg[8];  // code vector v unsigned (Q8_0: |w|, and its signs in sg)
        if constexpr (T == Q8_0) {
            for (int v = 0; v < 8; ++v) {
                sg[v] = _mm256_loadu_si256((const __m256i*)(pb + NIB + 32 * v));
                u[v] = _mm256_sign_epi8(sg[v], sg[v]);
            }
        } else {
            for (int v = 0; v < 4; ++v) {
                const __m256i packed = _mm256_loadu_si256((const __m256i*)(pb + NIB + 32 * v));
                u[v] = _mm256_and_si256(packed, nib);
                u[4 + v] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nib);
            }
            if constexpr (T == Q5_0 || T == Q5_1) add_fifth_bits(_mm256_loadu_si256((const __m256i*)(pb + NIB + 128)), u);
        }
        for (int r = 0; r < R; ++r) {
            const int8_t* q = a.q.data() + (m0 + r) * K + b * 32;
            __m256i dots;
            if constexpr (T == Q8_0) {
                dots = _mm256_setzero_si256();
                for (int v = 0; v < 8; ++v) {
                    const __m256i pairs = _mm256_maddubs_epi16(u[v], _mm256_sign_epi8(broadcast_codes(q + 4 * v), sg[v]));
                    dots = _mm256_add_epi32(dots, _mm256_madd_epi16(pairs, ones));
                }
            } else if constexpr (T == Q4_0 || T == Q4_1) {
                __m256i s = _mm256_maddubs_epi16(u[0], broadcast_codes(q));
                for (int v = 1; v < 8; ++v)
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[v], broadcast_codes(q + 4 * (v % 4) + 16 * (v / 4))));
                dots = _mm256_madd_epi16(s, ones);
            } else {
                __m256i s0 = _mm256_maddubs_epi16(u[0], broadcast_codes(q));
                __m256i s1 = _mm256_maddubs_epi16(u[4], broadcast_codes(q + 16));
                for (int v = 1; v < 4; ++v) {
                    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(u[v], broadcast_codes(q + 4 * v)));
                    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(u[4 + v], broadcast_codes(q + 16 + 4 * v)));
                }
                dots = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
            }
            sum[r] = step32<T>(sum[r], dots, a, (m0 + r) * blocks + b, dv, mv);
        }
    }
    store_lanes(&sum, 8, R, acc);
}

// One group's rows from its packed blocks: the K-quants' kernel or the 32-weight formats'.
template <int T, int RF>
inline void packed_rows(const uint8_t* pg, const Acts& a, int64_t m0, int R, int64_t K, float (*acc)[ROWS]) {
    if constexpr (T == Q4_K || T == Q5_K || T == Q6_K)
        packed_group<T, RF>(pg, a, m0, R, K, acc);
    else
        packed32_group<T, RF>(pg, a, m0, R, K, acc);
}

template <int T>
void linear_packed(const float* x, int64_t ldx, const uint8_t* packed, const float* bias, float* y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, int threads) {
    constexpr bool k = T == Q4_K || T == Q5_K || T == Q6_K;
    Acts a;
    quantize(T, x, ldx, M, K, a, threads);
    const int64_t groups = (N + 7) / 8, group_bytes = k ? K / 256 * PACKED<T> : K / 32 * PACKED32<T>;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int C = (int)(N - 8 * g < 8 ? N - 8 * g : 8);
        const uint8_t* pg = packed + g * group_bytes;
        float acc[8][ROWS];
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int R = (int)(M - m0 < ROWS ? M - m0 : ROWS);
            switch (R) {
                case 1: packed_rows<T, 1>(pg, a, m0, R, K, acc); break;
                case 2: packed_rows<T, 2>(pg, a, m0, R, K, acc); break;
                case 3: packed_rows<T, 3>(pg, a, m0, R, K, acc); break;
                case 4: packed_rows<T, 4>(pg, a, m0, R, K, acc); break;
                default: packed_rows<T, 0>(pg, a, m0, R, K, acc);
            }
            write_out(acc, C, R, bias, 8 * g, y + m0 * ldy, ldy);
        }
    }
}
#endif

}  // namespace

extern "C" {

// Bytes of ``type`` weights (N rows of K) repacked for this build's kernel (hfspec_int8_pack), or 0 where the
// build reads that type as the file stores it.
int64_t hfspec_int8_packed_bytes(int type, int64_t N, int64_t K) {
#if defined(HFSPEC_INT8_AVX2)
    if (is_k(type) && K % 256 == 0)
        return (N + 7) / 8 * (K / 256) * (type == Q4_K ? PACKED<Q4_K> : type == Q5_K ? PACKED<Q5_K> : PACKED<Q6_K>);
#if defined(__F16C__)
    if (block_bytes(type) != 0 && !is_k(type) && K % 32 == 0)
        return (N + 7) / 8 * (K / 32) * 8 * block_bytes(type);  // PACKED32: the file's bytes, 8 columns a group
#endif
#endif
    (void)type, (void)N, (void)K;
    return 0;
}

// Writes hfspec_int8_packed_bytes(type, N, K) bytes of the repacked weights to ``out``; 0 where there is no packing.
int hfspec_int8_pack(int type, const uint8_t* w, int64_t ldw, int64_t N, int64_t K, uint8_t* out, int threads) {
    if (hfspec_int8_packed_bytes(type, N, K) == 0) return 0;
#if defined(HFSPEC_INT8_AVX2)
    switch (type) {
        case Q4_K: pack<Q4_K>(w, ldw, N, K, out, threads); break;
        case Q5_K: pack<Q5_K>(w, ldw, N, K, out, threads); break;
        case Q6_K: pack<Q6_K>(w, ldw, N, K, out, threads); break;
#if defined(__F16C__)
        case Q4_0: pack32<Q4_0>(w, ldw, N, K, out, threads); break;
        case Q4_1: pack32<Q4_1>(w, ldw, N, K, out, threads); break;
        case Q5_0: pack32<Q5_0>(w, ldw, N, K, out, threads); break;
        case Q5_1: pack32<Q5_1>(w, ldw, N, K, out, threads); break;
        case Q8_0: pack32<Q8_0>(w, ldw, N, K, out, threads); break;
#endif
    }
#else
    (void)w, (void)ldw, (void)out, (void)threads;
#endif
    return 1;
}

// hfspec_int8_linear on weights repacked by hfspec_int8_pack: the same bits.
int hfspec_int8_linear_packed(int type, const float* x, int64_t ldx, const uint8_t* packed, const float* bias,
                              float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if (hfspec_int8_packed_bytes(type, N, K) == 0) return 0;
#if defined(HFSPEC_INT8_AVX2)
    switch (type) {
        case Q4_K: linear_packed<Q4_K>(x, ldx, packed, bias, y, ldy, M, N, K, threads); break;
        case Q5_K: linear_packed<Q5_K>(x, ldx, packed, bias, y, ldy, M, N, K, threads); break;
        case Q6_K: linear_packed<Q6_K>(x, ldx, packed, bias, y, ldy, M, N, K, threads); break;
#if defined(__F16C__)
        case Q4_0: linear_packed<Q4_0>(x, ldx, packed, bias, y, ldy, M, N, K, threads); break;
        case Q4_1: linear_packed<Q4_1>(x, ldx, packed, bias, y, ldy, M, N, K, threads); break;
        case Q5_0: linear_packed<Q5_0>(x, ldx, packed, bias, y, ldy, M, N, K, threads); break;
        case Q5_1: linear_packed<Q5_1>(x, ldx, packed, bias, y, ldy, M, N, K, threads); break;
        case Q8_0: linear_packed<Q8_0>(x, ldx, packed, bias, y, ldy, M, N, K, threads); break;
#endif
    }
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)M, (void)threads;
#endif
    return 1;
}

// Whether K-quant tiles of several rows run on AMX: ``want`` 1 or 0 turns it on or off for the process (where the
// build and the CPU have it), -1 only asks. The bits are the same either way.
int hfspec_int8_amx(int want) {
#if defined(HFSPEC_INT8_AMX)
    if (want >= 0) amx_wanted.store(want != 0);
    return amx_on() ? 1 : 0;
#else
    (void)want;
    return 0;
#endif
}

const char* hfspec_int8_isa() {
#if defined(HFSPEC_INT8_AVX512)
    return "avx512vnni";
#elif defined(HFSPEC_INT8_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

// y (M rows, ldy apart) = x (M rows, ldx apart) @ w^T + bias in the arithmetic above, for w N rows (ldw bytes apart)
// of ggml type ``type`` blocks over K. Returns 0 (and computes nothing) for a type it does not read or a K that is
// not a whole number of blocks.
int hfspec_int8_linear(int type, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const float* bias,
                       float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if (block_bytes(type) == 0 || K % block_elements(type) != 0) return 0;
    switch (type) {
        case Q4_0: linear<Q4_0>(x, ldx, w, ldw, bias, y, ldy, M, N, K, threads); break;
        case Q4_1: linear<Q4_1>(x, ldx, w, ldw, bias, y, ldy, M, N, K, threads); break;
        case Q5_0: linear<Q5_0>(x, ldx, w, ldw, bias, y, ldy, M, N, K, threads); break;
        case Q5_1: linear<Q5_1>(x, ldx, w, ldw, bias, y, ldy, M, N, K, threads); break;
        case Q8_0: linear<Q8_0>(x, ldx, w, ldw, bias, y, ldy, M, N, K, threads); break;
        case Q4_K: linear<Q4_K>(x, ldx, w, ldw, bias, y, ldy, M, N, K, threads); break;
        case Q5_K: linear<Q5_K>(x, ldx, w, ldw, bias, y, ldy, M, N, K, threads); break;
        case Q6_K: linear<Q6_K>(x, ldx, w, ldw, bias, y, ldy, M, N, K, threads); break;
    }
    return 1;
}

}
