"""Drafters: whatever proposes the tokens that the target verifies.

The loop knows a drafter only through the small interface below, as vLLM's
rejection sampler knows its proposers: ``propose`` returns γ tokens per row with
the exact distribution ``q`` each was drawn from, and ``commit`` says how many the
target accepted so that the drafter can roll back. A drafter that picks its tokens
deterministically (n-gram lookup, an argmax) returns ``q=None``: its q is one-hot,
and the acceptance rule min(1, p/q) of Leviathan et al. (arXiv 2211.17192) then
accepts a token x with probability p(x) and resamples from p without x.

Rows of a batch are the active prompts of the run, in the loop's order; a drafter
keeps per-row state in that order and drops rows in ``select_rows``.

This module is the interface only: it imports no drafter. Turning what a user passes
as the draft (a model, a head, a path, ``"ngram"``) into a drafter is
``hfspec.drafters.factory.make_drafter``'s job, which sits above every drafter and the loaders.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hfspec.decoding import sampling
from hfspec.measure.costs import Price
from hfspec.tree.proposal import TreeProposal

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# stop(i, confidence): after i drafts, with (B,) the drafter's probability of each row's
# last draft, True ends the step's drafting early.
Stop = Callable[[int, torch.Tensor], bool]


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one step.

    ``tokens`` (B, γ) long; ``q`` (B, γ, V) the distributions they were drawn from, or
    ``None`` when each token was picked deterministically (a one-hot q); ``counts``
    (B,) the drafts of each row, ≤ γ, whose later columns are padding that is never
    accepted (``None``: γ for every row); ``forwards`` the draft forwards it took
    (``None``: one per column, γ).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    forwards: int | None = None

    @property
    def gamma(self) -> int:
        return self.tokens.shape[1]

    def draft_forwards(self) -> int:
        return self.gamma if self.forwards is None else self.forwards

    def drafted(self) -> torch.Tensor:
        """(B,) drafts per row."""
        if self.counts is None:
            return torch.full((self.tokens.shape[0],), self.gamma, dtype=torch.long, device=self.tokens.device)
        return self.counts

    @classmethod
    def empty(cls, batch: int, device: torch.device) -> Proposal:
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device))


@dataclass(frozen=True)
class Features:
    """Target hidden states a drafter asked for, read during a target forward the loop ran anyway.

    ``values`` (B, k, F) at the k fed columns; ``positions`` (B, k) the row position of the
    token each column read; ``valid`` (B, k) bool: the column read a real token (not padding,
    not a padding draft). Columns of the prefill are committed as they come; those of a
    verification (``verification=True``: the pending token, then the drafts) are committed
    for the first ``num_accepted + 1`` columns, which the next ``commit`` tells.
    """

    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    verification: bool


class Context(Protocol):
    """What the loop shows a drafter: the committed tokens and the shared processing."""

    tokens: torch.Tensor  # (B, L): row b's committed tokens are tokens[b, :lengths[b]]
    lengths: torch.Tensor  # (B,) committed tokens per row; the last one is pending (not yet fed to the target)
    vocab: int  # ids [0, vocab) are the ones both sides can score
    sample: bool  # False: greedy decoding
    generator: torch.Generator | None
    # How the γ policy priced the step being proposed (gamma="auto"), for a drafter that can take cheaper steps
    # (``hfspec.drafters.hybrid``); None: by expected tokens alone, and outside a proposal.
    price: Price | None

    def dists(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft distributions (B, k, V) at k tree nodes from raw logits (B, k, ≥vocab), processed as the
        target's (probabilities of the scores when greedy)."""
        ...

    def pick(self, logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft i of each row from raw logits (B, ≥vocab): (token (B,), q (B, V) or None when greedy,
        confidence (B,)); processed exactly as the target's scores will be, and written to ``tokens``."""
        ...


class Drafter:
    """Base class of drafters; see the module docstring for the contract."""

    # transformers ``hidden_states`` indices of the target whose values ``observe`` should receive.
    feature_layers: tuple[int, ...] = ()
    # Logit rows the drafter can produce (padded embeddings included); None when it has no vocabulary.
    vocab_size: int | None = None
    # A short name for stats and errors; the loop and the command line never branch on it.
    kind: str = "drafter"
    # True when each step's rows may draft from two sources (a model, or lookup alone), each priced by the policy
    # (``Context.price``) and reported by ``commit`` (a hybrid's ``Outcome``); such a drafter drafts no trees.
    mixes_sources: bool = False
    # The draft model this drafter runs as its own, whose cache and state the generator checks; None
    # for lookup and for an EAGLE-3 head (a head is no causal LM: it drafts from the target's features).
    model: PreTrainedModel | None = None
    # The draft model's own tokenizer where it differs from the target's (``cross_tokenizer``); None when
    # the drafter proposes target ids directly. transformers' assisted generation needs it to pair them.
    draft_tokenizer: PreTrainedTokenizerBase | None = None

    def start(self, batch: int, device: torch.device) -> None:
        """A new generation of ``batch`` rows begins: forget per-row state."""

    def observe(self, ctx: Context, features: Features) -> None:
        """Target features of the columns a target forward just read (only with ``feature_layers``)."""

    def propose(self, ctx: Context, gamma: int, stop: Stop | None = None) -> Proposal:
        raise NotImplementedError

    def propose_tree(self, ctx: Context, nodes: int, depth: int) -> Proposal | TreeProposal:
        """Up to ``nodes`` drafts as a tree at most ``depth`` deep (``hfspec.tree``); a drafter that cannot
        build one proposes its chain of ``depth`` drafts."""
        return self.propose(ctx, depth)

    def commit_tree(self, ctx: Context, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After a tree's verification: row b kept the nodes ``path[b, :num_accepted[b]]`` of the last tree."""
        raise NotImplementedError(f"{type(self).__name__} proposed no tree")

    def commit(self, ctx: Context, num_accepted: torch.Tensor) -> Any:
        """After each verification: row b kept ``num_accepted[b]`` drafts of the last proposal
        (0 for a step without one). ``ctx.lengths`` still counts the tokens before that step. Returns what
        a γ policy may learn of the step beyond the counts (a hybrid's ``Outcome``: ``Step.outcome``), or None."""
        return None

    def finished(self, row: int, output: torch.Tensor) -> None:
        """Row ``row`` ended with ``output`` (1-D), its committed new tokens; it leaves at the next
        ``select_rows``. Drafters that learn from earlier outputs keep them here."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (1-D long) of the batch, in that order."""

    def fork(self, own_context: bool = False) -> Drafter:
        """A drafter sharing this one's models with per-row state of its own (``start`` gives it some): rows
        prefilled apart from a running batch, which ``merge`` then appends to it. ``own_context``: its rows draft
        from their own context alone, never from what other requests left behind (a seeded sampled row, whose
        tokens must not depend on what ran before or beside it); a drafter that learns nothing across rows
        ignores it."""
        return copy.copy(self)

    def prefill(self, ctx: Context) -> None:
        """Catch up now on the committed tokens but the pending one, which a first ``propose`` would feed: a row
        joining a running batch then brings no long catch-up into the batch's step."""

    def merge(self, other: Drafter) -> None:
        """Append the rows of ``other`` (a ``fork`` of this drafter, between steps) after this drafter's rows."""
        raise NotImplementedError(f"{type(self).__name__} cannot take rows into a running batch")

    def check(self, ctx: Context) -> None:
        """Assert internal invariants after a step (the loop calls it when checks are on)."""

    def step_seconds(self, context: list[int], device: torch.device) -> float:
        """Seconds of one drafting step after ``context`` (measured here), for the cost model."""
        return 0.0

    @property
    def parameters(self) -> int | None:
        """Parameters one drafting step reads: decoding is memory-bound, so this ÷ the target's is a first
        guess at the cost ratio c. 0 for a drafter that runs no model; None when the drafter cannot tell."""
        return None

    @property
    def recurrent(self) -> bool:
        """True when the drafter's state cannot hold a masked hole, so rows must run one at a time."""
        return False

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}


def kept_fed_drafts(
    ctx: Context, drafts: torch.Tensor, num_accepted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a draft model that fed its own drafts (B, γ) to its cache, all but the last: ``(fed, kept)``, the fed
    drafts and how many of them per row to keep, those accepted that the committed text also begins with
    (under a hybrid, another drafter's proposal may have been the one verified). ``ctx.lengths`` still counts
    the tokens before the step."""
    fed = drafts[:, :-1]
    committed = ctx.tokens.gather(1, ctx.lengths[:, None] + torch.arange(fed.shape[1], device=ctx.tokens.device))
    return fed, torch.minimum(sampling.first_rejection(fed == committed), num_accepted)


def merges_rows(drafter: Drafter) -> bool:
    """Whether ``drafter`` takes rows into a running batch (``Drafter.merge``)."""
    return type(drafter).merge is not Drafter.merge


def builds_trees(drafter: Drafter) -> bool:
    """Whether ``drafter`` builds draft trees; one that does not proposes its chain from ``propose_tree``."""
    return type(drafter).propose_tree is not Drafter.propose_tree
