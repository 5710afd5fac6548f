"""The quantized kernel: every format's output equals the fp32 kernel's on the dequantized weights, bit for bit.

The reference weights are the gguf package's numpy dequantization (what transformers loads); the reference output
is ``kernels.linear`` on them, for every row count 1..50, every block shape, odd N, K within one slice of a panel and
across several, with and without a bias.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from gguf_files import random_blocks
from torch import nn

from hfspec.cpu import kernels, quant

FORMATS = list(quant.FORMATS)


@pytest.fixture(scope="module")
def qk(library):
    found = quant.kernel()
    if found is None:
        pytest.skip(f"no quantized kernel: {quant.unavailable()}")
    return found


def reference(blocks: torch.Tensor, fmt: quant.Format, k: int) -> torch.Tensor:
    values = quants.dequantize(blocks.numpy(), GGMLQuantizationType(fmt.type))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(blocks.shape[0], k)


def case(name: str, n: int = 37, seed: int = 0, blocks: int | None = None) -> tuple[quant.Format, int, torch.Tensor]:
    fmt = quant.FORMATS[name]
    k = (blocks or (2 if fmt.elements == 256 else 6)) * fmt.elements
    return fmt, k, torch.from_numpy(random_blocks(name, n, k, np.random.default_rng(seed)))


def assert_every_shape_matches(
    library, qk, name: str, fmt: quant.Format, k: int, blocks: torch.Tensor, rows: list[int]
) -> None:
    weight = reference(blocks, fmt, k)
    g = torch.Generator().manual_seed(1)
    x, bias = torch.randn(max(rows), k, generator=g), torch.randn(blocks.shape[0], generator=g)
    for m in rows:
        for b in (None, bias):
            want = kernels.linear(library, x[:m], weight, b)
            for shape in range(len(qk.shapes)):
                got = quant.linear(qk, x[:m], blocks, fmt, b, (shape,))
                assert torch.equal(got, want), f"{name}: {m} rows, shape {qk.shapes[shape]}, bias {b is not None}"


@pytest.mark.parametrize("name", FORMATS)
def test_dequantization_is_the_gguf_packages_bit_for_bit(qk, name):
    fmt, k, blocks = case(name)
    want = reference(blocks, fmt, k)
    assert torch.equal(quant.dequantize(blocks, fmt, k).view(torch.int32), want.view(torch.int32))
    rows = torch.tensor([[3, 0], [36, 3]])
    assert torch.equal(quant.dequantize(blocks, fmt, k, rows), want[rows.reshape(-1)])


@pytest.mark.parametrize("name", FORMATS)
def test_every_row_count_and_shape_gives_the_fp32_kernels_bits(library, qk, name):
    fmt, k, blocks = case(name)
    assert_every_shape_matches(library, qk, name, fmt, k, blocks, list(range(1, 51)))


@pytest.mark.parametrize("name", FORMATS)
def test_rows_longer_than_a_slice_give_the_fp32_kernels_bits(library, qk, name):
    # A panel's weights are dequantized a slice of K at a time (512 weights), its sums carried over: K of 3 K-quant
    # blocks is a slice and a half, 33 blocks of 32 two slices and one block.
    fmt, k, blocks = case(name, n=13, blocks=3 if quant.FORMATS[name].elements == 256 else 33)
    assert_every_shape_matches(library, qk, name, fmt, k, blocks, [1, 2, 3, 4, 5, 8, 9, 13, 17])


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K"])
def test_two_threads_give_the_fp32_kernels_bits(library, qk, name):
    # Two threads pack the input rows together, then take half the panels each.
    fmt, k, blocks = case(name, blocks=6 if quant.FORMATS[name].elements == 256 else 48)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_every_shape_matches(library, qk, name, fmt, k, blocks, [1, 3, 8, 17])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_fewer_weight_rows_than_a_block_holds(library, qk, n):
    fmt, k, blocks = case("Q4_K", n=n)
    x = torch.randn(3, k)
    for shape in range(len(qk.shapes)):
        assert torch.equal(
            quant.linear(qk, x, blocks, fmt, None, (shape,)), kernels.linear(library, x, reference(blocks, fmt, k))
        )


def test_a_layer_matches_the_kernel_and_falls_back_to_torch(library, qk, monkeypatch):
    fmt, k, blocks = case("Q6_K")
    bias = torch.randn(blocks.shape[0])
    layer = quant.QuantLinear(blocks, fmt, k, bias)
    weight = reference(blocks, fmt, k)
    x = torch.randn(2, 3, k)
    with torch.no_grad():
        assert torch.equal(layer(x), kernels.linear(library, x, weight, bias))
        assert layer(x.bfloat16()).dtype == torch.bfloat16
        monkeypatch.setattr(quant, "_KERNEL", None)  # the kernel off: torch's own path, same values up to rounding
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias))


def test_an_embedding_dequantizes_the_rows_it_looks_up(qk):
    fmt, k, blocks = case("Q5_0")
    emb = quant.QuantEmbedding(blocks, fmt, k)
    ids = torch.tensor([[4, 4, 0], [36, 1, 2]])
    assert torch.equal(emb(ids), reference(blocks, fmt, k)[ids])


@pytest.mark.parametrize("name", quant.QUANTIZABLE)
def test_quantize_linear_builds_the_gguf_packages_blocks(library, qk, name):
    torch.manual_seed(0)
    dense = nn.Linear(64, 9).to(torch.bfloat16)
    layer = quant.quantize_linear(dense, name)
    fmt = quant.FORMATS[name]
    want = quants.quantize(dense.weight.detach().float().numpy(), GGMLQuantizationType(fmt.type))
    assert np.array_equal(layer.weight.numpy(), want) and layer.bias.dtype == torch.float32
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), kernels.linear(library, x, reference(layer.weight, fmt, 64), layer.bias))
    with pytest.raises(ValueError, match="cannot quantize to 'Q4_K'"):
        quant.quantize_linear(dense, "Q4_K")


def test_quantized_layers_are_described(qk):
    fmt, k, blocks = case("Q8_0")
    model = nn.Sequential(quant.QuantEmbedding(blocks, fmt, k), quant.QuantLinear(blocks, fmt, k))
    assert quant.describe(model) == {
        "layers": 1,
        "formats": {"Q8_0": 1, "Q8_0 embedding": 1},
        "bytes": blocks.numel(),
        "packed_bytes": 0,
        "arithmetic": "float32",
    }
