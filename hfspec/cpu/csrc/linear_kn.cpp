// Linear layers whose weights are stored input-major, w[K, N] (transformers' Conv1D: GPT-2, OpenAI GPT):
// y[M, N] = x[M, K] @ w (+ b[N]), fp32 or bf16 weights, fp32 inputs and outputs.
//
// Each output feature is a vector lane: for a block of rows and of output lanes the kernel walks k = 0 .. K - 1
// once, broadcasting x[r, k] and adding x[r, k] * w[k, lanes] into each row's accumulators. So every output is
// the same chain of multiply-adds in k order, whatever the block shape, the number of rows or the thread that
// computes it, and a row gets the same bits however many rows share the call (torch's addmm does not promise that).
// Threads take contiguous ranges of output lanes; the weights stream once per block of rows.
#include <stdint.h>

#include <algorithm>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

namespace {

using namespace hfspec_vec;

#if defined(__AVX512F__)
constexpr int ROWS = 6, COLS = 4;  // 24 accumulators + 4 weight registers + 1 input of 32
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int ROWS = 3, COLS = 3;  // 9 + 3 + 1 of 16
#else
constexpr int ROWS = 4, COLS = 2;
#endif

// y rows [0, R), lanes [0, C * VW) with the last vector holding ``tail`` lanes.
template <int R, int C, typename W>
void block(const float* x, int64_t ldx, const W* w, int64_t ldw, const float* b, float* y, int64_t ldy, int64_t K,
           int tail) {
    vec acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = vzero();
    for (int64_t k = 0; k < K; ++k) {
        vec wv[C];
        for (int c = 0; c < C; ++c) wv[c] = vload(w + k * ldw + c * VW, c == C - 1 ? tail : VW);
        for (int r = 0; r < R; ++r) {
            const vec xv = vset(x[r * ldx + k]);
            for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            const int n = c == C - 1 ? tail : VW;
            vec out = b ? vadd(acc[r][c], vload(b + c * VW, n)) : acc[r][c];
            vstore(y + r * ldy + c * VW, out, n);
        }
}

template <typename W, int R = ROWS, int C = COLS>
void block_any(int r, int c, const float* x, int64_t ldx, const W* w, int64_t ldw, const float* b, float* y,
               int64_t ldy, int64_t K, int tail) {
    if constexpr (R > 1)
        if (r < R) return block_any<W, R - 1, C>(r, c, x, ldx, w, ldw, b, y, ldy, K, tail);
    if constexpr (C > 1)
        if (c < C) return block_any<W, R, C - 1>(r, c, x, ldx, w, ldw, b, y, ldy, K, tail);
    block<R, C>(x, ldx, w, ldw, b, y, ldy, K, tail);
}

template <typename W>
void linear_kn(const float* x, int64_t ldx, const W* w, int64_t ldw, const float* b, float* y, int64_t ldy,
               int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t width = (int64_t)COLS * VW, blocks = (N + width - 1) / width;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {
        const int64_t n0 = nb * width, cols = std::min(width, N - n0);
        const int c = (int)((cols + VW - 1) / VW), tail = (int)(cols - (int64_t)(c - 1) * VW);
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int r = (int)std::min<int64_t>(ROWS, M - m0);
            block_any<W>(r, c, x + m0 * ldx, ldx, w + n0, ldw, b ? b + n0 : nullptr, y + m0 * ldy + n0, ldy, K, tail);
        }
    }
}

}  // namespace

extern "C" {

// ``dtype`` of the weights: 0 float32, 1 bfloat16 (raw uint16 bits); x, b and y are float32.
void hfspec_linear_kn(int dtype, const float* x, int64_t ldx, const void* w, int64_t ldw, const float* b, float* y,
                      int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    if (dtype == 1)
        linear_kn(x, ldx, (const uint16_t*)w, ldw, b, y, ldy, M, N, K, threads);
    else
        linear_kn(x, ldx, (const float*)w, ldw, b, y, ldy, M, N, K, threads);
}

}
