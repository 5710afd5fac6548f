// RMSNorm and rotary position embedding in one call each, every row on its own.
//
// A Llama-family forward spends most of its time outside the linears in a dozen small torch ops per norm (a cast,
// pow, mean, add, rsqrt, two products, a cast back) and per rotary (two slices, a negation, a cat, two products and a
// sum, for q and for k). Here each is one pass over the rows.
//
// RMSNorm, as LlamaRMSNorm computes it: per row, the float32 sum of squares in one fixed order (VW lanes, each summing
// every VW-th element in turn, then vec.h's fixed pairing of the lanes), divided by the row's length, plus eps, one
// over its square root; each element times that in float32, rounded to the input's dtype, times the weight, rounded to
// the output's dtype (float32 unless input and weight are both bfloat16). A row's bits depend on that row alone.
//
// Rotary, as apply_rotary_pos_emb computes it: q * cos + rotate_half(q) * sin, each product and the sum rounded on
// their own (this file is compiled with -ffp-contract=off: no FMA), in float32 or rounded to bfloat16 after each step
// as torch's bfloat16 ops do. With rotate_half(q) = (-q2, q1): out1 = q1 cos1 + (-q2) sin1, out2 = q2 cos2 + q1 sin2,
// which are torch's bits element for element.
#include <math.h>
#include <stdint.h>

#include <algorithm>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

namespace {

using namespace hfspec_vec;

inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = narrow_bf16(v); }
// v rounded to T's precision and widened back (the identity for float32).
inline float round_as(float v, const float*) { return v; }
inline float round_as(float v, const uint16_t*) { return widen(narrow_bf16(v)); }

template <typename X>
float sum_of_squares(const X* x, int64_t n) {
    vec acc = vzero();
    for (int64_t i = 0; i < n; i += VW) {
        const int m = (int)std::min<int64_t>(VW, n - i);
        vec v = vload(x + i, m);  // lanes past the row read as 0
        acc = vadd(acc, vmul(v, v));
    }
    return vsum(acc);
}

template <typename X, typename W, typename O>
void rmsnorm(const X* x, int64_t sx, const W* w, O* out, int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(rows >= 16 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const X* row = x + r * sx;
        O* y = out + r * n;
        const float variance = sum_of_squares(row, n) / (float)n;
        const float scale = 1.0f / sqrtf(variance + eps);
        for (int64_t i = 0; i < n; ++i) {
            const float normed = round_as(widen(row[i]) * scale, row);  // hidden_states.to(input_dtype)
            put(y + i, widen(w[i]) * normed);
        }
    }
}

// One tensor's heads: in (rows, heads, dim) with a row stride, out contiguous (rows, heads, dim).
template <typename T>
void rotate(const T* in, int64_t s_in, T* out, int64_t batch, int64_t tokens, int64_t heads, int64_t dim,
            const T* cos, const T* sin, int64_t sc_b, int64_t sc_t) {
    const int64_t half = dim / 2;
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t t = 0; t < tokens; ++t) {
            const T* c = cos + b * sc_b + t * sc_t;
            const T* s = sin + b * sc_b + t * sc_t;
            const int64_t row = b * tokens + t;
            for (int64_t h = 0; h < heads; ++h) {
                const T* q = in + row * s_in + h * dim;
                T* o = out + (row * heads + h) * dim;
                for (int64_t i = 0; i < half; ++i) {
                    const float a = round_as(widen(q[i]) * widen(c[i]), q);
                    const float e = round_as(-widen(q[i + half]) * widen(s[i]), q);
                    put(o + i, a + e);
                }
                for (int64_t i = half; i < dim; ++i) {
                    const float a = round_as(widen(q[i]) * widen(c[i]), q);
                    const float e = round_as(widen(q[i - half]) * widen(s[i]), q);
                    put(o + i, a + e);
                }
            }
        }
}

}  // namespace

extern "C" {

// out (rows, n), contiguous = RMSNorm of x's rows (row stride sx elements) with weight w (n values).
// x_dtype and w_dtype: 0 float32, 1 bfloat16; out is bfloat16 when both are, else float32.
void hfspec_rmsnorm(int x_dtype, int w_dtype, const void* x, int64_t sx, const void* w, void* out, int64_t rows,
                    int64_t n, float eps, int threads) {
    if (x_dtype == 0 && w_dtype == 0)
        rmsnorm((const float*)x, sx, (const float*)w, (float*)out, rows, n, eps, threads);
    else if (x_dtype == 1 && w_dtype == 1)
        rmsnorm((const uint16_t*)x, sx, (const uint16_t*)w, (uint16_t*)out, rows, n, eps, threads);
    else if (x_dtype == 1)
        rmsnorm((const uint16_t*)x, sx, (const float*)w, (float*)out, rows, n, eps, threads);
    else
        rmsnorm((const float*)x, sx, (const uint16_t*)w, (float*)out, rows, n, eps, threads);
}

// q (batch * tokens rows of q_heads * dim, row stride sq) and k (the same with k_heads, row stride sk) rotated by cos
// and sin ((batch or 1, tokens, dim); element strides sc_b, sc_t; stride 1 along dim) into q_out and k_out, contiguous
// (batch, tokens, heads, dim). dtype: 0 float32, 1 bfloat16 (every tensor alike).
void hfspec_rope(int dtype, const void* q, int64_t sq, const void* k, int64_t sk, void* q_out, void* k_out,
                 int64_t batch, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t dim, const void* cos,
                 const void* sin, int64_t sc_b, int64_t sc_t) {
    if (dtype == 1) {
        typedef uint16_t T;
        rotate((const T*)q, sq, (T*)q_out, batch, tokens, q_heads, dim, (const T*)cos, (const T*)sin, sc_b, sc_t);
        rotate((const T*)k, sk, (T*)k_out, batch, tokens, k_heads, dim, (const T*)cos, (const T*)sin, sc_b, sc_t);
    } else {
        typedef float T;
        rotate((const T*)q, sq, (T*)q_out, batch, tokens, q_heads, dim, (const T*)cos, (const T*)sin, sc_b, sc_t);
        rotate((const T*)k, sk, (T*)k_out, batch, tokens, k_heads, dim, (const T*)cos, (const T*)sin, sc_b, sc_t);
    }
}

}
