"""Draft trees: the pure tree math, exactness at any temperature, greedy identity, caches and refusals."""

from __future__ import annotations

import itertools

import eagle3_heads as eh
import numpy as np
import pytest
import stat_utils
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue

from hfspec import SpeculativeGenerator, api, tree
from hfspec import generator as generator_module
from hfspec.commands import cli
from hfspec.decoding import sampling
from hfspec.drafters import ngram
from hfspec.drafters.eagle3 import Eagle3Drafter
from hfspec.errors import HfspecError
from hfspec.generator import AUTO_TREES
from hfspec.measure.costs import Costs
from hfspec.models import adapter as models
from hfspec.models import kv_cache as cache
from hfspec.models.kv_cache import KVState
from hfspec.tree import Proposal
from hfspec.tree import probe as tree_probe

V = 9

# -- the pure functions, on hand-made trees and distributions ---------------------------------------

#        root
#       /    \
#      0(4)   1(5)
#     /  \      \
#   2(6) 3(7)   4(6)
PARENTS = torch.tensor([[-1, -1, 0, 0, 1]])
TOKENS = torch.tensor([[4, 5, 6, 7, 6]])


def test_depths_and_ancestry_of_a_hand_made_tree():
    assert tree.depths(PARENTS).tolist() == [[1, 1, 2, 2, 2]]
    seen = tree.ancestry(PARENTS)[0].int().tolist()
    assert seen == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [0, 1, 0, 0, 1]]


def test_greedy_walk_follows_the_target_argmax():
    hand = Proposal(TOKENS, parents=PARENTS)
    # argmax after the root is 5 (node 1), after node 1 is 6 (node 4), after node 4 is 3 (the bonus)
    argmax = torch.tensor([[5, 0, 6, 0, 0, 3]])
    path, accepted, nxt = tree.verify_greedy(hand, argmax)
    assert path.tolist() == [[1, 4]] and accepted.tolist() == [2] and nxt.tolist() == [3]
    # a padding node never matches, even when its token is the argmax
    padded = Proposal(TOKENS, parents=PARENTS, real=torch.tensor([[True, False, True, True, True]]))
    path, accepted, nxt = tree.verify_greedy(padded, argmax)
    assert accepted.tolist() == [0] and nxt.tolist() == [5]


def test_a_child_equal_to_the_target_is_always_accepted_and_one_of_zero_target_mass_never():
    p = torch.full((1, 6, V), 1e-9)
    p[0, 0, 5] = 1.0  # the target puts everything on node 1's token
    p = p / p.sum(-1, keepdim=True)
    q = torch.full((1, 5, V), 1.0 / V)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        path, accepted, _ = tree.verify(Proposal(TOKENS, q, PARENTS), p, g)
        assert int(path[0, 0]) == 1  # node 0 (token 4) has ~0 target mass; node 1 is accepted with certainty


def random_dist(g: torch.Generator, *shape: int, peak: float = 3.0) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, V, generator=g) * peak, dim=-1)


