"""hfspec behind transformers' ``model.generate(..., custom_generate=...)``: the folder and the callable form.

In the spirit of transformers' own ``test_assisted_decoding_matches_greedy_search``: greedy output through the hook
equals ``model.generate()`` without it (several architectures, left-padded batches and single prompts, rows that
stop early), sampling follows the target's distribution (chi-square, with a negative control that must fail),
lookup and drafts with another tokenizer run, what hfspec cannot honour is refused by name, and one generator
serves later calls without keeping a model alive. Models are tiny, saved and loaded by path.
"""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import pytest
import stat_utils
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue
from test_cross_tokenizer import loaded
from test_cross_tokenizer import pair as cross_pair  # noqa: F401 (a fixture: a target, a draft with another tokenizer)
from test_distribution import PROMPT_A, V, chain_pair
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hfspec
from hfspec import HfspecError
from hfspec.assisted import SpeculativeOutput, reuse
from hfspec.decoding import sampling

HOOK = {"custom_generate": hfspec.CUSTOM_GENERATE, "trust_remote_code": True}
LENGTHS = (5, 1, 9, 3)


@pytest.fixture(autouse=True, scope="module")
def modules_cache(tmp_path_factory):
    """transformers copies custom_generate/generate.py into its cache of remote code; one cache per test process,
    so that two processes never copy the file over each other while one of them imports it."""
    from transformers import dynamic_module_utils

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf-modules")))
        yield


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[tiny.PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def batch(vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return left_padded([torch.randint(tiny.BOS + 6, vocab_size, (n,), generator=g).tolist() for n in LENGTHS])


def early_eos(target, ids, mask) -> int:
    """An EOS id that stops some rows before the others: a token from the middle of row 0's greedy output."""
    out = target.generate(ids[:1], attention_mask=mask[:1], do_sample=False, max_new_tokens=8, eos_token_id=None)
    return int(out[0, ids.shape[1] + 4])


def only_generator(target):
    (gen,) = reuse.generators(target).entries.values()
    return gen


def kinds(target) -> set[str]:
    """The kinds of drafter of the generators kept on ``target``."""
    return {gen.drafter.kind for gen in reuse.generators(target).entries.values()}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_greedy_equals_generate_without_the_hook(arch, tiny_pair):
    target, draft, _ = tiny_pair(arch, vocab_size=32)
    reuse.forget(target)
    ids, mask = batch(32, seed=("llama", "gpt2", "qwen2").index(arch))
    eos = early_eos(target, ids, mask)
    want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, eos_token_id=eos)
    finished = (want[:, ids.shape[1] :] == eos).any(dim=1)
    assert finished.any() and not finished.all(), "no row stops before the others; the test would not cover it"
    for assistant in (draft, target):
        got = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=assistant,
            do_sample=False,
            max_new_tokens=20,
            eos_token_id=eos,
            **HOOK,
        )
        assert torch.equal(got, want), arch
        for row in range(len(LENGTHS)):  # one prompt, without padding or a mask
            alone = ids[row : row + 1, ids.shape[1] - LENGTHS[row] :]
            want_alone = target.generate(alone, do_sample=False, max_new_tokens=20, eos_token_id=eos)
            got_alone = target.generate(
                alone, assistant_model=assistant, do_sample=False, max_new_tokens=20, eos_token_id=eos, **HOOK
            )
            assert torch.equal(got_alone, want_alone), (arch, row)
    assert kinds(target) == {"model"} and len(reuse.generators(target)) == 2  # one per draft


def test_the_callable_form_equals_generate(tiny_pair):
    target, draft, _ = tiny_pair("llama", vocab_size=32)
    ids, mask = batch(32, seed=5)
    want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    for decoding in (hfspec.custom_generate(draft), hfspec.custom_generate(draft, gamma=3), hfspec.custom_generate()):
        got = target.generate(ids, attention_mask=mask, custom_generate=decoding, do_sample=False, max_new_tokens=16)
        assert torch.equal(got, want)
    out = target.generate(
        ids,
        attention_mask=mask,
        custom_generate=hfspec.custom_generate(draft),
        max_new_tokens=16,
        do_sample=False,
        return_dict_in_generate=True,
        gamma=2,
    )
    assert torch.equal(out.sequences, want) and out.stats.gamma_histogram[2] > 0


