"""The fast warpers and sampler against transformers' own.

``warped_probs`` must give exactly (``torch.equal``) the probabilities of transformers'
warpers followed by a float32 softmax, in transformers' order; ``sample`` must draw
from the given distribution (chi-square, with a negative control) and repeat per seed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stat_utils import ALPHA, chi_square_pvalue, warpers
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hfspec.decoding import sampling
from hfspec.decoding.scoring import Scoring
from hfspec.settings import SamplingParams

INF = float("inf")

SETTINGS = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.7),
    "top_k": dict(top_k=5),
    "top_k_over_vocab": dict(top_k=100_000),
    "large_top_k": dict(top_k=2000, top_p=0.99),  # threshold from the value sort at V=49152
    "top_p": dict(top_p=0.9),
    "tiny_top_p": dict(top_p=1e-7),
    "top_p_zero": dict(top_p=0.0),
    "min_p": dict(min_p=0.1),
    "min_p_one": dict(min_p=1.0),
    "temperature_top_p": dict(temperature=0.7, top_p=0.95),
    "temperature_top_k_top_p": dict(temperature=0.8, top_k=40, top_p=0.9),
    "temperature_min_p": dict(temperature=0.7, min_p=0.02),
    "all": dict(temperature=1.3, top_k=50, top_p=0.8, min_p=0.05),
}
SHAPES = [(1, 7), (3, 100), (4, 1001), (2, 49152)]


def lm_like(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits with a few large values over a broad mass of small ones, like an LM's."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 2.0 + torch.empty(batch, vocab).exponential_(generator=g) * 2.0


def reference(settings: dict, logits: torch.Tensor) -> torch.Tensor:
    """transformers' warpers for ``settings`` (in generate()'s order), then the softmax generate() samples from."""
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return torch.softmax(warpers(settings)(ids, logits).float(), dim=-1)


def fast(settings: dict, logits: torch.Tensor) -> torch.Tensor:
    return sampling.warped_probs(logits, sampling.Warpers(**settings))


def assert_same(settings: dict, logits: torch.Tensor) -> torch.Tensor:
    want, got = reference(settings, logits), fast(settings, logits)
    assert torch.equal(got, want), (
        f"support differs in {int(((got > 0) != (want > 0)).sum())} tokens, "
        f"largest difference {float((got - want).abs().max()):.3g}"
    )
    return want


@pytest.fixture
def fallbacks(monkeypatch):
    """Counts the rows that go through transformers' TopPLogitsWarper."""
    rows = []
    call = TopPLogitsWarper.__call__
    monkeypatch.setattr(
        TopPLogitsWarper, "__call__", lambda self, ids, scores: rows.append(len(scores)) or call(self, ids, scores)
    )
    return rows


# -- equality with transformers ---------------------------------------------------------------


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_equal_to_transformers(name, shape):
    for seed, scale in enumerate((0.3, 1.0, 3.0)):
        assert_same(dict(**SETTINGS[name]), lm_like(*shape, seed) * scale)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_top_p_one_and_filtered_underflow(top_p):
    # SamplingParams drops top_p=1.0; the warper itself still removes tokens whose probability underflows to 0.
    logits = lm_like(3, 500, 0)
    logits[:, :50] = -200.0
    assert_same(dict(top_p=top_p), logits)


def test_tiny_top_p_keeps_one_token():
    probs = assert_same(dict(top_p=1e-7), lm_like(4, 1000, 1))
    assert (probs > 0).sum(dim=-1).tolist() == [1, 1, 1, 1]


def test_top_p_mass_exactly_on_the_boundary():
    logits = lm_like(1, 300, 2)
    cum = torch.sort(logits).values.softmax(dim=-1).cumsum(dim=-1)[0]
    for j in (100, 250, 295):
        top_p = 1.0 - float(cum[j])  # 1 - top_p is then exactly cum[j] in float32: position j is removed
        assert torch.tensor(1 - top_p, dtype=torch.float32) == cum[j]
        probs = assert_same(dict(top_p=top_p), logits)
        expected = 300 - int((cum <= cum[j]).sum())
        assert int((probs > 0).sum()) == expected
        for nudge in (-1e-9, 1e-9):  # either side of the boundary
            assert_same(dict(top_p=top_p + nudge), logits)