def two_level_samples(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of the first two tokens when a two-level tree (children drawn without replacement by
    ``tree.expand``) is verified against hand-made p, and the exact joint p1(x) p2(y | x)."""
    g = torch.Generator().manual_seed(seed)
    p1, p2 = random_dist(g), random_dist(g, V)  # the target: p2[x] follows token x
    q1, q2 = random_dist(g, peak=2.0), random_dist(g, V, peak=2.0)  # an unrelated draft
    ones = torch.ones(rows, 1)
    alive = torch.ones(rows, 1, dtype=torch.bool)
    f1, t1, c1, r1 = tree.expand(ones, alive, q1.expand(rows, 1, V), 3, True, g)
    f2, t2, _, r2 = tree.expand(c1, r1, q2[t1], 4, True, g)
    tokens = torch.cat([t1, t2], 1)
    parents = torch.cat([torch.full_like(f1, -1), f2], 1)
    q = torch.cat([q1.expand(rows, 3, V), q2[t1].gather(1, f2[:, :, None].expand(-1, -1, V))], 1)
    p = torch.cat([p1.expand(rows, 1, V), p2[t1], p2[t2]], 1)  # after a depth-2 node: any p (a bonus, unused)
    hand = Proposal(tokens, q, parents, torch.cat([r1, r2], 1))
    path, accepted, nxt = tree.verify(hand, p, g)
    counts = np.zeros((V, V))
    for b in range(rows):
        drawn = tokens[b, path[b, : accepted[b]]].tolist() + [int(nxt[b])]
        if len(drawn) < 2:  # the second token comes from the target after the first
            drawn.append(int(sampling.sample(p2[drawn[0]][None], g)[0]))
        counts[drawn[0], drawn[1]] += 1
    return counts, (p1[:, None] * p2).numpy()


def test_multi_draft_acceptance_is_exact_and_the_negative_control_fails(monkeypatch):
    counts, exact = two_level_samples(3000, seed=1)
    assert chi_square_pvalue(counts, exact) > ALPHA
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)  # the wrong rule: a rejected child leaves p as it was
    counts, exact = two_level_samples(3000, seed=1)
    assert chi_square_pvalue(counts, exact) < ALPHA


def test_expand_draws_children_without_replacement_and_marks_empty_slots():
    q = torch.zeros(2, 1, V)
    q[:, 0, :2] = 0.5  # two tokens possible: a third child is padding
    frontier, tokens, cum, real = tree.expand(
        torch.ones(2, 1), torch.ones(2, 1, dtype=torch.bool), q, 3, True, torch.Generator().manual_seed(0)
    )
    assert frontier.tolist() == [[0, 0, 0]] * 2 and real.tolist() == [[True, True, False]] * 2
    assert sorted(tokens[0, :2].tolist()) == [0, 1] and torch.allclose(cum[:, :2], torch.full((2, 2), 0.5))
    # greedy: the best slots across the frontier by cumulative probability
    q = torch.zeros(1, 2, V)
    q[0, 0, 3], q[0, 0, 4], q[0, 1, 5], q[0, 1, 6] = 0.6, 0.4, 0.9, 0.1
    frontier, tokens, cum, _ = tree.expand(torch.tensor([[0.5, 0.4]]), torch.ones(1, 2, dtype=torch.bool), q, 3, False)
    assert frontier.tolist() == [[0, 0, 1]] and tokens.tolist() == [[3, 4, 5]]
    assert torch.allclose(cum, torch.tensor([[0.3, 0.2, 0.36]]))


def test_keep_gathers_a_tree_path_and_crops_the_rest():
    kv = KVState(2, torch.device("cpu"))
    keys = torch.arange(2 * 7, dtype=torch.float32).view(2, 1, 7, 1)
    kv.append(keys, keys.clone())
    kv.extend_mask(torch.ones(2, 7, dtype=torch.long))
    kv.keep(torch.tensor([3, 2]), 3, path=torch.tensor([[0, 2, 3], [0, 1, -1]]))
    layer = kv.cache.layers[0]
    assert layer.keys[:, 0, :, 0].tolist() == [[0, 1, 2, 3, 5, 6], [7, 8, 9, 10, 11, 12]]  # a hole keeps its column
    assert kv.mask.tolist() == [[1] * 6, [1, 1, 1, 1, 1, 0]]
    kv.check(torch.tensor([6, 5]), "test")


# -- end to end: exact at any temperature -----------------------------------------------------------

# The exact samplers draw 3,000 rows. The negative controls of the model and lookup trees draw 1,500 and still fail
# far below ALPHA = 1e-8 (seeds 3 to 6: the tree without the residual update 1e-147 to 1e-174, the lookup tree 1e-27
# to 1e-32, the hybrid tree 1e-88 to 1e-148); the EAGLE-3 control keeps 3,000 (1e-42 to 1e-58; 1e-9 at 1,500).
NEW, SAMPLES, CONTROL_SAMPLES = 3, 3_000, 1_500
PROMPT = [7, 8, 7, 7]


def tree_pair(model_dir) -> tuple:
    """(target, draft, tokenizer), loaded afresh: the models these tests draw trees with."""
    common = dict(vocab_size=V, sharpness=30.0, eos=None, hidden=16, layers=1)
    target, tok = tiny.load(model_dir("llama", seed=10, **common))
    # Far from the target (noise as large as the weights): many rejections, yet some paths two deep.
    draft, _ = tiny.load(model_dir("llama", seed=10, perturb=1.0, perturb_seed=5, **common))
    return target, draft, tok


@pytest.fixture(scope="module")
def pair(model_dir):
    return tree_pair(model_dir)


def tree_pvalue(
    gen: SpeculativeGenerator, settings: dict, nodes: int, seed: int, prompt: list[int] = PROMPT, samples: int = SAMPLES
) -> tuple[float, list[int]]:
    """The chi-square p-value of ``samples`` rows' first NEW tokens drawn with trees of ``nodes`` against the
    target's exact joint, and the steps by accepted depth."""
    g = torch.Generator().manual_seed(seed)
    out = gen.generate([prompt] * samples, max_new_tokens=NEW, tree=nodes, do_sample=True, generator=g, **settings)
    counts = np.zeros([V] * NEW)
    np.add.at(counts, tuple(out.sequences[:, -NEW:].numpy().T), 1)
    depths = list(out.stats.depth_histogram)
    return chi_square_pvalue(counts, stat_utils.exact_joint(gen.target, prompt, settings, V, NEW)), depths


SETTINGS = {"t0.7_top_k": {"temperature": 0.7, "top_k": 4}, "t0.7_top_p": {"temperature": 0.7, "top_p": 0.85}}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_tree_samples_match_the_target(pair, name):
    target, draft, tok = pair
    pv, depths = tree_pvalue(SpeculativeGenerator(target, draft, tok), SETTINGS[name], 6, seed=3)
    deepest = 2 if "top_k" in name else 1  # top-p at T=0.7 leaves the draft one token often: paths stay short
    assert len(depths) > deepest and depths[0] > 0, f"no path {deepest} deep accepted, or none rejected: {depths}"
    assert pv > ALPHA, f"{name}: tree samples differ from the target (p-value {pv:.3g})"


def test_tree_samples_with_float32_draws_match_the_target(pair, monkeypatch):
    monkeypatch.setattr(sampling, "draw_dtype", lambda device: torch.float32)  # as on MPS: no float64 there
    target, draft, tok = pair
    pv, depths = tree_pvalue(SpeculativeGenerator(target, draft, tok), SETTINGS["t0.7_top_k"], 6, seed=4)
    assert len(depths) > 2 and pv > ALPHA, f"float32 draws: p-value {pv:.3g}, depths {depths}"


def test_negative_control_tree_without_the_residual_update_is_detected(pair, monkeypatch):
    target, draft, tok = pair
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    settings = SETTINGS["t0.7_top_k"]
    gen = SpeculativeGenerator(target, draft, tok)
    assert tree_pvalue(gen, settings, 6, seed=3, samples=CONTROL_SAMPLES)[0] < ALPHA


# -- greedy: identical to the target's own generate() ----------------------------------------------


def reference(model, ids: list[int], new: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("llama", {}),
        ("gpt2", {}),
        ("qwen2", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0}),
        ("gemma2", {"sliding_window": 4}),
    ],
)
def test_greedy_trees_equal_target_greedy_on_ragged_batches(arch, extra, model_dir):
    common = dict(vocab_size=64, eos=None, **extra)
    target, tok = tiny.load(model_dir(arch, seed=0, **common))
    draft, _ = tiny.load(model_dir(arch, seed=0, perturb=0.3, **common))  # close to the target: deep paths
    gen = SpeculativeGenerator(target, draft, tok)
    prompts = [list(range(5, 25)), [7, 8, 9], list(range(30, 41))]  # longer than the window, and ragged
    want = [reference(target, p, 24) for p in prompts]
    # 0: the chain, whose sliding windows are counted in positions too. A tree of one node per level is the chain
    # (test_tree_of_one_node_per_level_is_the_chain); here trees one and two levels wide on every cache type.
    for nodes in (0, 5, 16):
        out = gen.generate(prompts, max_new_tokens=24, gamma=3, tree=nodes)  # the invariants are checked every step
        got = [row[-24:] for row in out.sequences.tolist()]
        assert got == want, (arch, nodes)
        if nodes:
            assert out.stats.tree_nodes > 0 and len(out.stats.depth_histogram) > min(nodes, 2), (
                out.stats.depth_histogram
            )


