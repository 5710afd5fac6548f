"""The speculative decoding loop: propose → verify → accept → roll back.

Each step (Leviathan et al., arXiv 2211.17192, Algorithm 1; Chen et al., arXiv 2302.01318):
1. the drafter proposes γ tokens per row, with the distributions q it drew them from;
2. the target scores the last committed token plus the γ drafts in one forward, giving p;
3. drafts are accepted with probability min(1, p/q); the next token comes from the residual
   max(0, p - q) at the first rejection, or is the bonus token from p when all are accepted;
4. the target's cache is rolled back to the accepted prefix, and the drafter is told how
   many of its drafts were kept so that it can roll back its own state.

Cache invariant (checked every step): the target's cache holds every committed token
except the last one (the *pending* token, fed at the start of the next step). A drafter
states and checks its own (see ``hfspec.drafters``). No token is fed to a cache twice.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase

from hfspec import config as cfg
from hfspec import costs, recurrent, sampling
from hfspec.cache import KVState
from hfspec.drafters import Drafter, Features, Proposal, cross_tokenizer
from hfspec.errors import NumericalFault
from hfspec.inputs import prepare_inputs
from hfspec.loading import load_pair, make_drafter
from hfspec.models import check_causal_lm, forward, forward_features, shared_vocab_size
from hfspec.costs import Costs
from hfspec.policy import GammaPolicy, Step, Tuning, as_policy
from hfspec.stats import RowStats, Stats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateOutput:
    """Like transformers' output: ``sequences`` is (B, prompt + new), right-padded with pad_token_id."""

    sequences: torch.Tensor
    stats: Stats
    prompt_length: int  # columns of the (left-padded) prompt at the start of ``sequences``


