"""γ policies on scripted costs and acceptances: what they choose, and when they stop drafting; a hybrid's steps
priced by what they draft."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hfspec.drafters import Drafter, Proposal
from hfspec.drafters.hybrid import HybridDrafter
from hfspec.measure.alpha import AlphaEstimate
from hfspec.measure.costs import Costs, Price
from hfspec.policy import AutoGamma, CostModelGamma, HeuristicGamma, Plan, Step, Tuning
from hfspec.policy.auto import AutoPlan
from hfspec.tree import Sources
from hfspec.tree import shape as tree_shape
from hfspec.tree.acceptance import TreeAcceptance, first_children

ROW = torch.tensor([0])


def step(
    gamma: int,
    accepted: list[int],
    confidence: list[list[float]] | None = None,
    drafted: list[int] | None = None,
    draft_seconds: float | None = None,
    verify_seconds: float | None = None,
    costs: Costs | None = None,
    plan: Plan | None = None,
) -> Step:
    """A scripted step of ``plan`` (by default a plain plan of γ); by default it took exactly what ``costs``
    predict."""
    rows = torch.arange(len(accepted))
    drafted_t = torch.tensor(drafted if drafted is not None else [gamma] * len(accepted))
    if costs is not None:
        draft_seconds = gamma * costs.draft if draft_seconds is None else draft_seconds
        verify_seconds = costs.verify[gamma + 1] if verify_seconds is None else verify_seconds
    return Step(
        rows,
        Plan(gamma) if plan is None else plan,
        gamma,
        drafted_t,
        torch.tensor(accepted),
        None if confidence is None else torch.tensor(confidence, dtype=torch.float32),
        draft_seconds or 0.0,
        verify_seconds or 0.0,
    )


def cpu_costs(draft_ms: float = 4.0, v: tuple[float, ...] = (1.16, 1.34, 2.30, 2.01, 2.2, 2.4, 2.6, 2.8)) -> Costs:
    """A 40 ms target step whose forward over k tokens costs v(k-1) times that (an AVX-512 CPU's profile)."""
    step_s = 0.040
    return Costs({1: step_s, **{g + 1: step_s * x for g, x in enumerate(v, start=1)}}, draft_ms / 1e3)


def auto(costs: Costs, prior: float | None = None, batch: int = 1) -> AutoGamma:
    tuning = Tuning(costs=costs)
    if prior is not None:
        tuning.evidence().accepted, tuning.evidence().trials = prior * 100, 100.0
    policy = AutoGamma(tuning)
    policy.begin(batch)
    return policy


def test_cost_model_follows_the_acceptance_rate():
    policy = CostModelGamma(cost=0.05)
    for _ in range(50):
        policy.update(step(4, [4]))  # every draft accepted: the estimate of α rises, and so does γ
    assert policy.alpha > 0.9 and policy.gamma(ROW).gamma == 8
    for _ in range(200):
        policy.update(step(4, [0]))
    assert policy.alpha < 0.1 and policy.gamma(ROW).gamma == 1


def test_heuristic_grows_after_full_acceptance_and_shrinks_otherwise():
    policy = HeuristicGamma(value=3)
    policy.update(step(3, [3]))
    assert policy.gamma(ROW).gamma == 5
    policy.update(step(5, [2]))
    assert policy.gamma(ROW).gamma == 4


def test_auto_picks_plain_decoding_when_nothing_pays():
    costs = cpu_costs()
    policy = auto(costs, prior=0.05)
    assert policy.gamma(ROW).gamma == 0
    # A free verification and a free draft pay even for a poor draft.
    flat = Costs(dict.fromkeys(range(1, 10), 0.04), 0.0)
    assert auto(flat, prior=0.05).gamma(ROW).gamma >= 1


def test_auto_follows_the_measured_verification_cost_not_a_formula():
    # Verifying 2..3 tokens is cheap, 4+ dear (this CPU): a good draft still stops at γ = 2.
    costs = cpu_costs(v=(1.05, 1.10, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0))
    assert auto(costs, prior=0.8).gamma(ROW).gamma == 2
    # On a machine where 5 tokens cost no more than 2 (the EPYC's dip), γ = 4 wins.
    costs = cpu_costs(v=(1.63, 2.01, 1.46, 1.22, 3.0, 3.0, 3.0, 3.0))
    assert auto(costs, prior=0.6).gamma(ROW).gamma == 4


def test_auto_comes_back_when_acceptance_rises():
    costs = cpu_costs()
    policy = auto(costs, prior=0.05)
    chosen = []
    for _ in range(400):
        plan = policy.gamma(ROW)
        g = plan.gamma
        chosen.append(g)
        # The draft has become perfect: every probe is fully accepted.
        policy.update(step(g, [g], confidence=[[0.9] * g] if g else None, costs=costs, plan=plan))
    assert chosen[0] == 0, "starts from the poor acceptance the generator remembers"
    assert chosen.count(0) < 20, "a probe notices the change within a few plain steps"
    assert chosen[-1] >= 2


def test_probes_get_rarer_while_they_fail():
    costs = cpu_costs()
    policy = auto(costs, prior=0.05)
    probes = []
    for i in range(600):
        plan = policy.gamma(ROW)
        g = plan.gamma
        if g:
            probes.append(i)
        policy.update(step(g, [0] * 1, confidence=[[0.1] * g] if g else None, costs=costs, plan=plan))
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > 4 * gaps[0]


def test_a_probe_kept_whole_but_slower_than_plain_steps_does_not_call_the_next_one_soon():
    # A one-draft probe accepted 41% of the time, each taking twice a plain step (a catch-up, a draft, two tokens
    # verified): "kept whole" said "look again soon" and probes ran every 8 plain steps; now only a probe that
    # committed its tokens faster than plain steps do shortens the wait.
    def probes(step_seconds: float) -> list[int]:
        costs = cpu_costs()
        policy, found = auto(costs, prior=0.05), []
        for i in range(600):
            plan = policy.gamma(ROW)
            if plan.gamma:
                found.append(i)
            seconds = (0.0, 0.040) if not plan.gamma else (step_seconds - 0.040, 0.040)
            kept = [plan.gamma] if plan.gamma else [0]
            confidence = [[0.9] * plan.gamma] if plan.gamma else None
            policy.update(step(plan.gamma, kept, confidence, None, *seconds, costs=costs, plan=plan))
            policy.tuning.evidence().accepted, policy.tuning.evidence().trials = 5.0, 100.0  # α stays poor
            policy.by_row[0].accepted, policy.by_row[0].trials = 0.05 * policy.row_weight, policy.row_weight
        return found

    slow, fast = probes(0.080 * 2), probes(0.060)  # 2 tokens in 4 plain steps' time, or in 1.5
    assert len(slow) < len(fast) / 3, (len(slow), len(fast))
    assert max(b - a for a, b in zip(slow, slow[1:])) > 64


def test_auto_stops_drafting_early_on_low_confidence():
    costs = cpu_costs(v=(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0))
    policy = auto(costs, prior=0.7)
    # Teach the calibration: confident drafts are accepted, unsure ones are not.
    for i in range(300):
        plan = policy.gamma(ROW)
        if i % 3:
            policy.update(step(4, [4], confidence=[[0.95] * 4], costs=costs, plan=plan))
        else:
            policy.update(step(4, [1], confidence=[[0.95, 0.1, 0.1, 0.1]], costs=costs, plan=plan))
    plan = policy.gamma(ROW)
    assert plan.gamma >= 4
    sure, unsure = torch.tensor([0.95]), torch.tensor([0.05])
    assert not policy.stop(plan, [sure]), "a confident draft: draft on"
    assert policy.stop(plan, [sure, unsure]), "an unsure draft: the next ones will hardly be accepted"
    assert not policy.stop(plan, [sure]), "the plan is unchanged by asking: the same drafts, the same answer"


def test_auto_measures_nothing_itself_and_keeps_real_step_times():
    costs = cpu_costs()
    policy = auto(costs, prior=0.6)
    g = policy.gamma(ROW).gamma
    before = costs.verify_seconds(1, g + 1)
    for _ in range(30):  # the real verification turns out 3x dearer than measured
        plan = policy.gamma(ROW)
        policy.update(step(g, [1], confidence=[[0.5] * g], costs=costs, verify_seconds=3 * before, plan=plan))
    assert costs.verify_seconds(1, g + 1) > 2.5 * before
    assert policy.gamma(ROW).gamma != g or g == 0


def test_rows_keep_their_own_acceptance():
    costs = cpu_costs(v=(1.0,) * 8)
    policy = auto(costs, prior=0.5, batch=2)
    for _ in range(100):
        plan = policy.gamma(torch.tensor([0, 1]))
        rows, drafted, accepted = torch.tensor([0, 1]), torch.tensor([3, 3]), torch.tensor([3, 0])
        policy.update(Step(rows, plan, 3, drafted, accepted, None, 0.012, 0.04))
    alpha = policy.alphas(torch.tensor([0, 1]))
    assert alpha[0] > 0.9 and alpha[1] < 0.1
    # The good row alone is worth drafting for; the bad row alone is not.
    assert policy.gamma(torch.tensor([0])).gamma > policy.gamma(torch.tensor([1])).gamma


def test_acceptance_counts_runs_and_steps_without_drafts_teach_nothing():
    rate = AlphaEstimate(prior=0.5, weight=2.0, decay=0.5)
    rate.add_step(0, 0)  # no drafts: no trial, and no decay either
    assert (rate.accepted, rate.trials) == (1.0, 2.0)
    rate.add_step(4, 4)  # all accepted: 4 successes, no failure
    assert (rate.accepted, rate.trials) == (4.5, 5.0)
    rate.add_step(4, 1)  # one accepted, then a rejection
    assert (rate.accepted, rate.trials) == (3.25, 4.5)
    rate.add(0, failed=False)  # an empty run only fades the evidence: α stays
    assert (rate.accepted, rate.trials) == (1.625, 2.25) and rate.alpha == pytest.approx(3.25 / 4.5)


# -- a hybrid drafter: each step priced by what it drafts -----------------------------------------


class Stub(Drafter):
    """A draft model that proposes token 1 everywhere, and counts its runs (no model: pricing only)."""

    vocab_size = 16

    def __init__(self):
        self.runs = 0

    def propose(self, ctx, gamma: int, stop=None, price=None) -> Proposal:
        self.runs += 1
        return Proposal(torch.ones(ctx.tokens.shape[0], gamma, dtype=torch.long))


def hybrid_auto(costs: Costs, model: float, lookup: float, match: float = 0.5, batch: int = 1) -> AutoGamma:
    """AutoGamma for a hybrid whose model and lookup start from these acceptance rates, and whose lookup finds
    a match this often."""
    tuning = Tuning(costs=costs)
    for source, prior in (("draft", model), ("lookup", lookup), ("match", match)):
        tuning.evidence(source).accepted, tuning.evidence(source).trials = prior * 100, 100.0
    policy = AutoGamma(tuning, hybrid=True)
    policy.begin(batch)
    return policy


def hybrid_step(
    policy: AutoGamma, plan: AutoPlan, lookup: tuple[int, bool] | None, model: tuple[int, int] | None
) -> None:
    """A scripted batch-1 hybrid step of ``plan`` that took what the costs predict: the lookup's run (None: no
    match), and the model's (drafted, accepted) if the row took it; told as the proposal's sources and the verdict."""
    gamma = plan.gamma
    model_gamma = gamma if plan.price.model else 0
    drafted, accepted = model if model is not None else (gamma, lookup[0]) if lookup is not None else (0, 0)
    if lookup is None:
        k, agree = 0, 0
    elif model is None:  # the row took the lookup's proposal
        k, agree = gamma, 0
    else:  # the lookup's proposal agreed with the model's kept drafts for its run
        k, agree = gamma, lookup[0]
    sources = Sources(
        torch.tensor([k]),
        torch.tensor([2 if k else 0]),
        torch.tensor([model is None and k > 0]),
        torch.tensor([agree]),
        model_gamma,
    )
    costs = policy.costs
    width = max(drafted, model_gamma)
    policy.update(
        Step(
            ROW,
            plan,
            width,
            torch.tensor([drafted]),
            torch.tensor([accepted]),
            None,
            model_gamma * costs.draft,
            costs.verify[width + 1],
            sources=sources,
        )
    )


def alone(costs: Costs, evidence: dict[int, AlphaEstimate]) -> AutoGamma:
    """AutoGamma for a single drafter with these per-row acceptance records (row -> record)."""
    policy = auto(costs)
    policy.by_row = {row: AlphaEstimate(e.prior, e.weight, e.decay) for row, e in evidence.items()}
    for row, mine in policy.by_row.items():
        mine.accepted, mine.trials = evidence[row].accepted, evidence[row].trials
    return policy


def test_a_hybrid_whose_model_never_pays_takes_lookup_steps_at_the_lookups_rate():
    # A draft model as dear as the target and a lookup that always matches and is nearly always right.
    costs = cpu_costs(draft_ms=40.0)
    policy = hybrid_auto(costs, model=0.3, lookup=0.5, match=1.0)
    chosen = []
    for _ in range(40):
        plan = policy.gamma(ROW)
        chosen.append((plan.gamma, plan.price.model))
        hybrid_step(policy, plan, (plan.gamma, False), None)
    assert all(g > 0 and not model for g, model in chosen), "every step drafts by lookup alone"
    # n-gram lookup alone (no draft cost) with the same acceptance evidence predicts the same γ and rate.
    ngram = alone(cpu_costs(draft_ms=0.0), policy.lookup_by_row)
    plan, other = policy.gamma(ROW), ngram.gamma(ROW)
    g, rate = plan.gamma, plan.rate
    assert g == 8 and other.gamma == g and other.rate == pytest.approx(rate, rel=1e-12)
    assert rate > 1.5 / costs.verify_seconds(1, 1), "well above plain decoding"


def test_a_hybrid_whose_lookup_never_matches_prices_as_its_model():
    # A cheap, good draft model and a lookup that never finds a match.
    costs = cpu_costs(draft_ms=2.0, v=(1.05,) * 8)
    policy = hybrid_auto(costs, model=0.8, lookup=0.5)
    chosen = []
    for _ in range(40):
        plan = policy.gamma(ROW)
        g, model = plan.gamma, plan.price.model
        chosen.append((g, model))
        hybrid_step(policy, plan, None, (g, g - 1) if model and g else None)
    assert all(g > 0 and model for g, model in chosen[10:]), "the model drafts once the lookup has shown it misses"
    assert policy.match_by_row[0].alpha < 0.05
    model = alone(cpu_costs(draft_ms=2.0, v=(1.05,) * 8), policy.by_row)
    plan, other = policy.gamma(ROW), model.gamma(ROW)
    assert other.gamma == plan.gamma and other.rate == pytest.approx(plan.rate, rel=1e-12)


def test_a_hybrid_falls_back_to_plain_decoding_when_neither_part_pays():
    costs = cpu_costs()  # a 4 ms draft step and a dear verification: a poor draft cannot pay
    policy = hybrid_auto(costs, model=0.05, lookup=0.05)
    chosen = []
    for _ in range(60):
        plan = policy.gamma(ROW)
        g = plan.gamma
        chosen.append(g)
        hybrid_step(policy, plan, (0, True), (g, 0) if plan.price.model and g else None)
    assert chosen[-20:].count(0) >= 18, "plain steps, but for a rare probe"


def test_a_lookup_that_rarely_matches_is_still_tried_when_a_match_pays():
    # A lookup costs nothing and verifies only the pending token when it finds nothing: worth trying for any match.
    costs = cpu_costs(draft_ms=40.0)
    policy = hybrid_auto(costs, model=0.3, lookup=0.9, match=0.05)
    plan = policy.gamma(ROW)
    assert plan.gamma > 0 and not plan.price.model and plan.rate > 1 / costs.verify_seconds(1, 1)
    # Once the lookup takes time of its own, a rare match no longer pays for it.
    costs.record_lookup(1, 0.010)
    assert policy.gamma(ROW).gamma == 0


@pytest.mark.parametrize("seed", range(5))
def test_the_hybrid_is_predicted_no_slower_than_the_faster_of_its_parts(seed):
    rng = torch.Generator().manual_seed(seed)
    for i in range(40):
        a_model, a_lookup, match = torch.rand(3, generator=rng).tolist()
        match = 1.0 if i % 2 else match  # n-gram lookup alone prices its steps as if every row matched
        draft_ms = float(40 * torch.rand(1, generator=rng))
        v = tuple(sorted((1 + 2 * torch.rand(8, generator=rng)).tolist()))
        policy = hybrid_auto(cpu_costs(draft_ms, v), a_model, a_lookup, match=match)
        plan = policy.gamma(ROW)
        model = alone(cpu_costs(draft_ms, v), policy.by_row).gamma(ROW)
        ngram = alone(cpu_costs(0.0, v), policy.lookup_by_row).gamma(ROW)
        parts = [model.rate, ngram.rate] if match == 1.0 else [model.rate]
        assert plan.rate >= max(parts) * (1 - 1e-12)
        # A lookup that costs 2% of a target step keeps the hybrid within 5% of the faster part.
        policy.costs.record_lookup(1, 0.02 * 0.040)
        assert policy.gamma(ROW).rate >= 0.95 * max(parts)


def test_the_model_runs_only_where_the_step_pays_for_it():
    # Row 0's text repeats (a lookup proposal); row 1's does not.
    tokens = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4], [6, 7, 8, 9, 10, 11, 12, 13]])
    dear, cheap = cpu_costs(draft_ms=40.0), cpu_costs(draft_ms=0.4, v=(1.0,) * 8)
    for costs, model, runs in ((None, True, 1), (cheap, True, 1), (dear, True, 0), (cheap, False, 0)):
        ctx = SimpleNamespace(tokens=tokens, lengths=torch.tensor([8, 8]), vocab=16)
        hybrid = HybridDrafter(Stub())
        hybrid.start(2, torch.device("cpu"))
        proposal = hybrid.propose(ctx, 4, None, None if costs is None else Price(costs, model))
        assert hybrid.main.runs == runs, (costs, model)
        # Without the model, the row without a lookup proposal drafts nothing; the other keeps its lookup.
        assert proposal.drafted().tolist()[1] == (4 if runs else 0) and proposal.drafted().tolist()[0] > 0
        # The proposal says what the step paid for and where each row's drafts came from.
        sources = proposal.sources
        assert sources.model_gamma == 4 * runs and sources.lookup[1] == 0
        assert sources.took_lookup.tolist() == [True, False]  # the repeating row keeps its lookup
        hybrid.commit(ctx, torch.full((2, 4), -1))


