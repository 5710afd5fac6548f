"""The int8 kernel: every format's output equals the torch reference of llama.cpp's integer arithmetic, bit for bit.

Random blocks of every format, their fp16 scales signed, subnormal or zero; input rows with a zero row, a zero
block and rows a thousand times larger; rows 1-17, 33, 65 and 200, odd N, one and two threads. The reference is
computed once on all rows: it is a function of each row alone, so every prefix of the kernel's rows must match it,
which is also the kernel's row-count invariance.
"""

from __future__ import annotations

from pathlib import Path

import kernel_paths
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from hfspec.cpu import int8, int8_reference, quant

FORMATS = list(int8_reference.BLOCK)
ROWS = [*range(1, 18), 33, 65, 200]
# Where each block holds its fp16 scales (the rest is codes).
HALVES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}
HALVES["Q6_K"] = (208,)


@pytest.fixture(scope="module")
def ik(library):
    found = int8.kernel()
    if found is None:
        pytest.skip("no CPU kernel here")
    return found


def blocks(fmt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(n, bytes per row) random blocks; each scale a signed normal, a signed subnormal or a zero fp16."""
    rng = np.random.default_rng(seed)
    nb, size = k // int8_reference.BLOCK[fmt], int8_reference.NBYTES[fmt]
    out = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    for offset in HALVES[fmt]:
        normal = (rng.standard_normal((n, nb)) * 0.01).astype(np.float16).view(np.uint16)
        subnormal = rng.integers(1, 1024, size=(n, nb), dtype=np.uint16) | (rng.integers(0, 2, (n, nb)) << 15)
        kind = rng.integers(0, 8, size=(n, nb))
        halves = np.where(kind == 0, subnormal, np.where(kind == 1, np.uint16(0x8000), normal)).astype(np.uint16)
        out[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(out.reshape(n, -1))


def inputs(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[3] = 0.0  # an all-zero row: zero scales, zero codes
    x[5, :256] = 0.0  # an all-zero block
    x[7::9] *= 1000.0
    x[11, 17] = -x[11].abs().max() * 2  # the largest magnitude negative
    return x


def kernel_out(ik, x, w, fmt, bias, threads, packed=None):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return int8.linear(x, w, fmt, GGMLQuantizationType[fmt].value, bias, ik, packed)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_count_and_thread_count_gives_the_references_bits(ik, fmt):
    k = 512
    w = blocks(fmt, 19, k)  # a tile of 16 outputs and a partial one
    x = inputs(max(ROWS), k)
    bias = torch.randn(19, generator=torch.Generator().manual_seed(2))
    with_bias = int8_reference.linear(x, w, fmt, bias).view(torch.int32)
    without = int8_reference.linear(x, w, fmt).view(torch.int32)
    assert torch.isfinite(without.view(torch.float32)).all()
    for threads in (1, 2):
        for m in ROWS:
            got = kernel_out(ik, x[:m], w, fmt, bias if m % 2 else None, threads)
            expect = (with_bias if m % 2 else without)[:m]
            assert torch.equal(got.view(torch.int32), expect), f"{fmt}: {m} rows on {threads} threads"


@pytest.mark.parametrize("fmt", FORMATS)
def test_repacked_weights_give_the_references_bits(ik, fmt):
    """On AVX2 every format is repacked at load (8 columns interleaved); elsewhere nothing is packed."""
    k, n = 768, 19  # two groups of 8 columns and a partial one
    w = blocks(fmt, n, k, seed=5)
    typ = GGMLQuantizationType[fmt].value
    packed = int8.pack(w, typ, k, ik)
    if ik.isa != "avx2":
        assert packed is None
        return
    assert packed is not None and packed.data.numel() == ik.packed_bytes(typ, n, k)
    x = inputs(max(ROWS), k, seed=6)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    with_bias = int8_reference.linear(x, w, fmt, bias).view(torch.int32)
    without = int8_reference.linear(x, w, fmt).view(torch.int32)
    for threads in (1, 2):
        for m in ROWS:
            got = kernel_out(ik, x[:m], w, fmt, bias if m % 2 else None, threads, packed)
            expect = (with_bias if m % 2 else without)[:m]
            assert torch.equal(got.view(torch.int32), expect), f"{fmt}: {m} rows on {threads} threads"
    with pytest.raises(ValueError, match="do not hold"):
        kernel_out(ik, x[:1], w[:8], fmt, None, 1, packed)


def test_a_layer_packs_its_weight_once_and_again_when_it_is_replaced(ik):
    k = 512
    assert quant.kernel() is not None
    layer = quant.QuantLinear(blocks("Q4_K", 16, k, seed=8), "Q4_K", k, arithmetic="int8")
    quant.plan_layers(torch.nn.Sequential(layer))  # at load: packed before the first forward
    size = ik.packed_bytes(GGMLQuantizationType.Q4_K.value, 16, k) if ik.isa == "avx2" else 0
    assert quant.describe(layer)["packed_bytes"] == size
    x = inputs(12, k, seed=9)
    first = layer(x)
    assert torch.equal(first, int8_reference.linear(x, layer.weight, "Q4_K"))
    held = layer._packing
    assert held is not None and (held[1] is not None) == (ik.isa == "avx2")
    layer(x)
    assert layer._packing is held
    layer.weight = torch.nn.Parameter(blocks("Q4_K", 16, k, seed=10), requires_grad=False)
    second = layer(x)
    assert torch.equal(second, int8_reference.linear(x, layer.weight, "Q4_K"))
    assert not torch.equal(first, second)


def test_amx_off_and_on_give_the_references_bits(ik):
    """Where the CPU has AMX, K-quant tiles of several rows run on it by default; turned off, the same rows take
    the AVX-512 VNNI path. Both give the reference's bits (the main test above runs with AMX on): up to 8 rows two
    sub-blocks share a tile multiply, from 9 rows one does."""
    if not ik.use_amx(True):
        pytest.skip("no AMX here")
    try:
        for fmt in ("Q4_K", "Q5_K", "Q6_K"):
            w = blocks(fmt, 19, 512, seed=11)
            x = inputs(65, 512, seed=12)
            expect = int8_reference.linear(x, w, fmt).view(torch.int32)
            for on in (False, True):
                assert ik.use_amx(on) == on
                for m in (4, 5, 6, 7, 8, 9, 12, 16, 33, 65):
                    got = kernel_out(ik, x[:m], w, fmt, None, 2)
                    assert torch.equal(got.view(torch.int32), expect[:m]), f"{fmt}: {m} rows, AMX {on}"
    finally:
        ik.use_amx(True)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_row_alone_gives_the_bits_it_gives_among_others(ik, fmt):
    k = 768 if fmt != "Q8_0" else 96
    w = blocks(fmt, 37, k, seed=3)
    x = inputs(20, k, seed=4)
    together = kernel_out(ik, x, w, fmt, None, 2)
    for i in range(x.shape[0]):
        alone = kernel_out(ik, x[i : i + 1], w, fmt, None, 1)
        assert torch.equal(alone.view(torch.int32), together[i : i + 1].view(torch.int32)), f"{fmt} row {i}"


def test_activation_quantizers_follow_ggml():
    # Q8_K: the first element of largest magnitude sets the scale (here the negative one), rounding half to even.
    x = torch.zeros(1, 256)
    x[0, :6] = torch.tensor([-127.0, 127.0, 0.5, 1.5, 2.5, -0.5])
    q, d, bsums = int8_reference.quantize_q8_k(x)
    assert d.item() == 1.0  # iscale = -127 / -127
    assert q[0, :6].tolist() == [-127, 127, 0, 2, 2, 0] and bsums[0, 0, 0].item() == 4
    # Q8_0: d = amax / 127 in fp16; Q8_1's s = fp16(d * sum(q)).
    x = torch.linspace(-1, 2, 32).reshape(1, 32)
    q, hd, _ = int8_reference.quantize_q8_0(x)
    assert q.max().item() == 127 and hd.item() == torch.tensor(2 / 127).half().float().item()
    _, _, hs = int8_reference.quantize_q8_1(x)
    assert hs.item() == (torch.tensor(2.0) / 127 * q.sum().float()).half().float().item()


def test_the_reference_is_close_to_the_dequantized_product():
    from gguf import quants

    w = blocks("Q4_K", 16, 512, seed=5)
    values = torch.from_numpy(quants.dequantize(w.numpy(), GGMLQuantizationType.Q4_K).reshape(16, 512))
    ok = torch.isfinite(values).all(-1)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(6))
    got, want = int8_reference.linear(x, w[ok], "Q4_K"), x @ values[ok].T
    assert (got - want).norm() <= 0.05 * want.norm()


# The paths this CPU's build does not take, built on their own where the CPU can run them; each must give the
# reference's bits, as the native build does (integer sums are exact, the float steps the same).
OTHER_PATHS = {"avx512vnni": kernel_paths.AVX512_VNNI, "avx2": kernel_paths.AVX2, "scalar": kernel_paths.SCALAR}


@pytest.fixture(scope="module")
def other_paths(ik) -> dict[str, int8.Int8Kernel]:
    source = Path(int8.__file__).parent / "csrc" / "int8.cpp"
    return kernel_paths.build(source, OTHER_PATHS, int8._bind)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_path_gives_the_references_bits(other_paths, fmt):
    w = blocks(fmt, 19, 512, seed=7)
    x = inputs(33, 512, seed=8)
    expect = int8_reference.linear(x, w, fmt).view(torch.int32)
    for isa, other in other_paths.items():
        packed = int8.pack(w, GGMLQuantizationType[fmt].value, 512, other)
        assert (packed is not None) == (isa == "avx2")  # AVX2 repacks every format
        for m in (1, 5, 16, 17, 33):
            got = kernel_out(other, x[:m], w, fmt, None, 2)
            assert torch.equal(got.view(torch.int32), expect[:m]), f"{fmt}: {m} rows on the {isa} path"
            if packed is not None:
                got = kernel_out(other, x[:m], w, fmt, None, 2, packed)
                assert torch.equal(got.view(torch.int32), expect[:m]), f"{fmt}: {m} rows on the {isa} path, packed"
