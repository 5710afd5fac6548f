"""End to end with sampling: the penalties, bad words and min-p leave speculative samples distributed as the target's.

As tests/test_distribution.py does for temperature, top-k and top-p: the exact joint of the first three tokens
under the target alone, processed by transformers' own processors (stat_utils.warpers) with each position seeing
the prompt and the tokens before it, against samples drawn through SpeculativeGenerator in one batch of many rows.
Each setting has a negative control that must fail: for the processors that read the text so far, verification
positions that see the text before the step only (the drafts before them left out); for min-p, the setting
dropped from hfspec's processing.
"""

from __future__ import annotations

import dataclasses

import pytest
import stat_utils
import torch
from stat_utils import ALPHA, chi_square_pvalue
from test_distribution import NEW, PROMPT_A, V, exact_joint, pair  # noqa: F401 - pair is a fixture

from hfspec import SpeculativeGenerator
from hfspec.decoding import sampling, scoring
from hfspec.settings import SamplingParams

SETTINGS = {
    "repetition_penalty": {"repetition_penalty": 1.8},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
    # One token always, and the likeliest second tokens after the likeliest first ones (2, 6 after PROMPT_A).
    "bad_words_ids": {"bad_words_ids": [[3], [2, 6], [6, 2]]},
    "min_p": {"min_p": 0.15, "temperature": 0.8},
}


# Rows per setting (the tests ask for p < ALPHA = 1e-8 of every negative control). The repetition penalty's control
# only shifts probabilities: 3000 rows put it at 1e-25 to 1e-40 over 5 seeds (1000: 1e-4). The others' controls draw
# tokens the target never does (p = 0) in each of 5 seeds at 1000 rows already.
SAMPLES = {"repetition_penalty": 3_000, "no_repeat_ngram_size": 1_000, "bad_words_ids": 1_000, "min_p": 1_000}


def pvalue(pair, name: str, seed: int) -> float:  # noqa: F811
    target, draft, tok = pair
    (counts,) = stat_utils.sample_counts(
        SpeculativeGenerator(target, draft, tok),
        [PROMPT_A],
        SETTINGS[name],
        seed,
        vocab=V,
        new=NEW,
        samples=SAMPLES[name],
        batch=SAMPLES[name],
    )
    return chi_square_pvalue(counts, exact_joint(target, PROMPT_A, SETTINGS[name]))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_joint_of_first_tokens_matches_the_target_with(pair, name):  # noqa: F811
    pv = pvalue(pair, name, seed=11)
    assert pv > ALPHA, f"{name}: speculative samples differ from the target (p-value {pv:.3g})"


def stale_context(self, logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, extra: int) -> torch.Tensor:
    """Scoring.process with a bug: every position reads the text before the first of them."""
    if not self.head:
        return logits
    return torch.stack(
        [
            sampling.process(self.head, logits[:, i], scoring.prefixes(tokens, lengths + extra))
            for i in range(logits.shape[1])
        ],
        dim=1,
    )


@pytest.mark.parametrize("name", ["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids"])
def test_negative_control_positions_that_miss_the_drafts_before_them_are_detected(
    pair,
    name,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setattr(scoring.Scoring, "process", stale_context)
    pv = pvalue(pair, name, seed=12)
    assert pv < ALPHA, f"{name}: a stale context went unnoticed (p-value {pv:.3g})"


def test_negative_control_min_p_dropped_is_detected(pair, monkeypatch):  # noqa: F811
    warpers = SamplingParams.warpers

    def without_min_p(self):
        found = warpers(self)
        return found if found is None else dataclasses.replace(found, min_p=None)

    monkeypatch.setattr(SamplingParams, "warpers", without_min_p)
    pv = pvalue(pair, "min_p", seed=13)
    assert pv < ALPHA, f"min_p dropped went unnoticed (p-value {pv:.3g})"