# -- trees: auto weighs trees against the chain -------------------------------


def tree_costs(v: dict[int, float], draft_ms: float = 4.0) -> Costs:
    """A 40 ms target step; a forward over k tokens costs v[k] times that (every chain size and N+1 of each tree)."""
    return Costs({k: 0.040 * v.get(k, 1.0) for k in [*range(1, 10), 9, 17, 33]}, draft_ms / 1e3)


def tree_auto(costs: Costs, chain_alpha: float) -> AutoGamma:
    policy = auto(costs, prior=chain_alpha)
    policy.tuning.trees = (8, 16, 32)
    return policy


def second_and_third_guesses_hold_the_target(policy: AutoGamma, steps: int = 40, plan: Plan | None = None) -> None:
    """Tree steps of 8 nodes whose root has 4 children and node 1 the other 4: the target takes the root's
    second child (node 1), then that node's third (node 6): the drafter's top-1 misses, its top-2/top-3 hold.
    Each step took what the costs predict."""
    parents = torch.tensor([[-1, -1, -1, -1, 1, 1, 1, 1]])
    plan = Plan(2, 8) if plan is None else plan
    for _ in range(steps):
        policy.update(
            Step(
                ROW,
                plan,
                2,
                torch.tensor([8]),
                torch.tensor([2]),
                None,
                2 * policy.costs.draft,
                policy.costs.verify[9],
                path=torch.tensor([[1, 6]]),
                parents=parents,
                real=torch.ones_like(parents, dtype=torch.bool),
            )
        )


