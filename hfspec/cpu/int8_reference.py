"""llama.cpp's CPU integer arithmetic for GGUF blocks, in plain torch: the definition ``csrc/int8.cpp`` is held to.

ggml's CPU backend does not multiply a quantized weight by float activations. It first quantizes each input row
block by block into an 8-bit activation format -- Q8_K beside the K-quants, Q8_0 beside Q4_0, Q5_0 and Q8_0, Q8_1
beside Q4_1 and Q5_1 (ggml-cpu.c, ``vec_dot_type``) -- then takes integer dot products of the weight codes with the
activation codes per block, and applies the blocks' scales in fp32. The integer sums are exact, so their order
does not matter; the float steps round, so their order is part of the definition. This module fixes one order
per output and never reassociates it:

Activations, each row on its own (ggml-quants.c and the x86 quantizers):

* **Q8_K** (blocks of 256): ``max`` = the signed value of the first element of largest magnitude; ``iscale =
  -127 / max``; ``q = min(127, round(iscale * x))`` (half to even); ``d = 1 / iscale`` kept in fp32; ``bsums`` the
  sums of 16 consecutive ``q``. An all-zero block has ``d = 0`` and zero codes.
* **Q8_0** (blocks of 32, x86): ``amax = max |x|``; ``d = amax / 127`` stored as fp16; ``q = round(x * (127 /
  amax))`` (half to even; 0 where ``amax = 0``).
* **Q8_1**: Q8_0's ``d`` and ``q``, and ``s = fp16(d * sum(q))`` with the unrounded ``d``.

Weights: ``w`` is the integer a code stands for (Q4_0 ``nibble - 8``, Q5_0 ``code - 16``, Q8_0 the signed byte,
Q4_1/Q5_1/Q4_K/Q5_K the unsigned code, Q6_K ``code - 32``); ``h()`` is an fp16 scale widened to fp32 (exact).

Per output, ``R = 0.0`` and then, block after block along K, each step one fp32 operation rounded on its own:

* Q4_0, Q5_0, Q8_0 (32 weights, activations Q8_0): ``S = sum(w * q)``; ``R = R + float(S) * (h(dw) * h(da))``.
* Q4_1, Q5_1 (activations Q8_1): ``R = R + (float(S) * (h(dw) * h(da)) + h(mw) * h(sa))``.
* Q4_K, Q5_K, Q6_K (256 weights, activations Q8_K): ``A = sum_j sc_j * S_j`` over the sub-blocks j (32 weights for
  Q4_K/Q5_K, 16 for Q6_K; ``sc`` the 6-bit or int8 sub-block scale); ``R = R + float(A) * (h(d) * da)``; then for
  Q4_K/Q5_K ``M = sum_j m_j * (the activation codes' sum over sub-block j)`` and ``R = R - float(M) * (h(dmin) * da)``.

Then ``y = R + bias``. ``float(S)`` is exact (|S| < 2^24); ``float(A)`` of a K-quant may round (to nearest even),
as an int32 to fp32 conversion does everywhere. This is ggml's scalar order for the 32-weight formats up to the
grouping of the two scale products, and for K-quants one sum per super-block where ggml's scalar code keeps eight
lanes. ggml's SIMD builds share the activations and the integer sums but order the float steps their own way
(eight fp32 lanes with FMAs), so a llama.cpp build agrees with these outputs to rounding, not bit for bit. What is
promised here is that every output is this function of its own row alone.

The embedding is a gather, not a matmul: in int8 arithmetic it still returns the dequantized rows.
"""

from __future__ import annotations

import torch

__all__ = ["ACTIVATION", "BLOCK", "dot_codes", "linear", "quantize_q8_0", "quantize_q8_1", "quantize_q8_k"]

# Weights per block, and the activation format ggml pairs with each weight format.
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
ACTIVATION = {
    "Q4_0": "Q8_0",
    "Q5_0": "Q8_0",
    "Q8_0": "Q8_0",
    "Q4_1": "Q8_1",
    "Q5_1": "Q8_1",
    "Q4_K": "Q8_K",
    "Q5_K": "Q8_K",
    "Q6_K": "Q8_K",
}
NBYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _half(raw: torch.Tensor) -> torch.Tensor:
    """fp16 values stored little-endian in the last dimension's byte pairs, widened to fp32 (exactly)."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _f16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to fp16 (nearest even) and widened back."""
    return x.to(torch.float16).float()


