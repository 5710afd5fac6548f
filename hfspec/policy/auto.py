"""``gamma="auto"``: speculation that pays on the machine at hand.

``AutoGamma`` chooses each step's γ (and whether a tree pays) from costs measured where it runs and the
acceptance seen so far; ``Tuning`` is what a generator keeps across calls for it. Only γ is chosen;
acceptance stays min(1, p/q), so every choice is lossless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hfspec.errors import HfspecError
from hfspec.measure.alpha import AlphaEstimate
from hfspec.measure.costs import Costs, Price
from hfspec.policy.simple import FixedGamma, GammaPolicy, Plan, Step, check_gamma
from hfspec.tree.acceptance import TreeAcceptance, first_children
from hfspec.tree.build import shape
from hfspec.tree.proposal import Sources


class Calibration:
    """How often a draft is accepted, by the drafter's own probability of it (decayed counts in bins).

    A drafter's confidence is a hint, not a probability of acceptance: the bins learn
    what it is worth. Until a bin has evidence, an estimate takes the overall α, or the
    confidence itself where that is lower (a drafter that says it is unsure is believed).
    Plain Python numbers: a step asks for a handful of them, and tiny tensors would cost more.
    """

    def __init__(self, bins: int = 10, weight: float = 4.0, decay: float = 0.999):
        self.bins, self.weight, self.decay = bins, weight, decay
        self.accepted = [0.0] * bins
        self.trials = [0.0] * bins

    def index(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def predict(self, confidence: list[float], fallback: list[float]) -> list[float]:
        """Estimated acceptance of drafts with ``confidence``, one per row; ``fallback`` is each row's α."""
        out = []
        for c, a in zip(confidence, fallback):
            i = self.index(c)
            out.append((self.accepted[i] + self.weight * min(a, c)) / (self.trials[i] + self.weight))
        return out

    def add(self, confidence: list[list[float]], reached: list[int], accepted: list[int]) -> None:
        """Row b's drafts with ``confidence[b]``: the first ``reached[b]`` were decided, the first
        ``accepted[b]`` of those kept."""
        decay = self.decay ** sum(reached)
        self.accepted = [x * decay for x in self.accepted]
        self.trials = [x * decay for x in self.trials]
        for conf, n, kept in zip(confidence, reached, accepted):
            for j, c in enumerate(conf[:n]):
                i = self.index(c)
                self.trials[i] += 1.0
                self.accepted[i] += 1.0 if j < kept else 0.0


def _evidence() -> AlphaEstimate:
    """A generator's memory of one setting's acceptance: α = 0.5 until steps say otherwise, slowly forgotten."""
    return AlphaEstimate(prior=0.5, weight=2.0, decay=0.995)


@dataclass
class Tuning:
    """What a generator learns across calls: its measured costs and how well its drafter does.

    ``memory`` holds acceptance evidence per sampling setting (greedy and each
    temperature accept differently); a call starts each prompt from it.
    """

    costs: Costs | None = None
    memory: dict[Any, AlphaEstimate] = field(default_factory=dict)
    calibration: dict[Any, Calibration] = field(default_factory=dict)
    tree_memory: dict[Any, TreeAcceptance] = field(default_factory=dict)
    trees: tuple[int, ...] = ()  # node budgets the current call may draft trees of (none: chains only)
    probes_taken: int = 0  # probe steps so far; every other one drafts a tree where trees are allowed
    probes: dict[Any, list[int]] = field(default_factory=dict)  # [plain steps since the last probe, interval]
    setting: Any = None  # the current call's sampling setting, the key of memory and calibration
    maximum: int = 8  # largest γ considered; costs are measured for 1..maximum+1 new tokens

    def evidence(self, source: str = "draft") -> AlphaEstimate:
        """Acceptance of ``source``'s proposals: "draft", or beside a hybrid's draft model "lookup" (its
        proposals) and "match" (how often it makes one)."""
        key = self.setting if source == "draft" else (self.setting, source)
        return self.memory.setdefault(key, _evidence())

    def remember(self, seen: dict[Any, tuple[float, float]]) -> None:
        """Start from the acceptance an earlier process saw (``hfspec.measure.cost_cache``): (accepted, trials) by key of
        ``memory``. What this generator has seen itself stays."""
        for key, (accepted, trials) in seen.items():
            if key not in self.memory:
                self.memory[key] = _evidence()
                self.memory[key].accepted, self.memory[key].trials = accepted, trials

    def tree_probe(self) -> bool:
        """Count a probe step; True when this one should draft the smallest tree (every other probe)."""
        self.probes_taken += 1
        return self.probes_taken % 2 == 0

    def tree_evidence(self) -> TreeAcceptance:
        """How this setting's tree steps fared (``hfspec.tree.acceptance``)."""
        return self.tree_memory.setdefault(self.setting, TreeAcceptance())

    def calibrated(self) -> Calibration:
        return self.calibration.setdefault(self.setting, Calibration())

    def probe_state(self, first_interval: int) -> list[int]:
        return self.probes.setdefault(self.setting, [0, first_interval])


