"""Bad input gets a clear error naming the problem and the fix; faults in the loop are caught."""

from __future__ import annotations

import math

import pytest
import tiny
import torch
from transformers import GenerationConfig

from hfspec import NumericalFault, SpeculativeGenerator
from hfspec.decoding import sampling


@pytest.fixture(scope="module")
def gen(model_dir):
    target, tok = tiny.load(model_dir("llama", vocab_size=32, seed=0))
    draft, _ = tiny.load(model_dir("llama", vocab_size=32, seed=1))
    return SpeculativeGenerator(target, draft, tok)


PROMPT = [[7, 8, 9]]


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"gamma": 0}, ValueError, "gamma"),
        ({"gamma": -2}, ValueError, "gamma"),
        ({"gamma": 1.5}, TypeError, "gamma"),
        ({"gamma": True}, TypeError, "gamma"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens"),
        ({"max_new_tokens": "5"}, TypeError, "max_new_tokens"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": math.nan}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
        ({"generation_config": GenerationConfig(num_beams=4)}, ValueError, "num_beams"),
        ({"generation_config": {"top_k": 3}}, TypeError, "GenerationConfig"),
        ({"on_context_limit": "wrap"}, ValueError, "on_context_limit"),
    ],
)
def test_bad_settings_raise_clear_errors(gen, kwargs, error, words):
    settings = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=words):
        gen.generate(PROMPT, **settings)


def test_one_sampling_params_value_says_what_the_keywords_say(gen):
    from hfspec.settings import SamplingParams

    keywords = dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=5, repetition_penalty=1.2, seed=3)
    params = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2, max_new_tokens=6, stop_token_ids=[2])
    want = gen.generate(PROMPT, gamma=2, **keywords).sequences
    assert torch.equal(gen.generate(PROMPT, gamma=2, sampling_params=params, seed=3).sequences, want)
    with pytest.raises(ValueError, match="drop temperature"):
        gen.generate(PROMPT, sampling_params=params, temperature=0.5)
    with pytest.raises(TypeError, match="SamplingParams"):
        gen.generate(PROMPT, sampling_params={"temperature": 0.5})


@pytest.mark.parametrize(
    "settings, error, words",
    [
        ({"temperature": math.inf}, ValueError, "temperature must be a finite number >= 0"),
        ({"top_k": 2.5}, TypeError, "top_k must be an integer >= 0"),
        ({"bad_words_ids": [[]]}, ValueError, "bad_words_ids must be"),
        ({"no_repeat_ngram_size": -1}, ValueError, "no_repeat_ngram_size must be an integer >= 0"),
        ({"min_p": 2.0, "top_p": 0.0}, ValueError, "top_p must be in .*; min_p must be in"),
    ],
)
def test_sampling_params_are_validated_once_with_every_problem_named(settings, error, words):
    from hfspec.settings import SamplingParams

    with pytest.raises(error, match=words):
        SamplingParams(**settings)


def test_max_new_tokens_is_required(gen):
    with pytest.raises(ValueError, match="max_new_tokens is required"):
        gen.generate(PROMPT)


@pytest.mark.parametrize(
    "input_ids, mask, error, words",
    [
        (None, None, ValueError, "input_ids is required"),
        ("w7 w8", None, TypeError, "hfspec.generate"),
        ([torch.tensor([7, 8]), [9]], None, TypeError, "mixes tensors and lists"),
        ([[7, 8], [9]], torch.ones(2, 2), ValueError, "drop attention_mask"),
        (torch.tensor([[7, 8, 99]]), None, ValueError, "outside the vocabulary"),
        (torch.tensor([[7, -1]]), None, ValueError, "outside the vocabulary"),
        (torch.tensor([[7, 8, 9]]), torch.ones(1, 2), ValueError, "attention_mask has shape"),
        (torch.tensor([[7.0, 8.0]]), None, TypeError, "integer token ids"),
        ([], None, ValueError, "no prompts"),
    ],
)
def test_bad_prompts_raise_clear_errors(gen, input_ids, mask, error, words):
    with pytest.raises(error, match=words):
        gen.generate(input_ids, mask, max_new_tokens=4)


def test_empty_prompt_starts_from_bos_or_refuses(gen, model_dir):
    out = gen.generate([[]], max_new_tokens=3)
    assert out.sequences[0, 0].item() == tiny.BOS
    target, _ = tiny.load(model_dir("llama", vocab_size=32, seed=0))
    target.generation_config.bos_token_id = None
    bare = SpeculativeGenerator(target, gen.draft)  # no tokenizer, and no BOS anywhere
    with pytest.raises(ValueError, match="no BOS token"):
        bare.generate([[]], max_new_tokens=3)


