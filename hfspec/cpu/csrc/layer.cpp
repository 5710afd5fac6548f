// One decoder layer of the Llama/Qwen2 shape in one call: the kernels a switched layer's modules call, in their order.
//
// input norm, q/k/v projections, rotary, the new keys and values written into the cache's buffers, attention over
// the filled columns, o projection, residual; post-attention norm, gate and up projections, activation times up, down
// projection, residual. Every step is one of this library's own entries with the arguments the Python modules give
// it (hfspec/cpu/layer.py builds them), and the two residual sums are float32 additions as torch's are, so the layer's
// output has the bits of the module path, row for row. What saves time is only what is gone: a torch op, a module
// call and a ctypes call per step.
#include <stdint.h>

#include <algorithm>
#include <cstring>
#include <vector>

extern "C" {
void hfspec_rmsnorm(int x_dtype, int w_dtype, const void* x, int64_t sx, const void* w, void* out, int64_t rows,
                    int64_t n, float eps, int threads);
void hfspec_rope(int dtype, const void* q, int64_t sq, const void* k, int64_t sk, void* q_out, void* k_out,
                 int64_t batch, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t dim, const void* cos,
                 const void* sin, int64_t sc_b, int64_t sc_t);
void hfspec_attention(int dtype, const void* q, const void* k, const void* v, void* out, const void* mask,
                      int mask_kind, const int64_t* sizes, float scale, float softcap, int causal, int threads);
void hfspec_activation_mul(int kind, int dtype, const void* x, const void* u, void* y, int64_t n, int threads);
void hfspec_linear_f32(int shape, const float* x, int64_t ldx, const float* w, int64_t ldw, const float* b, float* y,
                       int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int hfspec_quant_linear(int type, int shape, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw,
                        const float* b, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int hfspec_int8_linear(int type, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const float* bias,
                       float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int hfspec_int8_linear_packed(int type, const float* x, int64_t ldx, const uint8_t* packed, const float* bias,
                              float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
int hfspec_draft_linear(int bits, const float* x, int64_t ldx, const uint8_t* w, const float* b, float* y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
}

namespace {

// What a linear runs (hfspec.cpu.c_linear.Kind): the entry its module's forward calls.
enum Kind { FLOAT32 = 1, GGUF_FLOAT32 = 2, INT8 = 3, INT8_PACKED = 4, DRAFT = 5 };

// hfspec.cpu.c_linear.CLinear as C sees it.
struct Linear {
    int64_t kind, type;
    const void* w;
    int64_t ldw;
    const float* bias;
    int64_t n, k;
    const int64_t* plan;  // the block shape per row count (the last for more rows); FLOAT32 and GGUF_FLOAT32 only
    int64_t plan_len;
};

// hfspec.cpu.layer._Layer as C sees it.
struct Layer {
    Linear q, k, v, o, gate, up, down;
    const float* norm1;
    const float* norm2;
    int64_t hidden, heads, kv_heads, head_dim, inter, act;
    float eps1, eps2, scale;
};

// y (M rows of d.n, contiguous) = x (M rows, contiguous) through ``d``; 0 where the entry does not serve it.
int run(const Linear& d, const float* x, float* y, int64_t M, int threads) {
    const int shape = d.plan_len ? (int)d.plan[std::min<int64_t>(M, d.plan_len - 1)] : 0;
    const uint8_t* w = (const uint8_t*)d.w;
    switch (d.kind) {
        case FLOAT32:
            hfspec_linear_f32(shape, x, d.k, (const float*)d.w, d.ldw, d.bias, y, d.n, M, d.n, d.k, threads);
            return 1;
        case GGUF_FLOAT32: return hfspec_quant_linear((int)d.type, shape, x, d.k, w, d.ldw, d.bias, y, d.n, M, d.n, d.k, threads);
        case INT8: return hfspec_int8_linear((int)d.type, x, d.k, w, d.ldw, d.bias, y, d.n, M, d.n, d.k, threads);
        case INT8_PACKED: return hfspec_int8_linear_packed((int)d.type, x, d.k, w, d.bias, y, d.n, M, d.n, d.k, threads);
        case DRAFT: return hfspec_draft_linear((int)d.type, x, d.k, w, d.bias, y, d.n, M, d.n, d.k, threads);
    }
    return 0;
}

// Scratch space kept between calls (one forward runs its layers one after another on the calling thread).
thread_local std::vector<float> scratch;

}  // namespace

extern "C" {

// out (B * T rows of L.hidden) = the layer of x (the same shape, contiguous float32). ``step`` holds, in this order:
// B, T, start (the cache's filled columns before this call), the keys buffer's strides (b, h, j) and the values
// buffer's (unit stride along d in both), mask kind (hfspec_attention's; 0: none), the mask's strides (b, h, i, j;
// broadcast to (B, heads, T, start + T)), causal (0/1), and cos/sin's strides (b: 0 where shared, t).
// Returns 1, or 0 (out unspecified, the buffers perhaps written) where a linear's entry did not serve its format.
int hfspec_layer(const Layer* L, const float* x, float* out, const int64_t* step, const void* mask, const float* cos,
                 const float* sin, float* keys, float* values, int threads) {
    const int64_t B = step[0], T = step[1], start = step[2], M = B * T;
    const int64_t* ks = step + 3;
    const int64_t* vs = step + 6;
    const int64_t mask_kind = step[9];
    const int64_t* ms = step + 10;
    const int64_t causal = step[14], sc_b = step[15], sc_t = step[16];
    const int64_t d = L->hidden, D = L->head_dim, H = L->heads, Hkv = L->kv_heads;
    const int64_t nq = H * D, nkv = Hkv * D, F = L->inter;
    const int64_t need = M * (2 * d + 3 * nq + 3 * nkv + 3 * F);
    if ((int64_t)scratch.size() < need) scratch.resize(need);
    float* normed = scratch.data();
    float* q = normed + M * d;
    float* k = q + M * nq;
    float* v = k + M * nkv;
    float* q_rot = v + M * nkv;
    float* k_rot = q_rot + M * nq;
    float* attended = k_rot + M * nkv;
    float* gate = attended + M * nq;
    float* up = gate + M * F;
    float* act = up + M * F;
    float* down = act + M * F;

    hfspec_rmsnorm(0, 0, x, d, L->norm1, normed, M, d, L->eps1, threads);
    if (!run(L->q, normed, q, M, threads) || !run(L->k, normed, k, M, threads) || !run(L->v, normed, v, M, threads))
        return 0;
    hfspec_rope(0, q, nq, k, nkv, q_rot, k_rot, B, T, H, Hkv, D, cos, sin, sc_b, sc_t);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < Hkv; ++h) {
                const int64_t row = (b * T + t) * nkv + h * D;
                std::memcpy(keys + b * ks[0] + h * ks[1] + (start + t) * ks[2], k_rot + row, D * sizeof(float));
                std::memcpy(values + b * vs[0] + h * vs[1] + (start + t) * vs[2], v + row, D * sizeof(float));
            }
    const int64_t sizes[23] = {T * nq, D,      nq,    ks[0],     ks[1], ks[2], vs[0], vs[1],
                               vs[2],  T * nq, D,     nq,        ms[0], ms[1], ms[2], ms[3],
                               B,      H,      Hkv,   T,         start + T, D, D};
    hfspec_attention(0, q_rot, keys, values, attended, mask, (int)mask_kind, sizes, L->scale, 0.0f, (int)causal,
                     threads);
    if (!run(L->o, attended, out, M, threads)) return 0;
    for (int64_t i = 0; i < M * d; ++i) out[i] = x[i] + out[i];

    hfspec_rmsnorm(0, 0, out, d, L->norm2, normed, M, d, L->eps2, threads);
    if (!run(L->gate, normed, gate, M, threads) || !run(L->up, normed, up, M, threads)) return 0;
    hfspec_activation_mul((int)L->act, 0, gate, up, act, M * F, threads);
    if (L->down.n != d || !run(L->down, act, down, M, threads)) return 0;
    for (int64_t i = 0; i < M * d; ++i) out[i] = out[i] + down[i];
    return 1;
}

}