def first_then_second_guess_holds(policy: AutoGamma, steps: int = 40) -> None:
    """Tree steps of 8 nodes (the root's 4 children, node 0's 4): the target takes node 0, the root's first
    child, then node 5, node 0's second: a chain of first guesses keeps one draft of two (α about 1/2)."""
    parents = torch.tensor([[-1, -1, -1, -1, 0, 0, 0, 0]])
    for _ in range(steps):
        policy.update(
            Step(
                ROW,
                Plan(2, 8),
                2,
                torch.tensor([8]),
                torch.tensor([2]),
                None,
                2 * policy.costs.draft,
                policy.costs.verify[9],
                path=torch.tensor([[0, 5]]),
                parents=parents,
                real=torch.ones_like(parents, dtype=torch.bool),
            )
        )


def test_the_chain_inside_a_tree_step_is_its_first_children():
    parents, real = [-1, -1, 0, 0, 2, 1], [True] * 6
    assert first_children(parents, real, [0, 2, 4], 3) == (3, 3)  # 0 → 2 → 4: the first guesses, all kept
    assert first_children(parents, real, [0, 3], 2) == (3, 1)  # node 3 is node 0's second child
    assert first_children(parents, real, [1, 5], 2) == (3, 0)  # the root's second child: the chain failed at once
    assert first_children(parents, real, [0], 1) == (3, 1)
    assert first_children(parents, [False, True, True, True, True, True], [1, 5], 2) == (2, 2)  # node 0 padding
    assert first_children([], [], [], 0) == (0, 0)


