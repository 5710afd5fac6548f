"""Drafting without a draft model (n-gram lookup) and the hybrid with a model draft.

The index: longest suffix match, incremental updates, the bounded and switchable store of
earlier outputs, proposal lengths. Losslessness: greedy output equals ``target.generate``
(single prompts and ragged batches where some rows have no match), and the joint of the
first tokens matches the target's by chi-square, with negative controls that must fail.
Plumbing: ``"ngram"`` and ``ngram=True`` through every entry point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import stat_utils
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue
from test_batch import alone, batch_prompts, rows_of
from test_distribution import NEW, SETTINGS, V, exact_joint, pair  # noqa: F401 (pair is a fixture)

import hfspec
from hfspec import SpeculativeGenerator, api
from hfspec.commands import cli
from hfspec.decoding import sampling
from hfspec.decoding.loop import Call
from hfspec.drafters import Drafter, Proposal
from hfspec.drafters.hybrid import HybridDrafter, with_ngram
from hfspec.drafters.model import ModelDrafter
from hfspec.drafters.ngram import History, NgramDrafter, TokenIndex
from hfspec.errors import HfspecError
from hfspec.measure.alpha import AlphaEstimate
from hfspec.models.presets import load_preset


class Ctx:
    """The part of the loop's Context a model-free drafter reads."""

    sample, generator = False, None

    def __init__(self, rows: list[list[int]], vocab: int = 100, garbage: int = 0):
        width = max(map(len, rows)) + garbage
        self.tokens = torch.tensor([r + [vocab - 1] * (width - len(r)) for r in rows])
        self.lengths = torch.tensor([len(r) for r in rows])
        self.vocab = vocab


def propose(drafter: NgramDrafter, rows: list[list[int]], gamma: int, **ctx) -> list[list[int]]:
    drafter.start(len(rows), torch.device("cpu"))
    proposal = drafter.propose(Ctx(rows, **ctx), gamma)
    return [proposal.tokens[b, :n].tolist() for b, n in enumerate(proposal.drafted().tolist())]


# -- the index ------------------------------------------------------------------------------------


def test_the_longest_suffix_match_wins_and_ties_go_to_the_most_recent():
    index = TokenIndex(key=2, max_match=32, candidates=64)
    index.extend([30, 11, 12, 13, 20, 21, 11, 12, 13, 22, 30, 11, 12, 13])
    m, ends = index.match(index.tail(32), exclude=index.size - 1)
    assert (m, ends) == (4, [3])  # "30 11 12 13" beats the later "21 11 12 13"
    assert index.follow(ends, 2, 0.0, periodic=False)[0] == [20, 21]
    index.extend([99, 11, 12, 13])
    m, ends = index.match(index.tail(32), exclude=index.size - 1)
    assert (m, ends) == (3, [3, 8, 13])
    tokens, chance = index.follow(ends, 1, 0.0, periodic=False)
    assert tokens == [99] and chance == pytest.approx([1 / 3])  # a three-way tie: the most recent


def test_extending_in_pieces_equals_extending_at_once():
    seq = torch.randint(0, 5, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    whole, pieces = TokenIndex(3, 32, 64), TokenIndex(3, 32, 64)
    whole.extend(seq)
    for start in range(0, len(seq), 7):
        pieces.extend(seq[start : start + 7])
    assert pieces.tokens == whole.tokens and pieces.ends == whole.ends
    assert sum(map(len, whole.ends.values())) == len(seq) - 2  # one entry per n-gram, each indexed once


def test_a_continuation_that_was_not_always_the_same_gives_a_shorter_proposal():
    # After "5 6": 7 twice then 8 and 9; 1 after the first 7 and 2 after the second.
    context = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 8, 5, 6, 9, 0, 5, 6]
    assert propose(NgramDrafter(min_prob=0.0, factor=4), [context], 8) == [[7, 2, 5, 6, 8, 5, 6, 9]]
    assert propose(NgramDrafter(min_prob=0.3, factor=4), [context], 8) == [[7]]  # 7 at 1/2; then 1/4
    assert propose(NgramDrafter(min_prob=0.6, factor=4), [context], 8) == [[]]
    drafter = NgramDrafter(min_prob=0.0)
    propose(drafter, [context], 3)
    assert drafter.expected.tolist() == pytest.approx([0.5 + 0.25 + 0.25])


