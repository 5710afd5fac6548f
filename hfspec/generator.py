"""The speculative decoding loop: propose → verify → accept → roll back.

Each step (Leviathan et al., arXiv 2211.17192, Algorithm 1; Chen et al., arXiv 2302.01318):
1. the draft proposes γ tokens autoregressively, keeping the distributions q it drew them from;
2. the target scores the last committed token plus the γ drafts in one forward, giving p;
3. drafts are accepted with probability min(1, p/q); the next token comes from the residual
   max(0, p - q) at the first rejection, or is the bonus token from p when all are accepted;
4. both caches are rolled back to the accepted prefix.

Cache invariant (checked every step): each model's cache holds every committed token
except the last one (the *pending* token, fed at the start of the next step); the draft
may also lack the last accepted draft after an all-accepted step (its *lag*), which it
catches up on together with the pending token. No token is ever fed to a cache twice.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase

from hfspec import config as cfg
from hfspec import sampling
from hfspec.cache import KVState
from hfspec.errors import NumericalFault
from hfspec.inputs import prepare_inputs
from hfspec.models import check_causal_lm, forward, shared_vocab_size
from hfspec.policy import GammaPolicy, as_policy
from hfspec.stats import RowStats, Stats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateOutput:
    """Like transformers' output: ``sequences`` is (B, prompt + new), right-padded with pad_token_id."""

    sequences: torch.Tensor
    stats: Stats
    prompt_length: int  # columns of the (left-padded) prompt at the start of ``sequences``


