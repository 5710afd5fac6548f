"""One ``generate`` call's decoding loop: propose → verify → roll back → accept.

Each step (Leviathan et al., arXiv 2211.17192, Algorithm 1; Chen et al., arXiv 2302.01318);
p is the target's distribution and q the draft's, as in the paper:
1. the drafter proposes γ tokens per row, with the distributions q it drew them from;
2. the target scores the last committed token plus the γ drafts in one forward, giving p;
3. drafts are accepted with probability min(1, p/q); the next token comes from the residual
   max(0, p - q) at the first rejection, or is the bonus token from p when all are accepted;
4. the target's cache is rolled back to the accepted prefix, and the drafter is told how
   many of its drafts were kept so that it can roll back its own state;
5. each row commits its kept drafts and the next token, cut at its budget and at EOS;
   finished rows leave the batch.

``Call.run`` is that step, on one screen; a ``Call`` holds one call's state (its rows, caches and counts) and is
built afresh for each call by ``SpeculativeGenerator.generate``. State passes between the steps as values: a
``Proposal`` (``hfspec.tree.proposal``: a chain, or a tree verified in the same one forward) goes into
verification, which returns a ``Verdict`` per row (the path of drafts kept and the next token) for the rollback
and the commit. The rows'
bookkeeping lives in ``hfspec.decoding.rows``, the processing of logits and what drafters see in
``hfspec.decoding.scoring``, the counts in ``hfspec.decoding.stats``. The loop drives any ``Drafter`` through its interface and
never asks which kind it has.

Cache invariant (checked every step): the target's cache holds every committed token
except the last one (the *pending* token, fed at the start of the next step). A drafter
states and checks its own (see ``hfspec.drafters``). No token is fed to a cache twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from hfspec import tree as trees
from hfspec.decoding.rows import Rows, right_pad
from hfspec.decoding.scoring import DraftContext, Scoring
from hfspec.decoding.stats import Stats, StatsCollector
from hfspec.drafters import Drafter, Features, Proposal
from hfspec.measure.timing import now, timed
from hfspec.models.adapter import forward, forward_features, sliding_window, takes_mask_mapping
from hfspec.models.kv_cache import KVState
from hfspec.policy import GammaPolicy, Plan, Step
from hfspec.settings import SamplingParams


@dataclass(frozen=True)
class GenerateOutput:
    """Like transformers' output: ``sequences`` is (B, prompt + new), right-padded with pad_token_id."""

    sequences: torch.Tensor
    stats: Stats
    prompt_length: int  # columns of the (left-padded) prompt at the start of ``sequences``


class Pair(Protocol):
    """What a call reads of its generator (``hfspec.generator.SpeculativeGenerator``)."""

    target: PreTrainedModel
    drafter: Drafter
    vocab_size: int  # ids [0, vocab_size) are the ones both sides can score
    check_invariants: bool


@dataclass(frozen=True)
class Verdict:
    """What one verification decided, per row: the drafts kept (a path from the root of the proposal) and the next
    token.

    The loop reads ``accepted`` (how many drafts a row keeps) and ``tokens()`` (what it commits) and hands
    ``path`` to the rollback, which keeps those columns of both caches.
    """

    proposal: Proposal
    accepted: torch.Tensor  # (B,) long: drafts kept, the nodes path[b, :accepted[b]]
    next_token: torch.Tensor  # (B,) long: from the residual at the first rejection, or the bonus token
    start: int  # the target cache's length before the verification forward
    fed: torch.Tensor  # (B, N+1) the pending token and the drafts: what the target's new cache columns read
    path: torch.Tensor  # (B, D) the kept nodes, -1 past accepted[b] (a chain's: 0, 1, …)

    def tokens(self) -> torch.Tensor:
        """(B, D+1) whose first ``accepted[b] + 1`` columns are the tokens row b commits."""
        block = torch.cat([trees.path_tokens(self.proposal.tokens, self.path), self.next_token[:, None]], dim=1)
        return block.scatter_(1, self.accepted[:, None], self.next_token[:, None])