def test_the_chains_rate_learns_from_tree_steps():
    # Trees win while the chain's estimate is low, so chain steps are rare: the trees' first guesses must
    # move it, or a chain judged on a few failed steps would stay below what its drafts really do.
    policy = tree_auto(tree_costs({}), chain_alpha=0.1)
    first_then_second_guess_holds(policy)
    assert 0.4 < policy.alphas(ROW)[0] < 0.6 and policy.tuning.evidence().alpha > 0.2  # the memory: from 0.1


def test_tree_evidence_learns_acceptance_by_rank_and_depth():
    evidence = TreeAcceptance()
    assert evidence.expected_tokens(8, 0.0) == 1.0  # nothing accepted: the target's own token
    for _ in range(60):
        evidence.add(8, [-1, -1, -1, -1, 1, 1, 1, 1], [True] * 8, [1, 6], 2)
    # The first guess never holds; the second at depth 1 only (half its trials); the third whenever tried.
    assert evidence.rank(0, 0.5) < 0.1 and 0.4 < evidence.rank(1, 0.5) < 0.6 and evidence.rank(2, 0.0) > 0.8
    assert evidence.depth(8, 1, 0.5) > 0.9 and evidence.depth(8, 2, 0.5) > 0.9
    assert evidence.expected_tokens(8, 0.5) > 2.8  # both levels kept: close to depth + 1 = 3


