"""hfspec's fused RMSNorm and rotary (hfspec.cpu.norms, hfspec.cpu.rotary): a row's bits alone and among others, close
to transformers' norm and equal to its rotary, switched on by accelerate() and off by restore(), and greedy hfspec
equal to the accelerated model's own generate()."""

from __future__ import annotations

import pytest
import tiny
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from hfspec import SpeculativeGenerator
from hfspec.cpu import activations, fast, mlp, norms, rotary

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def bound(library):
    norms.bind(library)
    rotary.bind(library)
    mlp.bind(library)
    activations.use(torch.nn.SiLU(), library)  # binds the activation kernel


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 1536])  # a tail off the vector width; the 1.5B's width
def test_rmsnorm_gives_a_row_the_same_bits_alone_and_among_k_rows_close_to_transformers(dtype, width):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, width, generator=g) * 3).to(dtype)
    weight = torch.randn(width, generator=g).to(dtype)
    batch = norms.rmsnorm(x, weight, 1e-6)
    for row in range(9):
        assert torch.equal(bits(norms.rmsnorm(x[row : row + 1], weight, 1e-6)), bits(batch[row : row + 1]))
    torch.testing.assert_close(norms.rmsnorm(x[:4], weight, 1e-6), batch[:4], rtol=0, atol=0)
    module = LlamaRMSNorm(width, eps=1e-6).to(dtype)
    module.weight.data.copy_(weight)
    with torch.no_grad():
        want = module(x)
    assert batch.dtype == want.dtype and batch.shape == want.shape
    tolerance = 1e-2 if dtype is torch.bfloat16 else 1e-5
    torch.testing.assert_close(batch.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_computes_transformers_bits_whatever_rows_share_the_call(dtype):
    g = torch.Generator().manual_seed(1)
    dim, tokens = 10, 6  # half a head off every vector width
    q = torch.randn(2, tokens, 4 * dim, generator=g).to(dtype)
    k = torch.randn(2, tokens, 2 * dim, generator=g).to(dtype)
    cos, sin = (torch.randn(2, tokens, dim, generator=g).to(dtype) for _ in range(2))
    assert rotary.serves(q, k, cos, sin, dim)
    got_q, got_k = rotary.rotary(q, k, cos, sin, dim)
    heads = (2, tokens, -1, dim)
    want_q, want_k = apply_rotary_pos_emb(q.view(heads).transpose(1, 2), k.view(heads).transpose(1, 2), cos, sin)
    assert torch.equal(bits(got_q), bits(want_q)) and torch.equal(bits(got_k), bits(want_k))
    alone_q, alone_k = rotary.rotary(q[1:, 3:4], k[1:, 3:4], cos[1:, 3:4], sin[1:, 3:4], dim)
    assert torch.equal(bits(alone_q), bits(got_q[1:, :, 3:4])) and torch.equal(bits(alone_k), bits(got_k[1:, :, 3:4]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [activations.SILU, activations.GELU_TANH])
def test_activation_times_up_gives_the_activation_kernels_bits_times_up(dtype, kind):
    g = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(5, 37, generator=g).to(dtype) * 3 for _ in range(2))
    got = mlp.activation_mul(kind, gate, up)
    assert torch.equal(bits(got), bits(activations._apply(kind, gate) * up))  # the two calls it fuses
    assert torch.equal(bits(mlp.activation_mul(kind, gate[2:3], up[2:3])), bits(got[2:3]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_accelerate_switches_the_norms_and_attention_and_restore_switches_them_back(library, model_dir, arch):
    model, _ = tiny.load(model_dir(arch))
    layers = model.config.num_hidden_layers
    ids = torch.tensor([[1, 5, 9, 14, 3, 22]])
    with torch.no_grad():
        before = model(ids).logits
    report = fast.accelerate(model)
    assert (report.norms, report.rotary, report.mlps, report.decoders) == (2 * layers + 1, layers, layers, layers)
    assert fast.describe(model)["fused"] == {"norms": 2 * layers + 1, "rotary": layers, "mlp": layers, "layers": layers}
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    fast.restore(model)
    assert type(model.model.norm).__name__.endswith("RMSNorm") and "fused" not in fast.describe(model)
    assert type(model.model.layers[0].self_attn).__name__.endswith("Attention")


def test_greedy_hfspec_equals_the_accelerated_models_own_generate(library, model_dir):
    gen = SpeculativeGenerator.from_pretrained(
        str(model_dir("qwen2", seed=0)), str(model_dir("qwen2", seed=1)), dtype="float32"
    )
    assert fast.describe(gen.target)["fused"]["rotary"] == gen.target.config.num_hidden_layers
    ids = torch.tensor([[1, 7, 9, 12, 30, 4, 17]])
    reference = gen.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    for gamma in (1, 4):
        assert torch.equal(gen.generate(ids, max_new_tokens=12, gamma=gamma).sequences, reference), gamma


def test_with_gradients_the_accelerated_model_runs_transformers_own_norm_and_rotary(library, model_dir):
    model, _ = tiny.load(model_dir("qwen2"))
    ids = torch.tensor([[1, 5, 9, 14]])
    want = model(ids).logits
    fast.accelerate(model)
    got = model(ids).logits  # weights that need gradients: torch's own ops, and a graph to differentiate
    got.sum().backward()
    assert torch.equal(got, want) and model.model.norm.weight.grad is not None
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
