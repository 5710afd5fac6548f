"""Drafts with another tokenizer: greedy identity, exact sampling, batches, boundaries, refusal, loading.

The target reads a byte-level BPE (GPT-2 style, ``Ġ`` for a space) and the draft a
SentencePiece-style BPE (``▁`` for a space, a space added at the start of a text), both
trained here on different texts with different vocabulary sizes; each model is sized to its
own tokenizer and saved by path with it.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import stat_utils
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue
from test_serve_engine import serve
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import hfspec
from hfspec import SpeculativeGenerator
from hfspec.bench import Bench, Contender, Mode
from hfspec.commands import cli
from hfspec.cpu import fast
from hfspec.decoding import sampling
from hfspec.drafters.cross_tokenizer import PRIME, REWORK, CrossTokenizerDrafter
from hfspec.drafters.loading import load_pair
from hfspec.drafters.vocabulary import byte_decoder, vocab_map
from hfspec.errors import HfspecError
from hfspec.serve.events import Request

WORDS = (
    "the a cat dog sat on mat ran to house big small red blue tree under over quick brown fox jumps lazy "
    "river ate bone bird sang song morning night"
).split()
TEXTS = ["The quick brown fox jumps over", "A cat sat", "The lazy dog ran to the big red house under a tree and"]


def corpus(seed: int, words: list[str], n: int = 400) -> list[str]:
    r = random.Random(seed)
    return [
        " ".join(r.choice(words) for _ in range(r.randint(4, 12))).capitalize() + r.choice(".!?,") for _ in range(n)
    ]


def byte_level_bpe(texts: list[str], size: int) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def metaspace_bpe(texts: list[str], size: int) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    core.decoder = decoders.Metaspace(prepend_scheme="first")
    core.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=size,
            special_tokens=["<unk>", "<|endoftext|>"],
            initial_alphabet=[chr(c) for c in range(32, 127)],
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def save(model, tok, directory):
    model.save_pretrained(directory)
    tiny.save_tokenizer(tok, directory)
    return directory


def resembling_draft(target, target_tok, draft_tok, perturb: float, seed: int = 1):
    """A Llama sized to the draft's tokenizer with the target's layers (perturbed) and, for each token both
    tokenizers share, the target's embedding and output rows: it predicts much as the target does."""
    from hfspec.drafters.vocabulary import vocab_map

    config = tiny.make_config("llama", len(draft_tok), eos=1, hidden=32)
    draft = AutoModelForCausalLM.from_config(config).eval()
    shared = vocab_map(target_tok, draft_tok, len(target_tok), len(draft_tok))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in draft.named_parameters():
            source = dict(target.named_parameters())[name]
            if w.shape == source.shape:
                w.copy_(source + torch.randn(w.shape, generator=g) * source.std().nan_to_num(0.0) * perturb)
            else:  # embedding and output rows, by shared token
                w.normal_(0, float(source.std()), generator=g)
                w[shared.draft_ids] = source[shared.target_ids]
    return draft


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Paths of the target (Llama, byte-level BPE), a resembling draft and an unrelated GPT-2 draft."""
    target_tok = byte_level_bpe(corpus(0, WORDS), 420)
    draft_tok = metaspace_bpe(corpus(1, WORDS + ["sun", "moon"]), 300)
    assert len(target_tok) != len(draft_tok)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny.make_config("llama", len(target_tok), eos=1, hidden=32)).eval()
    shared = vocab_map(target_tok, draft_tok, len(target_tok), len(draft_tok))
    with torch.no_grad():
        head = target.get_output_embeddings().weight
        scale = torch.full((head.shape[0], 1), 0.5)
        scale[shared.target_ids] = 12.0  # as in real text, mostly tokens both tokenizers have
        head.mul_(scale)
        for layer in target.model.layers:  # the next token depends mostly on the last one, as a draft can learn
            layer.self_attn.o_proj.weight.mul_(0.05)
    root = tmp_path_factory.mktemp("cross")
    torch.manual_seed(1)
    unrelated = AutoModelForCausalLM.from_config(tiny.make_config("gpt2", len(draft_tok), eos=1))
    return {
        "target": save(target, target_tok, root / "target"),
        "draft": save(resembling_draft(target, target_tok, draft_tok, perturb=0.3), draft_tok, root / "draft"),
        "unrelated": save(unrelated, draft_tok, root / "unrelated"),
    }


def loaded(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(path)


def generator(pair, draft="draft", greedy="tli") -> SpeculativeGenerator:
    """The pair with the drafter the constructor builds (greedy by the shared tokens, TLI), or with one built
    by hand (``greedy="slem"``: greedy by the draft's text)."""
    target, target_tok = loaded(pair["target"])
    draft_model, draft_tok = loaded(pair[draft])
    if greedy != "tli":
        return SpeculativeGenerator(
            target, CrossTokenizerDrafter(draft_model, draft_tok, target_tok, greedy), target_tok
        )
    return SpeculativeGenerator(target, draft_model, target_tok, draft_tokenizer=draft_tok)


def alone(target, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def rows_of(out) -> list[list[int]]:
    return [
        out.sequences[b, out.prompt_length : out.prompt_length + r.committed].tolist()
        for b, r in enumerate(out.stats.rows)
    ]


@pytest.mark.parametrize("greedy", ["tli", "slem"])
@pytest.mark.parametrize("draft", ["draft", "unrelated"])
def test_greedy_equals_target_generate(pair, draft, greedy):
    gen = generator(pair, draft, greedy)
    assert isinstance(gen.drafter, CrossTokenizerDrafter) and gen.drafter.greedy == greedy
    accepted = drafted = 0
    for text in TEXTS:
        prompt = gen.tokenizer(text)["input_ids"]
        want = alone(gen.target, prompt, 16)
        for gamma in (1, 5):  # one draft token, and several (γ = 3 runs in the batches below)
            out = gen.generate([prompt], max_new_tokens=16, gamma=gamma)
            assert rows_of(out)[0] == want, f"{draft}, {greedy}, γ={gamma}, {text!r}"
            accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    if draft == "draft":  # the resembling draft does get drafts accepted across the two tokenizers
        assert accepted > 0.3 * drafted


@pytest.mark.parametrize("greedy", ["tli", "slem"])
def test_batch_with_ragged_prompts_equals_each_prompt_alone(pair, greedy):
    gen = generator(pair, greedy=greedy)
    prompts = [gen.tokenizer(t)["input_ids"] for t in TEXTS + ["Red", "The bird sang a song in the morning"]]
    want = [alone(gen.target, p, 20) for p in prompts]
    for gamma in (2, 4):
        assert rows_of(gen.generate(prompts, max_new_tokens=20, gamma=gamma)) == want, f"γ={gamma}"
    out = gen.generate(prompts, max_new_tokens=20, gamma=3, do_sample=True, temperature=0.8, seed=0)
    assert [r.committed for r in out.stats.rows] and out.stats.drafted > 0  # invariants were checked every step


@pytest.mark.parametrize("greedy", ["tli", "slem"])
def test_prompts_that_end_inside_a_word_or_a_character(pair, greedy):
    """The target's last token is cut differently by the draft's tokenizer (part of a word, a token split
    into pieces the target's tokenizer would never produce, half of a UTF-8 character)."""
    gen = generator(pair, greedy=greedy)
    tok = gen.tokenizer
    byte_ids = {b: tok.convert_tokens_to_ids(c) for c, b in byte_decoder().items()}
    prompts = [
        tok("The quick bro")["input_ids"],
        tok("The cat")["input_ids"] + [tok.convert_tokens_to_ids(t) for t in ("Ġ", "s", "a")],
        tok("The cat")["input_ids"] + [byte_ids[0xC3]],  # the first byte of "é"
        tok("Ünder the tree")["input_ids"],
    ]
    want = [alone(gen.target, p, 16) for p in prompts]
    for gamma in (1, 3, 5):
        assert rows_of(gen.generate(prompts, max_new_tokens=16, gamma=gamma)) == want, f"γ={gamma}"


class _Context:
    """A hand-driven loop: committed target tokens, and a pick that takes the argmax."""

    sample, generator = False, None

    def __init__(self, rows: list[list[int]], vocab: int):
        self.tokens = torch.zeros(len(rows), 200, dtype=torch.long)
        for b, r in enumerate(rows):
            self.tokens[b, : len(r)] = torch.tensor(r)
        self.lengths = torch.tensor([len(r) for r in rows])
        self.vocab = vocab

    def pick(self, logits, i):
        token = logits[:, : self.vocab].argmax(dim=-1)
        self.tokens.scatter_(1, (self.lengths + i)[:, None], token[:, None])
        return token, None, torch.ones(token.shape)


def test_draft_context_is_its_tokenization_of_the_committed_text(pair, monkeypatch):
    """Step by step, as the text grows by target tokens that merge with earlier ones in the draft's tokenizer,
    the draft's cache holds exactly its own tokenization of the whole committed text, though only a window
    at its end is re-tokenized (the whole text only where that window does not fit)."""
    gen = generator(pair)
    drafter, tok, draft_tok = gen.drafter, gen.tokenizer, gen.drafter.draft_tokenizer
    whole = []
    monkeypatch.setattr(
        drafter, "_full", lambda row: whole.append(len(row.ends)) or CrossTokenizerDrafter._full(drafter, row)
    )
    texts = [" ".join(random.Random(seed).choice(WORDS) for _ in range(40)) for seed in (0, 1)]
    full = [tok(t)["input_ids"] for t in texts]
    ctx = _Context([f[:2] for f in full], len(tok))
    drafter.start(2, torch.device("cpu"))
    steps = 0
    while any(int(n) < len(f) for n, f in zip(ctx.lengths, full)):
        drafter.propose(ctx, 2)
        steps += 1
        for b, row in enumerate(drafter.rows):
            text = tok.decode(ctx.tokens[b, : ctx.lengths[b]].tolist())
            assert row.seq == draft_tok(text, add_special_tokens=False)["input_ids"], (steps, text)
        # Commit nothing of the proposal, and one to three more tokens of each text.
        drafter.commit(ctx, torch.full((2, 2), -1))
        drafter.check(ctx)
        ctx.lengths = torch.tensor([min(int(n) + 1 + steps % 3, len(f)) for n, f in zip(ctx.lengths, full)])
        for b, f in enumerate(full):
            ctx.tokens[b, : len(f)] = torch.tensor(f)
    # Only while a row holds too few tokens for a prime and a window.
    assert steps > 15 and max(whole) <= REWORK + PRIME + 1, f"the whole text was re-tokenized at lengths {whole}"


def test_sampling_matches_the_target_distribution(pair):
    gen = generator(pair)
    prompt = gen.tokenizer("The cat")["input_ids"]
    settings = {"temperature": 0.7, "top_p": 0.9, "eos_token_id": []}
    counts, exact = _sample(gen, prompt, settings, seed=3)
    pv = chi_square_pvalue(counts, exact)
    assert pv > ALPHA, f"cross-tokenizer samples differ from the target (p-value {pv:.3g})"


def test_negative_control_broken_residual_is_detected(pair, monkeypatch):
    gen = generator(pair)
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    prompt = gen.tokenizer("The cat")["input_ids"]
    counts, exact = _sample(gen, prompt, {"temperature": 0.7, "top_p": 0.9, "eos_token_id": []}, seed=4)
    assert chi_square_pvalue(counts, exact) < ALPHA


def test_negative_control_q_without_the_shared_processing_is_detected(pair, monkeypatch):
    """Drafts drawn as usual, but reported with q = the draft's row before temperature and top-p: no longer
    what they were drawn from, and the output leaves the target's distribution."""
    gen = generator(pair)
    raw: list[torch.Tensor] = []
    target_row = CrossTokenizerDrafter._target_row
    monkeypatch.setattr(
        CrossTokenizerDrafter, "_target_row", lambda self, logits: raw.append(target_row(self, logits)) or raw[-1]
    )
    propose = CrossTokenizerDrafter.propose

    def unprocessed_q(self, ctx, gamma, stop=None, price=None):
        raw.clear()
        out = propose(self, ctx, gamma, stop, price)
        return dataclasses.replace(out, q=torch.stack([torch.softmax(r, dim=-1) for r in raw], dim=1))

    monkeypatch.setattr(CrossTokenizerDrafter, "propose", unprocessed_q)
    prompt = gen.tokenizer("The cat")["input_ids"]
    counts, exact = _sample(gen, prompt, {"temperature": 0.7, "top_p": 0.9, "eos_token_id": []}, seed=5)
    assert chi_square_pvalue(counts, exact) < ALPHA


# 6000 samples: over 5 seeds each, the broken residual's p-value 1e-15 to 1e-21, the unprocessed q's 1e-36 to 1e-54,
# the correct sampler's 0.16 to 1 (the tests ask for p < ALPHA = 1e-8 and p > ALPHA).
def _sample(gen, prompt, settings, seed, samples=6_000, batch=3_000) -> tuple[np.ndarray, np.ndarray]:
    vocab = len(gen.tokenizer)
    (counts,) = stat_utils.sample_counts(
        gen, [prompt], settings, seed, vocab=vocab, new=2, samples=samples, batch=batch, gamma=2
    )
    exact = stat_utils.exact_joint(gen.target, prompt, settings, vocab, 2)
    return counts, exact


def test_the_draft_disagrees_enough_for_the_sampling_test_to_mean_something(pair):
    gen = generator(pair)
    prompt = gen.tokenizer("The cat")["input_ids"]
    out = gen.generate(
        [prompt] * 500, max_new_tokens=2, gamma=2, do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=[], seed=0
    )
    assert 0.2 < out.stats.acceptance_rate < 0.9


def test_no_usable_overlap_is_refused_naming_both(pair, tmp_path):
    # A word-level tokenizer (w7, w8, ...) shares next to nothing with the byte-level BPE.
    draft_dir = tiny.build(tmp_path / "words", "llama", vocab_size=64)
    with pytest.raises(HfspecError) as err:
        load_pair(pair["target"], draft_dir)
    message = str(err.value)
    assert str(pair["target"]) in message and str(draft_dir) in message
    assert "different tokenizers" in message and "share only" in message and "trained with the target's" in message
    target, target_tok = loaded(pair["target"])
    draft, draft_tok = tiny.load(draft_dir)
    with pytest.raises(HfspecError, match="share only .* ordinary tokens"):
        SpeculativeGenerator(target, draft, target_tok, draft_tokenizer=draft_tok)


def test_from_pretrained_api_and_cli_pick_the_cross_tokenizer_path(pair, capsys, fresh_api_cache):
    gen = SpeculativeGenerator.from_pretrained(str(pair["target"]), str(pair["draft"]), dtype="float32")
    assert isinstance(gen.drafter, CrossTokenizerDrafter) and gen.drafter.describe()["shared_tokens"] > 100
    prompt = gen.tokenizer(TEXTS[0])["input_ids"]
    want = gen.tokenizer.decode(alone(gen.target, prompt, 12), skip_special_tokens=True)
    assert rows_of(gen.generate([prompt], max_new_tokens=12, gamma=3))[0] == alone(gen.target, prompt, 12)
    text = hfspec.generate(
        TEXTS[0], target=str(pair["target"]), draft=str(pair["draft"]), max_new_tokens=12, gamma=3, dtype="float32"
    )
    assert text == want
    capsys.readouterr()
    code = cli.main(
        [
            "generate",
            TEXTS[0],
            "--target",
            str(pair["target"]),
            "--draft",
            str(pair["draft"]),
            "--max-new-tokens",
            "12",
            "--gamma",
            "3",
            "--dtype",
            "float32",
        ]
    )
    assert code == 0 and capsys.readouterr().out.strip() == want.strip()


def test_same_tokenizer_passed_as_draft_tokenizer_keeps_the_plain_model_drafter(pair):
    target, target_tok = loaded(pair["target"])
    draft, _ = loaded(pair["target"])
    gen = SpeculativeGenerator(target, draft, target_tok, draft_tokenizer=target_tok)
    assert gen.drafter.kind == "model"


def test_auto_gamma_measures_a_cross_tokenizer_step(pair):
    gen = generator(pair)
    prompt = gen.tokenizer(TEXTS[2])["input_ids"]
    out = gen.generate([prompt], max_new_tokens=12, gamma="auto")
    assert rows_of(out)[0] == alone(gen.target, prompt, 12)
    assert gen.tuning.costs is not None and gen.tuning.costs.draft > 0


def test_draft_context_window_full_of_its_own_smaller_tokens(pair, monkeypatch):
    """A draft whose tokenizer spends many more tokens on the same text than the target's outgrows its context
    window first: it then reads only the end of the text, and the output stays the target's."""
    draft_tok = metaspace_bpe(corpus(2, WORDS), 110)  # hardly more than single characters
    torch.manual_seed(2)
    draft = AutoModelForCausalLM.from_config(tiny.make_config("gpt2", len(draft_tok), eos=1, window=64)).eval()
    target, target_tok = loaded(pair["target"])
    gen = SpeculativeGenerator(target, draft, target_tok, draft_tokenizer=draft_tok)
    shortened = []
    monkeypatch.setattr(
        gen.drafter,
        "_shorten",
        lambda *args: shortened.append(args[0].origin) or CrossTokenizerDrafter._shorten(gen.drafter, *args),
    )
    prompt = target_tok(TEXTS[2])["input_ids"]
    assert len(draft_tok(TEXTS[2])["input_ids"]) > 2 * len(prompt)
    for gamma in (1, 4):
        out = gen.generate([prompt], max_new_tokens=64 - len(prompt), gamma=gamma)
        assert rows_of(out)[0] == alone(target, prompt, 64 - len(prompt)), f"γ={gamma}"
    assert len(shortened) >= 4  # it did start its context later, more than once per run


def test_with_ngram_lookup_added(pair):
    target, target_tok = loaded(pair["target"])
    draft, draft_tok = loaded(pair["draft"])
    gen = SpeculativeGenerator(target, draft, target_tok, draft_tokenizer=draft_tok, ngram=True)
    prompts = [target_tok(t)["input_ids"] for t in TEXTS]
    assert gen.drafter.kind == "hybrid"
    assert rows_of(gen.generate(prompts, max_new_tokens=20, gamma=3)) == [alone(target, p, 20) for p in prompts]
    slem = CrossTokenizerDrafter(draft, draft_tok, target_tok, greedy="slem")
    gen = SpeculativeGenerator(target, slem, target_tok, ngram=True)
    assert rows_of(gen.generate(prompts, max_new_tokens=20, gamma=3)) == [alone(target, p, 20) for p in prompts]


@pytest.mark.parametrize("greedy", ["tli", "slem"])
def test_served_in_company_greedy_equals_the_target_and_seeded_equals_alone(pair, greedy, library):
    gen = generator(pair, greedy=greedy)
    fast.accelerate(gen.target)  # hfspec's kernels: a row's bits whatever rows share the forward
    fast.accelerate(gen.drafter.model)
    prompts = [gen.tokenizer(t)["input_ids"] for t in TEXTS + ["Red", "The bird sang a song in the morning"]]
    settings = [dict(temperature=0.0), dict(temperature=0.8, top_k=20)]
    requests = [
        Request(f"c{i}", tuple(p), 12 + 2 * i, gamma=3, seed=i, **settings[i % 2]) for i, p in enumerate(prompts)
    ]
    together = serve(gen, requests, stagger=0.003)
    for request, (tokens, *_) in zip(requests, together):
        if request.temperature == 0:
            assert tokens == alone(gen.target, list(request.prompt_ids), request.max_new_tokens)
        else:
            assert tokens == serve(gen, [request])[0][0], f"{request.request_id} differs in company"
    assert sum(done.usage.accepted for *_, done in together) > 0


def test_a_call_cut_short_after_a_spelled_proposal_leaves_nothing_behind(pair):
    gen = generator(pair, greedy="slem")
    prompt = gen.tokenizer(TEXTS[0])["input_ids"]

    forwards = []

    def fail(*args):
        forwards.append(1)
        if len(forwards) == 2:  # the verification of the first proposal, spelled from the draft's text
            raise KeyboardInterrupt

    handle = gen.target.register_forward_pre_hook(fail)
    with pytest.raises(KeyboardInterrupt):
        gen.generate([prompt], max_new_tokens=8, gamma=3)
    handle.remove()
    # A first step that drafts nothing (one token left) must not roll back what the cut call had drafted.
    assert rows_of(gen.generate([prompt], max_new_tokens=1, gamma=3)) == [alone(gen.target, prompt, 1)]
    assert rows_of(gen.generate([prompt], max_new_tokens=12, gamma=3)) == [alone(gen.target, prompt, 12)]


def test_a_draft_with_another_vocabulary_but_no_draft_tokenizer_is_refused_naming_the_fix(pair):
    target, target_tok = loaded(pair["target"])
    draft, _ = loaded(pair["draft"])
    with pytest.raises(ValueError, match="draft_tokenizer="):
        SpeculativeGenerator(target, draft, target_tok)


def test_bench_runs_a_pair_with_other_tokenizers_and_keeps_the_draft_whole(pair):
    """transformers' universal assisted sampling prunes its assistant's LM head in place: the bench hands it a
    copy, so hfspec's draft keeps its full vocabulary and stays exact after the assisted contender ran."""
    target, target_tok = loaded(pair["target"])
    draft, draft_tok = loaded(pair["draft"])
    head = draft.get_output_embeddings().weight.shape
    bench = Bench(target, CrossTokenizerDrafter(draft, draft_tok, target_tok), target_tok, max_new_tokens=6, gamma=2)
    prompt = target_tok("the cat sat on")["input_ids"]
    sample = Mode("sample", True, 0.7, 0.95, 0)
    for mode in (Mode("greedy", False), sample):
        bench.run(Contender("assisted", "assisted", 2, "constant"), [prompt], mode, seed=0)
    assert draft.get_output_embeddings().weight.shape == head
    run = bench.run(Contender("hfspec", "hfspec", 2, "fixed"), [prompt], Mode("greedy", False), seed=0)
    assert run.tokens[0] == alone(target, prompt, 6)[: len(run.tokens[0])]


def test_auto_trees_with_a_drafter_that_builds_none_take_the_chain(pair):
    gen = generator(pair)
    prompt = gen.tokenizer(TEXTS[2])["input_ids"]
    out = gen.generate([prompt], max_new_tokens=12, gamma="auto", tree="auto")  # never refused
    assert rows_of(out)[0] == alone(gen.target, prompt, 12)
    assert gen.tuning.trees == () and out.stats.tree_nodes == 0
