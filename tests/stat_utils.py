"""A chi-square goodness-of-fit check shared by the statistical tests.

Significance: each check fails a correct sampler with probability ALPHA = 1e-8; the
suite runs fewer than 100 such checks, so a false failure of the whole suite is rarer
than 1 in a million runs (Bonferroni). The negative controls must reach p < ALPHA too.
"""
from __future__ import annotations

import numpy as np
from scipy import stats

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