class SpeculativeGenerator:
    """Lossless speculative decoding: a ``draft`` proposes, the ``target`` causal LM verifies.

    ``draft`` is a causal LM sharing the target's tokenizer, any ``hfspec.drafters.Drafter``, a
    path (an EAGLE-3 head's directory, a causal LM), or ``"ngram"`` (model-free lookup in the
    context and in earlier outputs). ``ngram=True`` adds that lookup to a model draft or head:
    per row, whichever is expected to get more accepted. A draft model with its own tokenizer
    is passed with ``draft_tokenizer=``: where it differs from ``tokenizer``, the draft proposes
    only the tokens both share (``hfspec.drafters.cross_tokenizer``), still losslessly.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | Drafter | str | Path,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        ngram: bool = False,
        draft_tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        check_causal_lm(target, "target")
        self.target = target.eval()
        if draft_tokenizer is not None:  # a draft model with its own tokenizer: drafts across them when they differ
            draft = cross_tokenizer.adapt(draft, draft_tokenizer, tokenizer)
        self.drafter = make_drafter(draft, tokenizer, target, ngram=ngram)
        self.tokenizer = tokenizer
        self.vocab_size = shared_vocab_size(target, self.drafter.vocab_size, tokenizer)
        # Refuse, before any generation, a recurrent state that cannot be rolled back exactly.
        recurrent.check(self.target, "target")
        if self.draft is not None:
            recurrent.check(self.draft, "draft")
        self.check_invariants = True
        self.tuning = Tuning()  # gamma="auto": the costs measured here and the acceptance seen so far

    def measure_costs(self, context: Sequence[int] | None = None, force: bool = False) -> Costs:
        """Time the target over 1..K+1 new tokens and one drafting step on this machine (once; ``force``
        measures again). ``context`` (token ids) fills the caches first; a stand-in is used without one."""
        if self.tuning.costs is None or force:
            ids = list(context or [0])
            ids = (ids * (64 // len(ids) + 1))[-64:]  # costs depend on the cache length a little: a realistic one
            window = self._context_window()
            if window is not None:  # context plus the largest verification must fit the position embeddings
                self.tuning.maximum = max(1, min(self.tuning.maximum, window // 2 - 1))
                ids = ids[-(window - self.tuning.maximum - 1):]
            device = self.target.get_output_embeddings().weight.device
            self.tuning.costs = costs.measure(self.target, self.drafter, ids, self.tuning.maximum, device)
            log.info("measured costs: %s", self.tuning.costs.to_dict())
        return self.tuning.costs

    @property
    def draft(self) -> PreTrainedModel | None:
        """The draft model, for drafters that have one (``Drafter.model``)."""
        return self.drafter.model

    @classmethod
    def from_pretrained(cls, target: str, draft: str, *, ngram: bool = False, **kwargs: Any) -> SpeculativeGenerator:
        """Load both models and the target's tokenizer by hub name or local path (see ``hfspec.loading``);
        ``draft="ngram"`` needs no model. A draft whose own tokenizer differs from the target's drafts
        through ``hfspec.drafters.cross_tokenizer`` without being asked."""
        return cls(*load_pair(target, draft, **kwargs), ngram=ngram)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        gamma: int | str | GammaPolicy = "auto",
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
        step, a ``GammaPolicy``, or ``"auto"``: γ from 0 (plain decoding) to K chosen each
        step from costs measured on this machine at the first call and the acceptance seen
        so far, drafting stopped early when the drafter is unsure (see ``AutoGamma``).
        Randomness comes only from ``generator`` (or a new
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
        window = self._context_window()
        ids, mask = prepare_inputs(input_ids, attention_mask, self.tokenizer, self.vocab_size, window,
                                   conf.max_new_tokens if on_context_limit == "error" else 1, conf.bos_token_id)
        if isinstance(gamma, str) and gamma == "auto":
            self.measure_costs(ids[0, mask[0].bool()].tolist())
            self.tuning.setting = (conf.do_sample, conf.temperature, conf.top_k, conf.top_p, conf.min_p) \
                if conf.do_sample else False
        policy = as_policy(gamma, self.tuning)
        if streamer is not None and ids.shape[0] != 1:
            raise ValueError("a streamer needs a single prompt (batch size 1); drop streamer= for batches")
        device = self.target.get_output_embeddings().weight.device
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(int(seed))
        processors = sampling.build_processors(conf, logits_processor)
        # A recurrent state cannot skip padding or a masked hole: then each prompt runs alone, unpadded.
        alone = KVState.is_recurrent(self.target) or self.drafter.recurrent
        rows = [(r[m.bool()][None], m[m.bool()][None]) for r, m in zip(ids, mask)] if alone else [(ids, mask)]
        try:
            parts = [_Run(self, conf, processors, policy, generator, streamer, window)
                     .execute(r.to(device), m.to(device)) for r, m in rows]
        finally:
            if streamer is not None:
                streamer.end()
        return _stack(ids.to(device), parts, _pad_id(conf)) if alone else parts[0]

    def _context_window(self) -> int | None:
        models = [self.target] + ([self.draft] if self.draft is not None else [])
        windows = [getattr(m.config.get_text_config(), "max_position_embeddings", None) for m in models]
        windows = [w for w in windows if w]
        return min(windows) if windows else None


class _Run:
    """The state of one ``generate`` call. Rows are the active prompts; finished rows leave.

    It is also the ``Context`` a drafter sees: ``tokens``, ``lengths``, ``pick``.
    """

    def __init__(self, gen: SpeculativeGenerator, conf: GenerationConfig, processors, policy: GammaPolicy,
                 generator: torch.Generator | None, streamer: Any, window: int | None):
        self.gen, self.conf, self.processors, self.policy = gen, conf, processors, policy
        self.drafter = gen.drafter
        self.generator, self.streamer, self.window = generator, streamer, window
        self.sample = conf.do_sample
        self.eos = cfg.eos_ids(conf)
        self.vocab = gen.vocab_size
        self.needs_context = sampling.needs_context(processors)
        # Processors that run as transformers' own code, then the warpers that run once over all positions.
        self.head, self.warpers = sampling.split_processors(processors) if self.sample else (processors, None)

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
        self.results: dict[int, tuple[torch.Tensor, RowStats]] = {}
        self.row_counts = torch.zeros(batch, 3, dtype=torch.long)  # accepted, passes, drafted, per row
        self.t_draft = self.t_target = 0.0
        self.target_passes = self.draft_passes = 0
        self.by_pos_acc: list[int] = []
        self.by_pos_drafted: list[int] = []
        self.gamma_counts: list[int] = []  # steps by the width of their proposal
        self.policy.begin(batch)
        self.eos_ids = torch.tensor(self.eos, dtype=torch.long, device=device)

        self.kv_target = KVState(batch, device, self.gen.target)
        self.drafter.start(batch, device)
        self.prefill(ids, mask)
        if self.streamer is not None:
            self.streamer.put(ids.cpu())
        self.finish(self.limit <= 0, torch.zeros_like(self.limit, dtype=torch.bool))
        while self.rows.numel():
            self.step()
        return self.output(ids, start)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Feed all prompt tokens but the last to the target (the last one is pending)."""
        if ids.shape[1] < 2:
            return
        prefix, prefix_mask = ids[:, :-1], mask[:, :-1]
        positions = (prefix_mask.cumsum(dim=1) - 1).clamp(min=0)
        t0 = time.perf_counter()
        self.target_forward(prefix, prefix_mask, positions, prefix_mask.bool(), verification=False, logits_to_keep=1)
        self.t_target += time.perf_counter() - t0

    def target_forward(self, feed: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                       real: torch.Tensor, verification: bool, logits_to_keep: int = 0) -> torch.Tensor:
        """One target forward over (B, k) new tokens; hands the drafter the features it asked for."""
        mask = self.kv_target.extend_mask(valid)
        layers = self.drafter.feature_layers
        if not layers:
            return forward(self.gen.target, feed, mask, positions, self.kv_target.cache, logits_to_keep)
        logits, values = forward_features(self.gen.target, feed, mask, positions, self.kv_target.cache, layers,
                                          logits_to_keep)
        self.drafter.observe(self, Features(values.to(feed.device), positions, real, verification))
        return logits

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> None:
        remaining = self.limit - (self.lengths - self.prompt_lens)
        gamma = max(0, min(self.policy.gamma(self.rows.cpu()), int(remaining.max()) - 1))
        t0 = time.perf_counter()
        self.confidence: list[torch.Tensor] = []
        proposal = (self.drafter.propose(self, gamma, self.policy.stop) if gamma
                    else Proposal.empty(self.rows.numel(), self.tokens.device))
        self.draft_passes += proposal.draft_forwards()
        t1 = time.perf_counter()
        num_accepted, next_token = self.verify(proposal)
        self.drafter.commit(self, num_accepted)
        self.kv_target.rollback(num_accepted + 1, self.target_start, self.fed)  # pending + accepted drafts
        t2 = time.perf_counter()
        self.t_draft += t1 - t0
        self.t_target += t2 - t1
        self.policy.update(Step(self.rows.cpu(), proposal.gamma, proposal.drafted().cpu(), num_accepted.cpu(),
                                torch.stack(self.confidence, 1).cpu() if self.confidence else None, t1 - t0, t2 - t1))
        self.accept(proposal, num_accepted, next_token, remaining)

    def process(self, processors: Sequence[LogitsProcessor], logits: torch.Tensor, extra: int) -> torch.Tensor:
        """Apply ``processors`` (all or the head of ``self.processors``) to ``logits`` (B, k, V), whose
        position i follows each row's first ``lengths + extra + i`` tokens; all positions in one call
        when no processor reads the context."""
        batch, k, vocab = logits.shape
        if not processors:
            return logits
        if not self.needs_context:  # the warpers a head leaves out never read the context
            ids = self.tokens[:, :1].repeat_interleave(k, dim=0)
            flat = sampling.process(processors, logits.reshape(batch * k, vocab), ids)
            return flat.view(batch, k, vocab)
        return torch.stack([sampling.process(processors, logits[:, i], self.prefixes(extra + i)) for i in range(k)],
                           dim=1)

    def prefixes(self, extra: int) -> torch.Tensor | list[torch.Tensor]:
        """Each row's tokens up to ``lengths + extra`` (the context a processor sees)."""
        ends = self.lengths + extra
        if bool((ends == ends[0]).all()):
            return self.tokens[:, : int(ends[0])]
        return [self.tokens[b, : int(e)] for b, e in enumerate(ends.tolist())]

    def pick(self, logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft i of each row from raw draft logits, processed like the target's (see ``Context.pick``)."""
        out = self.checked(logits[:, None, : self.vocab], "draft", i)[:, 0]  # (B, V)
        q = out if self.sample else sampling.probs_from_logits(out)
        token = sampling.sample(q, self.generator) if self.sample else out.argmax(dim=-1)
        self.tokens.scatter_(1, (self.lengths + i)[:, None], token[:, None])
        confidence = q.gather(1, token[:, None]).squeeze(1)
        self.confidence.append(confidence)
        return token, (q if self.sample else None), confidence

    def verify(self, proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the pending token and the drafts; accept per row."""
        drafts, gamma = proposal.tokens, proposal.gamma
        self.target_start = self.kv_target.length
        if gamma:  # the buffer holds the drafts: processors read them as context
            self.tokens.scatter_(1, self.lengths[:, None] + torch.arange(gamma, device=drafts.device), drafts)
        pending = self.tokens.gather(1, (self.lengths - 1)[:, None])
        self.fed = torch.cat([pending, drafts], dim=1)  # (B, γ+1)
        positions = (self.lengths - 1)[:, None] + torch.arange(gamma + 1, device=drafts.device)
        ones = torch.ones_like(self.fed)
        self.kv_target.snapshot()
        real = torch.arange(gamma + 1, device=drafts.device)[None, :] <= proposal.drafted()[:, None]
        logits = self.target_forward(self.fed, ones, positions, real, verification=True)[..., : self.vocab]
        self.target_passes += 1
        p = self.checked(logits.to(self.tokens.device), "target", 0)  # (B, γ+1, V); scores when greedy
        if not self.sample:
            return sampling.verify_greedy(drafts, p.argmax(dim=-1), proposal.counts)
        q = proposal.q if proposal.q is not None else sampling.one_hot(drafts, p.shape[-1])
        return sampling.verify(drafts, q, p, self.generator, proposal.counts)

    def checked(self, logits: torch.Tensor, role: str, extra: int) -> torch.Tensor:
        """Process raw ``logits`` (B, k, V): probabilities when sampling, else scores, for argmax.

        Refuses values that would silently become arbitrary tokens: one reduction finds any
        NaN or inf in the raw logits (their sum is then not finite). When sampling, the
        warpers at the end of the pipeline run once over all B·k positions
        (``sampling.warped_probs``: the same probabilities as transformers' warpers).
        """
        if not bool(torch.isfinite(logits.sum())):
            step = self.target_passes + (0 if role == "target" else 1)
            raise NumericalFault(
                f"the {role} model produced NaN or infinite logits at step {step}; "
                "check its weights and dtype (fp16 overflows are common: try dtype=bfloat16 or float32)"
            )
        scores = self.process(self.head, logits, extra)
        if self.head and bool((scores.amax(dim=-1) == float("-inf")).any()):
            raise NumericalFault(f"the {role} logits leave no token possible after processing "
                                 "(every token was filtered out); relax bad_words_ids/suppress_tokens")
        if self.warpers is None:
            return scores
        batch, k, vocab = scores.shape
        return sampling.warped_probs(scores.reshape(batch * k, vocab), self.warpers).view(batch, k, vocab)

    def accept(self, proposal: Proposal, num_accepted: torch.Tensor, next_token: torch.Tensor,
               remaining: torch.Tensor) -> None:
        """Commit accepted drafts plus the next token, roll the target back, retire finished rows."""
        gamma, drafted = proposal.gamma, proposal.drafted()
        self.tokens.scatter_(1, (self.lengths + num_accepted)[:, None], next_token[:, None])
        # Tokens this step commits per row: accepted drafts + 1, cut at max_new_tokens and at EOS.
        commit = torch.minimum(num_accepted + 1, remaining)
        new = self.tokens.gather(1, (self.lengths[:, None] + torch.arange(gamma + 1, device=self.tokens.device))
                                 .clamp(max=self.tokens.shape[1] - 1))
        in_block = torch.arange(gamma + 1, device=new.device)[None, :] < commit[:, None]
        hit_eos = torch.zeros_like(in_block)
        if self.eos:
            hit_eos = torch.isin(new, self.eos_ids) & in_block
        has_eos = hit_eos.any(dim=1)
        commit = torch.where(has_eos, hit_eos.long().argmax(dim=1) + 1, commit)
        if self.streamer is not None:
            self.streamer.put(new[0, : int(commit[0])].cpu())
        self.lengths += commit

        while len(self.gamma_counts) <= gamma:
            self.gamma_counts.append(0)
        self.gamma_counts[gamma] += 1
        counts = torch.stack([commit - 1, torch.ones_like(commit), drafted], dim=1)
        self.row_counts[self.rows.cpu()] += counts.cpu()
        positions = torch.arange(gamma, device=num_accepted.device)
        accepted_at = (num_accepted[:, None] > positions).sum(0).tolist()
        drafted_at = (drafted[:, None] > positions).sum(0).tolist()
        while len(self.by_pos_drafted) < gamma:
            self.by_pos_drafted.append(0)
            self.by_pos_acc.append(0)
        for i in range(gamma):
            self.by_pos_drafted[i] += drafted_at[i]
            self.by_pos_acc[i] += accepted_at[i]

        self.finish(has_eos | (self.lengths - self.prompt_lens >= self.limit), has_eos)
        if self.gen.check_invariants and self.rows.numel():
            self.kv_target.check(self.lengths - 1, "target")
            self.drafter.check(self)

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
            self.drafter.finished(b, new_tokens)
        keep = (~finished).nonzero().flatten()
        if keep.numel() == self.rows.numel():
            return
        for name in ("rows", "lengths", "prompt_lens", "limit", "tokens"):
            setattr(self, name, getattr(self, name)[keep])
        self.kv_target.select_rows(keep)
        self.drafter.select_rows(keep)

    def output(self, ids: torch.Tensor, start: float) -> GenerateOutput:
        batch = ids.shape[0]
        pad = _pad_id(self.conf)
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
            gamma_histogram=tuple(self.gamma_counts),
            time_draft=self.t_draft, time_target=self.t_target, time_total=time.perf_counter() - start,
            rows=rows,
        )
        return GenerateOutput(torch.cat([ids, gen], dim=1), stats, ids.shape[1])


def _pad_id(conf: GenerationConfig) -> int:
    """What right-pads finished rows: pad_token_id, else the first EOS, else 0."""
    if conf.pad_token_id is not None:
        return int(conf.pad_token_id)
    eos = cfg.eos_ids(conf)
    return eos[0] if eos else 0


def _stack(ids: torch.Tensor, parts: list[GenerateOutput], pad: int) -> GenerateOutput:
    """One output for prompts ``ids`` (B, T) that ran one at a time, as if they had run as a batch."""
    new = [p.sequences[0, p.prompt_length :] for p in parts]
    gen = torch.full((len(parts), max(t.numel() for t in new)), pad, dtype=torch.long, device=ids.device)
    for b, tokens in enumerate(new):
        gen[b, : tokens.numel()] = tokens
    return GenerateOutput(torch.cat([ids, gen], dim=1), Stats.combine([p.stats for p in parts]), ids.shape[1])