def test_the_cache_check_catches_a_path_gathered_wrong(tiny_pair, monkeypatch):
    target, draft, tok = tiny_pair("llama")
    keep = KVState.keep

    def wrong(kv: KVState, count: torch.Tensor, start: int, ids=None, path=None) -> None:
        keep(kv, count + 1 if path is not None and bool((path != torch.arange(path.shape[1])).any()) else count, start)

    monkeypatch.setattr(KVState, "keep", wrong)
    with pytest.raises(AssertionError, match="cache"):
        SpeculativeGenerator(target, draft, tok).generate([[5, 6, 7]], max_new_tokens=8, tree=4)


def test_chains_on_mistral_sliding_windows_run_each_prompt_alone_and_stay_exact(model_dir):
    # Mistral takes no mask per layer type, so its windows count cache columns: holes would shift them.
    common = dict(vocab_size=64, eos=None, sliding_window=4)
    target, tok = tiny.load(model_dir("mistral", seed=0, **common))
    draft, _ = tiny.load(model_dir("mistral", seed=1, **common))
    prompts = [list(range(5, 25)), [7, 8, 9], list(range(30, 41))]
    out = SpeculativeGenerator(target, draft, tok).generate(prompts, max_new_tokens=24, gamma=3)
    assert [row[-24:] for row in out.sequences.tolist()] == [reference(target, p, 24) for p in prompts]


