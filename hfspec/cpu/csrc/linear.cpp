// Linear layers for a handful of rows: y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]), fp32 and bf16 weights.
//
// A decoding step (M = 1) or the verification of k drafts (M = k + 1) is bound by streaming the weights
// from memory once.  The weights stay in nn.Linear's own [N, K] layout; each thread takes a contiguous
// range of output features and, for each block of NB weight rows, runs every block of MB input rows over
// it while it is still in L1, so M rows cost about what one row costs (the ggml micro-GEMM shape).
// The vector width is chosen when this file is compiled (-march=native): AVX-512 (AVX512F alone: every
// intrinsic below needs nothing more), AVX2+FMA or scalar; the block shape (MB, NB) per call, by the caller (see
// SHAPES). Each path uses only what its guard names, so any CPU that defines the macros builds it. Every output is the same dot product summed
// in the same order whatever the shape, so a row gets the same bits whatever rows come with it.
#include <stdint.h>
#include <string.h>

#include <algorithm>
#if defined(__AVX512F__)
#define HFSPEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define HFSPEC_AVX2 1
#endif
#if defined(HFSPEC_AVX512) || defined(HFSPEC_AVX2)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

#if defined(HFSPEC_AVX512)
constexpr int VW = 16;  // 32 registers (SHAPES)
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload_tail(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
// bf16 holds the high half of an fp32: widen 16 of them by a shift into the upper 16 bits.
inline vec vload_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// The last n < 16 of a row through a zeroed buffer: a masked 16-bit load would need AVX512BW and AVX512VL.
inline vec vload_bf16_tail(const uint16_t* p, int n) {
    uint16_t buf[16] = {0};
    memcpy(buf, p, n * sizeof(uint16_t));
    return vload_bf16(buf);
}
const char* ISA = "avx512";
#elif defined(HFSPEC_AVX2)
constexpr int VW = 8;  // 16 registers (SHAPES)
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i tail_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec vload_tail(const float* p, int n) { return _mm256_maskload_ps(p, tail_mask(n)); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vec vload_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vec vload_bf16_tail(const uint16_t* p, int n) {
    uint16_t buf[8] = {0};
    memcpy(buf, p, n * sizeof(uint16_t));
    return vload_bf16(buf);
}
const char* ISA = "avx2";
#else
constexpr int VW = 1;
typedef float vec;
inline vec vzero() { return 0.0f; }
inline vec vload(const float* p) { return *p; }
inline vec vload_tail(const float* p, int) { return *p; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float vsum(vec v) { return v; }
inline vec vload_bf16(const uint16_t* p) { uint32_t u = (uint32_t)*p << 16; float f; memcpy(&f, &u, 4); return f; }
inline vec vload_bf16_tail(const uint16_t* p, int) { return vload_bf16(p); }
const char* ISA = "scalar";
#endif

// Left alone, compilers fold each use of an input vector into its FMAs as a memory operand: C loads of it
// where one will do, and loads rather than FMAs then bound the block (measured: 15-25% slower from 8 rows
// up). An empty asm statement that claims to change the register stops the folding and emits nothing.
#if defined(__GNUC__) && (defined(HFSPEC_AVX512) || defined(HFSPEC_AVX2))
inline void keep_in_register(vec& v) { asm volatile("" : "+v"(v)); }
#else
inline void keep_in_register(vec&) {}
#endif

// Each block shape is a function of its own: inlined into the threads' loop, all of them shared one register
// allocation there, and some (3 rows over 1 weight row) reloaded their row pointers from the stack in the inner
// loop (measured: a forward's linears over 3 rows 22 ms where 4 rows took 19).
#if defined(__GNUC__)
#define NOINLINE __attribute__((noinline))
#else
#define NOINLINE
#endif

inline vec wload(const float* p) { return vload(p); }
inline vec wload(const uint16_t* p) { return vload_bf16(p); }
inline vec wload_tail(const float* p, int n) { return vload_tail(p, n); }
inline vec wload_tail(const uint16_t* p, int n) { return vload_bf16_tail(p, n); }

// sums[i * NB + j] = dot(x row i, w row j) over K, for R input rows and C <= NB weight rows.
// With ``next`` set, the weight rows of a block further on (``PREFETCH_BLOCKS``) are prefetched as this one
// streams in, so that memory keeps streaming while the rows are multiplied. (Spreading the prefetches over all
// passes measured slower.) They go to L2, not L1: prefetches into L1 wait for its few miss buffers, which
// capped the stream; into L2, a forward's linears over 8 rows took 18 ms instead of 26, over 1 row 14-17
// instead of 16-18 (AMD EPYC, AVX-512, 2 threads).
constexpr int PREFETCH_BLOCKS = 2;
constexpr int PREFETCH_L2 = 2;  // __builtin_prefetch locality: 3 = L1 (prefetcht0), 2 = L2 (prefetcht1)
template <int R, int C, int NB, typename W>
NOINLINE void block(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* sums, const W* next) {
    vec acc[R][C];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) acc[i][j] = vzero();
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        if (next && (k * sizeof(W)) % 64 == 0)
            for (int j = 0; j < NB; ++j) __builtin_prefetch(next + j * ldw + k, 0, PREFETCH_L2);
        vec wv[C];  // C weight registers held, one input register at a time: R * C + C + 1 in all
        for (int j = 0; j < C; ++j) wv[j] = wload(w + j * ldw + k);
        for (int i = 0; i < R; ++i) {
            vec xv = vload(x + i * ldx + k);
            keep_in_register(xv);
            for (int j = 0; j < C; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) {  // the last K % VW columns, loaded masked so that no bytes past a row are read
        int n = (int)(K - k);
        vec wv[C];
        for (int j = 0; j < C; ++j) wv[j] = wload_tail(w + j * ldw + k, n);
        for (int i = 0; i < R; ++i) {
            vec xv = vload_tail(x + i * ldx + k, n);
            for (int j = 0; j < C; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) sums[i * NB + j] = vsum(acc[i][j]);
}

// The block shape for the edges of M and N (r <= R rows, c <= C columns), so that neither needs padding.
template <int NB, typename W, int R, int C = NB>
void block_any(int r, int c, const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* sums,
               const W* next) {
    if constexpr (R > 1)
        if (r < R) return block_any<NB, W, R - 1, C>(r, c, x, ldx, w, ldw, K, sums, next);
    if constexpr (C > 1)
        if (c < C) return block_any<NB, W, R, C - 1>(r, c, x, ldx, w, ldw, K, sums, next);
    block<R, C, NB>(x, ldx, w, ldw, K, sums, next);
}

// y[i, j] (+ b[j]) for the block of r rows from x and c weight rows from w: the outputs of one block.
template <int MB, int NB, typename W>
inline void block_out(int r, int c, const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, const float* b,
                      float* y, int64_t ldy, const W* next) {
    float sums[MB * NB];
    block_any<NB, W, MB>(r, c, x, ldx, w, ldw, K, sums, next);
    for (int i = 0; i < r; ++i)
        for (int j = 0; j < c; ++j) y[i * ldy + j] = sums[i * NB + j] + (b ? b[j] : 0.0f);
}

// Rows beyond which a call is a prompt rather than a verification, and runs linear_tiled.
constexpr int64_t TILED_ROWS = 64;
// Weight bytes of one stretch of linear_tiled: it stays in L2 while every row passes over it.
constexpr int64_t STRETCH_BYTES = 512 * 1024;

// Many rows (a prompt): the same blocks in another order. Each thread takes stretches of weight rows small enough to
// stay in L2 and runs every block of input rows over a stretch before the next, so that the input rows stream once
// per stretch rather than once per block of weight rows (measured: a 512-row prompt over 1536 -> 8960 bf16 weights
// N x faster). Every output is still one block's dot product over all of K, so the bits are those of any other order.
template <int MB, int NB, typename W>
void linear_tiled(const float* x, int64_t ldx, const W* w, int64_t ldw, const float* b, float* y, int64_t ldy,
                  int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t blocks = (N + NB - 1) / NB;
    const int64_t fit = std::max<int64_t>(1, STRETCH_BYTES / (K * (int64_t)sizeof(W)) / NB);  // blocks per stretch
    int64_t stretches = (blocks + fit - 1) / fit;
    stretches = (stretches + threads - 1) / threads * threads;  // every thread as many
    const int64_t per = (blocks + stretches - 1) / stretches;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t st = 0; st < stretches; ++st) {
        const int64_t first = st * per, last = std::min(blocks, first + per);
        const int64_t passes = (M + MB - 1) / MB;
        for (int64_t p = 0, m0 = 0; p < passes; ++p) {
            const int R = (int)((M - m0 + (passes - p) - 1) / (passes - p));
            for (int64_t nb = first; nb < last; ++nb) {
                const int64_t n0 = nb * NB;
                const int C = (int)(N - n0 < NB ? N - n0 : NB);
                const W* next = (p == 0 && nb + PREFETCH_BLOCKS < last) ? w + (n0 + PREFETCH_BLOCKS * NB) * ldw
                                                                        : nullptr;
                block_out<MB, NB>(R, C, x + m0 * ldx, ldx, w + n0 * ldw, ldw, K, b ? b + n0 : nullptr,
                                  y + m0 * ldy + n0, ldy, next);
            }
            m0 += R;
        }
    }
}

template <int MB, int NB, typename W>
void linear_shaped(const float* x, int64_t ldx, const W* w, int64_t ldw, const float* b, float* y, int64_t ldy,
            int64_t M, int64_t N, int64_t K, int threads) {
    if (M > TILED_ROWS) return linear_tiled<MB, NB>(x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
    const int64_t blocks = (N + NB - 1) / NB;
    // Static scheduling gives each thread one contiguous stretch of weight rows to stream.
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {
        const int64_t n0 = nb * NB;
        const int C = (int)(N - n0 < NB ? N - n0 : NB);
        // Rows go in passes of about equal size (9 rows in blocks of 8: 5 + 4, not 8 + 1): a pass of very
        // few rows has too few independent sums to hide the FMA latency and costs nearly what a full one does.
        const int64_t passes = (M + MB - 1) / MB;
        for (int64_t p = 0, m0 = 0; p < passes; ++p) {
            const int R = (int)((M - m0 + (passes - p) - 1) / (passes - p));
            const W* next = (m0 == 0 && n0 + (PREFETCH_BLOCKS + 1) * NB <= N) ? w + (n0 + PREFETCH_BLOCKS * NB) * ldw
                                                                            : nullptr;
            block_out<MB, NB>(R, C, x + m0 * ldx, ldx, w + n0 * ldw, ldw, K, b ? b + n0 : nullptr, y + m0 * ldy + n0,
                              ldy, next);
            m0 += R;
        }
    }
}

// The block shapes a caller chooses from, by index (``hfspec_shape``): which is fastest for M rows depends on
// the CPU more than on the arithmetic (one AMD EPYC streamed 3-6 rows fastest one weight row at a time, another
// over 3 weight rows at once), so hfspec times them on the model's own layers where it runs (kernel_plan.py).
// Each holds MB * NB accumulators, NB weight registers and one input register.
#if defined(HFSPEC_AVX512)
constexpr int SHAPES[][2] = {{16, 1}, {12, 2}, {8, 3}};  // up to 24 + 3 + 1 of 32 registers
#elif defined(HFSPEC_AVX2)
constexpr int SHAPES[][2] = {{12, 1}, {4, 2}, {2, 4}};   // up to 13 + 1 of 16 registers
#else
constexpr int SHAPES[][2] = {{2, 4}};
#endif
constexpr int SHAPE_COUNT = sizeof(SHAPES) / sizeof(SHAPES[0]);

template <int I, typename W>
void linear_at(int shape, const float* x, int64_t ldx, const W* w, int64_t ldw, const float* b, float* y,
               int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if constexpr (I + 1 < SHAPE_COUNT)
        if (shape != I) return linear_at<I + 1>(shape, x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
    linear_shaped<SHAPES[I][0], SHAPES[I][1]>(x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
}

}  // namespace

extern "C" {

const char* hfspec_isa() { return ISA; }

int hfspec_shape_count() { return SHAPE_COUNT; }

// Rows and weight rows per block of shape ``i``.
void hfspec_shape(int i, int* mb, int* nb) {
    *mb = SHAPES[i][0];
    *nb = SHAPES[i][1];
}

// ``shape`` indexes SHAPES (out of range: the last); every shape gives the same bits.
void hfspec_linear_f32(int shape, const float* x, int64_t ldx, const float* w, int64_t ldw, const float* b,
                       float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    linear_at<0>(shape, x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
}

// bf16 weights (as raw uint16 bits) with fp32 inputs, bias and output.
void hfspec_linear_bf16w(int shape, const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, const float* b,
                         float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    linear_at<0>(shape, x, ldx, w, ldw, b, y, ldy, M, N, K, threads);
}

}