def test_ties_straddling_the_top_p_cut_keep_transformers_tokens(fallbacks):
    # Few distinct values: the cut falls inside a group of equal logits, and only the sort's
    # tie order says which of them transformers keeps; those rows go through its warper.
    logits = torch.randint(0, 5, (16, 200), generator=torch.Generator().manual_seed(4)).float()
    through_transformers = 0
    for top_p in (0.3, 0.6, 0.9):
        processors = dict(top_p=top_p)
        want = reference(processors, logits)
        fallbacks.clear()
        assert torch.equal(fast(processors, logits), want)
        through_transformers += sum(fallbacks)
    assert 0 < through_transformers < 3 * 16, "some rows, not all, should have a tie at the cut"


def test_bf16_valued_logits():
    # bfloat16 models give float32 logits with many exact ties.
    logits = lm_like(4, 49152, 5).bfloat16().float()
    for settings in (dict(temperature=0.7, top_p=0.95), dict(top_k=30, top_p=0.5), dict(min_p=0.05)):
        assert_same(dict(**settings), logits)


def test_bf16_scores():
    # The warpers then run in bfloat16, as transformers' would; the final softmax is float32.
    logits = lm_like(3, 777, 6).bfloat16()
    for settings in SETTINGS.values():
        assert_same(dict(**settings), logits)


def test_top_k_keeps_all_ties_at_the_kth_value():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.5, 2.0, -1.0]])
    probs = assert_same(dict(top_k=2), logits)
    assert (probs > 0).sum().item() == 5  # 3.0 and all four 2.0s
    assert_same(dict(top_k=2, top_p=0.5), logits)


def test_top_k_equal_to_vocab_keeps_every_token():
    logits = lm_like(2, 300, 12)
    assert_same(dict(top_k=300), logits)
    assert_same(dict(top_k=299, top_p=0.9), logits)


def test_rows_with_minus_inf():
    # What bad_words_ids / suppress_tokens leave: -inf entries, down to a single possible token.
    logits = lm_like(4, 1000, 7)
    logits[0, :400] = -INF
    logits[1, ::2] = -INF
    logits[2, :-1] = -INF
    logits[3, 10:] = -INF
    for settings in SETTINGS.values():
        assert_same(dict(**settings), logits)


def test_batched_rows_equal_rows_one_at_a_time():
    # The verify path warps all B·(γ+1) positions in one call; transformers saw one position at a time.
    logits = lm_like(10, 1001, 8)
    for settings in SETTINGS.values():
        processors = dict(**settings)
        one_by_one = torch.cat([reference(processors, row[None]) for row in logits])
        assert torch.equal(fast(processors, logits), one_by_one)


# -- from the settings: Scoring ---------------------------------------------------------------------


def test_settings_give_the_context_processors_then_the_warpers():
    params = SamplingParams(repetition_penalty=1.3, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)
    assert [type(p) for p in params.processors()] == [RepetitionPenaltyLogitsProcessor]
    assert params.warpers() == sampling.Warpers(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)
    greedy = SamplingParams(repetition_penalty=1.3, temperature=0)
    assert len(greedy.processors()) == 1 and greedy.warpers() is None
    assert SamplingParams().warpers() == sampling.Warpers()


class ShiftedTemperature(TemperatureLogitsWarper):
    def __call__(self, input_ids, scores):
        return super().__call__(input_ids, scores) + 1.0


@pytest.mark.parametrize(
    "own",
    [
        [TopPLogitsWarper(0.9), TemperatureLogitsWarper(0.7)],  # out of transformers' order
        [TopKLogitsWarper(5, filter_value=-1e4)],  # another filter value
        [MinPLogitsWarper(0.1, min_tokens_to_keep=3)],
        [TopPLogitsWarper(0.3, min_tokens_to_keep=7)],
        [ShiftedTemperature(0.7)],  # a subclass may compute something else
    ],
)
def test_the_callers_processors_run_as_transformers_runs_them(own):
    scoring = Scoring(SamplingParams(logits_processor=own))
    assert list(scoring.head) == own and scoring.warpers == sampling.Warpers()
    logits = lm_like(2, 300, 9)
    ids = torch.zeros(2, 1, dtype=torch.long)
    got = scoring.probs(logits[:, None], ids, torch.ones(2, dtype=torch.long), 0, "target", 1)[:, 0]
    assert torch.equal(got, torch.softmax(LogitsProcessorList(own)(ids, logits).float(), dim=-1))


