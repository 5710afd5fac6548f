// Attention whose every query row gets the same bits however many rows share the call.
//
// One query row's output is softmax(q k^T * scale (+ mask)) v over the keys it may see. A decoding step computes
// it for one row, a verification for k + 1, a tree for N + 1, a prefill for T, a ragged batch beside padding;
// torch's CPU attention picks its blocks, GEMMs and vector tails from those shapes, so the same row comes out in
// other bits. Here each row is reduced in one fixed order that depends on nothing but the keys it sees:
//   - a score is one dot product over the head dimension (vector lanes over d, then one horizontal sum);
//   - the keys a row cannot see (a false boolean mask, an additive -inf or the mask dtype's minimum, the causal
//     future) are skipped, not multiplied by zero, and so are keys whose weight underflows to exactly 0: they
//     change no sum and shift no lane, since the lanes run over d and the keys one after another;
//   - every exponential is the same vector polynomial (lanes past the end are computed and dropped), so no
//     element takes a scalar tail;
//   - the weights are summed, and the values accumulated (lanes over d), key after key in key order.
// Queries, keys and values are float32 or bfloat16 (widened exactly), all arithmetic is float32, the output is
// rounded to the input dtype (nearest even). OpenMP shares the query rows among threads; a row never depends on
// which thread runs it. A row that sees no key gets zeros.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

namespace {

using namespace hfspec_vec;

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = narrow_bf16(x); }

// What the caller's mask holds per (query, key): nothing, booleans, or additive float32/bfloat16/float16 values.
enum MaskKind { MASK_NONE = 0, MASK_BOOL = 1, MASK_F32 = 2, MASK_BF16 = 3, MASK_F16 = 4 };

inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        float f = ldexpf((float)mant, -24);  // subnormal (or zero): exact
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Whether key j is seen, and the additive value it gets (0 for booleans and no mask).
inline bool mask_at(const void* mask, int kind, int64_t at, float* add) {
    switch (kind) {
        case MASK_BOOL: *add = 0.0f; return ((const uint8_t*)mask)[at] != 0;
        case MASK_F32: *add = ((const float*)mask)[at]; return *add > -3.40282347e38f;
        case MASK_BF16: *add = widen(((const uint16_t*)mask)[at]); return *add > -3.38953139e38f;
        case MASK_F16: *add = half_to_float(((const uint16_t*)mask)[at]); return *add > -65504.0f;
        default: *add = 0.0f; return true;
    }
}

// dot(q, k) over D: lanes over d in order, then one horizontal sum; the same instructions for every (q, k).
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
    vec acc = vzero();
    for (int64_t d = 0; d < D; d += VW) {
        const int m = (int)std::min<int64_t>(VW, D - d);
        acc = vfma(vload(q + d, m), vload(k + d, m), acc);
    }
    return vsum(acc);
}

struct Args {
    const void *q, *k, *v, *mask;
    void* out;
    int64_t qs[3], ks[3], vs[3], os[3], ms[4];  // strides in elements: (b, h, i), (b, h, j), (b, h, i, j)
    int64_t B, H, Hkv, Q, L, D, Dv;
    float scale, softcap;
    int mask_kind, causal;
};

// Scratch for one row: the keys it sees, their scores (then weights), its query widened, its accumulators.
struct Scratch {
    std::vector<int64_t> keys;
    std::vector<float> score, add, query, acc;
};