def test_eos_on_an_accepted_path_ends_the_row(tiny_pair):
    # With draft = target the argmax path is always in the tree, so an EOS lands inside accepted paths.
    target, _, tok = tiny_pair("llama", vocab_size=16)
    gen = SpeculativeGenerator(target, target, tok)
    g = torch.Generator().manual_seed(11)
    stopped = 0
    for _ in range(12):
        ids = torch.randint(tiny.BOS + 6, 16, (1, int(torch.randint(1, 12, (1,), generator=g))), generator=g)
        want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        got = gen.generate(ids, max_new_tokens=40, tree=8)
        assert torch.equal(got.sequences, want)
        if got.stats.rows[0].stop_reason == "eos":
            stopped += 1
            new = got.sequences[0, ids.shape[1] :]
            assert new[-1].item() == tiny.EOS and bool((new[:-1] != tiny.EOS).all())
    assert stopped > 0, "no prompt produced an EOS; the test would prove nothing"


def test_tree_of_one_node_per_level_is_the_chain(tiny_pair):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)
    chain = gen.generate([[5, 6, 7]], max_new_tokens=16, gamma=1)
    one = gen.generate([[5, 6, 7]], max_new_tokens=16, tree=1)
    assert one.sequences.tolist() == chain.sequences.tolist()
    assert one.stats.target_passes == chain.stats.target_passes


# -- refusals ---------------------------------------------------------------------------------------


def test_recurrent_target_refuses_trees_and_still_runs_chains(model_dir):
    target, tok = tiny.load(model_dir("falcon_h1", vocab_size=64))
    draft, _ = tiny.load(model_dir("llama", seed=3, vocab_size=64))
    gen = SpeculativeGenerator(target, draft, tok)
    with pytest.raises(HfspecError, match="recurrent.*tree=None"):
        gen.generate([[5, 6, 7]], max_new_tokens=4, tree=8)
    assert gen.generate([[5, 6, 7]], max_new_tokens=4, tree=None).sequences.shape[1] == 7


def test_sliding_window_without_a_mask_per_layer_type_is_refused(model_dir):
    target, tok = tiny.load(model_dir("mistral", vocab_size=64, sliding_window=4))
    gen = SpeculativeGenerator(target, target, tok)
    with pytest.raises(HfspecError, match="sliding-window.*tree=None"):
        gen.generate([[5, 6, 7]], max_new_tokens=4, tree=8)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"tree": -1}, "node budget"),
        ({"tree": 2.5}, "node budget"),
        ({"tree": 4, "repetition_penalty": 1.3}, "reads the text so far"),
    ],
)
def test_bad_tree_settings_are_refused(tiny_pair, bad, message):
    target, draft, tok = tiny_pair("llama")
    with pytest.raises(HfspecError, match=message):
        SpeculativeGenerator(target, draft, tok).generate([[5, 6, 7]], max_new_tokens=4, **bad)