class SpeculativeGenerator:
    """Lossless speculative decoding over a ``target`` and a ``draft`` causal LM."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        check_causal_lm(target, "target")
        check_causal_lm(draft, "draft")
        self.target = target.eval()
        self.draft = draft.eval()
        self.tokenizer = tokenizer
        self.vocab_size = shared_vocab_size(target, draft, tokenizer)
        self.check_invariants = True

    @classmethod
    def from_pretrained(cls, target: str, draft: str, **kwargs: Any) -> SpeculativeGenerator:
        """Load both models and the target's tokenizer by hub name or local path (see ``hfspec.loading``)."""
        from hfspec.loading import load_pair

        return cls(*load_pair(target, draft, **kwargs))

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        gamma: int | GammaPolicy = 4,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        bad_words_ids: list[list[int]] | None = None,
        suppress_tokens: list[int] | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        logits_processor: Sequence[LogitsProcessor] | None = None,
        generation_config: GenerationConfig | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        streamer: Any = None,
        on_context_limit: str = "error",
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` per row, distributed exactly as the target's own sampling.

        Keyword names follow ``transformers.GenerationConfig``; ``None`` inherits from
        ``generation_config`` and then from the target's generation config. ``do_sample``
        defaults to greedy; ``temperature=0`` also means greedy (exact argmax, equal to
        ``target.generate(do_sample=False)``). ``gamma`` (γ) is the number of drafts per
        step, or a ``GammaPolicy``. Randomness comes only from ``generator`` (or a new
        one seeded with ``seed``; with neither, torch's global generator).
        ``on_context_limit``: ``"error"`` refuses prompts that would run past the models'
        context window; ``"stop"`` ends such rows there, with stop reason ``"context"``.
        """
        if on_context_limit not in ("error", "stop"):
            raise ValueError(f"on_context_limit must be 'error' or 'stop', got {on_context_limit!r}")
        conf = cfg.resolve(
            self.target.generation_config, generation_config,
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
            no_repeat_ngram_size=no_repeat_ngram_size, bad_words_ids=bad_words_ids,
            suppress_tokens=suppress_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )
        policy = as_policy(gamma)
        window = self._context_window()
        ids, mask = prepare_inputs(input_ids, attention_mask, self.tokenizer, self.vocab_size, window,
                                   conf.max_new_tokens if on_context_limit == "error" else 1, conf.bos_token_id)
        if streamer is not None and ids.shape[0] != 1:
            raise ValueError("a streamer needs a single prompt (batch size 1); drop streamer= for batches")
        device = self.target.get_output_embeddings().weight.device
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(int(seed))
        run = _Run(self, conf, sampling.build_processors(conf, logits_processor), policy, generator, streamer, window)
        try:
            return run.execute(ids.to(device), mask.to(device))
        finally:
            if streamer is not None:
                streamer.end()

    def _context_window(self) -> int | None:
        windows = [getattr(m.config.get_text_config(), "max_position_embeddings", None)
                   for m in (self.target, self.draft)]
        windows = [w for w in windows if w]
        return min(windows) if windows else None


class _Run:
    """The state of one ``generate`` call. Rows are the active prompts; finished rows leave."""

    def __init__(self, gen: SpeculativeGenerator, conf: GenerationConfig, processors, policy: GammaPolicy,
                 generator: torch.Generator | None, streamer: Any, window: int | None):
        self.gen, self.conf, self.processors, self.policy = gen, conf, processors, policy
        self.generator, self.streamer, self.window = generator, streamer, window
        self.sample = conf.do_sample
        self.eos = cfg.eos_ids(conf)
        self.vocab = gen.vocab_size
        self.needs_context = sampling.needs_context(processors)

    # -- setup -----------------------------------------------------------------------------

    def execute(self, ids: torch.Tensor, mask: torch.Tensor) -> GenerateOutput:
        start = time.perf_counter()
        batch, width = ids.shape
        device = ids.device
        max_new = self.conf.max_new_tokens
        self.prompt_lens = mask.sum(dim=1)
        self.lengths = self.prompt_lens.clone()
        # Per-row budget of new tokens: max_new_tokens, or less where the context window ends first.
        self.limit = torch.full_like(self.prompt_lens, max_new)
        if self.window is not None:
            self.limit = torch.minimum(self.limit, self.window - self.prompt_lens)
        # Row-major token buffer: row b's committed tokens are tokens[b, :lengths[b]], drafts follow.
        # Room for drafts past a row's end: γ never exceeds max_new_tokens - 1.
        self.tokens = torch.zeros(batch, int(self.prompt_lens.max()) + 2 * max_new + 2, dtype=torch.long,
                                  device=device)
        for b in range(batch):
            self.tokens[b, : self.prompt_lens[b]] = ids[b, mask[b].bool()]
        self.rows = torch.arange(batch, device=device)  # original index of each active row
        self.lag = torch.zeros(batch, dtype=torch.long, device=device)
        self.results: dict[int, tuple[torch.Tensor, RowStats]] = {}
        self.row_counts = torch.zeros(batch, 3, dtype=torch.long)  # accepted, passes, drafted, per row
        self.t_draft = self.t_target = 0.0
        self.target_passes = self.draft_passes = 0
        self.by_pos_acc: list[int] = []
        self.by_pos_drafted: list[int] = []

        self.kv_target = KVState(batch, device)
        self.kv_draft = KVState(batch, device)
        self.prefill(ids, mask)
        if self.streamer is not None:
            self.streamer.put(ids.cpu())
        self.finish(self.limit <= 0, torch.zeros_like(self.limit, dtype=torch.bool))
        while self.rows.numel():
            self.step()
        return self.output(ids, start)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Feed all prompt tokens but the last to both models (the last one is pending)."""
        if ids.shape[1] < 2:
            return
        prefix, prefix_mask = ids[:, :-1], mask[:, :-1]
        positions = (prefix_mask.cumsum(dim=1) - 1).clamp(min=0)
        t0 = time.perf_counter()
        forward(self.gen.target, prefix, self.kv_target.extend_mask(prefix_mask), positions, self.kv_target.cache,
                logits_to_keep=1)
        t1 = time.perf_counter()
        forward(self.gen.draft, prefix, self.kv_draft.extend_mask(prefix_mask), positions, self.kv_draft.cache,
                logits_to_keep=1)
        self.t_target += t1 - t0
        self.t_draft += time.perf_counter() - t1

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> None:
        remaining = self.limit - (self.lengths - self.prompt_lens)
        gamma = max(0, min(self.policy.gamma(), int(remaining.max()) - 1))
        t0 = time.perf_counter()
        drafts, q = self.propose(gamma)
        t1 = time.perf_counter()
        num_accepted, next_token = self.verify(drafts, q)
        t2 = time.perf_counter()
        self.t_draft += t1 - t0
        self.t_target += t2 - t1
        self.accept(gamma, num_accepted, next_token, remaining)

    def process(self, logits: torch.Tensor, extra: int) -> torch.Tensor:
        """Processed scores (B, V) for the position after each row's first ``lengths + extra`` tokens."""
        if not self.needs_context:
            return sampling.process(self.processors, logits, self.tokens[:, :1])
        return sampling.process(self.processors, logits, self.prefixes(extra))

    def prefixes(self, extra: int) -> torch.Tensor | list[torch.Tensor]:
        """Each row's tokens up to ``lengths + extra`` (the context a processor sees)."""
        ends = self.lengths + extra
        if bool((ends == ends[0]).all()):
            return self.tokens[:, : int(ends[0])]
        return [self.tokens[b, : int(e)] for b, e in enumerate(ends.tolist())]

    def propose(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft γ tokens per row; returns drafts (B, γ) and q (B, γ, V) when sampling."""
        batch = self.rows.numel()
        drafts = self.tokens.new_zeros(batch, gamma)
        if gamma == 0:
            return drafts, None
        self.draft_start = self.kv_draft.length
        pending_pos = (self.lengths - 1)[:, None]
        pending = self.tokens.gather(1, pending_pos)
        if bool(self.lag.any()):
            # Rows whose last step accepted every draft catch up on it; the others get a masked hole.
            catch_pos = (pending_pos - 1).clamp(min=0)
            feed = torch.cat([self.tokens.gather(1, catch_pos), pending], dim=1)
            valid = torch.stack([self.lag, torch.ones_like(self.lag)], dim=1)
            positions = torch.cat([catch_pos, pending_pos], dim=1)
        else:
            feed, valid, positions = pending, torch.ones_like(pending), pending_pos
        self.draft_cols = feed.shape[1] - 1
        qs = []
        for i in range(gamma):
            logits = forward(self.gen.draft, feed, self.kv_draft.extend_mask(valid), positions,
                             self.kv_draft.cache, logits_to_keep=1)[:, -1, : self.vocab]
            self.draft_passes += 1
            scores = self.checked(logits.to(self.tokens.device), "draft", i)
            if self.sample:
                q = sampling.probs_from_logits(scores)
                token = sampling.sample(q, self.generator)
                qs.append(q)
            else:
                token = scores.argmax(dim=-1)
            drafts[:, i] = token
            self.tokens.scatter_(1, (self.lengths + i)[:, None], token[:, None])
            feed, valid, positions = token[:, None], torch.ones_like(pending), (self.lengths + i)[:, None]
        return drafts, (torch.stack(qs, dim=1) if self.sample else None)

    def verify(self, drafts: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the pending token and the drafts; accept per row."""
        gamma = drafts.shape[1]
        self.target_start = self.kv_target.length
        pending = self.tokens.gather(1, (self.lengths - 1)[:, None])
        feed = torch.cat([pending, drafts], dim=1)  # (B, γ+1)
        positions = (self.lengths - 1)[:, None] + torch.arange(gamma + 1, device=feed.device)
        logits = forward(self.gen.target, feed, self.kv_target.extend_mask(torch.ones_like(feed)), positions,
                         self.kv_target.cache)[..., : self.vocab].to(self.tokens.device)
        self.target_passes += 1
        scores = self.checked(logits, "target", 0)  # (B, γ+1, V)
        if not self.sample:
            return sampling.verify_greedy(drafts, scores.argmax(dim=-1))
        p = sampling.probs_from_logits(scores)
        if q is None:
            q = p.new_zeros(p.shape[0], 0, p.shape[-1])
        return sampling.verify(drafts, q, p, self.generator)

    def checked(self, logits: torch.Tensor, role: str, extra: int) -> torch.Tensor:
        """Process raw ``logits`` (..., V), refusing values that would silently become arbitrary tokens.

        One reduction finds any NaN or inf in the raw logits (their sum is then not finite).
        """
        if not bool(torch.isfinite(logits.sum())):
            step = self.target_passes + (0 if role == "target" else 1)
            raise NumericalFault(
                f"the {role} model produced NaN or infinite logits at step {step}; "
                "check its weights and dtype (fp16 overflows are common: try dtype=bfloat16 or float32)"
            )
        if not self.processors:
            return logits
        if logits.dim() == 3:  # (B, γ+1, V): position i continues each row's first lengths + i tokens
            scores = torch.stack([self.process(logits[:, i], extra + i) for i in range(logits.shape[1])], dim=1)
        else:
            scores = self.process(logits, extra)
        if bool((scores.amax(dim=-1) == float("-inf")).any()):
            raise NumericalFault(f"the {role} logits leave no token possible after processing "
                                 "(every token was filtered out); relax bad_words_ids/suppress_tokens")
        return scores

    def accept(self, gamma: int, num_accepted: torch.Tensor, next_token: torch.Tensor,
               remaining: torch.Tensor) -> None:
        """Commit accepted drafts plus the next token, roll both caches back, retire finished rows."""
        batch = self.rows.numel()
        self.tokens.scatter_(1, (self.lengths + num_accepted)[:, None], next_token[:, None])
        # Tokens this step commits per row: accepted drafts + 1, cut at max_new_tokens and at EOS.
        commit = torch.minimum(num_accepted + 1, remaining)
        new = self.tokens.gather(1, (self.lengths[:, None] + torch.arange(gamma + 1, device=self.tokens.device))
                                 .clamp(max=self.tokens.shape[1] - 1))
        in_block = torch.arange(gamma + 1, device=new.device)[None, :] < commit[:, None]
        hit_eos = torch.zeros_like(in_block)
        if self.eos:
            hit_eos = torch.isin(new, torch.tensor(self.eos, device=new.device)) & in_block
        has_eos = hit_eos.any(dim=1)
        commit = torch.where(has_eos, hit_eos.long().argmax(dim=1) + 1, commit)
        if self.streamer is not None:
            self.streamer.put(new[0, : int(commit[0])].cpu())
        self.lengths += commit

        self.policy.update(gamma, num_accepted.tolist())
        counts = torch.stack([commit - 1, torch.ones_like(commit), torch.full_like(commit, gamma)], dim=1)
        self.row_counts[self.rows.cpu()] += counts.cpu()
        accepted_at = (num_accepted[:, None] > torch.arange(gamma, device=num_accepted.device)).sum(0).tolist()
        while len(self.by_pos_drafted) < gamma:
            self.by_pos_drafted.append(0)
            self.by_pos_acc.append(0)
        for i, n in enumerate(accepted_at):
            self.by_pos_drafted[i] += batch
            self.by_pos_acc[i] += n

        # Roll back: the target keeps pending + accepted drafts; the draft keeps what it was fed of those.
        self.kv_target.rollback(num_accepted + 1, self.target_start)
        if gamma > 0:
            fed = self.draft_cols + 1 + torch.clamp(num_accepted, max=gamma - 1)
            self.kv_draft.rollback(fed, self.draft_start)
            self.lag = (num_accepted == gamma).long()

        self.finish(has_eos | (self.lengths - self.prompt_lens >= self.limit), has_eos)
        if self.gen.check_invariants and self.rows.numel():
            self.kv_target.check(self.lengths - 1, "target")
            self.kv_draft.check(self.lengths - 1 - self.lag, "draft")

    def finish(self, finished: torch.Tensor, has_eos: torch.Tensor) -> None:
        """Store finished rows' outputs and drop them from the batch so they cost nothing more."""
        if not bool(finished.any()):
            return
        for b in finished.nonzero().flatten().tolist():
            row = int(self.rows[b])
            if bool(has_eos[b]):
                why = "eos"
            else:
                why = "length" if int(self.limit[b]) == self.conf.max_new_tokens else "context"
            accepted, passes, drafted = self.row_counts[row].tolist()
            new_tokens = self.tokens[b, self.prompt_lens[b] : self.lengths[b]].clone()
            self.results[row] = (new_tokens, RowStats(int(new_tokens.numel()), accepted, passes, drafted, why))
        keep = (~finished).nonzero().flatten()
        if keep.numel() == self.rows.numel():
            return
        for name in ("rows", "lengths", "prompt_lens", "limit", "lag", "tokens"):
            setattr(self, name, getattr(self, name)[keep])
        self.kv_target.select_rows(keep)
        self.kv_draft.select_rows(keep)

    def output(self, ids: torch.Tensor, start: float) -> GenerateOutput:
        batch = ids.shape[0]
        pad = self.conf.pad_token_id
        if pad is None:
            pad = self.eos[0] if self.eos else 0
        longest = max(t.numel() for t, _ in self.results.values())
        gen = torch.full((batch, longest), int(pad), dtype=torch.long, device=ids.device)
        for row, (new_tokens, _) in self.results.items():
            gen[row, : new_tokens.numel()] = new_tokens
        rows = tuple(self.results[r][1] for r in range(batch))
        stats = Stats(
            target_passes=self.target_passes, draft_passes=self.draft_passes,
            drafted=sum(r.drafted for r in rows), accepted=sum(r.accepted for r in rows),
            committed=sum(r.committed for r in rows),
            accepted_by_position=tuple(self.by_pos_acc), drafted_by_position=tuple(self.by_pos_drafted),
            time_draft=self.t_draft, time_target=self.t_target, time_total=time.perf_counter() - start,
            rows=rows,
        )
        return GenerateOutput(torch.cat([ids, gen], dim=1), stats, ids.shape[1])