template <typename T>
void attend_row(const Args& a, int64_t b, int64_t h, int64_t i, Scratch& s) {
    const int64_t g = h / (a.H / a.Hkv);  // the key/value head this query head reads, in place
    const T* q = (const T*)a.q + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
    const T* kb = (const T*)a.k + b * a.ks[0] + g * a.ks[1];
    const T* vb = (const T*)a.v + b * a.vs[0] + g * a.vs[1];
    T* out = (T*)a.out + b * a.os[0] + h * a.os[1] + i * a.os[2];
    // 1. The keys this row sees, in key order, with their additive mask values.
    const int64_t last = a.causal ? std::min(a.L, i + 1) : a.L;
    int64_t n = 0;
    const int64_t m0 = b * a.ms[0] + h * a.ms[1] + i * a.ms[2];
    for (int64_t j = 0; j < last; ++j) {
        float add;
        if (!mask_at(a.mask, a.mask_kind, m0 + j * a.ms[3], &add)) continue;
        s.keys[n] = j;
        s.add[n++] = add;
    }
    // 2. Scores: scale, soft-capping (tanh), then the mask, as eager attention orders them; the row's maximum.
    for (int64_t d = 0; d < a.D; ++d) s.query[d] = widen(q[d]);
    float top = -INFINITY;
    for (int64_t t = 0; t < n; ++t) {
        float x = dot(s.query.data(), kb + s.keys[t] * a.ks[2], a.D) * a.scale;
        if (a.softcap > 0.0f) x = a.softcap * tanhf(x / a.softcap);
        x += s.add[t];
        s.score[t] = x;
        top = x > top ? x : top;
    }
    // 3. Weights exp(x - max), each through the same vector polynomial; then weights summed and values
    //    accumulated key after key, skipping the weights that are exactly 0.
    const int64_t dv = a.Dv;
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    float total = 0.0f;
    if (n > 0 && top > -INFINITY) {
        const vec shift = vset(top);
        for (int64_t t = 0; t < n; t += VW) {
            const int m = (int)std::min<int64_t>(VW, n - t);
            vstore(s.score.data() + t, vexp(vsub(vload(s.score.data() + t, m), shift)), m);
        }
        float* acc = s.acc.data();
        for (int64_t t = 0; t < n; ++t) {
            const float p = s.score[t];
            if (p == 0.0f) continue;
            total += p;
            const T* v = vb + s.keys[t] * a.vs[2];
            const vec pv = vset(p);
            for (int64_t d = 0; d < dv; d += VW) {
                const int m = (int)std::min<int64_t>(VW, dv - d);
                vstore(acc + d, vfma(pv, vload(v + d, m), vload(acc + d, m)), m);
            }
        }
        const vec inv = vset(total);
        for (int64_t d = 0; d < dv; d += VW) {
            const int m = (int)std::min<int64_t>(VW, dv - d);
            vstore(acc + d, vdiv(vload(acc + d, m), inv), m);
        }
    }
    for (int64_t d = 0; d < dv; ++d) store(out + d, total > 0.0f ? s.acc[d] : 0.0f);
}

template <typename T>
void attend(const Args& a, int threads) {
    // Rows ordered (b, key/value head, query, head in the group): neighbours read the same keys and values.
    const int64_t group = a.H / a.Hkv, rows = a.B * a.H * a.Q;
#pragma omp parallel num_threads(threads)
    {
        Scratch s;
        s.keys.resize(a.L);
        s.score.resize(a.L + VW);
        s.add.resize(a.L);
        s.query.resize(a.D + VW);
        s.acc.resize(a.Dv + VW);
#pragma omp for schedule(dynamic, 8)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t j = r % group, i = (r / group) % a.Q, g = (r / (group * a.Q)) % a.Hkv,
                          b = r / (group * a.Q * a.Hkv);
            attend_row<T>(a, b, g * group + j, i, s);
        }
    }
}

}  // namespace

extern "C" {

// out (b, h, i, :) = attention of query (b, h, i) over keys/values (b, h / (H / Hkv), j) for the keys j it sees:
// j <= i with ``causal`` (upper left, as torch's is_causal), and where the mask (kind: MaskKind) lets it.
// ``dtype``: 0 float32, 1 bfloat16 (queries, keys, values and output alike). Strides are in elements, the
// innermost dimension (d; j of the mask) has the stride given last (d: unit).
// ``sizes`` holds, in this order, the strides qs[3], ks[3], vs[3], os[3], ms[4] and B, H, Hkv, Q, L, D, Dv.
void hfspec_attention(int dtype, const void* q, const void* k, const void* v, void* out, const void* mask,
                      int mask_kind, const int64_t* sizes, float scale, float softcap, int causal, int threads) {
    Args a{q, k, v, mask, out, {}, {}, {}, {}, {}, 0, 0, 0, 0, 0, 0, 0, scale, softcap, mask_kind, causal};
    memcpy(a.qs, sizes, sizeof a.qs);
    memcpy(a.ks, sizes + 3, sizeof a.ks);
    memcpy(a.vs, sizes + 6, sizeof a.vs);
    memcpy(a.os, sizes + 9, sizeof a.os);
    memcpy(a.ms, sizes + 12, sizeof a.ms);
    const int64_t* n = sizes + 16;
    a.B = n[0], a.H = n[1], a.Hkv = n[2], a.Q = n[3], a.L = n[4], a.D = n[5], a.Dv = n[6];
    if (dtype == 1)
        attend<uint16_t>(a, threads);
    else
        attend<float>(a, threads);
}

}