def test_auto_tree_with_a_fixed_gamma_is_the_chain(tiny_pair):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)
    auto = gen.generate([[5, 6, 7]], max_new_tokens=12, gamma=3, tree="auto")
    assert auto.stats.tree_nodes == 0
    assert auto.sequences.tolist() == gen.generate([[5, 6, 7]], max_new_tokens=12, gamma=3).sequences.tolist()


def flat_costs(draft_ms: float = 0.1) -> Costs:
    """Costs given by hand: every verification as dear as one token, drafting next to free (trees pay)."""
    return Costs(dict.fromkeys([*range(1, 10), 17, 33], 0.01), draft_ms / 1e3)


def test_auto_trees_equal_target_greedy(model_dir):
    common = dict(vocab_size=64, eos=None)
    target, tok = tiny.load(model_dir("llama", seed=0, **common))
    draft, _ = tiny.load(model_dir("llama", seed=0, perturb=0.6, **common))
    gen = SpeculativeGenerator(target, draft, tok)
    gen.tuning.costs = flat_costs()
    gen.tuning.costs.drafter = gen.drafter
    prompts = [list(range(5, 25)), [7, 8, 9], list(range(30, 41))]
    want = [reference(target, p, 24) for p in prompts]
    out = gen.generate(prompts, max_new_tokens=24)  # the defaults, gamma="auto" and tree="auto"; invariants checked
    assert [row[-24:] for row in out.sequences.tolist()] == want
    assert out.stats.tree_nodes > 0 and gen.tuning.trees == AUTO_TREES, "flat costs: auto drafts trees"
    assert gen.tuning.tree_evidence().depth_trials, "tree steps taught acceptance by depth"


def test_auto_trees_sample_with_the_invariants_kept(tiny_pair):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, target, tok)  # the target as its own draft: every guess is worth a tree
    gen.tuning.costs = flat_costs()
    out = gen.generate(
        [[5, 6, 7], [9, 8]], max_new_tokens=16, gamma="auto", tree="auto", do_sample=True, temperature=0.8, seed=0
    )  # the caches' invariants are checked after every step
    assert out.stats.tree_nodes > 0
    assert all(r.committed == 16 or r.stop_reason == "eos" for r in out.stats.rows), out.stats.rows
    assert sum(out.stats.depth_histogram[2:]) > 0, "a perfect drafter's trees are kept two deep and more"


def test_auto_trees_pick_the_chain_where_trees_cannot_be_exact(tiny_pair):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)
    gen.tuning.costs = flat_costs()
    out = gen.generate([[5, 6, 7]], max_new_tokens=12, gamma="auto", tree="auto", repetition_penalty=1.3)
    assert out.stats.tree_nodes == 0 and gen.tuning.trees == ()  # the penalty reads each path: chains only
    want = target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3)
    assert out.sequences.tolist() == want.tolist()
    out = gen.generate([[5, 6, 7]], max_new_tokens=12, gamma="auto", tree="auto")
    assert gen.tuning.trees == AUTO_TREES  # the same generator without the penalty: trees allowed again
    assert out.sequences[0, 3:].tolist() == reference(target, [5, 6, 7], 12)


def test_every_tree_shape_fits_its_budget():
    for nodes in itertools.chain(range(1, 40), (64, 100)):
        width, depth = tree.shape(nodes)
        assert 1 <= width <= nodes and (depth - 1) * width < nodes <= depth * width


# -- n-gram trees -----------------------------------------------------------------------------------


def test_trie_keeps_the_most_frequent_prefixes_parents_first():
    nodes = ngram.trie([[3, 4], [3, 4], [3, 5], [6]], 4, 0.0)
    assert nodes == [(3, -1), (6, -1), (4, 0), (5, 0)]
    assert ngram.trie([[3, 4], [3, 4], [3, 5], [6]], 4, 0.4) == [(3, -1), (4, 0)]  # shares under 0.4 left out


def test_ngram_tree_holds_every_continuation_of_the_match():
    drafter = ngram.NgramDrafter(history=False)
    drafter.start(2, torch.device("cpu"))
    ctx = NgramCtx([[1, 2, 3, 9, 1, 2, 4, 9, 1, 2], [5, 5]])
    proposal = drafter.propose_tree(ctx, 6, 3)
    real = proposal.mask()
    row = list(zip(proposal.tokens[0][real[0]].tolist(), proposal.parents[0][real[0]].tolist()))
    assert (3, -1) in row and (4, -1) in row and (9, row.index((3, -1))) in row
    assert proposal.q is None and int(real[1].sum()) == 0  # one-hot q; the second row has no match


