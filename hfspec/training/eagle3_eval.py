"""How well an EAGLE-3 head drafts on held-out text: α and greedy agreement per unrolled step, and its step time.

p is the target's distribution and q the head's (0 outside the draft vocabulary), as in Leviathan et al.
(arXiv 2211.17192): α = E[Σ_x min(p, q)] at T=1, against the staged top-k (a lower bound, during training) or a
target forward (the final report).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hfspec.drafters.eagle3 import Eagle3Drafter
from hfspec.heads.eagle3 import Eagle3Head
from hfspec.training.eagle3_data import StagedSplit, make_batch
from hfspec.training.eagle3_ttt import forward
from hfspec.training.report import decode_step_seconds

__all__ = ["Heldout", "evaluate", "step_times", "target_probs"]


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Heldout:
    """How well the head drafts on held-out text, per unrolled step and over the draft vocabulary."""

    alpha: tuple[float, ...]  # per unrolled step
    agreement: tuple[float, ...]
    coverage: float  # mean p on the draft vocabulary
    argmax_coverage: float
    positions: int  # scored at step 0

    @property
    def accepted(self) -> float:
        """Σ_k Π_{i<=k} α_i: expected accepted drafts per step of γ = len(alpha), chaining the per-step α."""
        return sum(math.prod(self.alpha[: k + 1]) for k in range(len(self.alpha)))


@torch.inference_mode()
def evaluate(
    head: Eagle3Head,
    split: StagedSplit,
    t2d: torch.Tensor,
    embedding: torch.Tensor,
    unroll: int,
    batch: int,
    target: PreTrainedModel | None = None,
    pad: int = 0,
) -> Heldout:
    """Held-out α and agreement per step: p from the staged top-k (a lower bound on α, missing the mass outside
    the top-k), or with ``target`` exactly, from a target forward over each sample."""
    was_training = head.training
    head.eval()
    ids = head.target_ids()
    overlap, agree, count = [0.0] * unroll, [0] * unroll, [0] * unroll
    covered, argmax_in = 0.0, 0
    for start in range(0, len(split), batch):
        idx = list(range(start, min(len(split), start + batch)))
        b = make_batch(split, idx, t2d, unroll)
        p_full = target_probs(target, [split.samples[i] for i in idx], pad) if target is not None else None
        for k, (logits, lab) in enumerate(zip(forward(head, b, embedding, unroll), b.labels)):
            q = logits.float().softmax(-1)  # (N, Vd)
            if p_full is None:
                p, best = lab.p, lab.argmax
                overlap[k] += float(torch.minimum(p, q.gather(-1, lab.draft_ids.clamp(min=0))).sum())
            else:
                p_rows = p_full[lab.gen_pos]  # (N, V)
                p, best = p_rows[:, ids], p_rows.argmax(-1)
                overlap[k] += float(torch.minimum(p, q).sum())  # q is 0 outside the draft vocabulary
            agree[k] += int((ids[q.argmax(-1)] == best).sum())
            count[k] += q.shape[0]
            if k == 0:
                covered += float(p.sum())
                argmax_in += int((t2d[best] >= 0).sum())
    head.train(was_training)
    n = [max(1, c) for c in count]
    return Heldout(
        tuple(o / c for o, c in zip(overlap, n)),
        tuple(a / c for a, c in zip(agree, n)),
        covered / n[0],
        argmax_in / n[0],
        count[0],
    )


def target_probs(target: PreTrainedModel, samples: list[dict], pad: int) -> torch.Tensor:
    """(Σ G, V) the target's T=1 distribution at each generated position of ``samples``, in order."""
    seqs = [torch.cat([x["prompt"], x["gen"]]).long() for x in samples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
        mask[row, : len(s)] = 1
    logits = target(input_ids=ids, attention_mask=mask).logits
    # Position P + t - 1 predicts generated token t.
    rows = [logits[r, len(x["prompt"]) - 1 : len(x["prompt"]) - 1 + len(x["gen"])] for r, x in enumerate(samples)]
    return torch.cat(rows).float().softmax(-1)


def step_times(target: PreTrainedModel, head: Eagle3Head, context: list[int], rounds: int = 3) -> tuple[float, float]:
    """Median seconds of one target decode step and one cached head step (as the drafter runs it, logits
    included), taken in turns; both timings wait for the device before reading the clock."""
    drafter = Eagle3Drafter(head, target)
    device = drafter.device
    t_target, t_head = [], []
    for _ in range(rounds):  # in turns, so that both see the same background load
        t_target.append(decode_step_seconds(target, context=len(context), steps=16, warmup=4)[0])
        t_head.append(drafter.step_seconds(context, device, repeats=16))
    return statistics.median(t_target), statistics.median(t_head)
