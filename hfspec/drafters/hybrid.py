"""A model drafter plus n-gram lookup: per row, whichever is expected to get more tokens accepted,
and the draft model only in steps where it raises the expected tokens per second.

Each step the n-gram lookup proposes first (it costs no forward). For each row with an
n-gram proposal of k tokens after a match of m tokens, the expected accepted length is
E_ngram = α + α² + … + α^k, with α the running per-token acceptance of n-gram drafts
after matches of about m tokens (one record per match-length bucket: 1, 2–3, 4–7, …);
that of the main drafter is E_main = β + … + β^γ with β its own running acceptance.
The row takes the n-gram proposal when E_ngram ≥ E_main, the main drafter's otherwise.
When every row takes the n-gram proposal, the main drafter does not run that step.

That per-row rule is a rule on tokens per second too, once the step runs the model: a
draft-model step is one batched forward whatever rows use it, so its cost is the step's,
and a row's best use of a paid step is the proposal with more expected tokens. Whether
the step pays for the model at all is decided by time: with the step's costs
(the ``price`` that ``gamma="auto"`` hands to ``propose``), the model runs only when the step's expected tokens
with it, Σ (1 + max(E_ngram, E_main)) over the rows, divided by γ draft-model steps and
the verification over γ+1 tokens, beat those of the lookup alone, Σ (1 + E_ngram) over
the lookup alone's time (no draft-model step, a verification only as wide as the longest
lookup proposal). A γ policy may also forbid the model for a step (``Price(model=False)``);
rows without a lookup proposal then draft nothing. So a step that takes only lookup
proposals pays no draft-model cost, and the γ policy (``hfspec.policy.AutoGamma``) prices
it so: it learns the two proposers apart from the proposal's ``Sources`` (which source drafted each
row, whether the model ran) and the verdict.

The main drafter may be a model or an EAGLE-3 head: it hears every verification (and
the target features it reads), and keeps of its own drafts only those the committed
text begins with.

Both records are per-token Bernoulli counts with exponential decay, as in
``hfspec.policy.CostModelGamma``: a run of n accepts of k drafts is n successes and, if
n < k, one failure. The n-gram record also learns in rows where it lost: for one-hot
drafts, draft i is accepted exactly when it equals the committed token (a rejection
resamples from p without it), so comparing the n-gram proposal with the main drafter's
accepted tokens is the same Bernoulli trial; where those run out the comparison stops
without a failure.

Rows join a running batch (``fork``, ``prefill``, ``merge``: the server's continuous batching) with
state of their own in both drafters. The running records are learnt from every row, so a row's
choice between the two proposals depends on what else ran; a row forked with ``own_context``
(the server's seeded sampled rows, whose tokens must be the same alone or in company) always
takes the main drafter's proposal, which depends on its own context alone.

Mixed batches carry one-hot q rows and the main drafter's q rows in one (B, γ, V)
tensor; verification is the usual one (Leviathan et al., arXiv 2211.17192), so the
output is distributed exactly as the target's. A ``ModelDrafter`` keeps none of its drafts
in rows that took the n-gram proposal (unless they happen to equal it) and catches up on
the committed tokens in its next forward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hfspec import tree
from hfspec.decoding import sampling
from hfspec.drafters import Context, Drafter, Features, Proposal, Sources, Stop
from hfspec.drafters.ngram import NgramDrafter
from hfspec.errors import HfspecTypeError
from hfspec.measure.alpha import AlphaEstimate
from hfspec.measure.costs import Costs, Price

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BUCKETS = 6  # match lengths 1, 2-3, 4-7, 8-15, 16-31, 32+


def bucket(match_length: int) -> int:
    return min(max(match_length, 1).bit_length() - 1, BUCKETS - 1)


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class _Drafted:
    """The last proposal as the hybrid's own records learn from it at ``commit``."""

    sources: Sources
    drafted: list[int]  # drafts per row in the proposal
    buckets: list[int]  # per row: the lookup's match-length bucket


