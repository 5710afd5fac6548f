"""hfspec's CPU linear kernel: equal to F.linear, row-invariant, exact in speculative decoding, and optional."""

from __future__ import annotations

import logging

import pytest
import tiny
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from hfspec import SpeculativeGenerator
from hfspec.cpu import fast, kernels

# (N, K) with N and K off the vector widths (8, 16) and the 4-row blocks, and a few aligned ones.
SHAPES = [(1, 1), (3, 5), (17, 33), (53, 37), (64, 128), (130, 15), (7, 300)]
# fp32 sums in another order than torch's: |error| stays near K * eps * |terms|, far below 1e-4 here.
RTOL, ATOL = 1e-5, 1e-4


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
def test_equals_f_linear_for_1_to_48_rows_and_a_prompt(library, n, k, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for m in [*range(1, 18), 24, 31, 32, 33, 47, 48, 200]:  # every row count a chain or tree verifies, a prompt
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(kernels.linear(library, x, w, b), F.linear(x, w, b), rtol=RTOL, atol=ATOL)


def test_bf16_weights_equal_f_linear_on_the_widened_weights(library):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=g).bfloat16()
    b = torch.randn(37, generator=g)
    x = torch.randn(5, 53, generator=g)
    torch.testing.assert_close(kernels.linear(library, x, w, b), F.linear(x, w.float(), b), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(library, dtype):
    # Verification feeds k + 1 rows where decoding feeds one, a prompt many (the tiled path past 64 rows): the
    # kernel must not tell them apart.
    g = torch.Generator().manual_seed(1)
    w, b, x = (
        torch.randn(45, 71, generator=g).to(dtype),
        torch.randn(45, generator=g),
        torch.randn(100, 71, generator=g),
    )
    for rows in (16, 100):
        together = kernels.linear(library, x[:rows], w, b)
        for i in range(rows):
            assert torch.equal(kernels.linear(library, x[i : i + 1], w, b), together[i : i + 1]), f"row {i} of {rows}"


def test_strided_rows_and_a_bad_layout(library):
    g = torch.Generator().manual_seed(2)
    w, wide = torch.randn(9, 20, generator=g), torch.randn(3, 50, generator=g)
    x = wide[:, 5:25]  # rows 50 floats apart
    torch.testing.assert_close(kernels.linear(library, x, w), F.linear(x, w), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="unit stride"):
        kernels.linear(library, x, w.t().contiguous().t())


def test_fast_linear_uses_the_kernel_only_for_few_rows_without_grad(library, monkeypatch):
    layer = nn.Linear(24, 10)
    calls = []
    monkeypatch.setattr(kernels, "linear_unchecked", lambda *a: calls.append(1) or F.linear(*a[1:4]))
    report = fast.accelerate(layer, max_rows=4)
    assert report.layers == ("",) and report.bytes_added == 0
    with torch.no_grad():
        layer(torch.randn(2, 2, 24))
        assert len(calls) == 1
        layer(torch.randn(5, 24))  # more rows than max_rows: torch's GEMM
        assert len(calls) == 1
    x = torch.randn(1, 24, requires_grad=True)
    layer(x).sum().backward()  # autograd: torch's linear, so gradients still work
    assert len(calls) == 1 and x.grad is not None


def test_bf16_layer_stays_close_to_torch(library):
    torch.manual_seed(3)
    layer = nn.Linear(40, 30).bfloat16()
    x = torch.randn(3, 40).bfloat16()
    want = layer(x)
    with torch.no_grad(), fast.accelerated(layer) as report:
        assert report.layers == ("",)
        got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 rounding of the output


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equals_the_patched_models_own_generate(library, tiny_pair, gamma):
    target, draft, tok = tiny_pair("llama", vocab_size=32)
    g = torch.Generator().manual_seed(gamma)
    with fast.accelerated(target) as report, fast.accelerated(draft):
        assert {"lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"} <= set(report.layers)
        gen = SpeculativeGenerator(target, draft, tok)
        for n in (1, 5, 11):
            ids = torch.randint(tiny.BOS + 6, 32, (1, n), generator=g)
            want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
            got = gen.generate(ids, max_new_tokens=20, gamma=gamma)
            assert torch.equal(got.sequences, want), f"prompt of {n}, γ={gamma}"
    assert not fast.is_accelerated(target) and not fast.is_accelerated(draft)


def test_tied_head_stays_tied_and_costs_no_memory(library):
    config = tiny.make_config("llama", 48)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[5, 9, 7, 11]])
    with torch.no_grad():
        want = model(ids).logits
        report = fast.accelerate(model)
        got = model(ids).logits
    assert "lm_head" in report.layers and report.bytes_added == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert fast.restore(model) == len(report.layers)


def test_model_is_untouched_unless_the_caller_opts_in(library, tiny_pair):
    target, draft, tok = tiny_pair("llama", vocab_size=32)
    ids = torch.tensor([[7, 8, 9]])
    SpeculativeGenerator(target, draft, tok).generate(ids, max_new_tokens=5, gamma=2)
    assert not fast.is_accelerated(target)
    assert all(type(m) is nn.Linear for m in target.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        before = target(ids).logits
        with fast.accelerated(target):
            assert fast.is_accelerated(target)
        assert torch.equal(target(ids).logits, before)  # restored: torch's linear, bit for bit


@pytest.mark.parametrize("cxx", ["/nonexistent/c++", "false"])
def test_without_a_compiler_the_model_keeps_torch_and_says_why(cxx, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    monkeypatch.setenv("HFSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("HFSPEC_KERNELS", raising=False)  # the build is tried, not switched off
    monkeypatch.setattr(kernels, "_LOADED", {})
    layer = nn.Linear(8, 4)
    with caplog.at_level(logging.WARNING, logger="hfspec.cpu.kernels"):
        first, second = fast.accelerate(layer), fast.accelerate(layer)
    assert first.layers == () and first.isa is None
    assert ("no C++ compiler" if cxx.startswith("/") else "cannot build the CPU kernel") in first.reason
    assert second.reason == first.reason
    assert len(caplog.records) == 1  # one line, not one per call
    assert type(layer) is nn.Linear and kernels.load() is None


def test_switched_off_by_environment_and_bad_max_rows(monkeypatch):
    monkeypatch.setenv("HFSPEC_KERNELS", "0")
    layer = nn.Linear(8, 4)
    assert fast.accelerate(layer).reason == "HFSPEC_KERNELS=0" and type(layer) is nn.Linear
    with pytest.raises(ValueError, match="max_rows"):
        fast.accelerate(layer, max_rows=0)


def test_every_row_count_runs_on_the_kernel_in_both_dtypes(library, monkeypatch):
    # Prompts too: a row's bits may not depend on how many rows share the call (tests/test_row_invariance.py).
    calls = []

    def counted(library, x, w, b=None, plan=None):
        calls.append(x.numel() // x.shape[-1])
        return F.linear(x, w.float(), b)

    monkeypatch.setattr(kernels, "linear_unchecked", counted)
    f32, bf16 = nn.Linear(16, 8), nn.Linear(16, 8).bfloat16()
    fast.accelerate(f32)
    fast.accelerate(bf16)
    assert f32.max_rows == bf16.max_rows == fast.ALL_ROWS
    with torch.no_grad():
        f32(torch.randn(1, 400, 16))
        bf16(torch.randn(400, 16).bfloat16())
        bf16(torch.randn(40, 16).bfloat16())
    assert calls == [400, 400, 40]
