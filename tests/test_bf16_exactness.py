"""Greedy hfspec in bfloat16 equals the model's own generate() token for token, with the CPU kernels on.

The models have many near-ties: small logits (the output layer scaled by 0.3) in bfloat16, whose top two are
often one unit in the last place apart, so a logit that moves by a bit flips the token. Where a row's bits depend
on how many rows share the forward (torch's attention, activations and GEMMs), greedy hfspec diverges here from the
model's own generate(): the prompt split between hfspec's prefill and its first verification, γ + 1 rows per
verification, N + 1 per tree, a left-padded batch. With hfspec's kernels (``hfspec.fast.accelerate``: every linear,
the attention and the activations), every row gets the bits a decoding step gives it, and every setting here is
identical: chains, trees, n-gram lookup, an EAGLE-3 head, a draft with another tokenizer, ragged batches and sliding
windows. On torch's own kernels the tests assert what holds there: any divergence is at a near-tie, the reference's
two tokens within a few units in the last place of bfloat16.
"""

from __future__ import annotations

import math
import random

import eagle3_heads as eh
import pytest
import tiny
import torch
from test_cross_tokenizer import TEXTS, pair  # noqa: F401 - the cross-tokenizer models, as a fixture
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hfspec import SpeculativeGenerator
from hfspec.cpu import fast
from hfspec.drafters.eagle3 import Eagle3Drafter

V, NEW = 128, 24
# hidden 40: head dimension 10 and an MLP 80 wide, off every vector width.
COMMON = dict(vocab_size=V, hidden=40, layers=3, eos=None, sharpness=0.3)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(7, V) for _ in range(_rng.randrange(3, 25))] for _ in range(10)]
# The prompts each also run alone (3 and 5 tokens): on torch's kernels a row alone diverges from the reference on
# these in each chain, tree and lookup setting, where the first three prompts never do.
ALONE = (4, 8)
# The prompts of the near-tie check on torch's kernels: from the fourth to the ninth, all three that diverge alone.
TORCH_PROMPTS = PROMPTS[3:9]
SETTINGS = {
    "chain γ=1": dict(gamma=1, tree=None),
    "chain γ=4": dict(gamma=4, tree=None),
    "tree of 8": dict(tree=8),
    "ngram chain": dict(gamma=3, tree=None),
    "ngram tree of 8": dict(tree=8),
}


def bf16(path, tokenizer: bool = False):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    return (model, PreTrainedTokenizerFast.from_pretrained(path)) if tokenizer else model


def accelerated(*models):
    for model in models:
        report = fast.accelerate(model)
        assert report.reason is None and report.attention and report.activations, report
    return models


def own(model, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    """The model's own greedy generate(), each prompt alone."""
    out = []
    for p in prompts:
        x = torch.tensor([p])
        out.append(
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False)[
                0, len(p) :
            ].tolist()
        )
    return out


def rows_of(out) -> list[list[int]]:
    return [
        out.sequences[b, out.prompt_length : out.prompt_length + r.committed].tolist()
        for b, r in enumerate(out.stats.rows)
    ]


def check(
    gen: SpeculativeGenerator,
    prompts: list[list[int]],
    want: list[list[int]],
    setting: dict,
    new: int = NEW,
    alone: tuple[int, ...] = ALONE,
) -> int:
    """All prompts as one ragged batch, and those at the indices ``alone`` each on its own, equal ``want``; the
    drafts accepted. (Where the generator runs a batch's prompts one by one, a recurrent model's or a window counted
    in cache columns, the batch is already each prompt alone: ``alone=()``.)"""
    out = gen.generate(prompts, max_new_tokens=new, **setting)
    assert rows_of(out) == want, (setting, "batch")
    accepted = out.stats.accepted
    for p, w in ((prompts[i], want[i]) for i in alone):
        out = gen.generate([p], max_new_tokens=new, **setting)
        assert rows_of(out)[0] == w, (setting, p)
        accepted += out.stats.accepted
    return accepted


@pytest.fixture(scope="module")
def kernel_models(model_dir, library):
    target, draft = accelerated(
        bf16(model_dir("llama", seed=3, **COMMON)), bf16(model_dir("llama", seed=3, perturb=0.3, **COMMON))
    )
    return target, draft, own(target, PROMPTS)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_chains_trees_and_lookup_equal_the_accelerated_models_own_generate(kernel_models, name):
    target, draft, want = kernel_models
    gen = SpeculativeGenerator(target, "ngram" if "ngram" in name else draft, None)
    assert check(gen, PROMPTS, want, SETTINGS[name]) > 0