# -- activations --------------------------------------------------------------------------------------------------


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_K of fp32 rows ``x`` (M, K): codes (M, K) int64, ``d`` (M, K/256) fp32, ``bsums`` (M, K/256, 16)."""
    m, k = x.shape
    xb = x.reshape(m, k // 256, 256)
    first = xb.abs().argmax(-1, keepdim=True)  # the first element of largest magnitude
    top = xb.gather(-1, first)
    zero = top == 0
    iscale = torch.where(zero, torch.ones_like(top), torch.full_like(top, -127.0) / torch.where(zero, 1.0, top))
    q = torch.round(iscale * xb).clamp(max=127).to(torch.int64)
    q = torch.where(zero, 0, q)
    d = torch.where(zero, 0.0, torch.ones_like(iscale) / iscale).squeeze(-1)
    return q.reshape(m, k), d, q.reshape(m, k // 256, 16, 16).sum(-1)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0 of fp32 rows ``x`` (M, K) as ggml's x86 quantizer makes it: codes (M, K) int64, ``h(d)`` (M, K/32) fp32,
    and the unrounded ``d`` (for Q8_1's ``s``)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inverse = torch.where(amax != 0, torch.full_like(amax, 127.0) / torch.where(amax != 0, amax, 1.0), 0.0)
    q = torch.round(xb * inverse).to(torch.int64)
    return q.reshape(m, k), _f16(d).squeeze(-1), d.squeeze(-1)


def quantize_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_1 of fp32 rows ``x`` (M, K): codes, ``h(d)`` and ``h(s)`` with ``s = fp16(d * sum(q))``."""
    q, hd, d = quantize_q8_0(x)
    sums = q.reshape(q.shape[0], -1, 32).sum(-1).to(torch.float32)
    return q, hd, _f16(d * sums)


