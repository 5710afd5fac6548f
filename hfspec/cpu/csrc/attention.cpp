// Attention whose every query row gets the same bits however many rows share the call.
//
// One query row's output is softmax(q k^T * scale (+ mask)) v over the keys it may see. A decoding step computes
// it for one row, a verification for k + 1, a tree for N + 1, a prefill for T, a ragged batch beside padding;
// torch's CPU attention picks its blocks, GEMMs and vector tails from those shapes, so the same row comes out in
// other bits. Here each row is reduced in one fixed order that depends on nothing but the keys it sees:
//   - a score is one dot product over the head dimension (vector lanes over d, then one horizontal sum);
//   - the keys a row cannot see (a false boolean mask, an additive -inf or the mask dtype's minimum, the causal
//     future) are skipped, not multiplied by zero, and so are keys whose weight comes out exactly 0 (a finite
//     mask value such as -1e9, a score far below the row's top): they change no sum and shift no lane, so such a
//     key gives the bits of a hidden one, and a NaN under it reaches no output;
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

// The dot products of one query row (widened to float32) with VW keys: lanes over d, chunk after chunk, then each
// key's lanes summed by vsums; lane j of the result is key j's. ND > 0: the query's ND vectors held in registers.
template <int ND, typename T>
inline vec dots(const float* q, const T* const* k, int64_t D) {
    vec acc[VW];
    if constexpr (ND > 0) {
        vec qv[ND];
        for (int c = 0; c < ND; ++c) qv[c] = vload(q + c * VW, c == ND - 1 ? (int)(D - (ND - 1) * VW) : VW);
        for (int j = 0; j < VW; ++j) {
            vec sum = vzero();
            for (int c = 0; c < ND; ++c)
                sum = vfma(qv[c], vload(k[j] + c * VW, c == ND - 1 ? (int)(D - (ND - 1) * VW) : VW), sum);
            acc[j] = sum;
        }
    } else {
        for (int j = 0; j < VW; ++j) {
            vec sum = vzero();
            for (int64_t d = 0; d < D; d += VW) {
                const int m = (int)std::min<int64_t>(VW, D - d);
                sum = vfma(vload(q + d, m), vload(k[j] + d, m), sum);
            }
            acc[j] = sum;
        }
    }
    return vsums(acc);
}

// Scores of one query row against keys[0, n): dot products, scaled, soft-capped, plus the mask's value; returns
// their maximum. Keys go in batches of VW; a batch's empty slots repeat a key and are dropped, and every slot is
// summed alike, so a key's score does not depend on where its batch starts.
template <int ND, typename T>
float scores(const float* q, const T* kb, int64_t ldk, const int64_t* keys, const float* add, int64_t n, int64_t D,
             float scale, float softcap, float* out) {
    vec top = vset(-INFINITY);
    for (int64_t t0 = 0; t0 < n; t0 += VW) {
        const int nk = (int)std::min<int64_t>(VW, n - t0);
        const T* k[VW];
        for (int j = 0; j < VW; ++j) k[j] = kb + keys[t0 + (j < nk ? j : 0)] * ldk;
        vec x = vmul(dots<ND>(q, k, D), vset(scale));
        if (softcap > 0.0f) {  // tanh has no vector form here: libm's, element by element, the same for every key
            alignas(64) float buf[VW];
            vstore(buf, x, VW);
            for (int j = 0; j < VW; ++j) buf[j] = softcap * tanhf(buf[j] / softcap);
            x = vload(buf, VW);
        }
        x = vadd(x, vload(add + t0, nk));
        vstore(out + t0, x, nk);
        top = vmax(top, vkeep(x, nk, -INFINITY));
    }
    return vmaxall(top);
}

template <typename T, int ND = 8>
float scores_any(const float* q, const T* kb, int64_t ldk, const int64_t* keys, const float* add, int64_t n,
                 int64_t D, float scale, float softcap, float* out) {
    const int64_t nd = (D + VW - 1) / VW;
    if constexpr (ND > 1)
        if (nd < ND) return scores_any<T, ND - 1>(q, kb, ldk, keys, add, n, D, scale, softcap, out);
    return nd == ND ? scores<ND>(q, kb, ldk, keys, add, n, D, scale, softcap, out)
                    : scores<0>(q, kb, ldk, keys, add, n, D, scale, softcap, out);
}