def test_return_dict_in_generate_gives_sequences_and_stats(tiny_pair):
    target, draft, _ = tiny_pair("llama", vocab_size=32)
    ids, mask = batch(32, seed=6)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=12,
        return_dict_in_generate=True,
        **HOOK,
    )
    assert isinstance(out, GenerateDecoderOnlyOutput) and isinstance(out, SpeculativeOutput)
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12))
    assert len(out.stats.rows) == len(LENGTHS) and out.stats.target_passes > 0
    assert out.scores is None and out.cache is None


def test_prompt_lookup_num_tokens_runs_lookup(tiny_pair):
    target, draft, _ = tiny_pair("gpt2", vocab_size=32)
    reuse.forget(target)
    ids, mask = left_padded([[9, 10, 11, 12, 9, 10, 11, 12, 9, 10], [20, 21, 20, 21, 20]])
    want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=None)
    out = target.generate(
        ids,
        attention_mask=mask,
        prompt_lookup_num_tokens=3,
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=None,
        return_dict_in_generate=True,
        **HOOK,
    )
    assert torch.equal(out.sequences, want)
    assert only_generator(target).drafter.kind == "ngram"
    assert out.stats.drafted > 0 and max(g for g, n in enumerate(out.stats.gamma_histogram) if n) == 3
    # Beside a draft model, lookup is added to it: per row, whichever is expected to get more accepted.
    both = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        prompt_lookup_num_tokens=3,
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=None,
        **HOOK,
    )
    assert torch.equal(both, want)
    assert kinds(target) == {"ngram", "hybrid"}


def test_without_a_draft_it_drafts_by_lookup_under_auto(tiny_pair):
    target, _, _ = tiny_pair("qwen2", vocab_size=32)
    reuse.forget(target)
    ids, mask = batch(32, seed=7)
    want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    assert torch.equal(target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, **HOOK), want)
    gen = only_generator(target)
    assert gen.drafter.kind == "ngram" and gen.tuning.costs is not None  # gamma="auto" measured its costs


def test_a_draft_with_another_tokenizer(cross_pair):  # noqa: F811 (the fixture)
    # A target on a byte-level BPE and a draft resembling it on a SentencePiece-style BPE.
    (target, target_tok), (draft, draft_tok) = loaded(cross_pair["target"]), loaded(cross_pair["draft"])
    batch_ = target_tok(
        ["The quick brown fox jumps over", "A cat sat"], return_tensors="pt", padding=True, padding_side="left"
    )
    want = target.generate(**batch_, do_sample=False, max_new_tokens=16)
    out = target.generate(
        **batch_,
        assistant_model=draft,
        tokenizer=target_tok,
        assistant_tokenizer=draft_tok,
        do_sample=False,
        max_new_tokens=16,
        return_dict_in_generate=True,
        **HOOK,
    )
    assert torch.equal(out.sequences, want)
    assert only_generator(target).drafter.kind == "cross-tokenizer" and out.stats.accepted > 0
    with pytest.raises(HfspecError, match="tokenizer="):
        target.generate(**batch_, assistant_model=draft, assistant_tokenizer=draft_tok, max_new_tokens=4, **HOOK)


