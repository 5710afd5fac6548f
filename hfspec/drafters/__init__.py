"""Drafters: whatever proposes the tokens that the target verifies.

The loop knows a drafter only through the small interface below, as vLLM's
rejection sampler knows its proposers: ``propose`` returns a ``Proposal`` (``hfspec.tree.proposal``: a chain of
γ tokens per row, or from ``propose_tree`` a tree) with the exact distribution ``q`` each was drawn from, and
``commit`` says which of them the target kept (the accepted path) so that the drafter can roll back. A drafter
that picks its tokens
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
from hfspec.tree.proposal import Proposal, Sources

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "Context",
    "Drafter",
    "Features",
    "Pick",
    "Proposal",
    "Sources",
    "Stop",
    "builds_trees",
    "draft_chain",
    "kept_drafts",
    "merges_rows",
]

# stop(i, confidence): after i drafts, with (B,) the drafter's probability of each row's
# last draft, True ends the step's drafting early.
Stop = Callable[[int, torch.Tensor], bool]
# pick(logits, i): draft i of each row from logits (B, V): (token (B,), q (B, V) or None, confidence (B,)).
Pick = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]


@dataclass(frozen=True)
class Features:
    """Target hidden states a drafter asked for, read during a target forward the loop ran anyway.

    ``values`` (B, k, F) at the k fed columns; ``positions`` (B, k) the row position of the
    token each column read; ``valid`` (B, k) bool: the column read a real token (not padding,
    not a padding draft). Columns of the prefill are committed as they come; those of a
    verification (``verification=True``: the pending token, then the drafts) are committed
    for the pending token and the kept path, which the next ``commit`` tells.
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
    # (the ``price`` handed to ``propose``) and named in the proposal (``Proposal.sources``); such a drafter drafts
    # no trees.
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

    def propose(self, ctx: Context, gamma: int, stop: Stop | None = None, price: Price | None = None) -> Proposal:
        """A chain of up to ``gamma`` drafts per row; ``stop`` may end it early; ``price``: how the γ policy priced
        the step (``gamma="auto"``), for a drafter that can take cheaper steps (``hfspec.drafters.hybrid``); None:
        by expected tokens alone."""
        raise NotImplementedError

    def propose_tree(self, ctx: Context, nodes: int, depth: int) -> Proposal:
        """Up to ``nodes`` drafts as a tree at most ``depth`` deep (``hfspec.tree``); a drafter that cannot
        build one proposes its chain of ``depth`` drafts."""
        return self.propose(ctx, depth)

    def commit(self, ctx: Context, path: torch.Tensor) -> None:
        """After each verification: row b kept the nodes ``path[b]`` (B, D) of the last proposal, up to the first
        -1 (a chain's path is 0, 1, …; none for a step without a proposal); their tokens follow the committed ones
        in ``ctx.tokens``, and ``ctx.lengths`` still counts the tokens before that step."""

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
    def module(self) -> torch.nn.Module | None:
        """The module a drafting step runs (a draft model, a head); None for lookup."""
        return self.model

    @property
    def lookup(self) -> Drafter | None:
        """The n-gram drafter whose store of earlier outputs this drafter drafts from, if any
        (``hfspec.drafters.ngram``)."""
        return None

    @property
    def recurrent(self) -> bool:
        """True when the drafter's state cannot hold a masked hole, so rows must run one at a time."""
        return False

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}


def kept_drafts(ctx: Context, drafts: torch.Tensor, path: torch.Tensor, fed: int) -> torch.Tensor:
    """(B,) how many nodes of the kept ``path`` (B, D) a draft model whose own proposal was ``drafts`` (B, N) keeps
    in its cache, which holds its first ``fed`` nodes: the leading nodes it fed that are its own, tokens and all
    (under a hybrid, another drafter's proposal may have been the one verified). ``ctx.tokens`` holds the kept
    path's tokens after ``ctx.lengths``."""
    width = path.shape[1]
    if not width or not drafts.shape[1]:
        return torch.zeros_like(ctx.lengths)
    nodes = path.clamp(min=0, max=drafts.shape[1] - 1)
    committed = ctx.tokens.gather(1, ctx.lengths[:, None] + torch.arange(width, device=ctx.tokens.device))
    mine = (path >= 0) & (path < fed) & (drafts.gather(1, nodes) == committed)
    return sampling.first_rejection(mine)


def draft_chain(
    step: Callable[[int, torch.Tensor | None], torch.Tensor | None], pick: Pick, gamma: int, stop: Stop | None
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The draft loop of a chain drafter: catch up, snapshot, then pick, stop and feed, up to γ drafts.

    ``step(i, token)`` runs the draft forward that gives draft i's logits: for i = 0 the catch-up on the committed
    tokens not yet fed (``token`` None), after which the drafter snapshots what it will roll back; then the one
    that feeds draft i - 1 (``token`` (B,)), or None where the drafter cannot read that token (drafting ends
    there). ``pick`` (``Context.pick``, or the drafter's own) chooses draft i; ``stop`` may end drafting early.
    The last draft is never fed. Returns the drafts' tokens and q's, in order."""
    tokens: list[torch.Tensor] = []
    qs: list[torch.Tensor | None] = []
    token = None
    for i in range(gamma):
        logits = step(i, token)
        if logits is None:
            break
        token, q, confidence = pick(logits, i)
        tokens.append(token)
        qs.append(q)
        if i + 1 == gamma or (stop is not None and stop(i + 1, confidence)):
            break
    return tokens, qs


def merges_rows(drafter: Drafter) -> bool:
    """Whether ``drafter`` takes rows into a running batch (``Drafter.merge``)."""
    return type(drafter).merge is not Drafter.merge


def builds_trees(drafter: Drafter) -> bool:
    """Whether ``drafter`` builds draft trees; one that does not proposes its chain from ``propose_tree``."""
    return type(drafter).propose_tree is not Drafter.propose_tree