// acc[r][d0 + ...] = sum over t of p[r][t] v[keys[t]][d0 + ...], key after key, for R rows and NV vectors of d
// (the last holding ``last`` lanes): the accumulators stay in registers, one value vector feeds every row.
template <int R, int NV, typename T>
void weigh(const T* vb, int64_t ldv, const int64_t* keys, int64_t n, const float* p, int64_t ldp, int last,
           float* acc_out, int64_t lda) {
    vec acc[R][NV];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
    for (int64_t t = 0; t < n; ++t) {
        const T* v = vb + keys[t] * ldv;
        vec vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = vload(v + c * VW, c == NV - 1 ? last : VW);
        for (int r = 0; r < R; ++r) {
            const vec pr = vset(p[r * ldp + t]);
            for (int c = 0; c < NV; ++c) acc[r][c] = vfma(pr, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) vstore(acc_out + r * lda + c * VW, acc[r][c], c == NV - 1 ? last : VW);
}

// Vectors of d per pass over the keys, and rows per pass: as many accumulators as the registers hold.
constexpr int MAX_NV = 4;
constexpr int MAX_GROUP = 64;  // query heads per key/value head handled together (more: in parts)
#if defined(__AVX512F__)
constexpr int REGISTERS = 32;
#else
constexpr int REGISTERS = 16;
#endif
constexpr int max_rows(int nv) { return std::min(8, std::max(1, (REGISTERS - 2 - nv) / nv)); }

template <typename T, int R = max_rows(1), int NV = MAX_NV>
void weigh_any(int r, int nv, const T* vb, int64_t ldv, const int64_t* keys, int64_t n, const float* p, int64_t ldp,
               int last, float* acc, int64_t lda) {
    if constexpr (NV > 1)
        if (nv < NV) return weigh_any<T, std::min(R, max_rows(NV - 1)), NV - 1>(r, nv, vb, ldv, keys, n, p, ldp, last,
                                                                              acc, lda);
    if constexpr (R > max_rows(NV))
        return weigh_any<T, max_rows(NV), NV>(r, nv, vb, ldv, keys, n, p, ldp, last, acc, lda);
    else {
        if constexpr (R > 1)
            if (r < R) return weigh_any<T, R - 1, NV>(r, nv, vb, ldv, keys, n, p, ldp, last, acc, lda);
        weigh<R, NV>(vb, ldv, keys, n, p, ldp, last, acc, lda);
    }
}

struct Args {
    const void *q, *k, *v, *mask;
    void* out;
    int64_t qs[3], ks[3], vs[3], os[3], ms[4];  // strides in elements: (b, h, i), (b, h, j), (b, h, i, j)
    int64_t B, H, Hkv, Q, L, D, Dv;
    float scale, softcap;
    int mask_kind, causal;
};

// Scratch for a group of rows: the keys they see, their scores (then weights), queries, accumulators.
struct Scratch {
    std::vector<int64_t> keys;
    std::vector<float> add, score, query, acc;
    Scratch(const Args& a, int rows)
        : keys(a.L), add(a.L), score(rows * (a.L + VW)), query(rows * (a.D + VW)), acc(rows * (a.Dv + VW)) {}
};

// The query heads h0 .. h0 + rows - 1 of query i, which read key/value head g and see the same keys: scores per
// row, weights per row, then the values weighed for all of them at once (each row's sums stay its own).
template <typename T>
void attend_group(const Args& a, int64_t b, int64_t g, int64_t h0, int rows, int64_t i, Scratch& s) {
    const T* kb = (const T*)a.k + b * a.ks[0] + g * a.ks[1];
    const T* vb = (const T*)a.v + b * a.vs[0] + g * a.vs[1];
    // 1. The keys the rows see, in key order, with their additive mask values.
    const int64_t last = a.causal ? std::min(a.L, i + 1) : a.L;
    const int64_t m0 = b * a.ms[0] + h0 * a.ms[1] + i * a.ms[2];
    int64_t n = 0;
    for (int64_t j = 0; j < last; ++j) {
        float add;
        if (!mask_at(a.mask, a.mask_kind, m0 + j * a.ms[3], &add)) continue;
        s.keys[n] = j;
        s.add[n++] = add;
    }
    // 2. Per row: scores and their maximum; weights exp(x - max), each through the same vector polynomial.
    const int64_t ldp = a.L + VW, ldq = a.D + VW, lda = a.Dv + VW;
    for (int r = 0; r < rows; ++r) {
        const T* q = (const T*)a.q + b * a.qs[0] + (h0 + r) * a.qs[1] + i * a.qs[2];
        float* query = s.query.data() + r * ldq;
        for (int64_t d = 0; d < a.D; ++d) query[d] = widen(q[d]);
        float* p = s.score.data() + r * ldp;
        const float top = scores_any(query, kb, a.ks[2], s.keys.data(), s.add.data(), n, a.D, a.scale, a.softcap, p);
        if (!(top > -INFINITY)) {  // no key seen (or all at -inf): weights 0, the row comes out 0
            std::fill(p, p + n, 0.0f);
            continue;
        }
        const vec shift = vset(top);
        for (int64_t t = 0; t < n; t += VW) {
            const int m = (int)std::min<int64_t>(VW, n - t);
            vstore(p + t, vexp(vsub(vload(p + t, m), shift)), m);
        }
    }
    // 3. Keys of weight exactly 0 in every row are left out, as hidden keys are.
    int64_t kept = 0;
    for (int64_t t = 0; t < n; ++t) {
        bool counts = false;
        for (int r = 0; r < rows; ++r) counts |= s.score[r * ldp + t] != 0.0f;
        if (!counts) continue;
        s.keys[kept] = s.keys[t];
        for (int r = 0; r < rows; ++r) s.score[r * ldp + kept] = s.score[r * ldp + t];
        ++kept;
    }
    n = kept;
    // 4. Per row, the sum of its weights in lanes by the ordinal of its keys of nonzero weight (lane l: the l-th,
    //    (l + VW)-th, ... of them), then the lanes: it depends on the keys that count alone, not on where they
    //    sit in the cache nor on keys of weight 0 (in other rows a key of weight 0 adds exactly 0 below).
    float total[MAX_GROUP];
    float* nonzero = s.add.data();  // the mask values are read: scratch for one row's nonzero weights
    for (int r = 0; r < rows; ++r) {
        const float* p = s.score.data() + r * ldp;
        int64_t m = 0;
        for (int64_t t = 0; t < n; ++t)
            if (p[t] != 0.0f) nonzero[m++] = p[t];
        vec sum = vzero();
        for (int64_t t = 0; t < m; t += VW) sum = vadd(sum, vload(nonzero + t, (int)std::min<int64_t>(VW, m - t)));
        total[r] = vsum(sum);
    }
    // 5. The values weighed, a few vectors of d and a few rows per pass over the keys.
    for (int64_t d0 = 0; d0 < a.Dv; d0 += MAX_NV * VW) {
        const int64_t width = std::min<int64_t>(MAX_NV * VW, a.Dv - d0);
        const int nv = (int)((width + VW - 1) / VW), tail = (int)(width - (int64_t)(nv - 1) * VW);
        for (int r0 = 0; r0 < rows; r0 += max_rows(nv)) {
            const int r = std::min(rows - r0, max_rows(nv));
            weigh_any<T>(r, nv, vb + d0, a.vs[2], s.keys.data(), n, s.score.data() + r0 * ldp, ldp, tail,
                         s.acc.data() + r0 * lda + d0, lda);
        }
    }
    // 6. Each row's output: its accumulators over its sum of weights, in the output dtype.
    for (int r = 0; r < rows; ++r) {
        T* out = (T*)a.out + b * a.os[0] + (h0 + r) * a.os[1] + i * a.os[2];
        const float* acc = s.acc.data() + r * lda;
        const vec sum = vset(total[r]);
        for (int64_t d = 0; d < a.Dv; d += VW) {
            const int m = (int)std::min<int64_t>(VW, a.Dv - d);
            vstore_as(out + d, total[r] > 0.0f ? vdiv(vload(acc + d, m), sum) : vzero(), m);
        }
    }
}

template <typename T>
void attend(const Args& a, int threads) {
    // Work items: (b, key/value head, query), with the query heads that read that key/value head. They see the same
    // keys unless the mask differs per head (a position bias): then each head is a group of its own.
    const int64_t group = a.H / a.Hkv;
    const int per = a.ms[1] == 0 ? (int)std::min<int64_t>(group, MAX_GROUP) : 1;
    const int64_t parts = (group + per - 1) / per, items = a.B * a.Hkv * a.Q * parts;
#pragma omp parallel num_threads(threads)
    {
        Scratch s(a, per);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t part = it % parts, i = (it / parts) % a.Q, g = (it / (parts * a.Q)) % a.Hkv,
                          b = it / (parts * a.Q * a.Hkv);
            const int64_t h0 = g * group + part * per;
            attend_group<T>(a, b, g, h0, (int)std::min<int64_t>(per, group - part * per), i, s);
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
