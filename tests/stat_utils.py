"""A chi-square goodness-of-fit check and the end-to-end sampling helpers shared by the statistical tests.

Significance: each check fails a correct sampler with probability ALPHA = 1e-8; the
suite runs fewer than 100 such checks, so a false failure of the whole suite is rarer
than 1 in a million runs (Bonferroni). The negative controls must reach p < ALPHA too.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

ALPHA = 1e-8
MIN_EXPECTED = 5.0


def chi_square_pvalue(counts, probs) -> float:
    """p-value of observed ``counts`` against exact ``probs`` (same shape, any order).

    Cells with expected count below 5 are pooled into one, as the test requires.
    Observed mass in a cell of probability 0 is an immediate failure (p = 0).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs * n
    big = expected >= MIN_EXPECTED
    obs = list(counts[big])
    exp = list(expected[big])
    if expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def warpers(settings: dict) -> LogitsProcessorList:
    """transformers' own processors for ``settings``, in generate()'s order: the penalties and bad words, then the
    warpers (temperature, top_k, top_p, min_p)."""
    out = LogitsProcessorList()
    if "repetition_penalty" in settings:
        out.append(RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    if "no_repeat_ngram_size" in settings:
        out.append(NoRepeatNGramLogitsProcessor(settings["no_repeat_ngram_size"]))
    if "bad_words_ids" in settings:
        out.append(NoBadWordsLogitsProcessor(settings["bad_words_ids"], None))
    if "temperature" in settings:
        out.append(TemperatureLogitsWarper(settings["temperature"]))
    if "top_k" in settings:
        out.append(TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        out.append(TopPLogitsWarper(settings["top_p"]))
    if "min_p" in settings:
        out.append(MinPLogitsWarper(settings["min_p"]))
    return out


@torch.no_grad()
def exact_joint(target, prompt: list[int], settings: dict, vocab: int, new: int) -> np.ndarray:
    """P(x1, ..., x_new) under the target alone, by enumerating all vocab^new continuations."""
    procs = warpers(settings)
    joint = np.ones([vocab] * new)
    for depth in range(new):
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        ids = torch.tensor([prompt + list(pre) for pre in prefixes])
        logits = target(ids).logits[:, -1, :vocab].float()
        probs = torch.softmax(procs(ids, logits), dim=-1).numpy()  # (vocab^depth, vocab)
        shape = [vocab] * depth + [vocab] + [1] * (new - depth - 1)
        joint = joint * probs.reshape(shape)
    return joint


def sample_counts(
    gen,
    prompts: list[list[int]],
    settings: dict,
    seed: int,
    *,
    vocab: int,
    new: int,
    samples: int,
    batch: int,
    gamma: int | str = 2,
    histogram: list[int] | None = None,
) -> list[np.ndarray]:
    """Counts of the first ``new`` tokens per prompt, drawing ``samples`` per prompt in batches of interleaved rows
    (and the steps by γ, added to ``histogram`` when given)."""
    counts = [np.zeros([vocab] * new) for _ in prompts]
    g = torch.Generator().manual_seed(seed)
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    for _ in range(samples * len(prompts) // batch):
        out = gen.generate(rows, max_new_tokens=new, gamma=gamma, do_sample=True, generator=g, **settings)
        drawn = out.sequences[:, -new:].numpy()
        for k, n in enumerate(out.stats.gamma_histogram if histogram is not None else ()):
            histogram[k] += n
        for i in range(len(prompts)):
            np.add.at(counts[i], tuple(drawn[i :: len(prompts)].T), 1)
    return counts


def joint_pvalues(
    gen, prompts: list[list[int]], settings: dict, seed: int, *, vocab: int, new: int, samples: int
) -> list[float]:
    """Per prompt, the p-value of ``samples`` rows' first ``new`` tokens against the exact joint of ``gen.target``,
    the prompts' rows interleaved in one batch."""
    counts = sample_counts(
        gen, prompts, settings, seed, vocab=vocab, new=new, samples=samples, batch=samples * len(prompts)
    )
    return [chi_square_pvalue(c, exact_joint(gen.target, p, settings, vocab, new)) for p, c in zip(prompts, counts)]