def test_proposal_length_follows_the_match_length_and_gamma():
    pattern = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    rows = [pattern + [40] + pattern[:2], pattern + [40] + pattern[:3], [10, 11, 12, 13], pattern + [40, 10]]
    assert [len(p) for p in propose(NgramDrafter(factor=1.0), rows, 8)] == [2, 3, 0, 0]
    assert [len(p) for p in propose(NgramDrafter(factor=2.0), rows, 8)] == [4, 6, 0, 0]
    assert [len(p) for p in propose(NgramDrafter(factor=2.0), rows, 5)] == [4, 5, 0, 0]
    assert [len(p) for p in propose(NgramDrafter(min_match=1, factor=2.0), rows, 8)] == [4, 6, 0, 2]
    drafter = NgramDrafter(factor=2.0)
    assert propose(drafter, rows, 8)[1] == pattern[3:9]
    drafter.start(len(rows), torch.device("cpu"))
    sources = drafter.propose(Ctx(rows), 8).sources  # what the proposal says of its lookup, per row
    assert sources.matched.tolist() == [2, 3, 0, 0] and sources.lookup.tolist() == [4, 6, 0, 0]


def test_a_repeating_pattern_continues_past_the_end_of_the_context():
    assert propose(NgramDrafter(factor=4), [[1, 2, 3, 1, 2, 3, 1, 2]], 7) == [[3, 1, 2, 3, 1, 2, 3]]
    assert propose(NgramDrafter(factor=8), [[4, 4, 4]], 6) == [[4] * 6]


def test_nothing_past_the_committed_tokens_is_read():
    # The buffer holds a copy of the pattern past lengths (as drafts would be): it must not match.
    ctx = Ctx([[10, 11, 12, 13, 10, 11]], garbage=6)
    ctx.tokens[0, 6:] = torch.tensor([12, 13, 10, 11, 12, 13])
    drafter = NgramDrafter()
    drafter.start(1, torch.device("cpu"))
    assert drafter.propose(ctx, 4).tokens.tolist() == [[12, 13, 10, 11]]
    assert drafter.rows[0].tokens == [10, 11, 12, 13, 10, 11]


def test_proposals_stay_inside_the_vocabulary():
    drafter = NgramDrafter()
    drafter.finished(0, torch.tensor([5, 6, 7, 80, 81]))
    assert propose(drafter, [[1, 5, 6]], 4, vocab=100) == [[7, 80, 81]]
    assert propose(drafter, [[1, 5, 6]], 4, vocab=50) == [[7]]


def test_the_history_is_bounded_and_switchable():
    store = History(capacity=40, key=2, max_match=32, candidates=64)
    for i in range(30):
        store.add([i, i + 1, i + 2, i + 3, i + 4])
        assert store.size <= 40
    assert store.outputs[-1] == [29, 30, 31, 32, 33] and [0, 1, 2, 3, 4] not in store.outputs
    store.add([7])  # too short to continue anything
    assert store.outputs[-1] == [29, 30, 31, 32, 33]
    learned = NgramDrafter()
    learned.finished(0, torch.tensor([3, 4, 5, 6, 7, 8]))
    assert propose(learned, [[9, 3, 4]], 4) == [[5, 6, 7, 8]]
    assert propose(NgramDrafter(history=False), [[9, 3, 4]], 4) == [[]]
    learned.clear_history()
    assert propose(learned, [[9, 3, 4]], 4) == [[]]


def test_settings_are_checked():
    for kwargs in ({"min_match": 0}, {"factor": 0}, {"min_prob": 2}, {"max_match": 1}, {"history_tokens": True}):
        with pytest.raises(ValueError):
            NgramDrafter(**kwargs)


# -- greedy equivalence ---------------------------------------------------------------------------

PROMPTS = [[1, 10, 11, 12, 10, 11, 12, 10], [3], [7, 8, 9, 10, 11, 7, 8], [5, 5, 5, 5, 5, 5], [9, 13, 14]]


def target_greedy(target, prompt, n=30, eos=None):
    return alone(target, prompt, n, eos if eos is not None else target.generation_config.eos_token_id)