def test_auto_picks_a_tree_when_verification_is_flat_and_lower_guesses_hold_the_target():
    policy = tree_auto(tree_costs({}), chain_alpha=0.3)
    second_and_third_guesses_hold_the_target(policy)
    plan = policy.gamma(ROW)
    assert plan.nodes in (8, 16, 32) and plan.gamma == tree_shape(plan.nodes)[1]


def test_auto_keeps_the_chain_when_verifying_a_tree_is_dear():
    # Short chains verify cheaply; from 4 tokens on, a forward costs k/2 single ones (trees verify 9+ tokens).
    steep = {k: 1.0 + 0.1 * (k - 1) if k <= 3 else k / 2 for k in range(2, 34)}
    policy = tree_auto(tree_costs(steep), chain_alpha=0.3)
    first_then_second_guess_holds(policy)  # trees keep two drafts a step, chains one of two
    plan = policy.gamma(ROW)
    assert plan.gamma >= 1 and plan.nodes == 0
    assert tree_auto(tree_costs({}), chain_alpha=0.3).tuning.trees  # the same evidence, flat costs: trees offered
    no_trees = auto(tree_costs({}), prior=0.3)  # a call that may not draft trees never gets one
    second_and_third_guesses_hold_the_target(no_trees)
    assert no_trees.gamma(ROW).nodes == 0


