// Activations whose every element gets the same bits wherever it falls in the tensor.
//
// torch's SiLU and GELU run a vector body (Sleef) and a scalar remainder (libm), and split the elements between
// threads in chunks that depend on the tensor's size: which elements take the remainder depends on how many rows
// share the call, and the two paths differ in the last bit for a few percent of inputs (measured: 3% for SiLU,
// 12% for GELU in float32). Here every element goes through the same vector code (vec.h: partial vectors masked,
// one exponential): SiLU x / (1 + e^-x), quick GELU x / (1 + e^-1.702x), the tanh GELU written as the same logistic,
// x / (1 + e^-2u) with u = sqrt(2/pi) (x + 0.044715 x^3), and the erf GELU 0.5 x (1 + erf(x / sqrt 2)) with the
// erf of Abramowitz and Stegun 7.1.26 that torch's own vector path uses, and the logistic sigmoid 1 / (1 + e^-x) (a
// gate that models call as a function). float32 or bfloat16 in and out, float32 arithmetic, bfloat16 rounded to
// nearest even.
#include <stdint.h>

#include <algorithm>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

namespace {

using namespace hfspec_vec;

enum Kind { SILU = 0, QUICK_GELU = 1, GELU_TANH = 2, GELU_ERF = 3, SIGMOID = 4 };

inline vec logistic_times(vec x, vec z) { return vdiv(x, vadd(vset(1.0f), vexp(vmul(z, vset(-1.0f))))); }

inline vec erf(vec x) {
    vec a = vabs(x);
    vec t = vdiv(vset(1.0f), vfma(vset(0.3275911f), a, vset(1.0f)));
    vec r = vfma(vfma(vfma(vfma(vset(1.061405429f), t, vset(-1.453152027f)), t, vset(1.421413741f)), t,
                      vset(-0.284496736f)), t, vset(0.254829592f));
    vec e = vexp(vmul(vmul(a, a), vset(-1.0f)));
    return vcopysign(vfnma(vmul(e, t), r, vset(1.0f)), x);
}

template <int K>
inline vec apply(vec x) {
    if constexpr (K == SILU) return logistic_times(x, x);
    if constexpr (K == SIGMOID) return logistic_times(vset(1.0f), x);
    if constexpr (K == QUICK_GELU) return logistic_times(x, vmul(x, vset(1.702f)));
    if constexpr (K == GELU_TANH) {
        vec u = vmul(vset(0.7978845608028654f), vfma(vmul(vset(0.044715f), vmul(x, x)), x, x));
        return logistic_times(x, vadd(u, u));
    }
    return vmul(vmul(x, vset(0.5f)), vadd(vset(1.0f), erf(vmul(x, vset(0.70710678118654752f)))));
}

// Chunks of whole vectors per thread: where the thread boundaries fall changes nothing.
constexpr int64_t CHUNK = 16384;

// f(i, m) for the vectors of n elements (m of them at i, m < VW only at the end), in CHUNK-sized pieces per thread.
template <typename F>
void chunked(int64_t n, int threads, F f) {
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(chunks > 1 ? threads : 1) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = std::min(n, (c + 1) * CHUNK);
        for (int64_t i = c * CHUNK; i < end; i += VW) f(i, (int)std::min<int64_t>(VW, end - i));
    }
}

template <int K, typename T>
void run(const T* x, T* y, int64_t n, int threads) {
    chunked(n, threads, [&](int64_t i, int m) { vstore_as(y + i, apply<K>(vload(x + i, m)), m); });
}

// v rounded to T's precision (the identity for float32): torch rounds an activation to the tensor's dtype before the
// product that follows it.
inline vec rounded(vec v, const float*) { return v; }
inline vec rounded(vec v, const uint16_t*) {
    float buf[VW];
    vstore(buf, v, VW);
    for (int i = 0; i < VW; ++i) buf[i] = widen(narrow_bf16(buf[i]));
    return vload(buf, VW);
}

// y = act(x) * u, element by element, as torch computes ``act_fn(gate) * up`` from this file's activation.
template <int K, typename T>
void run_mul(const T* x, const T* u, T* y, int64_t n, int threads) {
    chunked(n, threads, [&](int64_t i, int m) {
        vstore_as(y + i, vmul(rounded(apply<K>(vload(x + i, m)), x), vload(u + i, m)), m);
    });
}

template <typename T>
void dispatch_mul(int kind, const T* x, const T* u, T* y, int64_t n, int threads) {
    switch (kind) {
        case SILU: return run_mul<SILU>(x, u, y, n, threads);
        case QUICK_GELU: return run_mul<QUICK_GELU>(x, u, y, n, threads);
        case GELU_TANH: return run_mul<GELU_TANH>(x, u, y, n, threads);
        case SIGMOID: return run_mul<SIGMOID>(x, u, y, n, threads);
        default: return run_mul<GELU_ERF>(x, u, y, n, threads);
    }
}

template <typename T>
void dispatch(int kind, const T* x, T* y, int64_t n, int threads) {
    switch (kind) {
        case SILU: return run<SILU>(x, y, n, threads);
        case QUICK_GELU: return run<QUICK_GELU>(x, y, n, threads);
        case GELU_TANH: return run<GELU_TANH>(x, y, n, threads);
        case SIGMOID: return run<SIGMOID>(x, y, n, threads);
        default: return run<GELU_ERF>(x, y, n, threads);
    }
}

}  // namespace

extern "C" {

// y[i] = activation ``kind`` (Kind) of x[i] for n contiguous elements; ``dtype`` 0 float32, 1 bfloat16.
void hfspec_activation(int kind, int dtype, const void* x, void* y, int64_t n, int threads) {
    if (dtype == 1)
        dispatch(kind, (const uint16_t*)x, (uint16_t*)y, n, threads);
    else
        dispatch(kind, (const float*)x, (float*)y, n, threads);
}

// y[i] = activation ``kind`` of x[i] times u[i] (the activation rounded to the dtype first, as torch's two ops do).
void hfspec_activation_mul(int kind, int dtype, const void* x, const void* u, void* y, int64_t n, int threads) {
    if (dtype == 1)
        dispatch_mul(kind, (const uint16_t*)x, (const uint16_t*)u, (uint16_t*)y, n, threads);
    else
        dispatch_mul(kind, (const float*)x, (const float*)u, (float*)y, n, threads);
}

}
