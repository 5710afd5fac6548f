"""End to end: the first tokens of speculative sampling are distributed exactly as the target's.

The exact joint distribution of the first three tokens under the target alone is
enumerated (V^3 sequences, forward passes without caches, processed with
transformers' own warpers), then many samples are drawn through
SpeculativeGenerator and compared with a chi-square test (see stat_utils for
the significance level). Each generate call is a batch of many rows of the same
prompt(s): rows advance at different speeds, so the batch path is tested too.
"""

from __future__ import annotations

import numpy as np
import pytest
import stat_utils
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue

from hfspec import SpeculativeGenerator
from hfspec.decoding import sampling

# sample_counts' defaults, as other test files draw: 6000 samples put the negative control below p = 1e-260.
V, NEW, SAMPLES, BATCH = 9, 3, 6_000, 6_000
# The samples per prompt the tests here draw, in one call: 3000 put the negative control below p = 1e-98 (5 seeds
# tried); the test asks for p < ALPHA = 1e-8.
ROWS = 3_000
PROMPT_A = [7, 8, 7, 7]
PROMPT_B = [8]


def chain_pair(model_dir) -> tuple:
    """(target, draft, tokenizer), loaded afresh: the models these tests sample from."""
    common = dict(vocab_size=V, seed=10, sharpness=30.0, eos=None, hidden=16, layers=1)
    target, tok = tiny.load(model_dir("llama", **common))
    # The draft resembles the target (as a real one does): some drafts accepted, some not.
    draft, _ = tiny.load(model_dir("llama", perturb=0.5, **common))
    return target, draft, tok


@pytest.fixture(scope="module")
def pair(model_dir):
    return chain_pair(model_dir)


def exact_joint(target, prompt: list[int], settings: dict) -> np.ndarray:
    return stat_utils.exact_joint(target, prompt, settings, V, NEW)


def sample_counts(
    gen,
    prompts: list[list[int]],
    settings: dict,
    seed: int,
    gamma: int | str = 2,
    histogram: list[int] | None = None,
    samples: int = SAMPLES,
    batch: int = BATCH,
) -> list[np.ndarray]:
    return stat_utils.sample_counts(
        gen, prompts, settings, seed, vocab=V, new=NEW, samples=samples, batch=batch, gamma=gamma, histogram=histogram
    )


def drawn(gen, prompts: list[list[int]], settings: dict, seed: int, **kwargs) -> list[np.ndarray]:
    """ROWS samples per prompt, the prompts' rows interleaved in one call."""
    return sample_counts(gen, prompts, settings, seed, samples=ROWS, batch=ROWS * len(prompts), **kwargs)


SETTINGS = {
    "plain": {},
    "temperature": {"temperature": 0.6},
    "top_k": {"top_k": 3},
    "top_p": {"top_p": 0.8},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_joint_of_first_tokens_matches_target(pair, name):
    target, draft, tok = pair
    settings = SETTINGS[name]
    gen = SpeculativeGenerator(target, draft, tok)
    (counts,) = drawn(gen, [PROMPT_A], settings, seed=len(name))
    pv = chi_square_pvalue(counts, exact_joint(target, PROMPT_A, settings))
    assert pv > ALPHA, f"{name}: speculative samples differ from the target (p-value {pv:.3g})"


@pytest.mark.parametrize("profile", ["cheap", "dear"])
def test_auto_gamma_is_exact(pair, profile, scripted_auto):
    # γ chosen per step from acceptance, with early stops and plain steps: the joint must not move.
    target, draft, tok = pair
    gen = scripted_auto(SpeculativeGenerator(target, draft, tok), profile)
    settings = {"temperature": 0.8, "top_p": 0.9}
    histogram = [0] * 10
    (counts,) = drawn(gen, [PROMPT_A], settings, seed=7, gamma="auto", histogram=histogram)
    assert sum(1 for n in histogram if n) >= 2, f"auto chose a single γ: {histogram}"
    pv = chi_square_pvalue(counts, exact_joint(target, PROMPT_A, settings))
    assert pv > ALPHA, f"auto ({profile}): speculative samples differ from the target (p-value {pv:.3g})"


def test_float32_draws_where_a_device_has_no_float64_are_exact(pair, monkeypatch):
    # MPS has no float64: its uniforms and cumulative sums are float32 (sampling.draw_dtype); acceptance compares the
    # same float32 p and q as everywhere.
    monkeypatch.setattr(sampling, "draw_dtype", lambda device: torch.float32)
    target, draft, tok = pair
    settings = {"temperature": 0.8, "top_k": 5}
    (counts,) = drawn(SpeculativeGenerator(target, draft, tok), [PROMPT_A], settings, seed=11)
    pv = chi_square_pvalue(counts, exact_joint(target, PROMPT_A, settings))
    assert pv > ALPHA, f"float32 draws: speculative samples differ from the target (p-value {pv:.3g})"


def test_rows_with_different_prompts_do_not_influence_each_other(pair):
    target, draft, tok = pair
    gen = SpeculativeGenerator(target, draft, tok)
    counts = drawn(gen, [PROMPT_A, PROMPT_B], {"temperature": 0.8}, seed=99)
    for prompt, c in zip((PROMPT_A, PROMPT_B), counts):
        pv = chi_square_pvalue(c, exact_joint(target, prompt, {"temperature": 0.8}))
        assert pv > ALPHA, f"prompt {prompt}: p-value {pv:.3g}"


def test_negative_control_wrong_residual_is_detected(pair, monkeypatch):
    target, draft, tok = pair
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    gen = SpeculativeGenerator(target, draft, tok)
    (counts,) = drawn(gen, [PROMPT_A], {}, seed=5)
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT_A, {})) < ALPHA


def test_the_draft_really_disagrees_with_the_target(pair):
    # Otherwise the tests above could pass with any acceptance rule.
    target, draft, tok = pair
    out = SpeculativeGenerator(target, draft, tok).generate(
        [PROMPT_A] * 2000, max_new_tokens=NEW, gamma=2, do_sample=True, seed=0
    )
    assert 0.2 < out.stats.acceptance_rate < 0.9