def test_costs_of_tree_sizes_leave_the_chains_maximum_alone():
    costs = tree_costs({})
    assert costs.max_gamma == 8 and "16" in costs.to_dict()["v_tree"]
    assert costs.tree_draft_seconds(1, 16, 4) == pytest.approx(4 * costs.draft)  # one draft forward per level


def test_a_drafting_step_over_a_batch_never_seen_is_priced_by_its_rows():
    # The target: 10 ms a row, 1 ms more per extra row up to 4, then the last slope on.
    costs = Costs(verify={1: 0.010, 2: 0.011, 3: 0.012, 4: 0.013}, draft=0.004)
    assert costs.draft_seconds(1) == pytest.approx(0.004)
    assert costs.draft_seconds(16) == pytest.approx(0.004 * costs.rows(16) / costs.rows(1))  # 2.5x, not one row's
    costs.record_draft(8, 0.009)
    assert costs.draft_seconds(8) == pytest.approx(0.004 * costs.rows(8) / costs.rows(1) * 0.8 + 0.009 * 0.2)  # _EMA
    assert costs.draft_seconds(16) == pytest.approx(costs.draft_seconds(8) * costs.rows(16) / costs.rows(8))
    assert costs.draft_seconds(1) == pytest.approx(costs.draft_seconds(8) * costs.rows(1) / costs.rows(8))


