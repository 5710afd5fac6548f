"""A GGUF target in int8 arithmetic: speculation is exact to that target's own decoding.

Greedy: hfspec with an n-gram drafter and with a model draft, chains and a tree, equals hfspec at γ = 0 on the same
int8 target and the target's own ``generate()`` (on hfspec's kernels, as ``load_pair`` leaves it), token for token.
Sampled: the first tokens' joint against the int8 target's exact joint (chi-square), and the negative control
without the residual fails. The files are tiny Qwen2s the tests write (``gguf_files``), K-quants and the others.
"""

from __future__ import annotations

from types import SimpleNamespace

import gguf_files
import numpy as np
import pytest
import stat_utils
import torch
from stat_utils import ALPHA, chi_square_pvalue

from hfspec import SpeculativeGenerator
from hfspec.bench.field import MAIN, PLAIN_KERNEL
from hfspec.bench.runner import field_of
from hfspec.cpu import int8, quant
from hfspec.decoding import sampling
from hfspec.drafters.loading import load_pair
from hfspec.policy.simple import FixedGamma

K_MIX = {"*": "Q4_K", "ffn_down": "Q6_K", "attn_v": "Q5_K", "output": "Q6_K", "token_embd": "Q4_K"}
LEGACY_MIX = {"*": "Q4_0", "attn_q": "Q5_1", "attn_k": "Q4_1", "ffn_down": "Q5_0", "output": "Q8_0"}
V, NEW, SAMPLES = 9, 3, 6_000
NO_EOS = {"eos_token_id": []}  # every row draws NEW tokens, as the exact joint counts them


@pytest.fixture(scope="module")
def files(tmp_path_factory, library):
    if quant.kernel() is None:
        pytest.skip(f"no quantized kernel: {quant.unavailable()}")
    root = tmp_path_factory.mktemp("int8")
    return {
        "target": gguf_files.write(root / "target", "qwen2", K_MIX, vocab=64, seed=1),
        "draft": gguf_files.write(root / "draft", "qwen2", LEGACY_MIX, vocab=64, hidden=64, seed=2),
        "small-target": gguf_files.write(
            root / "small-target", "qwen2", LEGACY_MIX, vocab=V, hidden=64, seed=3, sharpness=30
        ),
        "small-draft": gguf_files.write(
            root / "small-draft", "qwen2", "Q8_0", vocab=V, hidden=64, seed=3, sharpness=15
        ),
    }


def pair(files, target: str, draft: str):
    t, d = files[target], files.get(draft)
    return load_pair(
        str(t.parent),
        str(d.parent) if d is not None else draft,
        gguf_file=t.name,
        draft_gguf_file=None if d is None else d.name,
        tokenizer=str(t.parent),
        arithmetic="int8",
    )


def test_greedy_speculation_equals_the_int8_targets_own_decoding(files):
    ids = torch.tensor([[1, 9, 17, 33, 4, 9, 17], [5, 6, 7, 8, 9, 10, 11]])
    target, draft, tok = pair(files, "target", "draft")
    assert {layer.arithmetic for layer in quant.quantized_layers(target)} == {"int8"}
    want = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    gen = SpeculativeGenerator(target, draft, tok)
    assert gen.describe()["arithmetic"] == "int8"
    plain = gen.generate(ids, max_new_tokens=24, gamma=FixedGamma(0), eos_token_id=[])
    assert torch.equal(plain.sequences, want)
    for gamma, tree in ((1, None), (4, None), ("auto", "auto"), (3, 6)):
        out = gen.generate(ids, max_new_tokens=24, gamma=gamma, tree=tree, eos_token_id=[])
        assert torch.equal(out.sequences, want), f"gamma {gamma}, tree {tree}"
    _, lookup, _ = pair(files, "target", "ngram")
    out = SpeculativeGenerator(target, lookup, tok).generate(ids, max_new_tokens=24, gamma=3, eos_token_id=[])
    assert torch.equal(out.sequences, want)


def test_int8_is_the_default_where_its_kernel_runs_and_float32_is_another_model_of_one_file(files, monkeypatch):
    ids = torch.tensor([[1, 9, 17, 33, 4, 9, 17]])
    t = files["target"]
    integer, _, _ = pair(files, "target", "ngram")
    default, _, _ = load_pair(str(t.parent), "ngram", gguf_file=t.name, tokenizer=str(t.parent))
    want = "int8" if int8.kernel() is not None else "float32"  # HFSPEC_KERNELS=0: no kernel, float32
    assert {layer.arithmetic for layer in quant.quantized_layers(default)} == {want}
    monkeypatch.setattr(int8, "kernel", lambda: None)  # a machine where the int8 kernel cannot be built
    fallback, _, _ = load_pair(str(t.parent), "ngram", gguf_file=t.name, tokenizer=str(t.parent))
    assert {layer.arithmetic for layer in quant.quantized_layers(fallback)} == {"float32"}
    monkeypatch.undo()
    floating, _, _ = load_pair(str(t.parent), "ngram", gguf_file=t.name, tokenizer=str(t.parent), arithmetic="float32")
    assert {layer.arithmetic for layer in quant.quantized_layers(floating)} == {"float32"}
    with torch.no_grad():
        a, b = integer(ids).logits, floating(ids).logits
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.05 * b.abs().max().item())


def test_sampling_follows_the_int8_targets_exact_joint(files, monkeypatch):
    target, draft, tok = pair(files, "small-target", "small-draft")
    prompt = [3, 4, 3]
    exact = stat_utils.exact_joint(target, prompt, {}, V, NEW)
    gen = SpeculativeGenerator(target, draft, tok)

    def counts(seed: int) -> np.ndarray:
        (found,) = stat_utils.sample_counts(
            gen, [prompt], NO_EOS, seed, vocab=V, new=NEW, samples=SAMPLES, batch=SAMPLES, gamma=2
        )
        return found

    assert chi_square_pvalue(counts(0), exact) > ALPHA
    out = gen.generate([prompt] * 1000, max_new_tokens=NEW, gamma=2, do_sample=True, seed=1, **NO_EOS)
    assert 0.1 < out.stats.acceptance_rate < 0.95  # accepts and rejects both seen
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)  # the negative control: no residual
    assert chi_square_pvalue(counts(1), exact) < ALPHA


def test_the_bench_checks_a_gguf_target_against_its_own_generate_on_the_kernels(files):
    # A target held in GGUF blocks runs hfspec's kernels (no FastLinear): its own generate() on them is the
    # reference greedy hfspec equals bit for bit, so the bench runs it as plain-kernel.
    target, draft, _ = pair(files, "target", "draft")
    bench = SimpleNamespace(specs={MAIN: None}, target=target, draft=draft)
    settings = SimpleNamespace(gamma="auto", lookup_tokens=None, skip=())
    main, _ = field_of(bench, settings, [2])
    assert PLAIN_KERNEL in {c.name for c in main}
