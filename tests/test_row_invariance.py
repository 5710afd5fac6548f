"""With hfspec's CPU kernels on, a row's bits do not depend on the rows computed with it, in every module.

A prefix goes through the decoding steps (one token per forward, generate()'s cache), verification blocks, one
prefill, a prefill then blocks (hfspec's prompt split), a tree with a wrong sibling beside every node, and a
left-padded batch (tests/invariance.py); every module's input and output rows must be the decoding steps' bits.
The models have sizes off the vector widths (head dim 10, MLP width 1100: tails everywhere, and 32 rows of it pass
torch's parallel grain), in float32 and bfloat16, on one thread and on two. The negative controls show the harness
finding what torch's own attention, activations and Conv1D do with the row count.
"""

from __future__ import annotations

import functools
import random

import invariance
import pytest
import tiny
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hfspec.cpu import activations, conv1d, fast

VOCAB = 96
SLIDING = dict(sliding_window=6)
ARCHS = {
    "llama": {},
    "qwen2": dict(SLIDING, use_sliding_window=True, max_window_layers=0),  # biases on q, k, v; a sliding window
    "gpt_neox": {},  # the erf GELU, LayerNorm, partial rotary
    "gpt2": {},  # Conv1D layers, the tanh GELU built from torch ops
    "gemma2": SLIDING,  # eager attention with soft-capping, the tanh GELU, a sliding window
    "mistral": SLIDING,  # a sliding window counted in cache columns
    # Gated attention, attn * torch.sigmoid(gate): an activation called as a function, 40 gate values per row (a
    # tail in torch's vector loop); dense MLPs (the MoE's experts run torch's F.linear over 3-D weights).
    "qwen3_next": dict(layer_types=["full_attention"] * 2, mlp_only_layers=[0, 1], head_dim=10),
}


def model_of(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    config = tiny.make_config(arch, VOCAB, hidden=40, layers=2, **ARCHS[arch])
    for name in ("intermediate_size", "n_inner"):
        if hasattr(config, name):
            setattr(config, name, 1100)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


IDS, OTHER = prompt(32, 0), prompt(50, 1)
CASES = [(arch, dtype, 1) for arch in ARCHS for dtype in (torch.float32, torch.bfloat16)]
CASES += [("llama", torch.bfloat16, 2), ("gemma2", torch.bfloat16, 2)]


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "arch, dtype, threads", CASES, indirect=["threads"], ids=[f"{a}-{str(d)[6:]}-{t}t" for a, d, t in CASES]
)
def test_every_schedule_gives_every_row_the_decoding_steps_bits(library, arch, dtype, threads):
    model = model_of(arch, dtype)
    report = fast.accelerate(model)
    assert report.attention and report.reason is None
    assert invariance.report(model, IDS, other=OTHER) == {
        name: None for name in invariance.schedules(model, IDS, other=OTHER) if name != "decode"
    }


def test_activations_called_as_functions_run_the_kernel_where_the_models_code_calls_them(library):
    llama, gated = model_of("llama", torch.float32), model_of("qwen3_next", torch.float32)
    assert activations.use(llama, library) and "hfspec_functional" not in llama.__dict__  # calls none: no mode
    fast.accelerate(gated)
    assert "hfspec_functional" in gated.__dict__ and gated.model.layers[0].self_attn._forward_pre_hooks  # alone too
    x = torch.randn(333, 83, generator=torch.Generator().manual_seed(0)) * 4
    calls = (torch.sigmoid, torch.Tensor.sigmoid, F.silu, F.gelu, functools.partial(F.gelu, approximate="tanh"))
    theirs = [f(x) for f in calls]
    with activations.FunctionalActivations():
        for f, torchs in zip(calls, theirs):
            got = f(x)
            assert torch.equal(got, torch.cat([f(row) for row in x.split(1)])), f  # the kernel's bits, row by row
            torch.testing.assert_close(got, torchs, rtol=1e-5, atol=1e-5)
    fast.restore(gated)
    assert "hfspec_functional" not in gated.__dict__ and not gated._forward_pre_hooks and not gated._forward_hooks


def differing(report: dict) -> set[str]:
    return {found[0] for found in report.values() if found is not None}


def test_negative_control_torchs_attention_depends_on_the_row_count():
    model = model_of("llama", torch.bfloat16)
    assert "model.layers.0.self_attn.o_proj:in" in differing(invariance.report(model, IDS, other=OTHER))


def test_negative_control_torchs_activation_and_conv1d_depend_on_the_row_count(library):
    # In float32, with everything else on the kernels: torch's SiLU, then torch's addmm are found.
    model = model_of("llama", torch.float32)
    fast.accelerate(model)
    activations.unuse(model)
    found = differing(invariance.report(model, IDS, other=OTHER))
    assert found and all(name.endswith("mlp.act_fn:out") for name in found), found
    model = model_of("gpt2", torch.float32)
    fast.accelerate(model)
    conv1d.unuse(model)
    found = differing(invariance.report(model, IDS, other=OTHER))
    assert found and all(name.endswith(("c_attn:out", "c_proj:out", "c_fc:out")) for name in found), found
