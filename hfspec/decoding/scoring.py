"""From raw logits to what acceptance compares, the same way for the target and the draft.

The acceptance rule min(1, p/q) (Leviathan et al., arXiv 2211.17192) is lossless only
if p and q are the distributions the target and the draft would really sample from:
both go through the user's logits processors and the sampling warpers, each position
seeing its own row's text so far (the drafts before it included). ``Scoring`` does
that once for both; ``DraftContext`` is what a drafter sees of the loop
(``hfspec.drafters.Context``), its ``pick`` the draft side of it.
"""

from __future__ import annotations

import torch

from hfspec.decoding import sampling
from hfspec.decoding.rows import Rows
from hfspec.errors import NumericalFault
from hfspec.settings import SamplingParams


class Scoring:
    """The processing of one ``SamplingParams``: its processors, run as transformers runs them (``head``), then its
    warpers, which hfspec runs once over all positions (``sampling.warped_probs``). A batch whose rows share a
    setting shares one; the server's batch keeps one per row."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.sample = not params.greedy
        self.head = params.processors()
        self.needs_context = sampling.needs_context(self.head)
        self.warpers = params.warpers()

    def probs(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        extra: int,
        role: str,
        step: int,
        checked: bool = False,
    ) -> torch.Tensor:
        """Process raw ``logits`` (B, k, V): probabilities when sampling, else scores, for argmax.

        Position i follows row b's first ``lengths[b] + extra + i`` of ``tokens``. Refuses
        NaN or infinite logits (``check_finite``) unless the caller ``checked`` them (a batch checks all its rows
        once, then processes each row). When sampling, the warpers at the end of the
        pipeline run once over all B·k positions (``sampling.warped_probs``: the same
        probabilities as transformers' warpers).
        """
        if not checked and not bool(torch.isfinite(logits.sum())):  # inline: this runs for every pick
            check_finite(logits, role, step)
        scores = self.process(logits, tokens, lengths, extra)
        if self.head and bool((scores.amax(dim=-1) == float("-inf")).any()):
            raise NumericalFault(
                f"the {role} logits leave no token possible after processing "
                "(every token was filtered out); relax bad_words_ids/suppress_tokens"
            )
        if self.warpers is None:
            return scores
        batch, k, vocab = scores.shape
        return sampling.warped_probs(scores.reshape(batch * k, vocab), self.warpers).view(batch, k, vocab)

    def process(self, logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, extra: int) -> torch.Tensor:
        """Apply the head processors to ``logits`` (B, k, V) as ``checked`` places them; all positions in one
        call when no processor reads the context."""
        batch, k, vocab = logits.shape
        if not self.head:
            return logits
        if not self.needs_context:  # the warpers a head leaves out never read the context
            ids = tokens[:, :1].repeat_interleave(k, dim=0)
            flat = sampling.process(self.head, logits.reshape(batch * k, vocab), ids)
            return flat.view(batch, k, vocab)
        return torch.stack(
            [sampling.process(self.head, logits[:, i], prefixes(tokens, lengths + extra + i)) for i in range(k)], dim=1
        )


def check_finite(logits: torch.Tensor, role: str, step: int) -> None:
    """Refuse NaN or infinite raw logits, found by one reduction (their sum is then not finite): they would silently
    become arbitrary tokens. ``role`` and ``step`` (the target pass in progress) name where."""
    if not bool(torch.isfinite(logits.sum())):
        raise NumericalFault(
            f"the {role} model produced NaN or infinite logits at step {step}; "
            "check its weights and dtype (fp16 overflows are common: try dtype=bfloat16 or float32)"
        )


def prefixes(tokens: torch.Tensor, ends: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """Row b's ``tokens`` up to ``ends[b]`` (the context a processor sees): one tensor when rows agree."""
    if bool((ends == ends[0]).all()):
        return tokens[:, : int(ends[0])]
    return [tokens[b, : int(e)] for b, e in enumerate(ends.tolist())]


class DraftContext:
    """What a drafter sees of the loop (``hfspec.drafters.Context``): the rows' committed tokens and ``pick``.

    The loop makes one per drafter call, so that the confidences of a proposal's picks go back
    to the loop with that proposal (``confidence``) and nowhere else; within one call the
    rows neither commit nor leave, so ``tokens`` and ``lengths`` are the rows' own tensors.
    """

    def __init__(
        self,
        rows: Rows,
        scoring: Scoring,
        vocab: int,
        generator: torch.Generator | None,
        step: int,
    ):
        self.rows, self.scoring, self.vocab, self.generator, self.step = rows, scoring, vocab, generator, step
        self.tokens, self.lengths, self.sample = rows.tokens, rows.lengths, scoring.sample
        self.picked: list[torch.Tensor] = []  # (B,) the drafter's probability of each pick, in order

    def pick(self, logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft i of each row from raw draft logits (B, ≥vocab), processed like the target's scores will be
        and written after the committed tokens, where later positions' processors read it."""
        out = self.scoring.probs(logits[:, None, : self.vocab], self.tokens, self.lengths, i, "draft", self.step)[
            :, 0
        ]  # (B, V)
        q = out if self.sample else sampling.probs_from_logits(out)
        token = sampling.sample(q, self.generator) if self.sample else out.argmax(dim=-1)
        self.rows.write(token[:, None], offset=i)
        confidence = q.gather(1, token[:, None]).squeeze(1)
        self.picked.append(confidence)
        return token, (q if self.sample else None), confidence

    def dists(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft distributions (B, k, V) of raw logits (B, k, ≥vocab) at k tree nodes, processed like the
        target's scores (probabilities of the scores when greedy). Trees take no processor that reads the
        context (the generator refuses them), so no node needs its own path as context."""
        out = self.scoring.probs(logits[..., : self.vocab], self.tokens, self.lengths, 0, "draft", self.step)
        return out if self.sample else sampling.probs_from_logits(out)

    def confidence(self) -> torch.Tensor | None:
        """(B, picks) on the CPU, what the γ policy calibrates; None when the drafter picked nothing here."""
        return torch.stack(self.picked, 1).cpu() if self.picked else None
