"""hfspec's CPU attention: close to exact attention, a row's bits independent of every other row and of the keys it
cannot see, and the accelerated model's own attention (sdpa and eager models alike)."""

from __future__ import annotations

import pytest
import tiny
import torch
from transformers import AutoModelForCausalLM

from hfspec.cpu import activations, fast
from hfspec.cpu import attention as cpu_attention


@pytest.fixture(scope="module", autouse=True)
def bound(library):
    cpu_attention.bind(library)


def exact(q, k, v, mask=None, scale=None, softcap=None, causal=False):
    """Attention in float64 (B, Q, H, Dv), keys and values repeated per query head."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return (s.softmax(-1) @ v).transpose(1, 2)


def qkv(batch=2, heads=6, kv_heads=2, rows=5, length=11, dim=24, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, rows, heads, dim, generator=g).transpose(1, 2)  # as models make it: a transposed view
    k = torch.randn(batch, kv_heads, length, dim, generator=g)
    v = torch.randn(batch, kv_heads, length, dv or dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dim, dv", [(24, 24), (64, 64), (8, 40), (130, 17)])
def test_close_to_exact_attention_with_every_kind_of_mask(dim, dv):
    q, k, v = qkv(dim=dim, dv=dv)
    g = torch.Generator().manual_seed(1)
    seen = torch.rand(2, 1, 5, 11, generator=g) > 0.3
    seen[..., 0] = True
    additive = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    for kwargs in (
        {},
        {"mask": seen},
        {"mask": additive},
        {"mask": additive.bfloat16()},
        {"mask": additive.half()},
        {"mask": seen, "softcap": 2.0, "scale": 0.3},
    ):
        got = cpu_attention.attention(q, k, v, **kwargs)
        want = exact(q, k, v, kwargs.get("mask"), kwargs.get("scale"), kwargs.get("softcap"))
        assert got.shape == (2, 5, 6, dv) and got.is_contiguous()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    q, k, v = qkv(rows=7, length=7, dim=dim, dv=dv)
    torch.testing.assert_close(
        cpu_attention.attention(q, k, v, is_causal=True).double(), exact(q, k, v, causal=True), rtol=1e-5, atol=1e-5
    )


def test_bfloat16_in_and_out_sums_in_float32():
    q, k, v = qkv(dtype=torch.bfloat16)
    got = cpu_attention.attention(q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact(q, k, v), rtol=1e-2, atol=1e-2)  # bf16 rounding of the output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_in_a_block_beside_padding_and_on_more_threads(dtype):
    # One query row (batch 0, last position) computed: alone over its keys (a decoding step); as the last of a
    # causal block (a prefill); under a boolean mask with other rows (a verification); with its keys shifted
    # right behind masked padding full of NaN (a left-padded batch); and on two threads.
    q, k, v = qkv(batch=1, rows=9, length=9, dtype=dtype)
    alone = cpu_attention.attention(q[:, :, -1:], k, v)[:, 0]
    prefill = cpu_attention.attention(q, k, v, is_causal=True)[:, -1]
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    verification = cpu_attention.attention(q[:, :, -4:], k, v, causal[..., -4:, :])[:, -1]
    pad = torch.full((1, 2, 3, 24), float("nan"), dtype=dtype)
    shifted = cpu_attention.attention(
        q[:, :, -4:],
        torch.cat([pad, k], 2),
        torch.cat([pad, v], 2),
        torch.cat([torch.zeros(1, 1, 4, 3, dtype=torch.bool), causal[..., -4:, :]], -1),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = cpu_attention.attention(q, k, v, is_causal=True)[:, -1]
    finally:
        torch.set_num_threads(threads)
    for other in (prefill, verification, shifted[:, -1], two):
        assert torch.equal(bits(alone), bits(other))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_key_masked_with_a_finite_large_negative_is_left_out_as_a_hidden_one(dtype):
    # A custom additive mask may hide keys with -1e9 (or -1e4) instead of -inf or the dtype's minimum: such a key's
    # weight is exactly 0, and every row must come out in the bits it has with the key hidden, even where the
    # hidden keys' values are NaN (their keys are finite: a NaN score is no large negative).
    q, k, v = qkv(batch=1, heads=4, kv_heads=2, rows=20, length=20, dtype=dtype, seed=3)
    seen = torch.rand(1, 1, 20, 20, generator=torch.Generator().manual_seed(4)) > 0.4
    seen[..., 0], seen[..., [5, 11]] = True, False
    v = v.clone()
    v[:, :, [5, 11]] = float("nan")
    hidden = cpu_attention.attention(q, k, v, seen)
    assert torch.isfinite(hidden).all()
    for value in (-1e9, -1e4):
        for mask_dtype in (torch.float32, torch.bfloat16):
            additive = torch.zeros(seen.shape).masked_fill(~seen, value).to(mask_dtype)
            got = cpu_attention.attention(q, k, v, additive)
            assert torch.equal(bits(got), bits(hidden)), (value, mask_dtype)


def test_a_row_that_sees_no_key_gets_zeros():
    q, k, v = qkv(batch=1, rows=2, length=4)
    mask = torch.tensor([[False] * 4, [True] * 4])[None, None]
    out = cpu_attention.attention(q, k, v, mask)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0])) and out[0, 1].abs().sum() > 0


def logits(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("arch, extra", [("llama", {}), ("gpt_neox", {}), ("gemma2", {"sliding_window": 4})])
def test_the_models_own_forward_runs_it_close_to_torchs(model_dir, arch, extra):
    model, _ = tiny.load(model_dir(arch, seed=24, **extra))
    original = model.config._attn_implementation
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :3] = 0
    want = logits(model, ids, pad)
    calls = []
    report = fast.accelerate(model)
    try:
        assert report.attention and model.config._attn_implementation == (
            cpu_attention.IMPLEMENTATION if original == "sdpa" else cpu_attention.EAGER
        )
        entry = cpu_attention._ENTRY
        cpu_attention._ENTRY = lambda *a: calls.append(1) or entry(*a)
        got = logits(model, ids, pad)
    finally:
        cpu_attention._ENTRY = entry
        fast.restore(model)
    assert len(calls) == model.config.num_hidden_layers and model.config._attn_implementation == original
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0, 3:], want[0, 3:], rtol=1e-4, atol=1e-4)


def test_what_the_kernel_does_not_serve_keeps_the_models_attention(model_dir):
    model, _ = tiny.load(model_dir("llama", seed=25))
    fast.accelerate(model)
    try:
        assert model.config._attn_implementation == cpu_attention.IMPLEMENTATION
        ids = torch.tensor([[5, 6, 7, 8]])
        assert not cpu_attention.serves(*qkv(dtype=torch.float16), None)  # float16: the model's own sdpa
        q, k, v = qkv()
        assert cpu_attention.serves(q, k, v, None) and not cpu_attention.serves(q.requires_grad_(), k, v, None)
        model.train()  # autograd: the model's own sdpa, so gradients flow
        out = model(ids).logits.sum()
        out.backward()
        assert model.model.embed_tokens.weight.grad is not None
    finally:
        model.eval()
        fast.restore(model)


def test_only_sdpa_and_eager_models_switch_and_restore_and_suspend_follow(model_dir, library):
    flash = AutoModelForCausalLM.from_pretrained(model_dir("llama", seed=24), attn_implementation="eager")
    flash.config._attn_implementation = "flex_attention"  # any other implementation is left alone
    assert cpu_attention.use(flash, library) is False
    model, _ = tiny.load(model_dir("llama", seed=24))
    report = fast.accelerate(model)
    assert report.attention and model.config._attn_implementation == cpu_attention.IMPLEMENTATION
    assert report.activations == model.config.num_hidden_layers
    with fast.suspended(model):
        assert model.config._attn_implementation == "sdpa"
        assert not any(type(m) is activations.InvariantActivation for m in model.modules())
    assert model.config._attn_implementation == cpu_attention.IMPLEMENTATION
    fast.restore(model)
    assert model.config._attn_implementation == "sdpa" and cpu_attention.unuse(model) is False
    assert not any(type(m) is activations.InvariantActivation for m in model.modules())
