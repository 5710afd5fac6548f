"""The exactness suites on hfspec's CPU kernel: chi-square, end to end, batches and greedy, every linear on it.

The statistical tests draw thousands of rows in one forward, and their models run every one on the kernel
(:func:`hfspec.fast.accelerate`'s default): the prefill, the verification of every row, the
draft's steps and the enumeration of the exact joint (``stat_utils.exact_joint``, on the same accelerated
target: the kernel's own numerics) all take the kernel. The greedy tests run as
hfspec loads its models. Every test counts its ``FastLinear``
forwards and asserts that each one ran the kernel, so none of them passes with the kernel silently off.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import eagle3_heads as eh
import pytest
import stat_utils
import tiny
import torch
from stat_utils import ALPHA
from test_distribution import PROMPT_A, PROMPT_B, chain_pair
from test_ngram import NGRAM_PROMPTS
from test_trees import NEW, NGRAM_PROMPT, SETTINGS, V, reference, tree_pair, tree_pvalue
from torch import nn

from hfspec import SpeculativeGenerator, sampling, tree
from hfspec.cpu import fast, kernels
from hfspec.drafters.eagle3 import Eagle3Drafter

# Rows per prompt: 3000 put both negative controls below p = 1e-150 (4 seeds tried; 1000 below 1e-40), the
# tests ask for p < ALPHA = 1e-8.
SAMPLES = 3_000


class KernelCalls:
    """Counts ``FastLinear`` forwards and calls to the kernel while it is installed (``monkeypatch``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.forwards = self.kernel = 0
        forward, linear = fast.FastLinear.forward, kernels.linear_unchecked

        def counted_forward(layer: fast.FastLinear, input: torch.Tensor) -> torch.Tensor:
            self.forwards += 1
            return forward(layer, input)

        def counted_linear(*args) -> torch.Tensor:
            self.kernel += 1
            return linear(*args)

        monkeypatch.setattr(fast.FastLinear, "forward", counted_forward)
        monkeypatch.setattr(kernels, "linear_unchecked", counted_linear)

    def check(self) -> None:
        """Every FastLinear forward ran the kernel (torch's F.linear none of them)."""
        assert self.forwards > 0 and self.kernel == self.forwards, (
            f"{self.forwards - self.kernel} of {self.forwards} linear forwards fell back to torch"
        )


@pytest.fixture
def calls(library, monkeypatch) -> KernelCalls:
    return KernelCalls(monkeypatch)


@contextlib.contextmanager
def on_kernel(*models: nn.Module) -> Iterator[None]:
    """Run ``models`` with every ``nn.Linear`` on the kernel inside the block, then restore them."""
    with contextlib.ExitStack() as stack:
        for model in models:
            report = stack.enter_context(fast.accelerated(model))
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            assert report.reason is None and len(report.layers) == len(linears) > 0, report
        yield


@pytest.fixture(scope="module")
def chain_models(model_dir):
    return chain_pair(model_dir)


@pytest.fixture(scope="module")
def tree_models(model_dir):
    return tree_pair(model_dir)


def joint_pvalues(gen: SpeculativeGenerator, prompts: list[list[int]], settings: dict, seed: int) -> list[float]:
    return stat_utils.joint_pvalues(gen, prompts, settings, seed, vocab=V, new=NEW, samples=SAMPLES)


# -- chains: a draft model, and the lookup ----------------------------------------------------------


@pytest.mark.parametrize("name", list(SETTINGS))
def test_chain_samples_of_ragged_rows_match_the_target(chain_models, name, calls):
    # Two prompts of different lengths interleaved in one batch: rows padded and advancing at their own pace.
    target, draft, tok = chain_models
    with on_kernel(target, draft):
        pvalues = joint_pvalues(SpeculativeGenerator(target, draft, tok), [PROMPT_A, PROMPT_B], SETTINGS[name], 1)
    calls.check()
    assert min(pvalues) > ALPHA, f"{name}: samples differ from the target on the kernel (p-values {pvalues})"


def test_negative_control_chain_with_a_wrong_residual_is_detected(chain_models, calls, monkeypatch):
    target, draft, tok = chain_models
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    with on_kernel(target, draft):
        (pv,) = joint_pvalues(SpeculativeGenerator(target, draft, tok), [PROMPT_A], SETTINGS["t0.7_top_k"], 5)
    calls.check()
    assert pv < ALPHA, pv


@pytest.mark.parametrize("name", list(SETTINGS))
def test_lookup_samples_match_the_target(chain_models, name, calls):
    # A prompt with a strong match and one with none at first, in one batch.
    target, _, tok = chain_models
    with on_kernel(target):
        pvalues = joint_pvalues(SpeculativeGenerator(target, "ngram", tok), NGRAM_PROMPTS, SETTINGS[name], 2)
    calls.check()
    assert min(pvalues) > ALPHA, f"{name}: lookup samples differ from the target on the kernel ({pvalues})"


# -- trees: a draft model, the lookup, an EAGLE-3 head ----------------------------------------------


@pytest.mark.parametrize("name", list(SETTINGS))
def test_tree_samples_match_the_target(tree_models, name, calls):
    target, draft, tok = tree_models
    with on_kernel(target, draft):
        pv, depths = tree_pvalue(SpeculativeGenerator(target, draft, tok), SETTINGS[name], 6, seed=3, samples=SAMPLES)
    calls.check()
    deepest = 2 if "top_k" in name else 1  # top-p at T=0.7 leaves the draft one token often: paths stay short
    assert len(depths) > deepest and depths[0] > 0, f"no path {deepest} deep accepted, or none rejected: {depths}"
    assert pv > ALPHA, f"{name}: tree samples differ from the target on the kernel (p-value {pv:.3g})"


def test_negative_control_tree_without_the_residual_update_is_detected(tree_models, calls, monkeypatch):
    target, draft, tok = tree_models
    monkeypatch.setattr(tree, "verify", functools.partial(tree.verify, residual_update=False))
    with on_kernel(target, draft):
        pv, _ = tree_pvalue(
            SpeculativeGenerator(target, draft, tok), SETTINGS["t0.7_top_k"], 6, seed=3, samples=SAMPLES
        )
    calls.check()
    assert pv < ALPHA, pv


def test_lookup_tree_samples_match_the_target(tree_models, calls):
    target, _, tok = tree_models
    with on_kernel(target):
        pv, depths = tree_pvalue(
            SpeculativeGenerator(target, "ngram", tok), SETTINGS["t0.7_top_k"], 6, 4, NGRAM_PROMPT, samples=SAMPLES
        )
    calls.check()
    assert depths[0] > 0 and len(depths) > 1, depths
    assert pv > ALPHA, f"lookup tree samples differ from the target on the kernel (p-value {pv:.3g})"


def test_eagle3_tree_samples_match_the_target(model_dir, calls):
    target, tok = tiny.load(model_dir("llama", vocab_size=V, layers=5, hidden=16, seed=10, sharpness=30.0, eos=None))
    head = eh.random_head(target, [1, 3, 4, 5, 6, 7], seed=1, scale=4.0, layer_ids=(1, 2, 3))
    with on_kernel(target, head):
        pv, depths = tree_pvalue(
            SpeculativeGenerator(target, Eagle3Drafter(head, target), tok),
            {"temperature": 0.7, "top_p": 0.95},
            6,
            8,
            samples=SAMPLES,
        )
    calls.check()
    assert depths[0] > 0 and len(depths) > 1, depths
    assert pv > ALPHA, f"EAGLE-3 tree samples differ from the target on the kernel (p-value {pv:.3g})"


# -- greedy: trees and the lookup (chains: test_kernels, test_fast_loading; bf16: test_bf16_exactness) -----


@pytest.mark.parametrize("draft, nodes", [("model", 8), ("ngram", 0), ("ngram", 8)])
def test_greedy_equals_the_accelerated_targets_own_generate(model_dir, draft, nodes, calls):
    common = dict(vocab_size=64, eos=None)
    target, tok = tiny.load(model_dir("llama", seed=0, **common))
    model = tiny.load(model_dir("llama", seed=0, perturb=0.3, **common))[0] if draft == "model" else None
    prompts = [[5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6], [9, 9, 9, 9], [30, 31, 32]]
    with on_kernel(*[m for m in (target, model) if m is not None]):
        want = [reference(target, p, 24) for p in prompts]
        gen = SpeculativeGenerator(target, model or "ngram", tok)
        out = gen.generate(prompts, max_new_tokens=24, gamma=3, tree=nodes)
    calls.check()
    assert [row[-24:] for row in out.sequences.tolist()] == want, (draft, nodes)
    assert out.stats.accepted > 0 and (out.stats.tree_nodes > 0) == (nodes > 0), out.stats
