"""Batches: every row of a batched greedy run equals the target's greedy run of that prompt alone."""

from __future__ import annotations

import pytest
import tiny
import torch

from hfspec import SpeculativeGenerator, tree
from hfspec.decoding.loop import Verdict
from hfspec.decoding.rows import Rows
from hfspec.drafters import Proposal

LENGTHS = (1, 3, 17, 6, 29, 2)


def batch_prompts(vocab_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def alone(target, prompt, max_new_tokens, eos):
    ids = torch.tensor([prompt])
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos
    )
    return out[0, len(prompt) :].tolist()


def early_eos(target, prompts):
    """An EOS id that makes at least one row stop early: a token from the middle of row 2's output."""
    return alone(target, prompts[2], 8, None)[5]


def rows_of(out):
    """Each row's new tokens, without the padding after an early stop."""
    return [
        out.sequences[b, out.prompt_length : out.prompt_length + r.committed].tolist()
        for b, r in enumerate(out.stats.rows)
    ]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_batched_greedy_rows_equal_each_prompt_alone(arch, tiny_pair):
    target, draft, tok = tiny_pair(arch, vocab_size=16)
    prompts = batch_prompts(16, seed=1)
    eos = early_eos(target, prompts)
    want = [alone(target, p, 30, eos) for p in prompts]
    assert any(len(w) < 30 for w in want), "no row stops early; the test would not cover it"
    gen = SpeculativeGenerator(target, draft, tok)
    for d in (draft, target):
        out = SpeculativeGenerator(target, d, tok).generate(prompts, max_new_tokens=30, gamma=3, eos_token_id=eos)
        assert rows_of(out) == want
    # The same batch given as a left-padded tensor with its attention mask.
    width = max(LENGTHS)
    ids = torch.tensor([[tiny.PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = gen.generate(ids, mask, max_new_tokens=30, gamma=2, eos_token_id=eos)
    assert rows_of(out) == want
    assert torch.equal(out.sequences[:, :width], ids)


@pytest.mark.parametrize("profile", ["cheap", "dear"])
def test_batched_auto_rows_equal_each_prompt_alone(profile, tiny_pair, scripted_auto):
    target, draft, tok = tiny_pair("llama", vocab_size=16)
    prompts = batch_prompts(16, seed=1)
    eos = early_eos(target, prompts)
    want = [alone(target, p, 30, eos) for p in prompts]
    gen = scripted_auto(SpeculativeGenerator(target, draft, tok), profile)
    out = gen.generate(prompts, max_new_tokens=30, gamma="auto", eos_token_id=eos)
    assert rows_of(out) == want
    assert sum(out.stats.gamma_histogram) == out.stats.target_passes


def test_finished_rows_are_padded_and_reasons_reported(tiny_pair):
    target, draft, tok = tiny_pair("llama", vocab_size=16)
    prompts = batch_prompts(16, seed=1)
    eos = early_eos(target, prompts)
    out = SpeculativeGenerator(target, draft, tok).generate(prompts, max_new_tokens=30, gamma=3, eos_token_id=eos)
    assert {r.stop_reason for r in out.stats.rows} == {"eos", "length"}
    for b, r in enumerate(out.stats.rows):
        new = out.sequences[b, out.prompt_length :]
        assert (new[r.committed :] == tiny.PAD).all()
        assert r.stop_reason == ("eos" if new[r.committed - 1] == eos else "length")
        assert r.committed == 30 or r.stop_reason == "eos"
    assert sum(r.committed for r in out.stats.rows) == out.stats.committed


def test_rows_leave_the_batch_when_they_finish(tiny_pair, monkeypatch):
    from hfspec.decoding.loop import Call

    sizes = []
    original = Call.verify

    def verify(self, proposal):
        sizes.append(proposal.tokens.shape[0])
        return original(self, proposal)

    monkeypatch.setattr(Call, "verify", verify)
    target, draft, tok = tiny_pair("llama", vocab_size=16)
    prompts = batch_prompts(16, seed=1)
    out = SpeculativeGenerator(target, draft, tok).generate(
        prompts, max_new_tokens=30, gamma=3, eos_token_id=early_eos(target, prompts)
    )
    assert sizes[0] == len(prompts)
    assert sizes[-1] < len(prompts)
    assert sizes == sorted(sizes, reverse=True)
    assert any(r.stop_reason == "eos" for r in out.stats.rows)


def test_batched_sampling_is_reproducible_and_rows_differ(tiny_pair):
    target, draft, tok = tiny_pair("llama", vocab_size=32)
    gen = SpeculativeGenerator(target, draft, tok)
    prompts = [[7, 8, 9]] * 4
    # A fixed γ: with gamma="auto" the steps depend on timings, and so does which random number meets which token.
    a = gen.generate(prompts, max_new_tokens=12, gamma=3, do_sample=True, seed=3, eos_token_id=[])
    b = gen.generate(prompts, max_new_tokens=12, gamma=3, do_sample=True, seed=3, eos_token_id=[])
    assert torch.equal(a.sequences, b.sequences)
    assert len({tuple(r) for r in a.sequences.tolist()}) > 1


def test_a_verdict_commits_the_kept_drafts_then_the_next_token():
    proposal, accepted = Proposal(torch.tensor([[3, 4, 5], [6, 7, 8]])), torch.tensor([1, 3])
    path = tree.chain_path(accepted, 3)
    verdict = Verdict(proposal, accepted, torch.tensor([9, 10]), start=0, fed=torch.zeros(2, 4), path=path)
    block = verdict.tokens()
    assert block[0, :2].tolist() == [3, 9] and block[1].tolist() == [6, 7, 8, 10]


def test_rows_commit_up_to_the_budget_and_the_first_eos():
    ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    rows = Rows(ids, mask, max_new_tokens=3, window=None, eos=[2])
    committed, has_eos = rows.commit(torch.tensor([[10, 11, 12, 2], [2, 14, 2, 15]]), torch.tensor([4, 3]))
    assert committed.tolist() == [3, 1] and has_eos.tolist() == [False, True]  # row 0's EOS lies past its budget
    assert rows.tokens[0, :5].tolist() == [5, 6, 10, 11, 12] and rows.tokens[1, :4].tolist() == [7, 8, 9, 2]
    assert rows.exhausted().tolist() == [True, False]
    done = rows.finish(torch.tensor([True, True]), has_eos)
    assert [(b, t.tolist()) for b, t in done] == [(0, [10, 11, 12]), (1, [2])]
    assert rows.outputs[0][1] == "length" and rows.outputs[1][1] == "eos"