@pytest.fixture(scope="module")
def wanted():
    """``wanted(target)``: the target's greedy continuation of each of PROMPTS, computed once per target."""
    cache: dict[int, list[list[int]]] = {}

    def of(target) -> list[list[int]]:
        if id(target) not in cache:
            cache[id(target)] = [target_greedy(target, p) for p in PROMPTS]
        return cache[id(target)]

    return of


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("hybrid", [False, True])
def test_greedy_output_equals_the_targets(arch, hybrid, tiny_pair, wanted):
    target, draft, tok = tiny_pair(arch, vocab_size=16)
    gen = SpeculativeGenerator(target, draft, tok, ngram=True) if hybrid else SpeculativeGenerator(target, "ngram", tok)
    accepted = 0
    for prompt, want in zip(PROMPTS, wanted(target)):
        for gamma in (1, 8):  # one token at a time, and long proposals cut short by rejections
            out = gen.generate([prompt], max_new_tokens=30, gamma=gamma)
            assert rows_of(out)[0] == want, (prompt, gamma)
            accepted += out.stats.accepted
    assert accepted > 0


class Steps:
    """Records the per-row draft counts of every verified proposal, and the hybrid's mixed steps."""

    def __init__(self, monkeypatch):
        self.counts: list[list[int]] = []
        self.mixed = 0
        verify, merge = Call.verify, HybridDrafter._merge

        def counting_verify(run, proposal: Proposal):
            self.counts.append(proposal.drafted().tolist())
            return verify(run, proposal)

        def counting_merge(drafter, *args):
            self.mixed += 1
            return merge(drafter, *args)

        monkeypatch.setattr(Call, "verify", counting_verify)
        monkeypatch.setattr(HybridDrafter, "_merge", counting_merge)

    def some_rows_without_drafts(self) -> bool:
        return any(0 in c and max(c) > 0 for c in self.counts)


