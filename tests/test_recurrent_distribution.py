"""Sampling with a recurrent target (and draft) is distributed exactly as the target's own sampling.

As in test_distribution: the exact joint of the first three tokens under the target alone is
enumerated and compared with samples by a chi-square test. Here the target and the draft are
Mamba-2 models, whose state is restored and replayed after every rejection; rows run one at a
time, so each sample is its own generate call and the sample count is smaller (the negative
control, a state restored but not replayed, is still far outside). Three tokens at γ = 2 put
steps that follow a rollback (keeping one or two columns) inside the joint.
"""

from __future__ import annotations

import numpy as np
import pytest
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue
from test_distribution import NEW, PROMPT_A, V, exact_joint

from hfspec import SpeculativeGenerator
from hfspec.models.recurrent import RecurrentState

SAMPLES = 300  # the negative control reaches p < 1e-300 with 100 samples already (6 seeds tried)
ARCH = "mamba2"


@pytest.fixture(scope="module")
def pair(model_dir):
    common = dict(vocab_size=V, seed=10, sharpness=30.0, eos=None, hidden=16, layers=1)
    target, tok = tiny.load(model_dir(ARCH, **common))
    draft, _ = tiny.load(model_dir(ARCH, perturb=0.2, **common))
    return target, draft, tok


def sample_counts(gen: SpeculativeGenerator, seed: int, samples: int = SAMPLES) -> tuple[np.ndarray, list]:
    """Counts of the first NEW tokens of ``samples`` calls, and each call's stats."""
    counts, stats = np.zeros([V] * NEW), []
    g = torch.Generator().manual_seed(seed)
    for _ in range(samples):
        out = gen.generate([PROMPT_A], max_new_tokens=NEW, gamma=2, do_sample=True, generator=g)
        counts[tuple(out.sequences[0, -NEW:].tolist())] += 1
        stats.append(out.stats)
    return counts, stats


@pytest.fixture(scope="module")
def drawn(pair):
    """The samples the exactness test counts; the rollback test reads their steps."""
    target, draft, tok = pair
    return sample_counts(SpeculativeGenerator(target, draft, tok), seed=1)


def test_recurrent_joint_of_first_tokens_matches_target(pair, drawn):
    counts, _ = drawn
    pv = chi_square_pvalue(counts, exact_joint(pair[0], PROMPT_A, {}))
    assert pv > ALPHA, f"{ARCH}: speculative samples differ from the target (p-value {pv:.3g})"


def test_negative_control_a_state_left_unreplayed_is_detected(pair, monkeypatch):
    # Restored but not advanced by the kept tokens: the steps after a rollback read a wrong state.
    target, draft, tok = pair
    monkeypatch.setattr(RecurrentState, "_replay_mixers", lambda self, keep: None)
    counts, _ = sample_counts(SpeculativeGenerator(target, draft, tok), seed=5, samples=100)
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT_A, {})) < ALPHA


def test_rollbacks_happen_after_partial_acceptance(drawn):
    # Otherwise the test above could pass without ever replaying a kept draft: its own samples' steps.
    _, stats = drawn
    accepted = [s.accepted_by_position for s in stats]
    assert 0.2 < sum(s.accepted for s in stats) / sum(s.drafted for s in stats) < 0.9
    assert any(a[:1] == (1,) and a[1:2] == (0,) for a in accepted), "no step kept exactly one of two drafts"