class NgramCtx:
    """The part of the loop's Context a model-free drafter reads."""

    sample, generator, vocab = False, None, 100

    def __init__(self, rows: list[list[int]]):
        width = max(map(len, rows))
        self.tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        self.lengths = torch.tensor([len(r) for r in rows])


def test_ngram_trees_equal_target_greedy(tiny_pair):
    target, _, tok = tiny_pair("llama", vocab_size=16)
    gen = SpeculativeGenerator(target, "ngram", tok)
    prompts = [[5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6], [9, 9, 9, 9], [3, 4]]
    out = gen.generate(prompts, max_new_tokens=30, tree=8, eos_token_id=[])
    for prompt, row in zip(prompts, out.sequences.tolist()):
        assert row[-30:] == reference(target, prompt, 30)
    assert out.stats.tree_nodes > 0 and out.stats.accepted > 0


# "8 3" was followed by 7 and by 3, which the target gives 0.36 and 0.43: two children, often rejected.
NGRAM_PROMPT = [8, 3, 7, 8, 3, 3, 8, 3]


@pytest.mark.parametrize("residual", ["exact", "control"])
@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
def test_lookup_tree_samples_match_the_target(pair, kind, residual, monkeypatch):
    # The lookup alone, and grafted onto the draft model's tree (one-hot nodes after sampled ones).
    target, draft, tok = pair
    if residual == "control":
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    settings = {"temperature": 0.7, "top_k": 5}
    gen = (
        SpeculativeGenerator(target, "ngram", tok)
        if kind == "ngram"
        else SpeculativeGenerator(target, draft, tok, ngram=True)
    )
    samples = SAMPLES if residual == "exact" else CONTROL_SAMPLES
    pv, depths = tree_pvalue(gen, settings, 6 if kind == "ngram" else 8, 4, NGRAM_PROMPT, samples)
    assert depths[0] > 0 and len(depths) > 1, depths
    assert (pv > ALPHA) if residual == "exact" else (pv < ALPHA), pv