@pytest.mark.parametrize("hybrid", [False, True])
def test_ragged_batches_equal_each_prompt_alone(hybrid, tiny_pair, monkeypatch):
    target, draft, tok = tiny_pair("llama", vocab_size=16)
    prompts = batch_prompts(16, seed=1) + PROMPTS
    eos = alone(target, prompts[2], 8, None)[5]
    want = [target_greedy(target, p, eos=eos) for p in prompts]
    assert any(len(w) < 30 for w in want), "no row stops early"
    steps = Steps(monkeypatch)
    gen = SpeculativeGenerator(target, draft if hybrid else "ngram", tok, ngram=hybrid)
    out = gen.generate(prompts, max_new_tokens=30, gamma=4, eos_token_id=eos)
    assert rows_of(out) == want
    if hybrid:
        assert steps.mixed, "no step mixed lookup rows and draft-model rows"
    else:
        assert steps.some_rows_without_drafts(), "no step where some rows drafted and others not"
    # A left-padded tensor with its mask gives the same rows.
    width = max(map(len, prompts))
    ids = torch.tensor([[tiny.PAD] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    assert rows_of(gen.generate(ids, mask, max_new_tokens=30, gamma=3, eos_token_id=eos)) == want


def test_the_hybrid_skips_the_draft_model_when_every_row_takes_the_lookup(tiny_pair, monkeypatch):
    target, draft, tok = tiny_pair("llama", vocab_size=16)
    gen = SpeculativeGenerator(target, draft, tok, ngram=True)
    main_steps = []
    original = ModelDrafter.propose
    monkeypatch.setattr(ModelDrafter, "propose", lambda self, *a: main_steps.append(1) or original(self, *a))
    steps = Steps(monkeypatch)
    out = gen.generate([[5, 5, 5, 5, 5, 5], [3]], max_new_tokens=30, gamma=4)
    assert rows_of(out) == [target_greedy(target, p) for p in ([5, 5, 5, 5, 5, 5], [3])]
    assert 0 < len(main_steps) < len(steps.counts)  # some steps ran the draft model, some did not
    assert out.stats.draft_passes < 4 * len(steps.counts)


@pytest.mark.parametrize("profile", ["cheap", "dear", "model dear as the target"])
def test_the_hybrid_under_auto_equals_target_greedy_and_pays_for_its_model_only_where_it_runs(
    profile, tiny_pair, scripted_auto, monkeypatch
):
    target, draft, tok = tiny_pair("llama", vocab_size=16)
    gen = scripted_auto(SpeculativeGenerator(target, draft, tok, ngram=True), "cheap" if profile == "cheap" else "dear")
    if profile == "model dear as the target":
        gen.tuning.costs.draft = gen.tuning.costs.verify[1]
    main_steps = []
    original = ModelDrafter.propose
    monkeypatch.setattr(ModelDrafter, "propose", lambda self, *a: main_steps.append(1) or original(self, *a))
    steps = Steps(monkeypatch)
    prompts = [[5, 5, 5, 5, 5, 5], [3, 9, 3, 9, 3, 9]]
    out = gen.generate(prompts, max_new_tokens=30)
    assert rows_of(out) == [target_greedy(target, p) for p in prompts]
    lookup_steps = sum(1 for c in steps.counts if max(c, default=0) > 0) - len(main_steps)
    assert lookup_steps > 0, "some steps drafted by lookup alone"
    if profile == "model dear as the target":  # it never pays: only a rare probe runs it
        assert len(main_steps) <= 2 and lookup_steps >= 5


def test_ngram_runs_no_draft_forward(tiny_pair):
    target, _, tok = tiny_pair("llama", vocab_size=16)
    out = SpeculativeGenerator(target, "ngram", tok).generate([PROMPTS[0]], max_new_tokens=20, gamma=4)
    assert out.stats.draft_passes == 0 and out.stats.drafted > 0


def test_earlier_outputs_are_learned_when_rows_finish(tiny_pair, monkeypatch):
    target, _, tok = tiny_pair("llama", vocab_size=16)
    outputs = []
    original = NgramDrafter.finished
    monkeypatch.setattr(NgramDrafter, "finished", lambda self, b, o: outputs.append(o.tolist()) or original(self, b, o))
    eos = alone(target, [3], 8, None)[5]
    gen = SpeculativeGenerator(target, "ngram", tok)
    out = gen.generate([[3], [9, 13, 14]], max_new_tokens=30, gamma=4, eos_token_id=eos)
    assert {r.stop_reason for r in out.stats.rows} == {"eos", "length"}
    assert sorted(outputs) == sorted(rows_of(out))  # exactly the committed tokens, cut at EOS
    for drafter, learns in ((NgramDrafter(), True), (NgramDrafter(history=False), False)):
        gen = SpeculativeGenerator(target, drafter, tok)
        first, second = (gen.generate([[3]], max_new_tokens=30, gamma=4) for _ in range(2))
        assert rows_of(first) == rows_of(second)
        # With the store, the second answer is looked up in the first.
        assert (second.stats.target_passes < first.stats.target_passes) == learns


# -- the hybrid's rule ----------------------------------------------------------------------------


def test_rates_follow_the_evidence():
    rate = AlphaEstimate(prior=0.5, weight=2.0, decay=1.0)
    assert rate.expected(2) == pytest.approx(0.75)
    rate.add(3, failed=True)  # 3 accepts then a rejection: 3 of 4 trials
    assert rate.alpha == pytest.approx(4 / 6)
    assert AlphaEstimate(prior=0.9).expected(8) > AlphaEstimate(prior=0.5).expected(8)


def test_the_hybrid_needs_a_model_drafter():
    class Featured(Drafter):
        feature_layers = (1,)

    with pytest.raises(TypeError, match="must draft with a model"):
        HybridDrafter(NgramDrafter())
    assert HybridDrafter(Featured()).feature_layers == (1,), "a head's features reach it through the hybrid"
    ngram = NgramDrafter()
    assert with_ngram(ngram) is ngram


def test_each_drafter_tells_its_own_model_and_the_parameters_a_step_reads(tiny_pair):
    _, draft, _ = tiny_pair("llama", vocab_size=16)
    model = ModelDrafter(draft)
    assert model.model is draft and model.parameters == draft.num_parameters() > 0
    hybrid = HybridDrafter(model)
    assert hybrid.model is draft and hybrid.parameters == model.parameters, "the main drafter's"
    assert NgramDrafter().model is None and NgramDrafter().parameters == 0
    assert Drafter().model is None and Drafter().parameters is None, "a drafter that cannot tell"


# -- exactness in distribution --------------------------------------------------------------------

NGRAM_PROMPTS = [[6, 6, 6, 6, 6], [8]]  # a strong match, and none at first
HYBRID_PROMPTS = [[8, 6, 6, 6], [8]]  # the lookup wins the first row, the draft model the second
# Per prompt: one call of 3000 rows, half of them each prompt's. The negative controls draw 500 rows per prompt and
# still reach p < 1e-31 (seeds 3 to 7 of each: 1e-31 to 1e-88; at 1,500 rows 1e-95 to 1e-288); the tests ask for
# p < ALPHA = 1e-8.
SAMPLES, CONTROL_SAMPLES = 1_500, 500


def sample_counts(gen, prompts: list[list[int]], settings: dict, seed: int, samples: int = SAMPLES) -> list:
    return stat_utils.sample_counts(
        gen, prompts, settings, seed, vocab=V, new=NEW, samples=samples, batch=samples * len(prompts)
    )


def generators(pair):
    target, draft, tok = pair
    return {
        "ngram": (SpeculativeGenerator(target, "ngram", tok), NGRAM_PROMPTS),
        "hybrid": (SpeculativeGenerator(target, draft, tok, ngram=True), HYBRID_PROMPTS),
    }


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
def test_joint_of_first_tokens_matches_target(pair, kind, name):
    gen, prompts = generators(pair)[kind]
    settings = SETTINGS[name]
    counts = sample_counts(gen, prompts, settings, seed=len(name))
    for prompt, c in zip(prompts, counts):
        pv = chi_square_pvalue(c, exact_joint(pair[0], prompt, settings))
        assert pv > ALPHA, f"{kind}, {name}, prompt {prompt}: samples differ from the target (p-value {pv:.3g})"


def accept_always(verify):
    """Verification that keeps every draft: the one-hot proposal taken as if it were the target's choice."""

    def wrong(drafts, q, p, generator=None, counts=None):
        real = sampling.draft_mask(drafts, counts)
        real = torch.ones_like(drafts, dtype=torch.bool) if real is None else real
        p_drafts = torch.where(real[..., None], q, p[:, :-1])  # then u * q <= p always holds
        return verify(drafts, q, torch.cat([p_drafts, p[:, -1:]], dim=1), generator, counts)

    return wrong


@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
@pytest.mark.parametrize("control", ["residual is p", "always accepted"])
def test_negative_controls_are_detected(pair, kind, control, monkeypatch):
    gen, prompts = generators(pair)[kind]
    if control == "residual is p":  # a rejected x may be drawn again
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    else:
        monkeypatch.setattr(sampling, "verify", accept_always(sampling.verify))
    counts = sample_counts(gen, prompts, {}, seed=3, samples=CONTROL_SAMPLES)  # p-values below 1e-31: ample power
    assert chi_square_pvalue(counts[0], exact_joint(pair[0], prompts[0], {})) < ALPHA


@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
def test_the_drafts_really_disagree_with_the_target(pair, kind, monkeypatch):
    # Otherwise the tests above could pass with any acceptance rule.
    gen, prompts = generators(pair)[kind]
    steps = Steps(monkeypatch)
    out = gen.generate(prompts * 1000, max_new_tokens=NEW, gamma=2, do_sample=True, seed=0)
    assert 0.2 < out.stats.acceptance_rate < 0.9
    if kind == "hybrid":
        assert steps.mixed, "no step mixed lookup rows and draft-model rows"
    else:
        assert steps.some_rows_without_drafts()


# -- plumbing -------------------------------------------------------------------------------------


def test_ngram_by_name(model_dir):
    path = str(model_dir("llama", vocab_size=16, window=40))
    target, tok = tiny.load(path)
    ids = [1, 10, 11, 12, 10, 11]
    want = target_greedy(target, ids, 12)
    for gen in (SpeculativeGenerator(target, "ngram", tok), SpeculativeGenerator.from_pretrained(path, "ngram")):
        assert isinstance(gen.drafter, NgramDrafter) and gen.draft is None
        assert gen._context_window() == 40
        assert rows_of(gen.generate([ids], max_new_tokens=12, gamma=4))[0] == want
    hybrid = SpeculativeGenerator.from_pretrained(
        path, str(model_dir("llama", vocab_size=16, window=40, seed=1)), ngram=True
    )
    assert isinstance(hybrid.drafter, HybridDrafter) and hybrid.draft is hybrid.drafter.main.model
    assert rows_of(hybrid.generate([ids], max_new_tokens=12, gamma=4))[0] == want
    with pytest.raises(ValueError, match="context window"):
        SpeculativeGenerator(target, "ngram", tok).generate([ids * 6], max_new_tokens=12)


def test_an_unknown_draft_name_is_a_clear_error(tiny_pair):
    target, _, tok = tiny_pair("llama", vocab_size=16)
    with pytest.raises(TypeError, match="'ngram'.*from_pretrained"):
        SpeculativeGenerator(target, "ngrams", tok)


@pytest.mark.usefixtures("fresh_api_cache")
def test_api_draft_ngram_and_the_hybrid(model_dir):
    target, draft = str(model_dir("llama", seed=0)), str(model_dir("llama", seed=1))
    reference = hfspec.generate("w10 w11 w10 w11", target=target, draft=draft, max_new_tokens=12)
    text, stats = hfspec.generate("w10 w11 w10 w11", target=target, draft="ngram", max_new_tokens=12, return_stats=True)
    assert text == reference and stats.draft_passes == 0
    assert hfspec.generate("w10 w11 w10 w11", target=target, draft=draft, ngram=True, max_new_tokens=12) == reference
    kinds = sorted(gen.drafter.kind for gen in api._PAIRS.values())
    assert kinds == ["hybrid", "model", "ngram"]
    with pytest.raises(TypeError, match="ngram must be True or False"):
        hfspec.generate("w10", target=target, draft=draft, ngram="yes")


@pytest.mark.usefixtures("fresh_api_cache")
def test_cli_draft_ngram_and_the_ngram_flag(capsys, model_dir):
    target, draft = str(model_dir("llama", seed=0)), str(model_dir("llama", seed=1))
    assert cli.main(["generate", "--help"]) == 0
    assert "--ngram" in capsys.readouterr().out
    runs = {}
    for name, flags in {
        "model": ["--draft", draft],
        "ngram": ["--draft", "ngram"],
        "hybrid": ["--draft", draft, "--ngram"],
    }.items():
        capsys.readouterr()
        code = cli.main(
            [
                "generate",
                "w10 w11 w10 w11",
                "--target",
                target,
                *flags,
                "--max-new-tokens",
                "12",
                "--json",
                "--adaptive",
                "cost",
            ]
        )
        assert code == 0, capsys.readouterr().err
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["ngram"]["text"] == runs["model"]["text"] == runs["hybrid"]["text"]
    assert [runs[k]["settings"]["drafter"] for k in ("model", "ngram", "hybrid")] == ["model", "ngram", "hybrid"]


@pytest.mark.usefixtures("fresh_api_cache")
def test_presets_name_ngram_and_the_hybrid(model_dir, tmp_path):
    target, draft = str(model_dir("llama", seed=0)), str(model_dir("llama", seed=1))
    lookup, hybrid = tmp_path / "lookup.json", tmp_path / "hybrid.json"
    lookup.write_text(json.dumps({"name": "lookup", "target": target, "draft": "ngram", "gamma": 6}))
    hybrid.write_text(json.dumps({"name": "hybrid", "target": target, "draft": draft, "ngram": True}))
    assert load_preset(hybrid).ngram is True and load_preset(lookup).ngram is False
    reference = hfspec.generate("w10 w11 w10", target=target, draft=draft, max_new_tokens=10)
    assert hfspec.generate("w10 w11 w10", config=str(lookup), max_new_tokens=10) == reference
    assert hfspec.generate("w10 w11 w10", config=str(hybrid), max_new_tokens=10) == reference
    assert hfspec.generate("w10 w11 w10", config=str(hybrid), ngram=False, max_new_tokens=10) == reference
    assert sorted(gen.drafter.kind for gen in api._PAIRS.values()) == ["hybrid", "model", "ngram"]
    hybrid.write_text(json.dumps({"name": "hybrid", "target": target, "draft": draft, "ngram": "yes"}))
    with pytest.raises(HfspecError, match="ngram must be bool"):
        load_preset(hybrid)


# -- prompt sets ----------------------------------------------------------------------------------


def read_jsonl(name: str) -> list[dict]:
    path = Path(hfspec.__file__).parent / "data" / "prompts" / name
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_grounded_and_mixed_prompt_sets_ship_with_the_package():
    grounded, mixed, bench = (read_jsonl(n) for n in ("grounded.jsonl", "mixed.jsonl", "bench.jsonl"))
    for items in (grounded, mixed):
        assert all(set(item) == {"id", "kind", "prompt"} for item in items)
        assert len({item["id"] for item in items}) == len(items)
    assert len(grounded) >= 12 and {"summary", "rewrite", "code-edit", "qa"} <= {g["kind"] for g in grounded}
    for item in grounded:  # an instruction, a blank line, then the given text of 80 to 300 words
        instruction, passage = item["prompt"].split("\n\n", 1)
        assert instruction and 80 <= len(passage.split()) <= 300, item["id"]
    # Half open-ended prompts of bench.jsonl, half grounded ones, each unchanged.
    assert sum(m in bench for m in mixed) == sum(m in grounded for m in mixed) == len(mixed) // 2
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "data/prompts/*" in data["tool"]["setuptools"]["package-data"]["hfspec"]