def test_one_stalled_step_pulls_a_running_time_up_by_a_tenth_at_most_and_a_fast_one_is_taken():
    costs = Costs(verify={1: 0.010, 2: 0.012}, draft=0.004, observed_verify={(8, 1): 0.020})
    costs.record_verify(8, 1, 0.200)  # another process stalled this step
    assert costs.verify_seconds(8, 1) == pytest.approx(0.020 * 1.1)
    costs.record_verify(8, 1, 0.001)
    assert costs.verify_seconds(8, 1) == pytest.approx(0.022 * 0.8 + 0.001 * 0.2)


def test_a_drafting_step_after_plain_ones_is_priced_with_the_catch_up_it_cost_last_time():
    # A server's batch of 8 at α = 0.5: one draft verified beside each row pays on the step's own price, but not
    # once the draft model's catch-up on the plain steps' tokens (timed on such a step) is added.
    costs = Costs(verify={1: 0.010, 2: 0.011}, draft=0.001, observed_draft={8: 0.002})
    costs.observed_verify.update({(8, 1): 0.020, (8, 2): 0.024})
    policy = auto(costs, prior=0.5, batch=8)
    rows = torch.arange(8)
    assert policy.gamma(rows).gamma >= 1
    plan = AutoPlan(1, 0, Price(costs, True), 8, (0.5,) * 8, tuple((i, 1.0, 0.5) for i in range(8)), (1.0,) * 8)
    policy.update(step(1, [0] * 8, drafted=[1] * 8, draft_seconds=0.200, verify_seconds=0.024, plan=plan))
    assert costs.catch_up_seconds(8) == 0.0  # the first drafting step read the prompts: no step's catch-up
    policy.update(step(0, [0] * 8, verify_seconds=0.020))  # a plain step
    assert policy.gamma(rows).gamma >= 1  # never timed: priced without a catch-up
    policy.update(step(1, [0] * 8, drafted=[1] * 8, draft_seconds=0.020, verify_seconds=0.024, plan=plan))
    assert costs.catch_up_seconds(8) == pytest.approx(0.020 - 0.002)  # the first drafting step after plain ones
    assert policy.gamma(rows).gamma >= 1  # drafting on: no catch-up to pay
    policy.update(step(0, [0] * 8, verify_seconds=0.020))  # a plain step: the next drafting one catches up
    assert policy.gamma(rows).gamma == 0


