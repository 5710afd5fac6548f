"""Greedy speculative decoding equals the target's own greedy generate(), token for token."""

from __future__ import annotations

import pytest
import tiny
import torch

from hfspec import SpeculativeGenerator

ARCHS = ("llama", "gpt2", "qwen2", "gpt_neox", "mistral")
# One draft a step, several, and seven (γ = 2 took the same path as 4: drafts cut at some position, or all kept).
GAMMAS = (1, 4, 7)


def prompts(vocab_size: int, count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (count,), generator=g).tolist()
    return [torch.randint(tiny.BOS + 6, vocab_size, (1, n), generator=g) for n in lengths]


def reference(target, ids, max_new_tokens, **kw):
    return target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **kw
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_equals_target_greedy(arch, tiny_pair):
    target, draft, tok = tiny_pair(arch, vocab_size=32)
    # The unrelated draft on two prompts (most of its drafts rejected); the target as its own draft accepts
    # everything whatever the prompt, so one prompt covers its path at each γ.
    for draft_model, label, count in ((draft, "unrelated draft", 2), (target, "draft = target", 1)):
        gen = SpeculativeGenerator(target, draft_model, tok)
        for ids in prompts(32, 3, seed=ARCHS.index(arch))[:count]:
            want = reference(target, ids, 20)
            for gamma in GAMMAS:
                got = gen.generate(ids, max_new_tokens=20, gamma=gamma)
                assert torch.equal(got.sequences, want), f"{arch}, {label}, γ={gamma}"


@pytest.fixture(scope="module")
def auto_references(tiny_pair):
    """The four prompts the gamma="auto" tests run, each with the target's own 30 greedy tokens (made once)."""
    target, _, _ = tiny_pair("llama", vocab_size=32)
    return [(ids, reference(target, ids, 30, eos_token_id=None)) for ids in prompts(32, 4, seed=21)]


@pytest.mark.parametrize("profile", ["cheap", "dear"])
def test_auto_equals_target_greedy(profile, tiny_pair, scripted_auto, auto_references):
    # gamma="auto" drafts, stops early and falls back to plain steps; none of it may change a token.
    target, draft, tok = tiny_pair("llama", vocab_size=32)
    for draft_model in (draft, target):
        gen = scripted_auto(SpeculativeGenerator(target, draft_model, tok), profile)
        histogram = [0] * 10
        for ids, want in auto_references:
            got = gen.generate(ids, max_new_tokens=30, gamma="auto", eos_token_id=[])
            assert torch.equal(got.sequences, want), profile
            for g, n in enumerate(got.stats.gamma_histogram):
                histogram[g] += n
        assert sum(1 for n in histogram if n) >= 2, f"auto chose a single γ: {histogram}"


def test_draft_equal_to_target_accepts_everything(tiny_pair):
    target, _, tok = tiny_pair("llama", vocab_size=32)
    out = SpeculativeGenerator(target, target, tok).generate(
        prompts(32, 1)[0], max_new_tokens=20, gamma=4, eos_token_id=[]
    )
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.target_passes == 4  # 20 tokens, 5 per pass


def test_unrelated_draft_accepts_little_yet_output_is_exact(tiny_pair):
    target, draft, tok = tiny_pair("llama", vocab_size=32)
    ids = prompts(32, 1, seed=5)[0]
    out = SpeculativeGenerator(target, draft, tok).generate(ids, max_new_tokens=30, gamma=4, eos_token_id=[])
    assert out.stats.acceptance_rate < 0.5
    assert torch.equal(out.sequences, reference(target, ids, 30, eos_token_id=None))


def test_eos_inside_an_accepted_block_ends_the_sequence(tiny_pair):
    # With draft = target every block is fully accepted, so an EOS lands mid-block. Seven of these eight prompts
    # stop: at the first, a middle and the last of a block's eight tokens, in the first block and in the fourth.
    target, _, tok = tiny_pair("llama", vocab_size=16)
    gen = SpeculativeGenerator(target, target, tok)
    stopped = 0
    for ids in prompts(16, 12, seed=11)[:8]:
        want = reference(target, ids, 40)
        got = gen.generate(ids, max_new_tokens=40, gamma=7)
        assert torch.equal(got.sequences, want)
        new = got.sequences[0, ids.shape[1] :]
        if new.numel() < 40:
            stopped += 1
            assert new[-1].item() == tiny.EOS and (new[:-1] != tiny.EOS).all()
            assert got.stats.rows[0].stop_reason == "eos"
    assert stopped > 0, "no prompt produced an EOS; the test would prove nothing"


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 3])
def test_max_new_tokens_below_gamma_is_never_exceeded(tiny_pair, max_new_tokens):
    target, draft, tok = tiny_pair("gpt2", vocab_size=32)
    ids = prompts(32, 1, seed=3)[0]
    for d in (draft, target):
        out = SpeculativeGenerator(target, d, tok).generate(
            ids, max_new_tokens=max_new_tokens, gamma=7, eos_token_id=[]
        )
        assert out.sequences.shape[1] == ids.shape[1] + max_new_tokens
        if max_new_tokens:
            assert torch.equal(out.sequences, reference(target, ids, max_new_tokens, eos_token_id=None))


def test_padded_vocabularies_never_produce_ids_outside_the_tokenizer(model_dir):
    # Target and draft pad their embeddings differently for one 48-token tokenizer.
    target, tok = tiny.load(model_dir("llama", vocab_size=56, tokenizer_size=48, seed=0))
    draft, _ = tiny.load(model_dir("llama", vocab_size=64, tokenizer_size=48, seed=1))
    assert len(tok) == 48
    gen = SpeculativeGenerator(target, draft, tok)
    # Left to themselves, on the first of these two prompts the draft's greedy choices fall past the tokenizer seven
    # times, on the second the target's twice.
    for ids in prompts(48, 3, seed=2)[1:]:
        want = reference(target, ids, 20, suppress_tokens=list(range(48, 56)))
        got = gen.generate(ids, max_new_tokens=20, gamma=3)
        assert torch.equal(got.sequences, want)
        sampled = gen.generate(ids, max_new_tokens=20, gamma=3, do_sample=True, seed=0)
        assert int(sampled.sequences.max()) < 48


def test_repetition_penalty_matches_target_greedy(tiny_pair):
    target, draft, tok = tiny_pair("llama", vocab_size=32)
    ids = prompts(32, 1, seed=8)[0]
    got = SpeculativeGenerator(target, draft, tok).generate(ids, max_new_tokens=20, gamma=3, repetition_penalty=1.5)
    assert torch.equal(got.sequences, reference(target, ids, 20, repetition_penalty=1.5))


def test_temperature_zero_is_greedy(tiny_pair):
    target, draft, tok = tiny_pair("llama", vocab_size=32)
    ids = prompts(32, 1, seed=9)[0]
    got = SpeculativeGenerator(target, draft, tok).generate(ids, max_new_tokens=16, do_sample=True, temperature=0)
    assert torch.equal(got.sequences, reference(target, ids, 16))
