"""Drafting without a draft model: continue the longest earlier match of the context.

Prompt lookup (transformers' ``prompt_lookup_num_tokens``) and SuffixDecoding (Oliaro
et al., arXiv 2411.04975) draft by copying: summaries, rewrites, code edits and answers
about a given text repeat long runs of their input. Each step, per row:

1. find ``m``, the length of the longest suffix of the context (prompt plus committed
   tokens) that also ends earlier in it, or in a bounded store of earlier outputs of
   the same drafter, and every earlier end of that suffix;
2. follow the continuation after those ends, one token at a time, taking the token most
   of the still-agreeing ends continue with (ties: the most recent); its share of them is
   the token's empirical frequency ``f``, and the running product ``P = f1·f2·…`` the
   empirical chance that the whole proposal so far is right;
3. stop at ``factor × m`` tokens (SuffixDecoding's max_spec), at γ, or before ``P``
   falls under ``min_prob``: a long match earns a long proposal, a continuation that was
   not always the same a short one.

Of the context's and the store's proposals the one with the larger ``ΣP`` (expected
accepted tokens, were ``f`` the acceptance probability) is used. The tokens are picked
deterministically, so their q is one-hot (``Proposal.q = None``): the target keeps a
draft x with probability p(x) and otherwise resamples from p without x, the ordinary
rule of Leviathan et al. (arXiv 2211.17192), exact at any temperature.

The index of each row grows with the tokens committed since the last step (O(new tokens)
per step) and reads nothing past ``ctx.lengths``: it learns only committed text, and the
store only whole outputs of finished rows.

Rows join a running batch (``fork``, ``prefill``, ``merge``: the server's continuous batching) with
their own index; the store stays shared, so a row may copy what an earlier request answered. That
store holds what finished before, in the order it finished, so with it a row's drafts depend on
what else ran. A greedy row's output cannot change with its drafts, nor a sampled row's
distribution; but a seeded sampled row must give the same tokens alone or in company, and its
drafts decide which of its random draws decide what. So a row forked with ``own_context`` (the
server's seeded sampled rows) looks up its own context only: its drafts, cut to its γ, are then a
function of its own tokens and γ (a proposal cut short is the prefix of a longer one). Its output
still enters the store when it finishes.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

import torch

from hfspec.drafters import Context, Drafter, Proposal, Sources, Stop
from hfspec.errors import HfspecError
from hfspec.measure.costs import Price

SEPARATOR = -1  # ends each output in the store; equal to no token, so no match crosses it


class TokenIndex:
    """A growing token sequence and, for each n-gram of ``key`` tokens in it, the positions where it ends.

    ``extend`` costs O(new tokens). ``match`` looks at the ``candidates`` most recent ends
    of the query's last ``key`` tokens and measures how far back each agrees with the
    query (at most ``max_match`` tokens). Plain lists: the sizes are small, and per-call
    overhead, not arithmetic, is what a step pays for.
    """

    def __init__(self, key: int, max_match: int, candidates: int):
        self.key, self.max_match, self.candidates = key, max_match, candidates
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    @property
    def size(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(new)
        # The n-grams ending at the new positions; earlier ones are indexed already.
        seq, key = self.tokens, self.key
        for end in range(max(key - 1, start), len(seq)):
            gram = tuple(seq[end - key + 1 : end + 1])
            if min(gram) >= 0:
                self.ends.setdefault(gram, []).append(end)

    def tail(self, n: int) -> list[int]:
        """The last ``n`` tokens (fewer if there are fewer)."""
        return self.tokens[-n:]

    def match(self, query: list[int], exclude: int | None = None) -> tuple[int, list[int]]:
        """``(m, ends)``: the longest suffix of ``query`` found here ends at each of ``ends``, m tokens long.

        ``exclude`` is a position not to count (the query's own end, when it is this sequence).
        """
        if len(query) < self.key:
            return 0, []
        found = self.ends.get(tuple(query[-self.key :]), [])
        seq, depth, last = self.tokens, min(self.max_match, len(query)), len(query) - 1
        best, ends = 0, []
        for end in found[-self.candidates - 1 :]:
            if end == exclude:
                continue
            m, reach = self.key, min(depth, end + 1)  # the key's tokens agree already
            while m < reach and seq[end - m] == query[last - m]:
                m += 1
            if m > best:
                best, ends = m, [end]
            elif m == best:
                ends.append(end)
        return best, ends[-self.candidates :]

    def follow(self, ends: list[int], limit: int, min_prob: float, periodic: bool) -> tuple[list[int], list[float]]:
        """The continuation after ``ends`` (step 2 of the module docstring) and its running ``P`` per token.

        ``periodic``: a continuation that reaches the end of the sequence goes on with the
        tokens proposed so far (the repeat of a period, as in LZ77's overlapping copies).
        """
        seq, size = self.tokens, len(self.tokens)
        tokens: list[int] = []
        chance: list[float] = []
        prob = 1.0
        for i in range(limit):
            votes: dict[int, int] = {}
            nexts = []
            for end in ends:  # oldest first, so the last vote for a token is its most recent
                at = end + 1 + i
                token = seq[at] if at < size else (tokens[at - size] if periodic else SEPARATOR)
                nexts.append(token)
                if token >= 0:
                    votes[token] = votes.get(token, 0) + 1
            if not votes:
                break
            top = max(votes.values())
            token = next(t for t in reversed(nexts) if votes.get(t) == top)
            share = top / sum(votes.values())
            if prob * share < min_prob:
                break
            prob *= share
            tokens.append(token)
            chance.append(prob)
            ends = [end for end, t in zip(ends, nexts) if t == token]
        return tokens, chance

    def ends_of(self, query: list[int], exclude: int | None = None) -> list[int]:
        """The most recent ends of ``query``'s last ``key`` tokens (not ``exclude``), however far back each agrees."""
        found = self.ends.get(tuple(query[-self.key :]), []) if len(query) >= self.key else []
        return [end for end in found[-self.candidates - 1 :] if end != exclude][-self.candidates :]

    def continuations(self, ends: list[int], limit: int, periodic: bool) -> list[list[int]]:
        """The up to ``limit`` tokens after each of ``ends`` (``periodic`` as in ``follow``)."""
        seq, size, out = self.tokens, len(self.tokens), []
        for end in ends:
            cont: list[int] = []
            for i in range(limit):
                at = end + 1 + i
                token = seq[at] if at < size else (cont[at - size] if periodic else SEPARATOR)
                if token < 0:
                    break
                cont.append(token)
            out.append(cont)
        return out


def trie(continuations: list[list[int]], nodes: int, min_prob: float) -> list[tuple[int, int]]:
    """The ``nodes`` most frequent prefixes of ``continuations`` as a tree: ``(token, parent)`` per node, parents
    first and siblings by frequency (the order they are tried in). A prefix's share of the continuations is its
    empirical chance (the running P of ``follow``); shares under ``min_prob`` are left out."""
    counts: dict[tuple[int, ...], int] = {}
    for cont in continuations:
        for i in range(len(cont)):
            counts[tuple(cont[: i + 1])] = counts.get(tuple(cont[: i + 1]), 0) + 1
    total = max(len(continuations), 1)
    # A prefix is never more frequent than its own prefixes: the best ones by (count, shortness) are closed.
    ranked = sorted((key for key, n in counts.items() if n / total >= min_prob), key=lambda k: (-counts[k], len(k)))
    kept = sorted(ranked[:nodes], key=lambda k: (len(k), -counts[k]))
    where = {key: i for i, key in enumerate(kept)}
    return [(key[-1], where.get(key[:-1], -1)) for key in kept]


class History:
    """Earlier outputs, newest last, bounded in tokens: when full, the oldest half goes."""

    def __init__(self, capacity: int, key: int, max_match: int, candidates: int):
        self.capacity = capacity
        self.settings = (key, max_match, candidates)
        self.outputs: deque[list[int]] = deque()
        self.index = TokenIndex(*self.settings)

    @property
    def size(self) -> int:
        """Tokens held, separators included."""
        return self.index.size

    def add(self, output: list[int]) -> None:
        output = output[-(self.capacity - 1) :]
        if len(output) <= self.index.key:
            return  # no n-gram with a continuation
        need = len(output) + 1
        if self.size + need > self.capacity:
            # Evict down to half the capacity at once, so rebuilding costs O(1) per token added.
            held = self.size
            while self.outputs and held + need > self.capacity // 2:
                held -= len(self.outputs.popleft()) + 1
            self.index = TokenIndex(*self.settings)
            for old in self.outputs:
                self.index.extend(old + [SEPARATOR])
        self.outputs.append(output)
        self.index.extend(output + [SEPARATOR])

    def clear(self) -> None:
        self.outputs.clear()
        self.index = TokenIndex(*self.settings)


class NgramDrafter(Drafter):
    """Model-free drafts: the continuation of the longest earlier match (see the module docstring).

    ``min_match``: shortest suffix match that proposes anything (also the index's n-gram
    length); ``max_match``: longest match measured; ``factor``: at most factor × m tokens
    after a match of m; ``min_prob``: the least running frequency P of a proposal;
    ``candidates``: most recent earlier ends compared per lookup; ``history``: also look up
    earlier outputs of this drafter, at most ``history_tokens`` tokens of them.

    A proposal's ``sources`` say, per row, how many tokens the lookup drafted after a match of how many
    (``Sources.lookup``, ``Sources.matched``); after each ``propose``, ``expected`` (B,) holds ΣP, the
    proposal's expected accepted tokens were its empirical frequencies the acceptance probabilities (0 for
    rows without a proposal).
    """

    kind = "ngram"

    def __init__(
        self,
        *,
        min_match: int = 2,
        max_match: int = 32,
        factor: float = 2.0,
        min_prob: float = 0.1,
        candidates: int = 64,
        history: bool = True,
        history_tokens: int = 1 << 16,
    ):
        for name, value in (
            ("min_match", min_match),
            ("max_match", max_match),
            ("candidates", candidates),
            ("history_tokens", history_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HfspecError(f"{name} must be a positive integer, got {value!r}")
        if max_match < min_match:
            raise HfspecError(f"max_match ({max_match}) must be >= min_match ({min_match})")
        if not factor > 0:
            raise HfspecError(f"factor must be > 0, got {factor!r}")
        if not 0 <= min_prob <= 1:
            raise HfspecError(f"min_prob must be in [0, 1], got {min_prob!r}")
        self.min_match, self.max_match, self.factor, self.min_prob = min_match, max_match, factor, min_prob
        self.candidates = candidates
        settings = (min_match, max_match, candidates)
        self.history = History(history_tokens, *settings) if history else None
        self.rows: list[TokenIndex] = []
        self.own_context = False  # rows of this drafter look up their own context only (``fork``)
        self.own: list[bool] = []  # per row: its own context only
        self.expected = torch.zeros(0)

    def start(self, batch: int, device: torch.device) -> None:
        self.rows = [TokenIndex(self.min_match, self.max_match, self.candidates) for _ in range(batch)]
        self.own = [self.own_context] * batch

    def fork(self, own_context: bool = False) -> NgramDrafter:
        """Rows of their own for a running batch, with the store shared (module docstring: ``own_context``)."""
        other = copy.copy(self)
        other.own_context = own_context
        return other

    def prefill(self, ctx: Context) -> None:
        self._catch_up(ctx)

    def merge(self, other: Drafter) -> None:
        assert isinstance(other, NgramDrafter) and other.history is self.history
        self.rows = self.rows + other.rows
        self.own = self.own + other.own

    def _catch_up(self, ctx: Context) -> None:
        """Index the tokens each row committed since the last call: only those, read in one gather."""
        seen = torch.tensor([row.size for row in self.rows], device=ctx.lengths.device)
        new = ctx.lengths - seen
        width = int(new.max()) if len(self.rows) else 0
        if width <= 0:
            return
        cols = (seen[:, None] + torch.arange(width, device=seen.device)).clamp(max=ctx.tokens.shape[1] - 1)
        block = ctx.tokens.gather(1, cols).tolist()
        for row, n, tokens in zip(self.rows, new.tolist(), block):
            if n > 0:
                row.extend(tokens[:n])

    def propose(self, ctx: Context, gamma: int, stop: Stop | None = None, price: Price | None = None) -> Proposal:
        self._catch_up(ctx)
        picks = [self._propose_row(row, gamma, ctx.vocab, own) for row, own in zip(self.rows, self.own)]
        width = max((len(tokens) for tokens, _, _ in picks), default=0)
        device = ctx.tokens.device
        flat = [x for t, _, _ in picks for x in t + [0] * (width - len(t))]
        tokens = torch.tensor(flat, dtype=torch.long).view(len(picks), width).to(device)
        counts = torch.tensor([len(t) for t, _, _ in picks], dtype=torch.long)
        matched = torch.tensor([m for _, _, m in picks], dtype=torch.long)
        self.expected = torch.tensor([sum(chance) for _, chance, _ in picks], dtype=torch.float32)
        sources = Sources(counts, matched, counts > 0, torch.zeros_like(counts), 0)
        return Proposal.chain(tokens, None, counts.to(device), forwards=0).with_sources(sources)

    def propose_tree(self, ctx: Context, nodes: int, depth: int) -> Proposal:
        """Every continuation of the matched suffix (in the context and in earlier outputs), merged into one
        tree scored by how often each prefix occurred (``trie``); tokens picked deterministically (one-hot q)."""
        self._catch_up(ctx)
        rows = [self._tree_row(row, nodes, depth, ctx.vocab, own) for row, own in zip(self.rows, self.own)]
        width = max((len(r) for r in rows), default=0)
        if not width:  # nothing matched anywhere: a plain step
            return Proposal.empty(len(rows), ctx.tokens.device)
        pad = [(0, -1, False)] * width
        table = [[(t, par, True) for t, par in r] + pad[len(r) :] for r in rows]
        device = ctx.tokens.device
        tokens = torch.tensor([[t for t, _, _ in r] for r in table], dtype=torch.long).view(len(rows), width)
        parents = torch.tensor([[par for _, par, _ in r] for r in table], dtype=torch.long).view(len(rows), width)
        real = torch.tensor([[ok for _, _, ok in r] for r in table], dtype=torch.bool).view(len(rows), width)
        self.expected = real.sum(dim=1).float()
        return Proposal(tokens.to(device), None, parents.to(device), real.to(device), forwards=0)

    def _tree_row(self, row: TokenIndex, nodes: int, depth: int, vocab: int, own: bool) -> list[tuple[int, int]]:
        """One row's tree (``trie``) from the continuations of every match of the last ``min_match`` tokens, in
        both sources (``own``: the row's context only); the longest match sets how deep (``factor × m``)."""
        query = row.tail(self.max_match)
        sources = [(row, row.size - 1, True)] + self._store(own)
        continuations: list[list[int]] = []
        for index, exclude, periodic in sources:
            m, _ = index.match(query, exclude)
            if m >= self.min_match:
                limit = min(depth, max(1, int(self.factor * m)))
                continuations += index.continuations(index.ends_of(query, exclude), limit, periodic)
        # A drafter shared with another target may remember ids this vocabulary lacks: cut such paths there.
        continuations = [c[: next((i for i, t in enumerate(c) if t >= vocab), len(c))] for c in continuations]
        return trie([c for c in continuations if c], nodes, self.min_prob)

    def _store(self, own: bool) -> list[tuple[TokenIndex, int | None, bool]]:
        """The store as a lookup source (index, excluded end, periodic), unless the row looks at ``own`` context."""
        return [] if own or self.history is None else [(self.history.index, None, False)]

    def _propose_row(
        self, row: TokenIndex, gamma: int, vocab: int, own: bool = False
    ) -> tuple[list[int], list[float], int]:
        """(tokens, running P per token, match length) for one row (``own``: from its context only); no tokens
        when nothing matches."""
        query = row.tail(self.max_match)
        best: tuple[list[int], list[float], int] = ([], [], 0)
        sources = [(row, row.size - 1, True)] + self._store(own)
        for index, exclude, periodic in sources:
            if sum(best[1]) >= gamma:
                break  # γ sure tokens already: no proposal can be better
            m, ends = index.match(query, exclude)
            if m < self.min_match:
                continue
            limit = min(gamma, max(1, int(self.factor * m)))
            tokens, chance = index.follow(ends, limit, self.min_prob, periodic)
            if sum(chance) > sum(best[1]):
                best = (tokens, chance, m)
        tokens, chance, m = best
        # A drafter shared with another target may remember ids this vocabulary lacks.
        cut = next((i for i, t in enumerate(tokens) if t >= vocab), len(tokens))
        return tokens[:cut], chance[:cut], m if cut else 0

    def finished(self, row: int, output: torch.Tensor) -> None:
        if self.history is not None:
            self.history.add(output.tolist())

    def select_rows(self, keep: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in keep.tolist()]
        self.own = [self.own[i] for i in keep.tolist()]

    def check(self, ctx: Context) -> None:
        seen = torch.tensor([row.size for row in self.rows], device=ctx.lengths.device)
        assert bool((seen <= ctx.lengths).all()), "the n-gram index read past the committed tokens"

    def clear_history(self) -> None:
        """Forget the earlier outputs."""
        if self.history is not None:
            self.history.clear()

    @property
    def lookup(self) -> NgramDrafter | None:
        return self if self.history is not None else None

    @property
    def parameters(self) -> int:
        """Lookup runs no model: drafting costs next to nothing."""
        return 0

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "min_match": self.min_match,
            "max_match": self.max_match,
            "factor": self.factor,
            "min_prob": self.min_prob,
            "history_tokens": None if self.history is None else self.history.size,
        }
