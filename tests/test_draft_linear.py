"""The draft kernel (hfspec.cpu.draft_linear): packing, the integer arithmetic against a torch reference, the torch
fallback, whole converted drafts, and exact speculative decoding with one."""

from __future__ import annotations

from pathlib import Path

import kernel_paths
import pytest
import stat_utils
import tiny
import torch
import torch.nn.functional as F
from stat_utils import ALPHA
from torch import nn

from hfspec import SpeculativeGenerator
from hfspec.cpu import draft_linear, fast, quant
from hfspec.decoding import sampling
from hfspec.decoding.sampling import OUTSIDE
from hfspec.errors import HfspecError
from hfspec.models.head_cut import FrequentHead, cut_head


@pytest.fixture(scope="module")
def draft_kernel(library):
    found = draft_linear.kernel()
    if found is None:
        pytest.skip(f"no draft kernel here: {draft_linear.unavailable()}")
    return found


@pytest.fixture
def kernel_off(monkeypatch, draft_kernel):
    """``kernel_off()`` unbinds the draft kernel, as HFSPEC_KERNELS=0 does; it is bound again after the test."""

    def switch() -> None:
        monkeypatch.setenv("HFSPEC_KERNELS", "0")
        assert draft_linear.kernel() is None

    yield switch
    monkeypatch.delenv("HFSPEC_KERNELS", raising=False)
    assert draft_linear.kernel() is not None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def linear(k: int, n: int, seed: int = 0, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def reference(x: torch.Tensor, layer: draft_linear.DraftLinear) -> torch.Tensor:
    """The kernel's integer arithmetic in torch, summed in float64: x per block of 32 as int8 codes q with scale
    dx = max|x| / 127, then per block d * dx * sum(code * q) + m * dx * sum(q), plus the bias."""
    codes, d, m = draft_linear.unpack(layer.packed, layer.bits, layer.out_features)
    blocks = x.reshape(-1, layer.in_features // 32, 32).float()
    dx = blocks.abs().amax(-1) / 127
    q = torch.round(blocks * torch.where(dx != 0, 1 / dx, 0).unsqueeze(-1)).double()
    dots = torch.einsum("mbk,nbk->mnb", q, codes.reshape(layer.out_features, -1, 32).double())
    dx = dx.double()[:, None]
    y = (d.double() * dx * dots + m.double() * dx * q.sum(-1)[:, None]).sum(-1)
    return y if layer.bias is None else y + layer.bias.double()


@pytest.mark.parametrize("bits", draft_linear.BITS)
def test_packing_round_trip_is_within_one_step(bits, draft_kernel):
    layer = linear(96, 37)
    packed = draft_linear.pack(layer.weight, bits)
    assert packed.shape == (3, 3, 16 * 32 * bits // 8 + 64)  # 37 rows in 3 groups of 16, 96 in 3 blocks of 32
    codes, d, m = draft_linear.unpack(packed, bits, 37)
    assert int(codes.max()) <= 2**bits - 1
    blocks = layer.weight.detach().reshape(37, 3, 32)
    step = (blocks.amax(-1) - blocks.amin(-1)) / (2**bits - 1)  # the step of a min/max grid
    err = (draft_linear.dequantize(packed, bits, 37) - layer.weight).reshape(37, 3, 32)
    assert (err.abs().amax(-1) <= step).all()
    assert (err.pow(2).mean(-1).sqrt() / step).mean() < 0.27  # better than the grid's 1/sqrt(12) = 0.29
    # the rows past 37 pack as zeros
    assert not draft_linear.dequantize(packed, bits, 48)[37:].any()


def test_bf16_and_fast_linears_pack_from_their_values(draft_kernel):
    layer = linear(64, 24).bfloat16()
    want = draft_linear.pack(layer.weight.float())
    assert torch.equal(draft_linear.DraftLinear.from_module(layer).packed, want)
    fast.accelerate(layer)
    assert type(layer) is fast.FastLinear and torch.equal(draft_linear.DraftLinear.from_module(layer).packed, want)


@pytest.mark.parametrize("bits", draft_linear.BITS)
def test_kernel_equals_the_integer_arithmetic(bits, draft_kernel):
    layer = draft_linear.DraftLinear.from_module(linear(96, 37), bits)  # 37 rows: a partial group of 16
    g = torch.Generator().manual_seed(1)
    for m in [*range(1, 10), 33]:
        x = torch.randn(m, 96, generator=g) * 3
        x[0, :32] = 0  # an all-zero block: scale 0
        with torch.no_grad():
            got = layer(x)
        want = reference(x, layer)
        assert got.dtype == torch.float32 and got.shape == (m, 37)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), m


# The paths this CPU's build does not take, built on their own where the CPU can run them.
OTHER_PATHS = {
    "avx2": kernel_paths.AVX2,
    "avxvnni": (["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}),
    "scalar": kernel_paths.SCALAR,
}


@pytest.fixture(scope="module")
def other_paths(draft_kernel) -> dict[str, draft_linear.DraftKernel]:
    source = Path(draft_linear.__file__).parent / "csrc" / "draft.cpp"
    return kernel_paths.build(source, OTHER_PATHS, draft_linear._bind)


@pytest.mark.parametrize("bits", draft_linear.BITS)
def test_every_path_computes_the_integer_arithmetic(bits, other_paths):
    layer = linear(96, 37)
    g = torch.Generator().manual_seed(3)
    for isa, dk in other_paths.items():
        packed = draft_linear.pack(layer.weight, bits, dk)
        drafted = draft_linear.DraftLinear(packed, bits, 96, 37, layer.bias)
        for m in (1, 2, 5, 9):
            x = torch.randn(m, 96, generator=g) * 3
            y = torch.empty(m, 37)
            dk.linear(
                bits, x.data_ptr(), 96, packed.data_ptr(), drafted.bias.data_ptr(), y.data_ptr(), 37, m, 37, 96, 1
            )
            want = reference(x, drafted)
            assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (isa, m)


def test_kernel_takes_any_leading_shape_strides_and_bf16(draft_kernel):
    layer = draft_linear.DraftLinear.from_module(linear(64, 20), 4)
    x = torch.randn(2, 3, 128)[..., ::2]  # not contiguous
    with torch.no_grad():
        got = layer(x)
        assert got.shape == (2, 3, 20)
        assert torch.allclose(got.reshape(6, 20).double(), reference(x.reshape(6, 64), layer), atol=1e-5)
        half = layer(x.bfloat16())
    assert half.dtype == torch.bfloat16
    assert torch.allclose(
        half.float(), reference(x.bfloat16().reshape(6, 64), layer).float().reshape(2, 3, 20), atol=2e-2
    )


def test_in_features_not_a_multiple_of_32_is_refused(draft_kernel):
    with pytest.raises(HfspecError, match="multiple of 32"):
        draft_linear.DraftLinear.from_module(linear(40, 8))
    model = nn.Sequential(linear(64, 40), nn.ReLU(), linear(40, 8))
    report = draft_linear.quantize_for_drafting(model)
    assert report.layers == ("0",) and report.skipped == (("2", "in_features 40 is not a multiple of 32"),)
    assert type(model[2]) is nn.Linear


def test_fallback_is_f_linear_on_the_dequantized_weight(kernel_off):
    layer = draft_linear.DraftLinear.from_module(linear(64, 20), 4)
    kernel_off()
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.dequantized(), layer.bias))
    # autograd takes the same path, with the graph
    x.requires_grad_(True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    # and a model is not converted while the kernel is off
    model = nn.Sequential(linear(64, 20))
    report = draft_linear.quantize_for_drafting(model)
    assert report.layers == () and report.reason == "HFSPEC_KERNELS=0" and type(model[0]) is nn.Linear


def test_fallback_and_kernel_agree_up_to_the_activations_rounding(draft_kernel):
    layer = draft_linear.DraftLinear.from_module(linear(128, 48), 4)
    x = torch.randn(4, 128)
    with torch.no_grad():
        got = layer(x)
    assert torch.allclose(got, F.linear(x, layer.dequantized(), layer.bias), atol=0.02)
    x.requires_grad_(True)  # autograd: torch's path
    assert torch.allclose(layer(x), F.linear(x, layer.dequantized(), layer.bias))


@torch.inference_mode()
def logits(model, ids):
    return model(ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bits, ratio, error", [(4, 5 / 32, 0.2), (8, 9 / 32, 0.02)])
def test_a_converted_draft_computes_close_to_the_original(arch, bits, ratio, error, model_dir, draft_kernel):
    path = model_dir(arch, vocab_size=64, hidden=64)
    original, _ = tiny.load(path)
    model, _ = tiny.load(path)
    fast.accelerate(model)  # FastLinear layers convert too
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    report = draft_linear.quantize_for_drafting(model, bits)
    linears = [name for name, m in original.named_modules() if isinstance(m, nn.Linear)]
    assert report.layers == tuple(linears) and report.isa == draft_kernel.isa and report.bits == bits
    assert report.bytes_after == pytest.approx(report.bytes_before * ratio, rel=0.1)  # codes and fp16 d, m vs fp32
    assert all(isinstance(model.get_submodule(name), draft_linear.DraftLinear) for name in linears)
    assert relative_error(logits(model, ids), logits(original, ids)) < error


def test_quantized_linears_convert_from_their_blocks(draft_kernel):
    layer = linear(64, 24)
    blocks = quant.quantize_linear(layer, "Q8_0")
    model = nn.Sequential(blocks)
    draft_linear.quantize_for_drafting(model)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert relative_error(model(x), layer(x)) < 0.1
        assert torch.equal(model[0].packed, draft_linear.pack(blocks.dequantized()))


def test_a_tied_head_gets_its_own_copy_and_the_embedding_stays(tmp_path, draft_kernel):
    model, _ = tiny.load(tiny.chat_target(tmp_path))
    embedding = model.get_input_embeddings()
    table = embedding.weight.detach().clone()
    assert model.get_output_embeddings().weight is embedding.weight
    draft_linear.quantize_for_drafting(model)
    assert isinstance(model.get_output_embeddings(), draft_linear.DraftLinear)
    assert model.get_input_embeddings() is embedding and torch.equal(embedding.weight, table)


def test_a_cut_head_converts_its_kept_rows(model_dir, draft_kernel):
    model, _ = tiny.load(model_dir("llama", vocab_size=64, hidden=64))
    keep = torch.arange(0, 64, 3)
    cut_head(model, keep)
    draft_linear.quantize_for_drafting(model)
    head = model.get_output_embeddings()
    assert isinstance(head, FrequentHead) and isinstance(head.kept, draft_linear.DraftLinear)
    out = logits(model, torch.tensor([[5, 6, 7]]))
    outside = torch.ones(64, dtype=torch.bool)
    outside[keep] = False
    assert (out[..., outside] == OUTSIDE).all() and (out[..., keep] > OUTSIDE).all()


@pytest.mark.parametrize(
    "arch, dtype",
    [("llama", torch.float32), ("qwen2", torch.float32), ("llama", torch.bfloat16)],
    ids=["llama", "qwen2", "llama-bf16"],
)
def test_greedy_with_a_converted_draft_equals_the_targets_generate(arch, dtype, model_dir, draft_kernel):
    # The draft is the target itself, converted: it agrees often but not always, so both accepts and rejects occur.
    path = model_dir(arch, vocab_size=64, hidden=64)
    target, tok = tiny.load(path)
    draft, _ = tiny.load(path)
    target, draft = target.to(dtype), draft.to(dtype)
    fast.accelerate(target)
    fast.accelerate(draft)
    draft_linear.quantize_for_drafting(draft)
    gen = SpeculativeGenerator(target, draft, tok)
    g = torch.Generator().manual_seed(2)
    accepted = []
    for length in (1, 5, 9):
        ids = torch.randint(7, 64, (1, length), generator=g)
        want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        out = gen.generate(ids, max_new_tokens=24, gamma=4)
        assert torch.equal(out.sequences, want), length
        accepted.append(out.stats.acceptance_rate)
    assert 0 < sum(accepted) / len(accepted)


def test_load_pair_runs_a_cpu_draft_in_integer_arithmetic_by_default(model_dir):
    from hfspec import SpeculativeGenerator
    from hfspec.drafters.loading import load_pair
    from hfspec.errors import HfspecError

    if draft_linear.kernel() is None:
        pytest.skip(f"no draft kernel: {draft_linear.unavailable()}")
    target, draft, tok = load_pair(model_dir("llama"), model_dir("llama", seed=1))
    assert any(isinstance(m, draft_linear.DraftLinear) for m in draft.modules())
    assert not any(isinstance(m, draft_linear.DraftLinear) for m in target.modules())
    gen = SpeculativeGenerator(target, draft, tok)
    described = gen.describe()["fast_kernels"]["draft"]
    assert described["on"] and described["integer"]["bits"] == [4]
    assert gen.describe()["drafter"]["parameters"] == sum(
        p.numel() for p in load_pair(model_dir("llama"), model_dir("llama", seed=1), draft_bits=None)[1].parameters()
    )
    ids = torch.tensor([[1, 9, 10, 11, 12]])
    want = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, eos_token_id=None
    )
    assert torch.equal(gen.generate(ids, max_new_tokens=16, gamma=3, eos_token_id=[]).sequences, want)
    _, kept, _ = load_pair(model_dir("llama"), model_dir("llama", seed=1), draft_bits=None)
    assert not any(isinstance(m, draft_linear.DraftLinear) for m in kept.modules())
    with pytest.raises(HfspecError, match="draft_bits must be 4, 8 or None"):
        load_pair(model_dir("llama"), model_dir("llama", seed=1), draft_bits=3)


# -- sampling with a converted draft: exactly the target's distribution ----------------------------------------------

V, NEW, SAMPLES = 9, 3, 6_000
PROMPT = [7, 8, 7, 7]


def converted_pair(model_dir, dtype: torch.dtype) -> tuple:
    """A tiny target and a perturbed copy as its draft (hidden 32: every linear converts), both on the kernels in
    ``dtype``, the draft's linears in 4-bit integer arithmetic."""
    common = dict(vocab_size=V, seed=10, sharpness=30.0, eos=None, hidden=32, layers=1)
    target, tok = tiny.load(model_dir("llama", **common))
    draft, _ = tiny.load(model_dir("llama", perturb=0.5, **common))
    target, draft = target.to(dtype), draft.to(dtype)
    fast.accelerate(target)
    fast.accelerate(draft)
    assert draft_linear.quantize_for_drafting(draft).layers and not draft_linear.describe(target)["layers"]
    return target, draft, tok


def first_tokens_pvalue(target, draft, tok, seed: int) -> float:
    settings = {"temperature": 0.8}
    gen = SpeculativeGenerator(target, draft, tok)
    (counts,) = stat_utils.sample_counts(
        gen, [PROMPT], settings, seed, vocab=V, new=NEW, samples=SAMPLES, batch=SAMPLES, gamma=2
    )
    return stat_utils.chi_square_pvalue(counts, stat_utils.exact_joint(target, PROMPT, settings, V, NEW))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampling_with_a_converted_draft_follows_the_target(model_dir, draft_kernel, dtype):
    target, draft, tok = converted_pair(model_dir, dtype)
    out = SpeculativeGenerator(target, draft, tok).generate(
        [PROMPT] * 500, max_new_tokens=NEW, gamma=2, do_sample=True, temperature=0.8, seed=0
    )
    assert 0.2 < out.stats.acceptance_rate < 0.95  # accepts and rejects both occur: the rule is exercised
    pv = first_tokens_pvalue(target, draft, tok, seed=3)
    assert pv > ALPHA, f"{dtype}: speculative samples with a 4-bit draft differ from the target (p-value {pv:.3g})"


def test_negative_control_a_converted_draft_without_the_residual_is_detected(model_dir, draft_kernel, monkeypatch):
    target, draft, tok = converted_pair(model_dir, torch.float32)
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    assert first_tokens_pvalue(target, draft, tok, seed=5) < ALPHA