@pytest.mark.parametrize("setting", [dict(gamma=3, tree=None), dict(tree=8)])
def test_an_eagle3_head_equals_the_accelerated_models_own_generate(kernel_models, setting):
    target, _, want = kernel_models
    head = eh.random_head(target, list(range(4, V)), seed=1, scale=4.0).to(torch.bfloat16)
    fast.accelerate(head)
    check(SpeculativeGenerator(target, Eagle3Drafter(head, target), None), PROMPTS, want, setting)


def test_a_draft_with_another_tokenizer_equals_the_accelerated_models_own_generate(pair, library):  # noqa: F811
    (target, tok), (draft, draft_tok) = bf16(pair["target"], True), bf16(pair["draft"], True)
    accelerated(target, draft)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    gen = SpeculativeGenerator(target, draft, tok, draft_tokenizer=draft_tok)
    assert check(gen, prompts, own(target, prompts, 20), dict(gamma=3), new=20, alone=(0, 1, 2)) > 0


@pytest.mark.parametrize(
    "arch, extra, settings",
    [
        (
            "gemma2",
            {},
            [dict(gamma=3, tree=None), dict(tree=8)],
        ),  # eager attention, soft-capping, a mask per layer type
        ("qwen2", dict(use_sliding_window=True, max_window_layers=0), [dict(gamma=3, tree=None), dict(tree=8)]),
        ("mistral", {}, [dict(gamma=3, tree=None)]),  # the window in cache columns: chains, rows run alone
    ],
)
def test_sliding_windows_equal_the_accelerated_models_own_generate(model_dir, library, arch, extra, settings):
    common = dict(COMMON, layers=2, sliding_window=4, **extra)
    target, draft = accelerated(
        bf16(model_dir(arch, seed=4, **common)), bf16(model_dir(arch, seed=4, perturb=0.3, **common))
    )
    prompts = [PROMPTS[i] for i in (0, 1, 4)]  # 15 and 9 tokens, past the window, and 3 within it
    want = own(target, prompts)
    for setting in settings:
        # One prompt alone (15 tokens, past the window) beside the batch: the chains' and trees' single rows are
        # covered at length above.
        check(
            SpeculativeGenerator(target, draft, None), prompts, want, setting, alone=() if arch == "mistral" else (0,)
        )


def test_a_qwen3_next_shaped_model_equals_its_own_generate(tmp_path, library):
    # A gated delta-rule layer, then gated attention (attn * torch.sigmoid(gate), called as a function: on the
    # kernels too), dense MLPs (the MoE's experts run torch's F.linear over 3-D weights, not the kernels).
    common = dict(COMMON, layers=2, mlp_only_layers=[0, 1], head_dim=10)
    target, draft = accelerated(
        bf16(tiny.build(tmp_path / "target", "qwen3_next", seed=5, **common)),
        bf16(tiny.build(tmp_path / "draft", "qwen3_next", seed=5, perturb=0.3, **common)),
    )
    assert "hfspec_functional" in target.__dict__  # its forwards run FunctionalActivations
    prompts = PROMPTS[:2]
    gen = SpeculativeGenerator(target, draft, None)
    assert check(gen, prompts, own(target, prompts), dict(gamma=3), alone=()) > 0


# -- torch's own kernels: identical up to rounding ------------------------------------------------------------


def ulp_bf16(x: float) -> float:
    """One unit in the last place of bfloat16 at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


@pytest.fixture(scope="module")
def torch_models(model_dir):
    target = bf16(model_dir("llama", seed=3, **COMMON))
    return target, bf16(model_dir("llama", seed=3, perturb=0.3, **COMMON)), own(target, TORCH_PROMPTS)


@pytest.mark.parametrize("name", ["chain γ=4", "tree of 8"])
def test_on_torchs_kernels_a_divergence_is_only_ever_a_near_tie(torch_models, name):
    target, draft, wanted = torch_models
    gen = SpeculativeGenerator(target, "ngram" if "ngram" in name else draft, None)
    for p, want in zip(TORCH_PROMPTS, wanted):
        got = rows_of(gen.generate([p], max_new_tokens=NEW, **SETTINGS[name]))[0]
        if got == want:
            continue
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.no_grad():
            logits = target(torch.tensor([p + want[:i]])).logits[0, -1].float()
        # This forward is a third shape (a prefill of it all): on torch its bits may rank the two tokens either way.
        gap = float(logits[want[i]] - logits[got[i]])
        assert abs(gap) <= 4 * ulp_bf16(float(logits[want[i]])), (name, p, i, gap)