# (position of a row in the step, probability, α): with that probability, the row drafts at acceptance rate α.
Part = tuple[int, float, float]


@dataclass(frozen=True)
class AutoPlan(Plan):
    """``AutoGamma``'s plan: the step's kind and what it predicted, which ``stop`` and ``update`` read back."""

    batch: int = 0  # active rows
    alpha: tuple[float, ...] = ()  # each row's running α
    parts: tuple[Part, ...] = ()  # the kind of step taken: its rows' parts (``AutoGamma.kinds``)
    reach: tuple[float, ...] = ()  # per part: P(it drafts), before any draft
    rate: float = 0.0  # the step's expected tokens per second, as predicted
    probing: bool = False  # a probe step: drafting although plain decoding was predicted to win


class AutoGamma(GammaPolicy):
    """``gamma="auto"``: the γ in 0..K with the best expected tokens per second, step by step.

    For each step it maximises, over γ, the expected committed tokens of the active rows
    (Leviathan et al., arXiv 2211.17192: (1 - α^(γ+1)) / (1 - α) per row, with each row's
    own running α) divided by the time the step will take (γ drafting steps plus a target
    forward over γ+1 tokens, from the measured and refined ``Costs``; the first step that runs
    the draft model after steps without it also pays its catch-up on their tokens, priced from
    such steps before). γ = 0 is plain decoding. While plain decoding wins, a probe step with
    drafts now and then (ever rarer while probes commit their tokens no faster than plain steps
    do) notices when acceptance rises again; where trees are allowed, every other probe drafts
    the smallest tree, so that trees gather evidence too.

    Within a step, drafting stops early when the drafter's probabilities, calibrated by
    what was accepted before, say that drafting on can no longer raise the step's
    expected tokens per second (the threshold is that comparison, not a constant).
    Only γ is chosen here; acceptance stays min(1, p/q), so every choice is lossless.

    Where the call allows trees (``Tuning.trees``: ``generate(tree="auto")`` with a drafter that
    builds them and nothing that makes a tree inexact), each budget N is priced beside the chains:
    expected tokens per row from acceptance by depth and by rank among siblings, learnt from the
    tree steps taken (``hfspec.tree.acceptance``), over the tree's drafting (one draft forward per
    level until timed) plus a target forward over N+1 tokens. A tree is taken only where it beats
    every chain; the plan's ``nodes`` tells the loop its budget, and γ is its depth; ``update`` learns from either kind of step.

    A hybrid drafter (``hfspec.drafters.hybrid``) can take two kinds of step, each priced
    by what it drafts. The lookup alone: row i finds a match with probability m_i and then
    drafts at its lookup α; the step pays one lookup (next to nothing, measured by the
    steps that take it) and verifies γ+1 tokens if some row found a match, 1 if none did;
    no draft-model cost. The model too: a row drafts at the better of its two α where its
    lookup matched and at the model's α elsewhere; the step pays γ draft-model steps and
    the lookup. The step takes the kind and γ with the best expected tokens per second and
    tells the hybrid whether its model may run. Why the hybrid is never slower than the
    faster of its parts (in the cost model; its own lookup time, measured and priced, is
    the noise): n-gram lookup alone takes lookup-alone steps, which the hybrid prices the
    same way and may take with the same γ; the model alone takes model steps with every
    row at the model's α, and the hybrid's model steps give each row at least that α at
    the same time plus a lookup. A best choice over a set that holds both is worth at least
    either. With a lookup that always matches, the lookup-alone price is n-gram lookup
    alone's exactly. ``hybrid`` says the drafter is one; the plan's ``price`` hands the step's kind to it,
    and each step's proposal says which source drafted each row (``Step.sources``), which with the verdict
    tells how its two proposers fared.
    """

    row_weight = 4.0  # trials' worth of the generator's memory a new prompt starts from
    row_decay = 0.95
    probe_every = 8  # plain steps before the first probe
    probe_max = 256  # plain steps between probes at most

    def __init__(self, tuning: Tuning, hybrid: bool = False):
        if tuning.costs is None:
            raise HfspecError("AutoGamma needs measured costs (Tuning.costs)")
        self.tuning, self.costs = tuning, tuning.costs
        self.maximum = min(tuning.maximum, self.costs.max_gamma)
        self.calibration = tuning.calibrated()
        # Plain steps since the last probe, and the probe interval: kept across calls, so short calls probe too.
        self.probe = tuning.probe_state(self.probe_every)
        self.after_plain = True  # the next drafting step also catches up on every token since
        # ... and at first on the prompt: a price paid once to draft at all, however long the call plain-decodes
        # first (the longer, the dearer), so never a step's; not timed as a step's catch-up either
        self.prompt = True
        self.hybrid = hybrid  # the drafter is a hybrid: lookup-alone steps are priced beside model steps

    def begin(self, batch: int) -> None:
        # Each prompt accepts at its own rate: it starts from the generator's memory and learns apart.
        self.by_row = self.row_records("draft", batch)
        if self.hybrid:  # a hybrid's lookup, learnt apart from its model
            self.lookup_by_row, self.match_by_row = self.row_records("lookup", batch), self.row_records("match", batch)

    def row_records(self, source: str, batch: int) -> dict[int, AlphaEstimate]:
        memory = self.tuning.evidence(source)
        return {row: AlphaEstimate(memory.alpha, self.row_weight, self.row_decay) for row in range(batch)}

    def admit(self, row: int) -> None:
        # A row joining a running batch (a server's): it starts from the generator's memory, as a prompt does.
        records = [self.by_row] + ([self.lookup_by_row, self.match_by_row] if self.hybrid else [])
        for source, record in zip(("draft", "lookup", "match"), records):
            record[row] = self.row_records(source, 1)[0]

    def forget(self, row: int) -> None:
        for record in [self.by_row] + ([self.lookup_by_row, self.match_by_row] if self.hybrid else []):
            record.pop(row, None)

    def alphas(self, rows: torch.Tensor, source: dict[int, AlphaEstimate] | None = None) -> list[float]:
        source = self.by_row if source is None else source
        return [min(0.99, source[r].alpha) for r in rows.tolist()]

    def kinds(self, rows: torch.Tensor, alpha: list[float]) -> list[AutoPlan]:
        """Each kind of step the drafter can take, as a plan of no drafts yet: its rows' parts, and whether the
        draft model runs (``price.model``). The last kind drafts with everything the drafter has (a probe's)."""
        batch = rows.numel()
        if not self.hybrid:
            return [self.kind(batch, alpha, [(i, 1.0, a) for i, a in enumerate(alpha)], True)]
        lookup = self.alphas(rows, self.lookup_by_row)
        match = [self.match_by_row[r].alpha for r in rows.tolist()]
        alone = [(i, m, a) for i, (m, a) in enumerate(zip(match, lookup))]
        both = [
            part for i, (m, a, b) in enumerate(zip(match, lookup, alpha)) for part in ((i, m, max(a, b)), (i, 1 - m, b))
        ]
        return [self.kind(batch, alpha, alone, False), self.kind(batch, alpha, both, True)]

    def kind(self, batch: int, alpha: list[float], parts: list[Part], model: bool) -> AutoPlan:
        return AutoPlan(
            0, 0, Price(self.costs, model), batch, tuple(alpha), tuple(parts), tuple(p for _, p, _ in parts)
        )

    def gamma(self, rows: torch.Tensor) -> AutoPlan:
        alpha = self.alphas(rows)
        kinds = self.kinds(rows, alpha)
        rates = [self.best(kind, kind.reach, float(kind.batch), 0)[1] for kind in kinds]
        kind = kinds[rates.index(max(rates))]  # a tie goes to the lookup alone: it runs no model
        gamma, rate = self.best(kind, kind.reach, float(kind.batch), 0)
        nodes, probing = 0, False
        tree_nodes, tree_rate = self.best_tree(kind.batch, alpha)
        if tree_rate > rate:  # a tree beats every chain: γ is its depth
            nodes, rate, gamma = tree_nodes, tree_rate, shape(tree_nodes)[1]
        if gamma == 0:
            self.probe[0] += 1
            if self.probe[0] >= self.probe[1]:  # probe: draft anyway, to learn whether it pays again
                self.probe[:] = [0, min(2 * self.probe[1], self.probe_max)]
                probing, kind = True, kinds[-1]
                gamma, rate = self.best(kind, kind.reach, float(kind.batch), 0, at_least=1)
                if self.tuning.trees and self.tuning.tree_probe():  # trees learn only from tree steps
                    nodes = min(self.tuning.trees)
                    gamma = shape(nodes)[1]
        else:
            self.probe[:] = [0, self.probe_every]
        return replace(kind, gamma=gamma, nodes=nodes, rate=rate, probing=probing)

    def best_tree(self, batch: int, alpha: list[float]) -> tuple[int, float]:
        """The tree budget with the best expected tokens per second, and that rate ((0, -1) without trees).

        A tree of N nodes commits ``TreeAcceptance.expected_tokens`` per row (from acceptance by depth and
        by rank among siblings) and costs its drafting (one draft forward per level until timed) plus a
        target forward over N+1 tokens, v(N) single-token forwards."""
        evidence, best = self.tuning.tree_evidence(), (0, -1.0)
        for nodes in self.tuning.trees:
            tokens = sum(evidence.expected_tokens(nodes, a) for a in alpha)
            seconds = (
                self.costs.tree_draft_seconds(batch, nodes, shape(nodes)[1])
                + self.costs.verify_seconds(batch, nodes + 1)
                + (self.costs.catch_up_seconds(batch) if self.catch_up_due else 0.0)
            )
            if tokens / seconds > best[1]:
                best = (nodes, tokens / seconds)
        return best

    def learn_tree(self, step: Step) -> None:
        """A tree step: acceptance by depth and by sibling rank, the chain's α from its first children, costs."""
        evidence = self.tuning.tree_evidence()
        probing = isinstance(step.plan, AutoPlan) and step.plan.probing  # (a call's fixed tree: no AutoPlan)
        if probing and any(n == step.path.shape[1] for n in step.accepted.tolist()):
            self.probe[1] = self.probe_every  # a tree probe kept a whole path: look again soon
        chains = []
        for parents, real, path, n in zip(
            step.parents.tolist(), step.real.tolist(), step.path.tolist(), step.accepted.tolist()
        ):
            evidence.add(step.plan.nodes, parents, real, path, n)
            chains.append(first_children(parents, real, path, n))
        # The chain's α learns from the trees' first children too: while trees win, chain steps are rare, and
        # a chain judged on a few of them alone can sink below the rate the trees' first guesses show.
        self.learn(step.rows.tolist(), [d for d, _ in chains], [k for _, k in chains], None)
        batch = step.rows.numel()
        self.costs.record_verify(batch, step.parents.shape[1] + 1, step.verify_seconds)
        if not self.after_plain:
            self.costs.record_tree_draft(batch, step.plan.nodes, step.draft_seconds)
        elif not self.prompt:  # drafting began with a catch-up: priced apart, for the next such step
            expected = self.costs.tree_draft_seconds(batch, step.plan.nodes, shape(step.plan.nodes)[1])
            self.costs.record_catch_up(batch, max(0.0, step.draft_seconds - expected))
        self.after_plain = self.prompt = False

    def best(
        self, plan: AutoPlan, reach: Sequence[float], expected: float, drafted: int, at_least: int = 0
    ) -> tuple[int, float]:
        """The γ ≥ ``drafted`` (and ≥ ``at_least``) with the best expected tokens per second for a step of
        ``plan``'s kind, and that rate, after ``drafted`` drafts that left each part drafting on with probability
        ``reach`` and ``expected`` tokens expected so far."""
        best, rate, future = drafted, -1.0, 0.0
        powers = list(reach)  # reach · α^k for the k-th draft after these
        for g in range(drafted, self.maximum + 1):
            if g > drafted:
                powers = [p * a for p, (_, _, a) in zip(powers, plan.parts)]
                future += sum(powers)
            if g < at_least:
                continue
            r = (expected + future) / self.seconds(plan, g)
            if r > rate:
                best, rate = g, r
        return best, rate

    @property
    def catch_up_due(self) -> bool:
        """Whether the next step that runs the draft model pays a priced catch-up: after steps without it, except
        its first read of the prompt."""
        return self.after_plain and not self.prompt

    def seconds(self, plan: AutoPlan, gamma: int) -> float:
        """The expected time of a step of ``plan``'s kind with γ drafts; after steps without the draft model, a
        step that runs it also pays its catch-up on their tokens."""
        if not self.hybrid:
            return self.costs.step_seconds(plan.batch, gamma, catch_up=self.catch_up_due)
        model, drafts = plan.price.model, 1.0
        if not model:  # the lookup alone verifies only the pending token when no row found a match
            drafts = 1.0 - math.prod(1.0 - p for _, p, _ in plan.parts)
        return self.costs.step_seconds(plan.batch, gamma, model, lookup=True, drafts=drafts, catch_up=self.catch_up_due)

    def stop(self, plan: Plan, confidence: list[torch.Tensor]) -> bool:
        assert isinstance(plan, AutoPlan), "a plan of this policy"
        reach, expected = list(plan.reach), float(plan.batch)
        for column in confidence:  # each draft, calibrated by what was accepted before
            accept = self.calibration.predict(column.tolist(), list(plan.alpha))
            reach = [r * accept[i] for r, (i, _, _) in zip(reach, plan.parts)]
            expected += sum(reach)
        drafted = len(confidence)
        return drafted >= plan.gamma or self.best(plan, reach, expected, drafted)[0] == drafted

    def beat_plain(self, step: Step) -> bool:
        """Whether a step committed its tokens faster than plain decoding's steps do: a one-draft probe kept
        whole at α ≈ 0.4 says little, and one that took twice a plain step for its two tokens did not pay."""
        batch = step.rows.numel()
        tokens = sum(n + 1 for n in step.accepted.tolist())
        seconds = step.draft_seconds + step.verify_seconds
        return seconds > 0 and tokens / seconds > batch / self.costs.verify_seconds(batch, 1)

    def update(self, step: Step) -> None:
        if step.tree:
            self.learn_tree(step)
            return
        drafted, accepted = step.drafted.tolist(), step.accepted.tolist()
        probing = isinstance(step.plan, AutoPlan) and step.plan.probing
        if probing and self.beat_plain(step):
            self.probe[1] = self.probe_every  # a probe that paid: look again soon
        sources = step.sources if self.hybrid else None
        if sources is None:
            self.learn(step.rows.tolist(), drafted, accepted, step.confidence)
            model_gamma = step.gamma
        else:
            self.learn_hybrid(step, sources)
            model_gamma = sources.model_gamma
        batch = step.rows.numel()
        self.costs.record_verify(batch, step.gamma + 1, step.verify_seconds)
        if sources is not None and not model_gamma:  # the lookup alone: its time is what drafting cost
            self.costs.record_lookup(batch, step.draft_seconds)
        elif model_gamma:
            lookup = self.costs.lookup_seconds(batch) if sources is not None else 0.0
            drafting = max(0.0, step.draft_seconds - lookup)
            if not self.after_plain:
                self.costs.record_draft(batch, drafting / model_gamma)
            elif not self.prompt:  # drafting began with a catch-up: priced apart, for the next such step
                self.costs.record_catch_up(batch, max(0.0, drafting - model_gamma * self.costs.draft_seconds(batch)))
            self.prompt = False
        self.after_plain = model_gamma == 0  # the draft model did not run: it catches up when it next does

    def learn(self, rows: list[int], drafted: list[int], accepted: list[int], confidence: torch.Tensor | None) -> None:
        """The draft model's (or the only drafter's) acceptance in ``rows``, and its calibration."""
        memory = self.tuning.evidence()
        for row, d, n in zip(rows, drafted, accepted):
            self.by_row[row].add_step(d, n)
            memory.add_step(d, n)
        if confidence is not None and confidence.numel():
            # Draft j of a row was decided if the drafts before it were accepted; it was kept if j < accepted.
            reached = [min(n + 1, d) for d, n in zip(drafted, accepted)]
            self.calibration.add(confidence.tolist(), reached, accepted)

    def learn_hybrid(self, step: Step, sources: Sources) -> None:
        """A hybrid's step, from its proposal's sources and the verdict: whether each row's lookup matched and how
        its proposal fared (where the model's was taken: how far it agreed with the model's kept drafts), and the
        model's drafts in the rows that took them."""
        match, lookup = self.tuning.evidence("match"), self.tuning.evidence("lookup")
        rows, accepted, took = step.rows.tolist(), step.accepted.tolist(), []
        each = zip(sources.lookup.tolist(), sources.took_lookup.tolist(), sources.agree.tolist())
        for i, (row, n, (k, used, agree)) in enumerate(zip(rows, accepted, each)):
            for record in (self.match_by_row[row], match):  # a match is a success, none a failure
                record.add(int(k > 0), k == 0)
            if not used and sources.model_gamma:  # the model's proposal; the lookup's against its kept drafts
                took.append(i)
            run = (n, n < k) if used else (min(agree, min(k, n)), agree < min(k, n))
            if k and (used or sources.model_gamma):
                self.lookup_by_row[row].add(*run)
                lookup.add(*run)
        confidence = step.confidence[took] if step.confidence is not None and took else None
        self.learn(
            [rows[i] for i in took],
            [int(step.drafted[i]) for i in took],
            [accepted[i] for i in took],
            confidence,
        )

    def __str__(self) -> str:
        return "auto"


def as_policy(gamma: int | str | GammaPolicy, tuning: Tuning | None = None, hybrid: bool = False) -> GammaPolicy:
    """A policy from what a caller passes as ``gamma``: a number, ``"auto"`` or a policy (``hybrid``: the drafter
    is a ``HybridDrafter``, whose steps ``"auto"`` prices by what they draft)."""
    if isinstance(gamma, GammaPolicy):
        return gamma
    if isinstance(gamma, str) and gamma == "auto":
        if tuning is None:
            raise HfspecError(
                "gamma='auto' needs the generator's measured costs; pass it to SpeculativeGenerator.generate"
            )
        return AutoGamma(tuning, hybrid)
    return FixedGamma(check_gamma(gamma))