class Call:
    """One ``generate`` call: the models, settings and policy it runs with; its rows, caches and counts."""

    def __init__(
        self,
        gen: Pair,
        params: SamplingParams,
        policy: GammaPolicy,
        generator: torch.Generator | None,
        streamer: Any,
        window: int | None,
        nodes: int = 0,
    ):
        self.target, self.drafter, self.vocab = gen.target, gen.drafter, gen.vocab_size
        self.checks = gen.check_invariants
        self.params, self.policy, self.generator, self.streamer, self.window = (
            params,
            policy,
            generator,
            streamer,
            window,
        )
        self.device = gen.target.get_output_embeddings().weight.device  # where generate put the prompts
        self.scoring = Scoring(params)
        self.sample = self.scoring.sample
        self.nodes = nodes  # a tree's node budget per step; 0 for a chain (or the policy's choice)
        self.depth = trees.shape(nodes)[1] if nodes else 0
        # Sliding windows counted in positions, not cache columns, where the target takes a mask per layer
        # type: the holes that rows keeping fewer drafts leave behind must not use up a row's window.
        self.sliding = (
            sliding_window(self.target)
            if takes_mask_mapping(self.target) and not KVState.is_recurrent(self.target)
            else None
        )

    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> GenerateOutput:
        """Prefill, then propose → verify → roll back → accept until every row has finished."""
        device = self.device
        start = now(device)
        rows = self.start(ids, mask)
        while rows.active:
            t0 = now(device)
            plan = self.policy.gamma(self.rows.index.cpu()) if not self.nodes else Plan(self.depth, self.nodes)
            proposal, confidence = self.propose(plan)  # 1. up to γ drafts per row (or a tree), and their q
            t1 = now(device)
            verdict = self.verify(proposal)  # 2-3. one target forward: drafts kept and the next token, per row
            block = self.rollback(verdict)  # 4. both caches forget what was not kept
            t2 = now(device)
            drafted = proposal.drafted()
            self.learn(plan, proposal, drafted, verdict, confidence, (t1 - t0, t2 - t1))
            committed, has_eos = rows.commit(block, verdict.accepted + 1)  # 5. cut at budgets and EOS
            self.stream(block, committed)
            self.stats.record(
                rows.index,
                proposal.gamma,
                drafted,
                verdict.accepted,
                committed,
                draft_forwards=proposal.draft_forwards(),
                seconds=(t1 - t0, t2 - t1),
            )
            self.retire(has_eos | rows.exhausted(), has_eos)
            self.check()
        return self.output(ids, now(device) - start)

    def start(self, ids: torch.Tensor, mask: torch.Tensor) -> Rows:
        """Fresh rows, statistics and caches; the prompts prefilled; rows without a budget retired at once."""
        batch = ids.shape[0]
        self.rows = Rows(ids, mask, self.params.max_new_tokens, self.window, list(self.params.stop_token_ids))
        self.stats = StatsCollector(batch)
        # The cache never holds much more than the prompt, the budget and one tree's nodes: its buffers' bound.
        self.kv = KVState(
            batch, self.device, self.target, reserve=ids.shape[1] + self.params.max_new_tokens + self.nodes
        )
        self.drafter.start(batch, self.device)
        self.policy.begin(batch)
        self.stats.time_target += timed(lambda: self.prefill(ids, mask), self.device)[1]
        self.stream(ids)
        self.retire(self.rows.exhausted(), torch.zeros_like(self.rows.lengths, dtype=torch.bool))
        return self.rows

    def context(self) -> DraftContext:
        """What the drafter sees now; the step named in errors is the target pass in progress."""
        return DraftContext(self.rows, self.scoring, self.vocab, self.generator, self.stats.target_passes + 1)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Feed all prompt tokens but the last to the target (the last one is pending)."""
        if ids.shape[1] < 2:
            return
        prefix, prefix_mask = ids[:, :-1], mask[:, :-1]
        positions = (prefix_mask.cumsum(dim=1) - 1).clamp(min=0)
        self.target_forward(prefix, prefix_mask, positions, prefix_mask.bool(), verification=False, logits_to_keep=1)

    def learn(
        self,
        plan: Plan,
        proposal: Proposal,
        drafted: torch.Tensor,
        verdict: Verdict,
        confidence: torch.Tensor | None,
        seconds: tuple[float, float],
    ) -> None:
        """Tell the policy what the step did: its plan, the proposal (``drafted`` (B,) per row; a tree's shape; which
        source drafted each row) and the kept path; ``seconds`` of drafting and of verifying."""
        tree = None if proposal.is_chain else (proposal.parents.cpu(), proposal.mask().cpu())
        self.policy.update(
            Step(
                self.rows.index.cpu(),
                plan,
                proposal.gamma,
                drafted.cpu(),
                verdict.accepted.cpu(),
                confidence,
                *seconds,
                path=verdict.path.cpu(),
                parents=tree[0] if tree else None,
                real=tree[1] if tree else None,
                sources=proposal.sources,
            )
        )

    def propose(self, plan: Plan) -> tuple[Proposal, torch.Tensor | None]:
        """The drafter's proposal for ``plan`` (a tree of at most ``plan.nodes`` nodes when the step drafts one),
        priced as the policy priced it, with γ (a tree: its depth) cut so that no row drafts past its budget; and
        its probability of each pick (B, picks) for the policy, if it gave any."""
        gamma = max(0, min(plan.gamma, int(self.rows.left.max()) - 1))
        if not gamma:
            return Proposal.empty(self.rows.active, self.device), None
        ctx = self.context()
        if plan.nodes:
            proposal = self.drafter.propose_tree(ctx, plan.nodes, gamma)
        else:
            drafts: list[torch.Tensor] = []  # the confidence of each draft so far, which the policy's stop reads

            def stop(i: int, confidence: torch.Tensor) -> bool:
                drafts.append(confidence)
                return self.policy.stop(plan, drafts)

            proposal = self.drafter.propose(ctx, gamma, stop, plan.price)
        return proposal, ctx.confidence()

    def verify(self, proposal: Proposal) -> Verdict:
        """One target forward over the pending token and every draft, each attending to the committed tokens and its
        own ancestors (a chain's: the drafts before it); accept along one path per row (``hfspec.tree.verify``:
        Leviathan et al., Alg. 1, with siblings tried in turn; greedy: while the draft is the target's argmax)."""
        rows = self.rows
        start = self.kv.length
        fed = torch.cat([rows.pending(), proposal.tokens], dim=1)  # (B, N+1); column 0 is the root
        real = torch.cat([torch.ones_like(fed[:, :1], dtype=torch.bool), proposal.mask()], dim=1)
        self.kv.snapshot()
        if proposal.is_chain:
            if proposal.nodes:  # the buffer holds the drafts: processors read them as context
                rows.write(proposal.tokens)
            columns = torch.arange(proposal.nodes + 1, device=fed.device)
            logits = self.target_forward(fed, torch.ones_like(fed), (rows.lengths - 1)[:, None] + columns, real, True)
        else:  # a tree reads its ancestors through a prepared mask (no processor reads the context: see generator)
            parents = torch.cat([torch.full_like(fed[:, :1], -1), proposal.parents + 1], dim=1)
            positions = (rows.lengths - 1)[:, None] + trees.depths(parents) - 1  # the root at depth 0
            self.kv.extend_mask(torch.ones_like(fed))
            attention = self.attention(trees.ancestry(parents), positions)
            logits = self.target_forward(fed, None, positions, real, True, attention=attention)
        p = self.scoring.probs(
            logits[..., : self.vocab].to(rows.tokens.device),
            rows.tokens,
            rows.lengths,
            0,
            "target",
            self.stats.target_passes + 1,
        )  # (B, N+1, V); scores when greedy
        if not self.sample:
            path, accepted, next_token = trees.verify_greedy(proposal, p.argmax(dim=-1))
        else:
            path, accepted, next_token = trees.verify(proposal, p, self.generator)
        if not proposal.is_chain:
            self.stats.record_tree(proposal.drafted(), accepted)
        return Verdict(proposal, accepted, next_token, start, fed, path)

    def target_forward(
        self,
        feed: torch.Tensor,
        valid: torch.Tensor | None,
        positions: torch.Tensor,
        real: torch.Tensor,
        verification: bool,
        logits_to_keep: int = 0,
        attention: torch.Tensor | dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One target forward over (B, k) new tokens; hands the drafter the features it asked for.
        ``attention``: a prepared mask (a tree's) for columns already added to the cache's mask."""
        mask = self.kv.extend_mask(valid) if attention is None else attention
        if attention is None and self.sliding is not None:
            k = feed.shape[1]
            causal = torch.ones(k, k, dtype=torch.bool, device=valid.device).tril()
            visible = (causal & valid.bool()[:, None, :]) | torch.eye(k, dtype=torch.bool, device=valid.device)
            mask = self.attention(visible, positions)
        layers = self.drafter.feature_layers
        if not layers:
            return forward(self.target, feed, mask, positions, self.kv.cache, logits_to_keep)
        logits, values = forward_features(self.target, feed, mask, positions, self.kv.cache, layers, logits_to_keep)
        self.drafter.observe(self.context(), Features(values.to(feed.device), positions, real, verification))
        return logits

    def attention(self, visible: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The target's masks for new columns at ``positions`` (B, k) that see ``visible`` (B, k, k) of each
        other and every valid cached column: full attention, plus the sliding window counted in positions
        where the target has one (trees run only where ``self.sliding`` covers it: see check_tree_attention)."""
        return self.kv.tree_attention(self.target, visible, positions, positions, self.sliding)

    def rollback(self, verdict: Verdict) -> torch.Tensor:
        """The drafter keeps what it needs of its drafts; the target keeps the pending token and the kept path.
        Runs before the commit, with the kept path's tokens written after the committed tokens (drafters read
        them); returns those tokens (``Verdict.tokens``)."""
        block = verdict.tokens()
        self.rows.write(block)
        self.drafter.commit(self.context(), verdict.path)
        columns = None  # a chain's kept columns are in place
        if not verdict.proposal.is_chain:
            columns = torch.cat([torch.zeros_like(verdict.path[:, :1]), verdict.path + 1], dim=1)
        self.kv.keep(verdict.accepted + 1, verdict.start, verdict.fed, columns)
        return block

    def stream(self, block: torch.Tensor, count: torch.Tensor | None = None) -> None:
        """Hand the streamer row 0's first ``count[0]`` tokens of ``block`` (B, k), or all of ``block``."""
        if self.streamer is not None:
            self.streamer.put((block if count is None else block[0, : int(count[0])]).cpu())

    def retire(self, finished: torch.Tensor, has_eos: torch.Tensor) -> None:
        """Store finished rows' outputs and drop them from the batch, so that they cost nothing more."""
        if not bool(finished.any()):
            return
        for b, new_tokens in self.rows.finish(finished, has_eos):
            self.drafter.finished(b, new_tokens)
        keep = (~finished).nonzero().flatten()
        self.rows.select(keep)
        self.kv.select_rows(keep)
        self.drafter.select_rows(keep)

    def check(self) -> None:
        """The cache invariant (module docstring), for the target and the drafter's own state."""
        if self.checks and self.rows.active:
            self.kv.check(self.rows.lengths - 1, "target")
            self.drafter.check(self.context())

    def output(self, ids: torch.Tensor, seconds: float) -> GenerateOutput:
        """The prompts with their right-padded new tokens, and the call's statistics, in the prompts' order."""
        outputs = [self.rows.outputs[b] for b in range(ids.shape[0])]
        new = right_pad([tokens for tokens, _ in outputs], self.params.pad(), ids.device)
        stats = self.stats.result([(tokens.numel(), why) for tokens, why in outputs], seconds)
        return GenerateOutput(torch.cat([ids, new], dim=1), stats, ids.shape[1])