def test_sampling_follows_the_targets_distribution(model_dir, monkeypatch):
    target, draft, _ = chain_pair(model_dir)
    settings, samples = {"temperature": 0.8}, 6_000
    exact = stat_utils.exact_joint(target, PROMPT_A, settings, V, 3)

    def pvalue(seed: int) -> tuple[float, float]:
        ids = torch.tensor([PROMPT_A] * samples)
        out = target.generate(
            ids,
            assistant_model=draft,
            do_sample=True,
            max_new_tokens=3,
            gamma=2,
            generator=torch.Generator().manual_seed(seed),
            return_dict_in_generate=True,
            **settings,
            **HOOK,
        )
        counts = np.zeros([V] * 3)
        np.add.at(counts, tuple(out.sequences[:, -3:].numpy().T), 1)
        return chi_square_pvalue(counts, exact), out.stats.acceptance_rate

    pv, acceptance = pvalue(3)
    assert pv > ALPHA, f"samples through model.generate(custom_generate=...) differ from the target (p {pv:.3g})"
    assert 0.2 < acceptance < 0.9, "the draft agrees too much or too little for the test to mean something"
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)  # negative control: a wrong residual must be seen
    assert pvalue(4)[0] < ALPHA


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_lengths_and_repeats_follow_transformers(tiny_pair):
    target, draft, _ = tiny_pair("llama", vocab_size=32)
    ids = torch.tensor([[9, 10, 11]])
    plain, hooked = Recorder(), Recorder()
    want = target.generate(ids, do_sample=False, max_new_tokens=10, streamer=plain)
    got = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=10, streamer=hooked, **HOOK)
    assert torch.equal(got, want) and hooked.ended
    assert [t for c in hooked.chunks for t in c] == [t for c in plain.chunks for t in c] == want[0].tolist()
    # max_length counts the prompt; with neither length, transformers' default of 20 new tokens.
    for lengths in ({"max_length": 9}, {}):
        want = target.generate(ids, do_sample=False, eos_token_id=None, **lengths)
        got = target.generate(ids, assistant_model=draft, do_sample=False, eos_token_id=None, **lengths, **HOOK)
        assert torch.equal(got, want), lengths
    out = target.generate(
        ids, assistant_model=draft, do_sample=True, num_return_sequences=3, max_new_tokens=5, seed=0, **HOOK
    )
    assert out.shape == (3, 8) and torch.equal(out[:, :3], ids.repeat(3, 1))
    # A setting the call turns off reaches hfspec, though the model's own config has it on.
    beams = copy.deepcopy(target)
    beams.generation_config.num_beams = 4
    assert torch.equal(
        beams.generate(ids, num_beams=1, do_sample=False, max_new_tokens=6, **HOOK),
        target.generate(ids, do_sample=False, max_new_tokens=6),
    )


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class Identity(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


REFUSED = {
    "num_beams": ({"num_beams": 2}, "num_beams=2.*set num_beams=1"),
    "output_scores": ({"output_scores": True, "return_dict_in_generate": True}, "output_scores=True"),
    "stop_strings": ({"stop_strings": ["w9"]}, "stop_strings"),
    "min_new_tokens": ({"min_new_tokens": 3}, "min_new_tokens=3"),
    "typical_p": ({"typical_p": 0.5, "do_sample": True}, "typical_p=0.5"),
    "num_assistant_tokens_schedule": ({"num_assistant_tokens_schedule": "dynamic"}, "num_assistant_tokens_schedule"),
    "assistant_confidence_threshold": ({"assistant_confidence_threshold": 0.2}, "assistant_confidence_threshold"),
    "stopping_criteria": ({"stopping_criteria": StoppingCriteriaList([Never()])}, "stopping_criteria \\(Never\\)"),
    "prefix_allowed_tokens_fn": ({"prefix_allowed_tokens_fn": lambda b, ids: [3]}, "prefix_allowed_tokens_fn"),
    "model keyword": ({"token_type_ids": torch.zeros(1, 3, dtype=torch.long)}, "token_type_ids="),
    "cache": ({"cache": object()}, "cache cannot run"),  # (past_key_values, renamed cache in transformers 5)
    "assistant_tokenizer alone": ({"assistant_tokenizer": object()}, "assistant_model="),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_hfspec_cannot_honour_is_refused_by_name(name, tiny_pair):
    target, _, tok = tiny_pair("llama", vocab_size=32)
    arguments, message = REFUSED[name]
    with pytest.raises(HfspecError, match=message):
        target.generate(torch.tensor([[9, 10, 11]]), max_new_tokens=4, tokenizer=tok, **arguments, **HOOK)


def test_the_callable_form_refuses_what_it_cannot_rebuild(tiny_pair):
    target, draft, _ = tiny_pair("llama", vocab_size=32)
    ids = torch.tensor([[9, 10, 11]])
    with pytest.raises(HfspecError, match="num_beams=2"):
        target.generate(ids, num_beams=2, max_new_tokens=4, custom_generate=hfspec.custom_generate(draft))
    with pytest.raises(HfspecError, match="stopping criteria Never"):
        target.generate(
            ids,
            max_new_tokens=4,
            stopping_criteria=StoppingCriteriaList([Never()]),
            custom_generate=hfspec.custom_generate(draft),
        )
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])  # replaces the one the setting builds
    with pytest.raises(HfspecError, match="CUSTOM_GENERATE"):
        target.generate(
            ids,
            max_new_tokens=4,
            repetition_penalty=1.2,
            logits_processor=penalty,
            custom_generate=hfspec.custom_generate(draft),
        )
    with pytest.raises(HfspecError, match="RepetitionPenaltyLogitsProcessor"):
        target.generate(
            ids, max_new_tokens=4, repetition_penalty=1.2, logits_processor=penalty, assistant_model=draft, **HOOK
        )
    # The caller's own processors run, between the penalties and the warpers as in transformers.
    own = LogitsProcessorList([Identity()])
    want = target.generate(ids, max_new_tokens=6, do_sample=False, repetition_penalty=1.2, logits_processor=own)
    for hook in ({"custom_generate": hfspec.custom_generate(draft)}, {"assistant_model": draft, **HOOK}):
        got = target.generate(
            ids, max_new_tokens=6, do_sample=False, repetition_penalty=1.2, logits_processor=own, **hook
        )
        assert torch.equal(got, want)