def test_a_call_drafts_from_its_first_step_whatever_catching_up_once_cost():
    # The draft model reads the prompt on its first drafting step: paid once to draft at all, so a call whose
    # drafts pay drafts from its first step rather than plain-decoding until a probe.
    costs = Costs(verify={1: 0.010, 2: 0.011}, draft=0.002)
    costs.record_catch_up(1, 0.500)
    policy = auto(costs, prior=0.9, batch=1)
    assert policy.gamma(torch.arange(1)).gamma >= 1


def test_rows_past_the_chain_follow_the_larger_sizes_measured():
    # A server times its batch's rows (16, 32): a forward between or past them is priced from them, not from the
    # one-row chain's slope, which memory-bound rows keep flat.
    costs = Costs(verify={1: 0.010, 2: 0.0105, 3: 0.011, 16: 0.040, 32: 0.072}, draft=0.004)
    assert costs.rows(3) == pytest.approx(0.011)
    assert costs.rows(8) == pytest.approx(0.011 + (0.040 - 0.011) * 5 / 13)
    assert costs.rows(24) == pytest.approx(0.056)
    assert costs.rows(64) == pytest.approx(0.072 + 0.002 * 32)
    chain_only = Costs(verify={1: 0.010, 2: 0.0105, 3: 0.011}, draft=0.004)
    assert chain_only.rows(32) == pytest.approx(0.011 + 0.0005 * 29)  # the chain's last slope, as before
    assert costs.verify_seconds(16, 2) > 1.7 * costs.verify_seconds(16, 1)  # verifying γ = 1 over 16 rows is dear


def test_tree_probes_let_trees_win_once_they_prove_themselves():
    # A poor chain: plain decoding wins, and the cautious prior keeps trees out too.
    costs = tree_costs({k: 1.0 + 0.05 * k for k in range(2, 34)})
    policy = tree_auto(costs, chain_alpha=0.05)
    plan = policy.gamma(ROW)
    assert plan.gamma == 0 and plan.nodes == 0
    nodes = []
    for _ in range(300):
        plan = policy.gamma(ROW)
        nodes.append(plan.nodes)
        if plan.nodes:  # the drafter's second and third guesses hold: every tree keeps two levels
            second_and_third_guesses_hold_the_target(policy, steps=1, plan=plan)
        else:
            policy.update(step(plan.gamma, [0], costs=costs, plan=plan))  # the chain's first guess never holds
    assert 0 < nodes.index(8) < 40, "a probe drafts a tree within a few probes"
    assert all(n > 0 for n in nodes[-20:]), "trees that pay are taken every step"


def test_a_large_batch_is_priced_by_its_token_rows_and_speculates_less():
    costs = cpu_costs()
    top = costs.max_gamma + 1
    slope = costs.verify[top] - costs.verify[top - 1]
    assert costs.verify_seconds(1, 4) == costs.verify[4]
    assert costs.verify_seconds(2, 3) == costs.verify[6]  # 6 token rows, as one row of 6 new tokens
    assert costs.verify_seconds(16, 5) == pytest.approx(costs.verify[top] + slope * (80 - top))
    rows = torch.arange(16)
    alone, crowded = auto(costs, prior=0.7), auto(costs, prior=0.7, batch=16)
    assert crowded.gamma(rows).gamma < alone.gamma(rows[:1]).gamma
    costs.record_verify(16, 3, 0.5 * costs.verify_seconds(16, 3))  # cheaper than priced: the table follows
    assert costs.verify_seconds(16, 4) < costs.rows(64)
