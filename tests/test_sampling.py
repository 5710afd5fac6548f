"""The acceptance math alone, on hand-made distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stat_utils import ALPHA, chi_square_pvalue

from hfspec import tree
from hfspec.decoding import sampling
from hfspec.settings import SamplingParams

V, GAMMA, N = 6, 3, 200_000


def fixed_pq():
    """Target and draft distributions per position that differ a lot (so bugs show)."""
    p = torch.tensor(
        [
            [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
            [0.05, 0.05, 0.30, 0.30, 0.20, 0.10],
            [0.50, 0.00, 0.20, 0.10, 0.10, 0.10],
            [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],
        ]
    )
    q = torch.tensor(
        [
            [0.10, 0.40, 0.30, 0.05, 0.05, 0.10],
            [0.30, 0.05, 0.05, 0.40, 0.10, 0.10],
            [0.20, 0.30, 0.20, 0.10, 0.10, 0.10],
        ]
    )
    return p, q


def draw(p, q, seed, q_used=None):
    """N vectorised rounds: drafts drawn from q, verified against p (and ``q_used`` if given)."""
    g = torch.Generator().manual_seed(seed)
    pb = p.expand(N, -1, -1)
    qb = q.expand(N, -1, -1)
    drafts = torch.stack([torch.multinomial(qb[:, i], 1, generator=g).squeeze(1) for i in range(GAMMA)], dim=1)
    n, nxt = sampling.verify(drafts, (q_used if q_used is not None else q).expand(N, -1, -1), pb, g)
    return drafts, n, nxt


def token_at(drafts, n, nxt, position):
    """The token emitted at ``position`` by rows that got that far: a draft if accepted, else the next token."""
    rows = n >= position
    d, nn, x = drafts[rows], n[rows], nxt[rows]
    col = min(position, GAMMA - 1)
    tok = torch.where(nn > position, d[:, col], x)
    return tok


def counts(tokens):
    return np.bincount(tokens.numpy(), minlength=V)


def positional_pvalues(drafts, n, nxt, p):
    """p-values of: emitted token at position i (given it was reached) ~ p[i], for i = 0..γ."""
    return [chi_square_pvalue(counts(token_at(drafts, n, nxt, i)), p[i].numpy()) for i in range(GAMMA + 1)]


def test_verify_is_exact_at_every_position():
    p, q = fixed_pq()
    drafts, n, nxt = draw(p, q, seed=0)
    for i, pv in enumerate(positional_pvalues(drafts, n, nxt, p)):
        assert pv > ALPHA, f"position {i}: emitted tokens are not distributed as p (p-value {pv:.3g})"
    # The acceptance rate of the first position is Σ min(p, q), as the derivation says.
    assert abs((n >= 1).float().mean().item() - torch.minimum(p[0], q[0]).sum().item()) < 0.01


def test_negative_control_resampling_from_p_is_rejected(monkeypatch):
    p, q = fixed_pq()
    monkeypatch.setattr(sampling, "residual", lambda p_, q_: p_)
    drafts, n, nxt = draw(p, q, seed=1)
    assert min(positional_pvalues(drafts, n, nxt, p)) < ALPHA


def test_negative_control_mismatched_q_is_rejected():
    # The classic bug: drafts drawn from one q, verified against another (e.g. before temperature).
    p, q = fixed_pq()
    wrong_q = torch.softmax(torch.log(q) * 0.5, dim=-1)
    drafts, n, nxt = draw(p, q, seed=2, q_used=wrong_q)
    assert min(positional_pvalues(drafts, n, nxt, p)) < ALPHA


def test_residual_is_max_p_minus_q_renormalised():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.5, 0.3]])
    assert torch.allclose(sampling.residual(p, q), torch.tensor([[1.0, 0.0, 0.0]]))


def test_residual_of_equal_distributions_falls_back_to_p():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    r = sampling.residual(p, p.clone())
    assert torch.equal(r, p)
    assert torch.isfinite(r).all()


def test_equal_distributions_accept_everything_and_bonus_comes_from_last_p():
    p, _ = fixed_pq()
    q = p[:GAMMA]
    g = torch.Generator().manual_seed(3)
    m = 50_000
    drafts = torch.stack([torch.multinomial(q[i].expand(m, -1), 1, generator=g).squeeze(1) for i in range(GAMMA)], 1)
    n, nxt = sampling.verify(drafts, q.expand(m, -1, -1), p.expand(m, -1, -1), g)
    assert bool((n == GAMMA).all())
    assert chi_square_pvalue(counts(nxt), p[GAMMA].numpy()) > ALPHA


def test_zero_probability_draft_under_target_is_always_rejected():
    # 100 000 draws of u, none of which may keep a token the target never emits.
    rows = 100_000
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]]).expand(rows, -1, -1)
    q = torch.tensor([[[1.0, 0.0]]]).expand(rows, -1, -1)
    n, nxt = sampling.verify(torch.zeros(rows, 1, dtype=torch.long), q, p, torch.Generator().manual_seed(0))
    assert bool((n == 0).all()) and bool((nxt == 1).all())


def zero_uniforms(monkeypatch):
    """torch.rand returns exactly 0 from here on: the draw that a ``u * q <= p`` rule would accept at p = 0."""
    rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.zeros_like(rand(*shape, **kwargs)))


def test_a_uniform_of_exactly_zero_keeps_no_token_of_probability_zero(monkeypatch):
    zero_uniforms(monkeypatch)
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    n, nxt = sampling.verify(torch.tensor([[0]]), torch.tensor([[[1.0, 0.0]]]), p)
    assert n.item() == 0 and nxt.item() == 1
    tiny = torch.tensor([[[1e-30, 1.0], [0.5, 0.5]]])
    n, _ = sampling.verify(torch.tensor([[0]]), torch.tensor([[[1.0, 0.0]]]), tiny)
    assert n.item() == 1  # any p(x) > 0 is kept at u = 0
    # The tree's walk: a root with one child whose token the target gives 0.
    proposal = tree.Proposal(torch.tensor([[0]]), torch.tensor([[[1.0, 0.0]]]), torch.tensor([[-1]]))
    path, accepted, nxt = tree.verify(proposal, p)
    assert accepted.item() == 0 and nxt.item() == 1


def test_verify_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="verify expects"):
        sampling.verify(torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 3, 4), torch.rand(1, 3, 4))


def test_verify_uses_only_the_given_generator():
    p, q = fixed_pq()
    a = draw(p, q, seed=7)
    torch.manual_seed(123)  # global RNG state must not matter
    b = draw(p, q, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_first_rejection_counts_leading_trues():
    acc = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert sampling.first_rejection(acc).tolist() == [2, 0, 4]


def test_verify_greedy_accepts_while_equal_to_argmax():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    argmax = torch.tensor([[5, 6, 9, 4], [5, 6, 7, 8], [0, 2, 3, 4]])
    n, nxt = sampling.verify_greedy(drafts, argmax)
    assert n.tolist() == [2, 3, 0]
    assert nxt.tolist() == [9, 8, 0]


def test_a_generation_config_becomes_one_setting_with_processors_in_transformers_order():
    from transformers import GenerationConfig

    from hfspec.decoding import config as cfg

    conf = GenerationConfig(do_sample=True, temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=1.3)
    params = cfg.params(conf, max_new_tokens=4)
    assert [type(x).__name__ for x in params.processors()] == ["RepetitionPenaltyLogitsProcessor"]
    assert params.warpers() == sampling.Warpers(temperature=0.5, top_k=3, top_p=0.9)
    conf.do_sample = False
    greedy = cfg.params(conf, max_new_tokens=4)
    assert greedy.greedy and greedy.warpers() is None and len(greedy.processors()) == 1


def test_ragged_rows_see_only_their_own_prefix():
    procs = SamplingParams(repetition_penalty=2.0).processors()
    logits = torch.ones(2, 5)
    out = sampling.process(procs, logits, [torch.tensor([1, 2]), torch.tensor([3])])
    assert out[0].tolist() == [1.0, 0.5, 0.5, 1.0, 1.0]
    assert out[1].tolist() == [1.0, 1.0, 1.0, 0.5, 1.0]


def test_predicted_speedup_and_best_gamma():
    from hfspec.policy import best_gamma, predicted_speedup

    # α = 0.8, γ = 3, c = 0.1: (1 - 0.8^4) / (0.2 * 1.3) = 0.5904 / 0.26
    assert predicted_speedup(0.8, 3, 0.1) == pytest.approx(0.5904 / 0.26)
    assert predicted_speedup(0.8, 3, 0.1, verify_cost=2.0) == pytest.approx(0.5904 / (0.2 * 2.3))
    assert predicted_speedup(1.0, 4, 0.0) == 5.0
    g, s = best_gamma(0.8, 0.1)
    assert s == max(predicted_speedup(0.8, k, 0.1) for k in range(1, 9)) and 1 <= g <= 8
    # A costly verification on CPUs favours fewer drafts than the paper's v = 1.
    assert best_gamma(0.6, 0.1, {k: 1.0 + 0.25 * k for k in range(1, 9)})[0] <= best_gamma(0.6, 0.1)[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sample_draws_each_token_at_its_probability_and_never_a_zero(monkeypatch, dtype):
    # float32 is what MPS draws with (no float64 there): still the row's distribution, zeros never drawn.
    real = sampling.draw_dtype
    assert (real(torch.device("mps")), real(torch.device("cpu"))) == (torch.float32, torch.float64)
    monkeypatch.setattr(sampling, "draw_dtype", lambda device: dtype)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = sampling.sample(probs.expand(60_000, -1), g)
    counts = torch.bincount(draws, minlength=6)
    assert counts[probs == 0].sum() == 0
    assert chi_square_pvalue(counts[probs > 0].numpy(), probs[probs > 0].double().numpy()) > ALPHA