def test_one_generator_serves_later_calls_and_keeps_no_model_alive(model_dir, tiny_pair):
    target, draft, _ = tiny_pair("gpt2", vocab_size=32)
    ids, mask = batch(32, seed=8)
    reuse.forget(target)
    for _ in range(2):
        target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=6, **HOOK)
    held = reuse.generators(target)
    assert len(held) == 1
    first = only_generator(target)
    target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=True, max_new_tokens=6, **HOOK)
    assert only_generator(target) is first  # other sampling settings, the same generator
    assert len(reuse.generators(copy.deepcopy(target))) == 0  # a copied model starts with none
    # A model that its user lets go is collected with its generators: nothing here keeps it alive.
    fresh, _ = tiny.load(model_dir("gpt2", vocab_size=32))
    fresh_draft, _ = tiny.load(model_dir("gpt2", vocab_size=32, seed=1))
    fresh.generate(ids, attention_mask=mask, assistant_model=fresh_draft, do_sample=False, max_new_tokens=4, **HOOK)
    refs = weakref.ref(fresh), weakref.ref(fresh_draft)
    del fresh, fresh_draft
    gc.collect()
    assert all(r() is None for r in refs)
    reuse.forget(target)
    assert len(reuse.generators(target)) == 0


def test_hfspec_settings_pass_through_and_a_generation_config_is_merged_as_transformers_merges_it(tiny_pair):
    target, draft, _ = tiny_pair("llama", vocab_size=32)
    ids, mask = batch(32, seed=9)
    config = GenerationConfig(max_new_tokens=10, do_sample=False)
    want = target.generate(ids, attention_mask=mask, generation_config=config)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        generation_config=config,
        gamma=4,
        tree=None,
        return_dict_in_generate=True,
        **HOOK,
    )
    assert torch.equal(out.sequences, want) and out.stats.gamma_histogram[4] > 0


def test_assistant_model_may_be_what_speculative_generator_takes_as_a_draft(model_dir, tiny_pair):
    target, _, _ = tiny_pair("llama", vocab_size=32)
    reuse.forget(target)
    ids, mask = batch(32, seed=10)
    want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    for assistant in (str(model_dir("llama", vocab_size=32, seed=1)), "ngram"):  # a draft's directory, lookup
        got = target.generate(
            ids, attention_mask=mask, assistant_model=assistant, do_sample=False, max_new_tokens=12, **HOOK
        )
        assert torch.equal(got, want), assistant
    assert kinds(target) == {"model", "ngram"}