# -- the surface ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fresh_api_cache")
def test_cli_tree_prints_the_api_text_and_the_tree_counts(capsys, model_dir):
    target, draft = str(model_dir("llama", seed=0)), str(model_dir("llama", seed=0, perturb=0.3))
    capsys.readouterr()
    code = cli.main(
        [
            "generate",
            "w10 w11 w12",
            "--target",
            target,
            "--draft",
            draft,
            "--max-new-tokens",
            "12",
            "--tree",
            "6",
            "--stats",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and out == api.generate("w10 w11 w12", target=target, draft=draft, max_new_tokens=12) + "\n"
    assert "tree nodes verified" in err and "steps by accepted depth" in err
    assert cli.main(["generate", "w10", "--target", target, "--draft", draft, "--tree", "-2"]) == 2
    assert "--tree: must be >= 0 or 'auto'" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["generate", "w10"]).tree == "auto"  # the API's default


# -- EAGLE-3 trees ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eagle_target(model_dir):
    return tiny.load(model_dir("llama", vocab_size=64, layers=8, hidden=32, seed=0, sharpness=8.0))


def test_eagle3_trees_equal_target_greedy(eagle_target):
    target, tok = eagle_target
    head = eh.train_head(target, draft_size=48, steps=60)
    gen = SpeculativeGenerator(target, Eagle3Drafter(head, target), tok)
    prompts = [[5], list(range(5, 17)), [9, 30, 31]]  # a one-token prompt cannot draft at first
    want = [reference(target, p, 20) for p in prompts]
    for nodes in (3, 12):
        out = gen.generate(prompts, max_new_tokens=20, tree=nodes, eos_token_id=[])
        assert [row[-20:] for row in out.sequences.tolist()] == want, nodes
        assert out.stats.accepted > 0 and len(out.stats.depth_histogram) > 2, out.stats.depth_histogram


@pytest.mark.parametrize("residual", ["exact", "control"])
def test_eagle3_tree_samples_match_the_target(model_dir, residual, monkeypatch):
    target, tok = tiny.load(model_dir("llama", vocab_size=V, layers=5, hidden=16, seed=10, sharpness=30.0, eos=None))
    head = eh.random_head(target, [1, 3, 4, 5, 6, 7], seed=1, scale=4.0, layer_ids=(1, 2, 3))
    if residual == "control":
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    settings = {"temperature": 0.8, "top_p": 0.95}
    pv, depths = tree_pvalue(SpeculativeGenerator(target, Eagle3Drafter(head, target), tok), settings, 6, 8)
    assert depths[0] > 0 and len(depths) > 1, depths
    assert (pv > ALPHA) if residual == "exact" else (pv < ALPHA), pv


# -- hybrid trees -----------------------------------------------------------------------------------


def test_graft_adds_lookup_paths_under_the_matching_nodes_once():
    main = Proposal(TOKENS, parents=PARENTS, real=torch.tensor([[True, True, True, True, False]]))
    # lookup paths: 4 6 (already there), 4 8 (new, under node 0), 5 6 (node 4 is padding: new), 3 (new root child)
    extra = Proposal(torch.tensor([[4, 5, 3, 6, 8, 6]]), parents=torch.tensor([[-1, -1, -1, 0, 0, 1]]))
    merged = tree.graft(main, extra)
    added = list(zip(merged.tokens[0, 5:].tolist(), merged.parents[0, 5:].tolist()))
    assert added == [(3, -1), (8, 0), (6, 1)] and merged.mask()[0].tolist() == [True] * 4 + [False] + [True] * 3


@pytest.mark.parametrize("head", [False, True])
def test_hybrid_trees_equal_target_greedy(eagle_target, head, model_dir):
    target, tok = eagle_target
    main = (
        Eagle3Drafter(eh.random_head(target, list(range(3, 43)), seed=3), target)
        if head
        else tiny.load(model_dir("llama", vocab_size=64, layers=8, hidden=32, seed=0, sharpness=8.0, perturb=0.5))[0]
    )
    gen = SpeculativeGenerator(target, main, tok, ngram=True)
    prompts = [[5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6], list(range(5, 17)), [9, 30, 31]]
    want = [reference(target, p, 24) for p in prompts]
    out = gen.generate(prompts, max_new_tokens=24, tree=10, eos_token_id=[])
    assert [row[-24:] for row in out.sequences.tolist()] == want
    assert out.stats.tree_nodes > 0 and out.stats.accepted > 0


# -- the probe: a target whose attention misreads the tree never verifies one ---------------------------------


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("llama", {}),
        ("gpt2", {}),
        ("qwen2", {}),
        ("gemma2", {"sliding_window": 4}),
    ],
)
def test_the_tree_probe_passes_targets_that_read_trees(arch, extra, model_dir):
    target, _ = tiny.load(model_dir(arch, seed=0, vocab_size=64, eos=None, **extra))
    assert tree_probe.reads_trees(target)


def test_the_tree_probe_catches_a_mask_that_lets_siblings_see_each_other(model_dir, monkeypatch):
    target, _ = tiny.load(model_dir("llama", seed=0, vocab_size=64, eos=None))
    monkeypatch.setattr(
        cache, "tree_attention", lambda model, full, sliding=None: models.tree_attention(model, torch.ones_like(full))
    )  # every node sees every node: the attention a careless model would use
    assert not tree_probe.reads_trees(target)


def test_a_target_that_misreads_trees_keeps_chains(tiny_pair, monkeypatch):
    target, draft, tok = tiny_pair("llama")
    monkeypatch.setattr(generator_module, "reads_trees", lambda model: False)
    gen = SpeculativeGenerator(target, draft, tok)
    with pytest.raises(HfspecError, match="did not read a draft tree exactly"):
        gen.generate([[5, 6, 7]], max_new_tokens=8, tree=4)
    gen.tuning.costs = flat_costs()
    out = gen.generate([[5, 6, 7]], max_new_tokens=12)  # tree="auto": the chain, exact
    assert out.stats.tree_nodes == 0 and gen.tuning.trees == ()
    assert out.sequences[0, 3:].tolist() == reference(target, [5, 6, 7], 12)