class HybridDrafter(Drafter):
    """``main`` (a model drafter) and ``ngram`` lookup: per row the proposal with more expected accepted tokens,
    the model only in steps where it pays (see the module docstring)."""

    kind = "hybrid"
    mixes_sources = True

    def __init__(self, main: Drafter, ngram: NgramDrafter | None = None):
        if main.mixes_sources or main.parameters == 0:  # lookup, or a hybrid: nothing drafts with a model
            raise HfspecTypeError(f"the main drafter of a hybrid must draft with a model, got a {main.kind} drafter")
        self.main = main
        self.feature_layers = main.feature_layers
        self.ngram = ngram if ngram is not None else NgramDrafter()
        self.vocab_size = main.vocab_size
        self.ngram_rates = [AlphaEstimate() for _ in range(BUCKETS)]
        self.main_rate = AlphaEstimate()
        self._last: _Drafted | None = None  # the last chain proposal, until it is committed

    @property
    def model(self) -> PreTrainedModel | None:
        """The main drafter's model (n-gram lookup has none)."""
        return self.main.model

    @property
    def module(self) -> torch.nn.Module | None:
        return self.main.module

    @property
    def lookup(self) -> Drafter | None:
        return self.ngram.lookup

    @property
    def draft_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The main drafter's own tokenizer, where it has one."""
        return self.main.draft_tokenizer

    @property
    def parameters(self) -> int | None:
        """The main drafter's: lookup reads no parameters."""
        return self.main.parameters

    @property
    def recurrent(self) -> bool:
        return self.main.recurrent

    def start(self, batch: int, device: torch.device) -> None:
        self.main.start(batch, device)
        self.ngram.start(batch, device)
        self._last = None

    def observe(self, ctx: Context, features: Features) -> None:
        self.main.observe(ctx, features)

    def propose(self, ctx: Context, gamma: int, stop: Stop | None = None, price: Price | None = None) -> Proposal:
        # Priced by the step's costs (without a price: by expected tokens alone, as with a fixed γ).
        costs, model = (None, True) if price is None else (price.costs, price.model)
        ng = self.ngram.propose(ctx, gamma)
        ng_counts = ng.drafted().cpu()
        buckets = [bucket(m) for m in ng.sources.matched.tolist()]
        e_ngram = [self.ngram_rates[j].expected(k) if k else 0.0 for k, j in zip(ng_counts.tolist(), buckets)]
        e_main = self.main_rate.expected(gamma)
        use = torch.tensor(
            [k > 0 and e >= e_main and not own for k, e, own in zip(ng_counts.tolist(), e_ngram, self.ngram.own)],
            dtype=torch.bool,
        )
        if not bool(use.all()) and not (model and self._model_pays(costs, e_ngram, e_main, ng.gamma, gamma)):
            use = ng_counts > 0  # the lookup alone: rows without a proposal draft nothing
            model = False
        if not model or bool(use.all()):
            proposal = ng
            agree, model_gamma = torch.zeros_like(ng_counts), 0
        else:
            mp = self.main.propose(ctx, gamma, stop)
            proposal = mp if not bool(use.any()) else self._merge(ng, mp, use.to(mp.tokens.device))
            agree = torch.tensor(
                [agreement(a[:k], b) for a, b, k in zip(ng.tokens.tolist(), mp.tokens.tolist(), ng_counts.tolist())]
            )
            model_gamma = mp.gamma
        sources = Sources(ng_counts, ng.sources.matched, use, agree, model_gamma)
        self._last = _Drafted(sources, proposal.drafted().tolist(), buckets)
        return proposal.with_sources(sources)

    @staticmethod
    def _model_pays(costs: Costs | None, e_ngram: list[float], e_main: float, width: int, gamma: int) -> bool:
        """Whether running the model raises the step's expected tokens per second (always, without costs).
        The lookup has run already: its time is the same either way, and left out of both."""
        if costs is None:
            return True
        batch = len(e_ngram)
        alone = (batch + sum(e_ngram)) / costs.step_seconds(batch, width, model=False)
        both = (batch + sum(max(e, e_main) for e in e_ngram)) / costs.step_seconds(batch, gamma)
        return both > alone

    def _merge(self, ng: Proposal, mp: Proposal, use: torch.Tensor) -> Proposal:
        """One proposal: the n-gram rows where ``use``, the main drafter's elsewhere; padding is zeros."""
        batch, width = mp.tokens.shape[0], max(mp.gamma, ng.gamma)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=mp.tokens.device)
        tokens[:, : mp.gamma] = mp.tokens
        tokens[use] = torch.nn.functional.pad(ng.tokens, (0, width - ng.gamma))[use]
        counts = torch.where(use, ng.drafted(), mp.drafted())
        q = None
        if mp.q is not None:  # (B, γ, V): the main drafter's q rows, one-hot rows for the n-gram's
            q = mp.q.new_zeros(batch, width, mp.q.shape[-1])
            q[:, : mp.gamma] = mp.q
            q[use] = sampling.one_hot(tokens[use], q.shape[-1])
        return Proposal.chain(tokens, q, counts, forwards=mp.draft_forwards())

    def propose_tree(self, ctx: Context, nodes: int, depth: int) -> Proposal:
        """The main drafter's tree with the lookup's tree grafted on (``tree.graft``): the lookup takes up to
        half the budget, the main drafter the rest. A main drafter that cannot build a tree: the hybrid's chain."""
        if self.main.recurrent:
            return self.propose(ctx, depth)
        ng = self.ngram.propose_tree(ctx, max(1, nodes // 2), depth)
        extra = int(ng.drafted().max()) if ng.nodes else 0
        main = self.main.propose_tree(ctx, max(1, nodes - extra), depth)
        if main.is_chain:  # the main drafter proposed its chain: verify that alone
            return main
        return tree.graft(main, ng) if ng.nodes else main

    def commit(self, ctx: Context, path: torch.Tensor) -> None:
        """Both drafters hear the verdict; the running records learn from a chain proposal's rows."""
        last, self._last = self._last, None
        if last is not None:
            self._learn(last, (path >= 0).sum(dim=1).tolist())
        self.main.commit(ctx, path)
        self.ngram.commit(ctx, path)

    def _learn(self, last: _Drafted, accepted: list[int]) -> None:
        """Update both running records from the kept drafts (see the module docstring)."""
        src = last.sources
        rows = zip(accepted, src.lookup.tolist(), src.took_lookup.tolist(), src.agree.tolist(), last.drafted)
        for b, (n, k, used, agree, drafted) in enumerate(rows):
            rate = self.ngram_rates[last.buckets[b]]
            if used:
                rate.add(n, n < k)
            elif src.model_gamma:
                if k:  # the n-gram proposal against the committed drafts of the main one
                    seen = min(k, n)
                    rate.add(min(agree, seen), agree < seen)
                self.main_rate.add(n, n < drafted)

    def finished(self, row: int, output: torch.Tensor) -> None:
        self.main.finished(row, output)
        self.ngram.finished(row, output)

    def select_rows(self, keep: torch.Tensor) -> None:
        self.main.select_rows(keep)
        self.ngram.select_rows(keep)

    def check(self, ctx: Context) -> None:
        self.main.check(ctx)
        self.ngram.check(ctx)

    def fork(self, own_context: bool = False) -> HybridDrafter:
        other = copy.copy(self)
        other.main, other.ngram = self.main.fork(own_context), self.ngram.fork(own_context)
        return other

    def prefill(self, ctx: Context) -> None:
        self.main.prefill(ctx)
        self.ngram.prefill(ctx)

    def merge(self, other: Drafter) -> None:
        assert type(other) is type(self) and self._last is None and other._last is None
        self.main.merge(other.main)
        self.ngram.merge(other.ngram)

    def step_seconds(self, context: list[int], device: torch.device) -> float:
        return self.main.step_seconds(context, device)

    def describe(self) -> dict[str, Any]:
        main = self.main.describe()
        return {
            "kind": self.kind,
            "parameters": main.get("parameters"),
            "main": main,
            "ngram": self.ngram.describe(),
            "ngram_alpha": [round(r.alpha, 3) for r in self.ngram_rates],
            "main_alpha": round(self.main_rate.alpha, 3),
        }


def with_ngram(drafter: Drafter) -> Drafter:
    """``drafter`` with n-gram lookup added (an n-gram or hybrid drafter is returned as it is)."""
    if drafter.mixes_sources or drafter.parameters == 0:
        return drafter
    return HybridDrafter(drafter)