# -- weights: codes and scales of every block ---------------------------------------------------------------------


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0/Q4_1 order: element j < 16 is qs[j]'s low nibble, element j >= 16 qs[j - 16]'s high one."""
    return torch.cat([qs & 15, qs >> 4], -1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: bit j of the little-endian u32 ``qh`` is element j's fifth bit (as 0 or 16)."""
    bits = torch.arange(8, dtype=torch.int64)
    return (((qh[..., :, None] >> bits) & 1).reshape(*qh.shape[:-1], 32)) << 4


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins (ggml's get_scale_min_k4) from ``scales[12]``."""
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def _k4_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K order: element 64c + l is qs[32c + l]'s low nibble, 64c + 32 + l its high one."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([q & 15, q >> 4], -2).reshape(*qs.shape[:-1], 256)


def unpack(blocks: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """``blocks`` (N, bytes per row) uint8 as integer weights ``w`` (N, nb, elements) and the scales: ``d`` (N, nb)
    and, by format, ``m`` (N, nb) fp32, ``sc`` and ``mins`` (N, nb, sub-blocks) int64."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, NBYTES[fmt]).to(torch.int64)
    raw = blocks.reshape(n, -1, NBYTES[fmt])
    if fmt == "Q4_0":
        return {"w": _nibbles(b[..., 2:18]) - 8, "d": _half(raw[..., 0:2])}
    if fmt == "Q4_1":
        return {"w": _nibbles(b[..., 4:20]), "d": _half(raw[..., 0:2]), "m": _half(raw[..., 2:4])}
    if fmt == "Q5_0":
        return {"w": (_nibbles(b[..., 6:22]) | _high_bits(b[..., 2:6])) - 16, "d": _half(raw[..., 0:2])}
    if fmt == "Q5_1":
        w = _nibbles(b[..., 8:24]) | _high_bits(b[..., 4:8])
        return {"w": w, "d": _half(raw[..., 0:2]), "m": _half(raw[..., 2:4])}
    if fmt == "Q8_0":
        return {"w": raw[..., 2:34].contiguous().view(torch.int8).to(torch.int64), "d": _half(raw[..., 0:2])}
    if fmt in ("Q4_K", "Q5_K"):
        sc, mins = _scale_min_k4(b[..., 4:16])
        w = _k4_codes(b[..., 16:144] if fmt == "Q4_K" else b[..., 48:176])
        if fmt == "Q5_K":  # bit 2c of qh[l] is element 64c + l's fifth bit, bit 2c + 1 element 64c + 32 + l's
            bits = (b[..., 16:48, None] >> torch.arange(8, dtype=torch.int64)) & 1  # (N, nb, l, bit)
            w = w | (bits.permute(0, 1, 3, 2).reshape(n, -1, 256) << 4)
        return {"w": w, "d": _half(raw[..., 0:2]), "dmin": _half(raw[..., 2:4]), "sc": sc, "mins": mins}
    if fmt == "Q6_K":
        ql, qh = b[..., 0:128].reshape(n, -1, 2, 2, 32), b[..., 128:192].reshape(n, -1, 2, 1, 32)
        low = torch.cat([ql & 15, ql >> 4], -2)  # (N, nb, half, 4, 32): ql[l], ql[l+32], ql[l] >> 4, ql[l+32] >> 4
        high = (qh >> torch.tensor([0, 2, 4, 6]).reshape(4, 1)) & 3
        w = (low | high << 4).reshape(n, -1, 256) - 32
        sc = raw[..., 192:208].contiguous().view(torch.int8).to(torch.int64)
        return {"w": w, "d": _half(raw[..., 208:210]), "sc": sc}
    raise ValueError(f"no int8 arithmetic for {fmt}; use one of {', '.join(BLOCK)}")


# -- the dot products ---------------------------------------------------------------------------------------------


def dot_codes(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact integer sums over the last dimension: ``w`` (N, nb, e), ``q`` (M, nb, e) -> (M, N, nb) int64. Done in
    float64, where every partial sum is an integer below 2^53 and so exact whatever order the matmul takes."""
    return torch.einsum("mbe,nbe->mnb", q.double(), w.double()).round().to(torch.int64)


def _scaled_sum(steps: list[torch.Tensor]) -> torch.Tensor:
    """R = 0, then R = R + step (or minus, for a negated step given as ("-", t)) in order: one fp32 op each."""
    total = torch.zeros_like(steps[0][1])
    for sign, step in steps:
        total = total + step if sign == "+" else total - step
    return total


def linear(x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (M, K) fp32 times the ``fmt`` weight in ``blocks`` (N, bytes per row) in llama.cpp's integer
    arithmetic, in the order the module docstring fixes: (M, N) fp32."""
    x = x.float()
    k = x.shape[-1]
    e = BLOCK[fmt]
    p = unpack(blocks, fmt)
    nb = k // e
    if ACTIVATION[fmt] == "Q8_K":
        q, yd, bsums = quantize_q8_k(x)
        sub = 16 if fmt == "Q6_K" else 32
        w = p["w"].reshape(p["w"].shape[0], nb * 256 // sub, sub)
        s = dot_codes(w, q.reshape(q.shape[0], -1, sub)).reshape(q.shape[0], -1, nb, 256 // sub)  # (M, N, nb, j)
        a = (s * p["sc"][None]).sum(-1).to(torch.float32)  # exact int64 sum, then one conversion
        steps = []
        for i in range(nb):
            steps.append(("+", a[:, :, i] * (p["d"][None, :, i] * yd[:, None, i])))
            if fmt != "Q6_K":
                sums = bsums[:, i].reshape(-1, 8, 2).sum(-1)  # (M, 8): the codes' sum per 32-weight sub-block
                mm = (sums[:, None, :] * p["mins"][None, :, i]).sum(-1).to(torch.float32)
                steps.append(("-", mm * (p["dmin"][None, :, i] * yd[:, None, i])))
    else:
        if ACTIVATION[fmt] == "Q8_0":
            q, hd, _ = quantize_q8_0(x)
        else:
            q, hd, hs = quantize_q8_1(x)
        s = dot_codes(p["w"], q.reshape(q.shape[0], nb, 32)).to(torch.float32)
        steps = []
        for i in range(nb):
            step = s[:, :, i] * (p["d"][None, :, i] * hd[:, None, i])
            if ACTIVATION[fmt] == "Q8_1":
                step = step + p["m"][None, :, i] * hs[:, None, i]
            steps.append(("+", step))
    out = _scaled_sum(steps)
    return out if bias is None else out + bias.float()
