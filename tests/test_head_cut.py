"""A draft whose LM head is cut to frequent tokens (FR-Spec): q is 0 outside, and hfspec stays exact."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue
from test_distribution import NEW, PROMPT_A, exact_joint, pair, sample_counts  # noqa: F401 (pair is a fixture)
from test_greedy import prompts, reference

from hfspec import SpeculativeGenerator
from hfspec.cpu import fast
from hfspec.decoding import sampling
from hfspec.models import head_cut


def cut_copy(model, ids):
    draft = copy.deepcopy(model)
    report = head_cut.cut_head(draft, ids)
    return draft, report


def test_kept_logits_are_the_heads_own_and_the_rest_have_no_probability(tiny_pair):
    _, draft, _ = tiny_pair("llama", vocab_size=32)
    ids = torch.tensor([3, 5, 8, 9, 20, 31])
    cut, report = cut_copy(draft, ids)
    assert (report.kept, report.vocab) == (6, 32) and report.bytes_saved == 26 * draft.config.hidden_size * 4
    x = torch.tensor([[4, 7, 9, 11]])
    with torch.no_grad():
        full, kept = draft(x).logits, cut(x).logits
    # torch's own linear over 6 rows of the head and over all 32 need not give the same bits (MKL picks its blocks
    # from the shape): equal up to rounding here; the kernel's exact bits are the next test's.
    torch.testing.assert_close(kept[..., ids], full[..., ids], rtol=1e-5, atol=1e-6)
    others = torch.ones(32, dtype=torch.bool)
    others[ids] = False
    assert (kept[..., others] == sampling.OUTSIDE).all()
    probs = torch.softmax(kept.float() / 0.3, dim=-1)
    assert (probs[..., others] == 0).all() and torch.isfinite(kept.sum())


def test_the_cut_head_runs_on_the_kernel_with_the_same_bits(tiny_pair, library):
    _, draft, _ = tiny_pair("llama", vocab_size=32)
    ids = torch.arange(0, 32, 2)
    cut, _ = cut_copy(draft, ids)
    x = torch.tensor([[4, 7, 9, 11]])
    with torch.no_grad():
        eager = cut(x).logits
        with fast.accelerated(cut) as report:
            assert any("lm_head" in name for name in report.layers)
            accelerated = cut(x).logits
        with fast.accelerated(draft):
            whole = draft(x).logits
    assert torch.equal(accelerated[..., ids], whole[..., ids])
    assert torch.allclose(eager, accelerated, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_with_a_cut_draft_equals_the_target(arch, tiny_pair):
    target, draft, tok = tiny_pair(arch, vocab_size=32)
    for draft_model in (draft, target):  # a cut copy of the target drafts its own argmax, when kept
        cut, _ = cut_copy(draft_model, torch.arange(0, 32, 3))
        gen = SpeculativeGenerator(target, cut, tok)
        for ids in prompts(32, 3, seed=4):
            want = reference(target, ids, 16, eos_token_id=None)
            for gamma in (1, 4):
                assert torch.equal(gen.generate(ids, max_new_tokens=16, gamma=gamma, eos_token_id=[]).sequences, want)


def test_sampling_with_a_cut_draft_follows_the_target(pair):
    target, draft, tok = pair
    cut, _ = cut_copy(draft, [0, 2, 3, 5, 7, 8])  # V = 9: a third of the tokens are never drafted
    gen = SpeculativeGenerator(target, cut, tok)
    (counts,) = sample_counts(gen, [PROMPT_A], {"temperature": 0.8}, seed=3)
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT_A, {"temperature": 0.8})) > ALPHA


def test_negative_control_a_draft_without_the_cut_in_q_is_detected(pair, monkeypatch):
    # If q were the uncut draft's while the tokens come from the cut one, the output would be wrong: the test sees it.
    target, draft, tok = pair
    cut, _ = cut_copy(draft, [0, 2, 3, 5, 7, 8])
    real_pick = sampling.sample

    def pick_within(probs, generator=None):
        kept = torch.zeros_like(probs)
        kept[..., [0, 2, 3, 5, 7, 8]] = probs[..., [0, 2, 3, 5, 7, 8]]
        return real_pick(kept / kept.sum(-1, keepdim=True), generator)

    gen = SpeculativeGenerator(target, draft, tok)  # the draft's full q ...
    monkeypatch.setattr(
        "hfspec.decoding.scoring.sampling.sample", pick_within
    )  # ... but drafts drawn only within the cut
    (counts,) = sample_counts(gen, [PROMPT_A], {"temperature": 0.8}, seed=3)
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT_A, {"temperature": 0.8})) < ALPHA


def test_frequent_ids_takes_the_most_counted_and_the_ones_asked_for():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert head_cut.frequent_ids(counts, 3).tolist() == [2, 3, 5]
    assert head_cut.frequent_ids(counts, 2, always=[1]).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="at least one"):
        head_cut.frequent_ids(counts, 0)


def test_count_tokens_counts_what_the_tokenizer_makes(tmp_path):
    tok = tiny.make_tokenizer(40)
    counts = head_cut.count_tokens(tok, [f"{tiny.word(7)} {tiny.word(9)} {tiny.word(7)}", tiny.word(9)], vocab=40)
    assert counts.sum() == 4 and int(counts.argmax()) in (7, 9) and np.count_nonzero(counts.numpy()) == 2


def test_a_head_that_is_not_a_plain_linear_is_refused(tiny_pair):
    _, draft, _ = tiny_pair("llama", vocab_size=32)
    cut, _ = cut_copy(draft, [1, 2])
    with pytest.raises(ValueError, match="already cut"):
        head_cut.cut_head(cut, [1])


def test_a_gguf_head_is_cut_in_its_blocks_with_the_same_bits(tmp_path, library):
    import gguf_files

    from hfspec.cpu import quant
    from hfspec.models import gguf_native

    path = gguf_files.write(tmp_path, "llama", {"*": "Q8_0", "token_embd": "Q4_1"}, tied=True)
    whole = gguf_native.load(str(path.parent), path.name, "draft")
    cut = gguf_native.load(str(path.parent), path.name, "draft")
    fast.accelerate(whole)
    ids = head_cut.first_ids(64, 20, always=[63])
    report = head_cut.cut_head(cut, ids)
    fast.accelerate(cut)
    assert isinstance(cut.get_output_embeddings().kept, quant.QuantLinear) and report.kept == 21
    assert report.bytes_saved == 43 * quant.FORMATS["Q4_1"].row_bytes(whole.config.hidden_size)
    x = torch.tensor([[4, 7, 9, 11]])
    with torch.no_grad():
        assert torch.equal(cut(x).logits[..., ids], whole(x).logits[..., ids])


def test_load_pair_cuts_the_drafts_head_when_asked_and_stays_exact(model_dir):
    from hfspec.drafters.loading import load_pair
    from hfspec.errors import HfspecError

    target, draft, tok = load_pair(model_dir("llama"), model_dir("llama", seed=1), draft_vocab=20)
    head = draft.get_output_embeddings()
    assert isinstance(head, head_cut.FrequentHead) and 20 <= head.ids.numel() < 30
    assert tok.eos_token_id in head.ids.tolist()
    _, whole, _ = load_pair(model_dir("llama"), model_dir("llama", seed=1))  # by default the whole head
    assert not isinstance(whole.get_output_embeddings(), head_cut.FrequentHead)
    gen = SpeculativeGenerator(target, draft, tok)
    for ids in prompts(target.config.vocab_size, 2, seed=5):
        want = reference(target, ids, 16, eos_token_id=None)
        assert torch.equal(gen.generate(ids, max_new_tokens=16, gamma=3, eos_token_id=[]).sequences, want)
    with pytest.raises(HfspecError, match="draft_vocab must be a number of tokens >= 1 or None"):
        load_pair(model_dir("llama"), model_dir("llama", seed=1), draft_vocab=0)