def test_prompt_longer_than_the_context_window(gen):
    with pytest.raises(ValueError, match="longer than the context window"):
        gen.generate([[7] * 5000], max_new_tokens=1)
    with pytest.raises(ValueError, match="run past the context window"):
        gen.generate(PROMPT, max_new_tokens=5000)


def test_vocabularies_that_differ_beyond_padding(model_dir):
    target, tok = tiny.load(model_dir("llama", vocab_size=32, seed=0))
    other, _ = tiny.load(model_dir("llama", vocab_size=2000, seed=1))
    with pytest.raises(ValueError, match="differ by more than padding"):
        SpeculativeGenerator(target, other)
    small, _ = tiny.load(model_dir("llama", vocab_size=24, seed=1))
    with pytest.raises(ValueError, match="tokenizer has 32 tokens"):
        SpeculativeGenerator(target, small, tok)


def test_models_that_are_not_causal_lms(gen):
    with pytest.raises(TypeError, match="PreTrainedModel"):
        SpeculativeGenerator(gen.target, torch.nn.Linear(2, 2))
    from transformers import BertConfig, BertModel

    bert = BertModel(
        BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    )
    with pytest.raises(TypeError, match="not a causal language model"):
        SpeculativeGenerator(gen.target, bert)


def test_streamer_needs_a_single_prompt(gen):
    with pytest.raises(ValueError, match="single prompt"):
        gen.generate([[7], [8]], max_new_tokens=2, streamer=object())


@pytest.mark.parametrize("role", ["draft", "target"])
def test_nan_logits_are_reported_with_model_and_step(gen, role):
    model = getattr(gen, role)
    calls = {"n": 0}

    def poison(module, args, output):
        calls["n"] += 1
        if calls["n"] >= 3:
            return torch.full_like(output, float("nan"))
        return output

    handle = model.get_output_embeddings().register_forward_hook(poison)
    try:
        with pytest.raises(NumericalFault, match=rf"the {role} model produced NaN.*at step \d+"):
            gen.generate(PROMPT, max_new_tokens=20, gamma=2, do_sample=True, seed=0)
    finally:
        handle.remove()


def test_a_draft_distribution_that_does_not_sum_to_one_is_caught():
    p = torch.full((1, 2, 4), 0.25)
    q = torch.full((1, 1, 4), 0.3)
    with pytest.raises(ValueError, match="not a probability distribution"):
        sampling.verify(torch.tensor([[1]]), q, p)


def test_same_seed_same_output(gen):
    # A fixed γ: with gamma="auto" the steps follow measured timings, and so does which random number meets which token.
    a = gen.generate(PROMPT, max_new_tokens=16, gamma=3, do_sample=True, seed=11, temperature=0.9)
    b = gen.generate(PROMPT, max_new_tokens=16, gamma=3, do_sample=True, seed=11, temperature=0.9)
    c = gen.generate(PROMPT, max_new_tokens=16, gamma=3, do_sample=True, seed=12, temperature=0.9)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)


class Recorder:
    """A streamer that records what it is given."""

    def __init__(self):
        self.prompt, self.tokens, self.ended = None, [], False

    def put(self, value):
        if self.prompt is None:
            self.prompt = value.tolist()
        else:
            self.tokens.extend(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_sees_every_committed_token_before_an_interrupt(gen):
    full = gen.generate(PROMPT, max_new_tokens=30, gamma=3).sequences[0, 3:].tolist()
    calls = {"n": 0}

    def interrupt(module, args, output):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return output

    rec = Recorder()
    handle = gen.target.register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            gen.generate(PROMPT, max_new_tokens=30, gamma=3, streamer=rec)
    finally:
        handle.remove()
    assert rec.ended
    assert rec.prompt == PROMPT
    assert 0 < len(rec.tokens) < 30
    assert rec.tokens == full[: len(rec.tokens)]


def test_stats_are_consistent(gen):
    out = gen.generate([[7, 8], [9, 10, 11]], max_new_tokens=25, gamma=3, do_sample=True, seed=0, eos_token_id=[])
    s = out.stats
    assert s.committed == 50
    assert all(r.committed == r.accepted + r.target_passes for r in s.rows)
    assert s.committed == s.accepted + sum(r.target_passes for r in s.rows)
    assert s.drafted == sum(r.drafted for r in s.rows)
    assert 0 <= s.acceptance_rate <= 1
    assert s.mean_accepted_length == pytest.approx(s.committed / sum(r.target_passes for r in s.rows))
    assert len(s.acceptance_by_position) == 3
    assert s.drafted_by_position[0] >= s.drafted_by_position[-1]
    assert s.time_total >= s.time_draft + s.time_target
    assert set(s.to_dict()) >= {"acceptance_rate", "mean_accepted_length", "rows", "tokens_per_second"}
