"""End to end: the first tokens of speculative sampling are distributed exactly as the target's.

The exact joint distribution of the first three tokens under the target alone is
enumerated (V^3 sequences, forward passes without caches, processed with
transformers' own warpers), then many samples are drawn through
SpeculativeGenerator and compared with a chi-square test (see stat_utils for
the significance level). Each generate call is a batch of many rows of the same
prompt(s): rows advance at different speeds, so the batch path is tested too.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hfspec import SpeculativeGenerator, sampling

V, NEW, SAMPLES, BATCH = 9, 3, 24_000, 6_000
PROMPT_A = [7, 8, 7, 7]
PROMPT_B = [8]


@pytest.fixture(scope="module")
def pair(model_dir):
    common = dict(vocab_size=V, seed=10, sharpness=30.0, eos=None, hidden=16, layers=1)
    target, tok = tiny.load(model_dir("llama", **common))
    # The draft resembles the target (as a real one does): some drafts accepted, some not.
    draft, _ = tiny.load(model_dir("llama", perturb=0.5, **common))
    return target, draft, tok


def warpers(settings: dict) -> LogitsProcessorList:
    out = LogitsProcessorList()
    if "temperature" in settings:
        out.append(TemperatureLogitsWarper(settings["temperature"]))
    if "top_k" in settings:
        out.append(TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        out.append(TopPLogitsWarper(settings["top_p"]))
    return out


@torch.no_grad()
def exact_joint(target, prompt: list[int], settings: dict) -> np.ndarray:
    """P(x1, x2, x3) under the target alone, by enumeration."""
    procs = warpers(settings)
    joint = np.ones([V] * NEW)
    for depth in range(NEW):
        prefixes = list(itertools.product(range(V), repeat=depth))
        ids = torch.tensor([prompt + list(pre) for pre in prefixes])
        logits = target(ids).logits[:, -1].float()
        probs = torch.softmax(procs(ids, logits), dim=-1).numpy()  # (V^depth, V)
        shape = [V] * depth + [V] + [1] * (NEW - depth - 1)
        joint = joint * probs.reshape(shape)
    return joint


def sample_counts(gen, prompts: list[list[int]], settings: dict, seed: int,
                  samples: int = SAMPLES) -> list[np.ndarray]:
    """Counts of (x1, x2, x3) per prompt, drawing ``samples`` per prompt in batches of interleaved rows."""
    counts = [np.zeros([V] * NEW) for _ in prompts]
    g = torch.Generator().manual_seed(seed)
    rows = [prompts[i % len(prompts)] for i in range(BATCH)]
    for _ in range(samples * len(prompts) // BATCH):
        out = gen.generate(rows, max_new_tokens=NEW, gamma=2, do_sample=True, generator=g, **settings)
        new = out.sequences[:, -NEW:].numpy()
        for i in range(len(prompts)):
            np.add.at(counts[i], tuple(new[i :: len(prompts)].T), 1)
    return counts


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
    (counts,) = sample_counts(gen, [PROMPT_A], settings, seed=len(name))
    pv = chi_square_pvalue(counts, exact_joint(target, PROMPT_A, settings))
    assert pv > ALPHA, f"{name}: speculative samples differ from the target (p-value {pv:.3g})"


def test_rows_with_different_prompts_do_not_influence_each_other(pair):
    target, draft, tok = pair
    gen = SpeculativeGenerator(target, draft, tok)
    counts = sample_counts(gen, [PROMPT_A, PROMPT_B], {"temperature": 0.8}, seed=99)
    for prompt, c in zip((PROMPT_A, PROMPT_B), counts):
        pv = chi_square_pvalue(c, exact_joint(target, prompt, {"temperature": 0.8}))
        assert pv > ALPHA, f"prompt {prompt}: p-value {pv:.3g}"


def test_negative_control_wrong_residual_is_detected(pair, monkeypatch):
    target, draft, tok = pair
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    gen = SpeculativeGenerator(target, draft, tok)
    (counts,) = sample_counts(gen, [PROMPT_A], {}, seed=5)
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT_A, {})) < ALPHA


def test_the_draft_really_disagrees_with_the_target(pair):
    # Otherwise the tests above could pass with any acceptance rule.
    target, draft, tok = pair
    out = SpeculativeGenerator(target, draft, tok).generate([PROMPT_A] * 2000, max_new_tokens=NEW, gamma=2,
                                                            do_sample=True, seed=0)
    assert 0.2 < out.stats.acceptance_rate < 0.9