def test_user_warper_before_the_sampling_warpers():
    scoring = Scoring(SamplingParams(temperature=0.7, top_p=0.9, logits_processor=[TopKLogitsWarper(3)]))
    assert len(scoring.head) == 1 and scoring.warpers == sampling.Warpers(temperature=0.7, top_p=0.9)


# -- through the loop: Scoring.probs --------------------------------------------------------------


@pytest.mark.parametrize("penalty", [None, 1.5])
@pytest.mark.parametrize("lengths", [[4, 4, 4], [3, 6, 4]])
def test_checked_equals_per_position_reference(penalty, lengths):
    vocab, k = 50, 4
    g = torch.Generator().manual_seed(10)
    tokens = torch.randint(0, vocab, (3, 12), generator=g)
    logits = torch.randn(3, k, vocab, generator=g) * 3
    settings = {"temperature": 0.7, "top_p": 0.9, **({"repetition_penalty": penalty} if penalty else {})}
    processors = warpers(settings)
    probs = Scoring(SamplingParams(**settings)).probs(logits, tokens, torch.tensor(lengths), 0, "target", 1)
    for b, length in enumerate(lengths):
        for i in range(k):
            ids = tokens[b : b + 1, : length + i]
            want = torch.softmax(processors(ids, logits[b, i][None]), dim=-1)[0]
            assert torch.equal(probs[b, i], want), (b, i)


# -- the sampler ------------------------------------------------------------------------------------


P = torch.tensor([0.30, 0.0, 0.12, 0.25, 0.0, 0.08, 0.2, 0.05, 0.0])
DRAWS = 100_000


def draws(probs: torch.Tensor, seed: int) -> torch.Tensor:
    return sampling.sample(probs.expand(DRAWS, -1), torch.Generator().manual_seed(seed))


def test_sample_draws_from_the_distribution():
    counts = np.bincount(draws(P, 0).numpy(), minlength=P.numel())
    assert chi_square_pvalue(counts, P.numpy()) > ALPHA
    assert counts[P.numpy() == 0].sum() == 0


def test_sample_draws_from_warped_probabilities():
    probs = fast(dict(temperature=0.7, top_p=0.95), lm_like(1, 300, 11) * 0.3)[0]
    assert (probs > 0).sum() > 20
    counts = np.bincount(draws(probs, 1).numpy(), minlength=probs.numel())
    assert chi_square_pvalue(counts, probs.double().numpy()) > ALPHA


def test_negative_control_shifted_uniform_is_rejected(monkeypatch):
    rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: rand(*a, **kw) ** 1.05)
    counts = np.bincount(draws(P, 2).numpy(), minlength=P.numel())
    assert chi_square_pvalue(counts, P.numpy()) < ALPHA


def test_sample_is_reproducible_per_seed():
    assert torch.equal(draws(P, 3)[:1000], draws(P, 3)[:1000])
    assert not torch.equal(draws(P, 3)[:1000], draws(P, 4)[:1000])


def test_sample_unnormalised_rows_and_single_token():
    rows = torch.tensor([[0.0, 0.0, 3.0], [2.0, 0.0, 2.0], [0.0, 5.0, 0.0]])
    tokens = sampling.sample(rows.repeat(1000, 1), torch.Generator().manual_seed(5)).view(1000, 3)
    assert set(tokens[:, 0].tolist()) == {2} and set(tokens[:, 1].tolist()) == {0, 2}
    assert set(tokens[:, 2].tolist()) == {1}


@pytest.mark.parametrize("row", [[0.0, 0.0], [float("nan"), 1.0]])
def test_sample_refuses_rows_without_mass(row):
    with pytest.raises(ValueError, match="positive probability"):
        sampling.sample(torch.tensor([row]))


@pytest.mark.parametrize(
    "bad", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=1.5), dict(top_p=0.0), dict(min_p=-0.1)]
)
def test_settings_refuse_what_transformers_refuses(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
