"""A running batch that rows join and leave between steps, each row with its own settings, γ and random stream.

The server's engine (``hfspec.serve.engine``) runs this batch's ``step`` in a loop. A request joins between
steps: ``prefill_alone`` prefills its prompt alone (the target, and the drafter's catch-up), then ``merge`` merges
its caches into the batch's, left-padded with holes (``KVState.merge``); a row leaves by ``leave`` as soon as it
finishes or is cancelled. The step is the generator's (``hfspec.decoding.loop.Call``: propose → verify → roll back → accept),
with the sampling math done per row:

- **Settings per row.** Each row keeps its ``SamplingParams``: a greedy row takes the target's argmax (exact,
  Leviathan et al.'s greedy case), a sampled row its own warpers (``sampling.warped_probs``), so that greedy rows
  sit beside sampled rows of other temperatures.
- **A row's output never depends on the batch.** Every sampling computation of row b (its drafts' q, its p,
  acceptance, the residual and the bonus) runs on row b's own slices, shaped as they would be alone, and draws
  from row b's own ``torch.Generator`` (seeded with the request's seed), in an order fixed by the row alone: per
  step, one draw per own draft, then γ_b acceptance uniforms and one residual/bonus draw. The target and a model
  draft on hfspec's kernels give a row the same bits whatever rows share the forward, and a hole is skipped, not
  weighted by zero (``hfspec.cpu.attention``); so a greedy row equals the same request served alone, token for
  token, and so does a seeded sampled row whose drafter runs on the kernels. A seeded sampled row's drafts
  depend on its own tokens alone: its drafter is forked with ``own_context`` (``Drafter.fork``), so n-gram
  lookup reads only the row's own context, not the store of earlier outputs that other requests filled.
- **γ per row.** The proposal is as wide as the widest row's γ; row b keeps only its first γ_b drafts (the rest
  are padding, never accepted, and never drawn from its stream). A seeded sampled row's γ must not depend on the
  batch: it is the request's γ, or, under ``"auto"``, a fixed ``seeded_gamma``; each is cut only by the row's
  own budget. Greedy rows and unseeded sampled rows under ``"auto"`` take ``AutoGamma``'s γ for the whole batch,
  priced at its size (``Costs.verify_seconds(batch, k)``), so speculation backs off when verification rows stop
  being cheap; γ cannot change a greedy row's output, nor any row's distribution. Drafting never stops early
  within a step here (the early stop is one decision for every row).

Every choice above changes only which tokens are drafted; acceptance stays min(1, p/q) with the residual and
bonus (Leviathan et al., arXiv 2211.17192; Chen et al., arXiv 2302.01318), so each row is the target's exact
distribution.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from hfspec import tree
from hfspec.decoding import sampling
from hfspec.decoding.loop import Call, Verdict
from hfspec.decoding.rows import Rows
from hfspec.decoding.scoring import Scoring, check_finite
from hfspec.drafters import Proposal
from hfspec.generator import SpeculativeGenerator
from hfspec.measure.timing import now
from hfspec.models.kv_cache import KVState
from hfspec.policy import GammaPolicy, Plan, Step
from hfspec.settings import SamplingParams


@dataclass
class RowState:
    """What one row samples with: its settings' processing (``Scoring`` of its ``SamplingParams``), its random stream
    and its fixed γ."""

    slot: int  # the row's index in ``Rows.index``, unique over the engine's life
    scoring: Scoring
    generator: torch.Generator
    gamma: int | None  # None: the batch's ``AutoGamma`` chooses


@dataclass(frozen=True)
class Committed:
    """What one step committed for one row."""

    slot: int
    tokens: tuple[int, ...]
    origins: tuple[str, ...]  # "accepted", "resampled" or "bonus", one per token
    drafted: int  # drafts the row kept in the proposal (its γ this step)
    accepted: int  # of them, accepted by the target
    eos: bool  # the row reached an EOS or stop token id
    exhausted: bool  # the row used its whole budget


class RowContext:
    """What a drafter sees of the batch (``hfspec.drafters.Context``), with ``pick`` done per row."""

    generator = None  # no stream shared by the rows: each draws from its own

    def __init__(self, batch: Batch, gammas: torch.Tensor | None = None):
        self.rows, self.states, self.vocab, self.gammas = batch.rows, batch.states, batch.vocab, gammas
        self.tokens, self.lengths, self.step = batch.rows.tokens, batch.rows.lengths, batch.steps
        self.sample = any(s.scoring.sample for s in self.states)
        self.picked: list[torch.Tensor] = []  # (B,) the drafter's probability of each pick, in order

    def pick(self, logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft i of each row from raw logits (B, ≥vocab), processed by the row's own ``Scoring``: a greedy row's
        argmax, a sampled row's draw from its own q with its own generator (only for its first γ_b drafts: later
        ones are padding, never drawn)."""
        logits = logits[:, : self.vocab]
        check_finite(logits, "draft", self.step)
        q = sampling.probs_from_logits(logits)  # (B, V): a plain greedy row's confidence
        token = logits.argmax(dim=-1)
        for b, state in enumerate(self.states):
            scoring = state.scoring
            if (scoring.sample or scoring.head) and (self.gammas is None or i < int(self.gammas[b])):
                row = slice(b, b + 1)
                out = scoring.probs(
                    logits[row, None], self.tokens[row], self.lengths[row], i, "draft", self.step, True
                )[0]
                q[b] = out[0] if scoring.sample else sampling.probs_from_logits(out)[0]
                token[b] = sampling.sample(out, state.generator)[0] if scoring.sample else out[0].argmax()
        self.rows.write(token[:, None], offset=i)
        confidence = q.gather(1, token[:, None]).squeeze(1)
        self.picked.append(confidence)
        return token, (q if self.sample else None), confidence

    def dists(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the server's batch drafts chains, not trees")

    def confidence(self) -> torch.Tensor | None:
        return torch.stack(self.picked, 1).cpu() if self.picked else None


class Batch(Call):
    """The server's running batch (see the module docstring): ``prefill_alone``/``merge``, ``step``, ``leave``."""

    def __init__(self, gen: SpeculativeGenerator, policy: GammaPolicy | None, window: int | None):
        super().__init__(gen, SamplingParams(temperature=0), policy, None, None, window)  # each row has its own
        self.auto = policy  # None: every row has a fixed γ
        self.steps = 0  # steps taken, named in errors
        self.rows: Rows | None = None
        self.states: list[RowState] = []
        self.kv = KVState(0, self.device)
        self.drafter.start(0, self.device)
        if policy is not None:
            policy.begin(0)
        self.gammas: torch.Tensor | None = None  # (B,) each row's γ in the step under way

    @property
    def active(self) -> int:
        return len(self.states)

    def context(self) -> RowContext:
        return RowContext(self, self.gammas)

    def prefill_alone(self, state: RowState, prompt: list[int], params: SamplingParams, eos: list[int]) -> Batch:
        """A one-row batch sharing this one's models: ``prompt`` prefilled alone (the target, then the drafter's
        catch-up), for ``merge``. ``eos``: the model's EOS ids (the request's stop token ids are added)."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        part = copy.copy(self)
        part.rows = Rows(
            ids, torch.ones_like(ids), params.max_new_tokens, self.window, eos + list(params.stop_token_ids)
        )
        part.rows.index = torch.tensor([state.slot], device=self.device)
        part.states, part.gammas = [state], None
        part.kv = KVState(1, self.device)  # attention only: the engine refuses recurrent targets
        part.drafter = self.drafter.fork(own_context=params.seed is not None and not params.greedy)
        part.drafter.start(1, self.device)
        part.prefill(ids, torch.ones_like(ids))
        part.drafter.prefill(part.context())
        return part

    def merge(self, part: Batch) -> None:
        """Append the rows of ``part`` (from ``prefill_alone``) to the batch, between steps."""
        if self.rows is None:
            self.rows = part.rows
        else:
            self.rows.merge(part.rows)
        self.kv.merge(part.kv)
        self.drafter.merge(part.drafter)
        self.states += part.states
        if self.auto is not None:
            for state in part.states:
                self.auto.admit(state.slot)

    def leave(self, finished: torch.Tensor) -> None:
        """Drop the rows ``finished`` (B,) bool marks from the batch: caches, drafter state, settings. Every step
        ends here: the cache invariant holds again once rows cut at an EOS have left."""
        if bool(finished.any()):
            self.retire(finished, torch.zeros_like(finished))
            for b in finished.nonzero().flatten().tolist():
                self.rows.outputs.pop(self.states[b].slot, None)
                if self.auto is not None:
                    self.auto.forget(self.states[b].slot)
            self.states = [s for s, done in zip(self.states, finished.tolist()) if not done]
        self.check()

    def plan(self) -> Plan | None:
        """Each row's γ for the next step (``self.gammas``), cut by its budget; the batch policy's plan, if asked."""
        plan = None
        if self.auto is not None and any(s.gamma is None for s in self.states):
            plan = self.auto.gamma(self.rows.index.cpu())
        auto = plan.gamma if plan is not None else 0
        wanted = torch.tensor([auto if s.gamma is None else s.gamma for s in self.states], device=self.device)
        self.gammas = torch.minimum(wanted, self.rows.left - 1).clamp(min=0)
        return plan

    def step(self) -> list[Committed]:
        """propose → verify → roll back → accept, once for every row; what each row committed."""
        self.steps += 1
        t0 = now(self.device)
        plan = self.plan()
        gamma = int(self.gammas.max())
        ctx = self.context()
        proposal = self.drafter.propose(ctx, gamma) if gamma else Proposal.empty(self.active, self.device)
        t1 = now(self.device)
        verdict = self.verify(proposal)  # drafts kept and the next token, per row
        block = self.rollback(verdict)
        t2 = now(self.device)
        drafted, accepted = verdict.proposal.drafted(), verdict.accepted
        if plan is not None:
            rows, seconds = self.rows.index.cpu(), (t1 - t0, t2 - t1)
            path = verdict.path.cpu()
            self.auto.update(Step(rows, plan, gamma, drafted.cpu(), accepted.cpu(), ctx.confidence(), *seconds, path))
        committed, has_eos = self.rows.commit(block, accepted + 1)
        exhausted = self.rows.exhausted()
        out = []
        for b, state in enumerate(self.states):
            n, kept, tried = int(committed[b]), int(accepted[b]), int(drafted[b])
            last = ("resampled" if kept < tried else "bonus",) if n > kept else ()
            origins = (("accepted",) * kept + last)[:n]
            tokens = tuple(block[b, :n].tolist())
            out.append(Committed(state.slot, tokens, origins, tried, kept, bool(has_eos[b]), bool(exhausted[b])))
        return out

    def verify(self, proposal: Proposal) -> Verdict:
        """One target forward over each row's pending token and drafts; accept per row with its own settings
        (``Scoring``) and stream, on its own slices (row b keeps at most its first γ_b drafts)."""
        rows, drafts, gamma = self.rows, proposal.tokens, proposal.gamma
        counts = torch.minimum(proposal.drafted(), self.gammas)
        start = self.kv.length
        if gamma:
            rows.write(drafts)
        fed = torch.cat([rows.pending(), drafts], dim=1)  # (B, γ+1)
        columns = torch.arange(gamma + 1, device=drafts.device)
        self.kv.snapshot()
        logits = self.target_forward(
            fed, torch.ones_like(fed), (rows.lengths - 1)[:, None] + columns, columns[None] <= counts[:, None], True
        )[..., : self.vocab]
        check_finite(logits, "target", self.steps)
        argmax = logits.argmax(dim=-1)  # (B, γ+1)
        accepted, next_token = torch.zeros_like(counts), torch.zeros_like(counts)
        for b, state in enumerate(self.states):
            n, own, row, scoring = int(counts[b]), drafts[b : b + 1, : int(counts[b])], slice(b, b + 1), state.scoring
            if not scoring.sample and not scoring.head:
                accepted[row], next_token[row] = sampling.verify_greedy(own, argmax[row, : n + 1])
                continue
            p = scoring.probs(logits[row, : n + 1], rows.tokens[row], rows.lengths[row], 0, "target", self.steps, True)
            if not scoring.sample:  # (1, n+1, V) scores
                accepted[row], next_token[row] = sampling.verify_greedy(own, p.argmax(dim=-1))
                continue
            q = proposal.q[b : b + 1, :n] if proposal.q is not None else sampling.one_hot(own, p.shape[-1])
            accepted[row], next_token[row] = sampling.verify(own, q, p, state.generator)
        kept = Proposal.chain(drafts, proposal.q, counts)
        return Verdict(kept, accepted, next_token, start, fed, tree.chain_path(accepted, gamma))
