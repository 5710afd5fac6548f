"""What a distilled draft is trained to minimise, and how well it meets it on staged text.

A batch of staged samples (:mod:`hfspec.training.staging`: prompt, generated tokens, and the target's top-k
log-probabilities at every generated position) is right-padded by :func:`collate`. The loss is the cross-entropy
to the target's top-k distribution ``p`` plus a weighted cross-entropy on its token (:func:`distill_loss`), over a
sampled subset of the vocabulary (:func:`candidate_logits`: sampled softmax). How well a draft meets it is α =
E[Σ_x min(p(x), q(x))] at temperature 1 and greedy agreement, against a target forward (:func:`acceptance`) or the
staged top-k alone (:func:`staged_acceptance`); ``q`` is the draft's distribution, as in Leviathan et al.
(arXiv 2211.17192).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

__all__ = ["acceptance", "candidate_logits", "collate", "distill_loss", "staged_acceptance"]


# --------------------------------------------------------------------------- loss


def distill_loss(
    logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor, token: torch.Tensor, hard_weight: float
) -> torch.Tensor:
    """Soft cross-entropy to the target's top-k plus hard cross-entropy on its token.

    logits (N, V) from the draft; top_ids/top_logp (N, k) from the target; token (N,).
    """
    logq = F.log_softmax(logits.float(), dim=-1)  # (N, V)
    p = top_logp.float().exp()  # (N, k), mass outside the top-k is dropped
    soft = -(p * logq.gather(-1, top_ids)).sum(-1)  # (N,)
    hard = -logq.gather(-1, token[:, None]).squeeze(-1)  # (N,)
    return (soft + hard_weight * hard).mean()


def candidate_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    top_ids: torch.Tensor,
    token: torch.Tensor,
    negatives: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits over a sampled subset of the vocabulary: the output layer dominates training cost.

    The subset is every id in the target's top-k or sampled, plus ``negatives`` uniform
    draws from the rest, whose logits get log((V − |U|)/|R|) added so that the softmax
    normaliser stays an unbiased estimate of the full one (sampled softmax).
    Returns (logits (N, C), top_ids and token re-indexed into the subset).
    """
    vocab = weight.shape[0]
    must = torch.unique(torch.cat([top_ids.flatten(), token]))  # (U,), sorted
    if negatives <= 0 or negatives >= vocab - must.numel():
        return hidden @ weight.T, top_ids, token
    draws = torch.randint(vocab, (negatives,), generator=generator)
    rest = torch.unique(draws[~torch.isin(draws, must)])  # (R,)
    cand = torch.cat([must, rest])
    logits = hidden @ weight[cand].T  # (N, U + R)
    correction = torch.zeros(cand.numel())
    correction[must.numel() :] = math.log((vocab - must.numel()) / max(1, rest.numel()))
    # Every top-k id and token is in ``must``, which leads ``cand``, so its position is its index.
    top_idx = torch.searchsorted(must, top_ids.contiguous())
    return logits + correction, top_idx, torch.searchsorted(must, token.contiguous())


def collate(samples: list[dict], pad: int) -> dict:
    """Right-pad prompt+generation rows; ``pos`` marks positions that predict a generated token."""
    rows = [torch.cat([x["prompt"], x["gen"]]).long() for x in samples]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    rows_idx, cols_idx = [], []
    for i, (r, x) in enumerate(zip(rows, samples)):
        input_ids[i, : len(r)] = r
        attention_mask[i, : len(r)] = 1
        start = len(x["prompt"]) - 1  # the last prompt position predicts the first generated token
        rows_idx.append(torch.full((len(x["gen"]),), i))
        cols_idx.append(torch.arange(start, start + len(x["gen"])))
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pos": (torch.cat(rows_idx), torch.cat(cols_idx)),
        "token": torch.cat([x["gen"] for x in samples]).long(),
        "top_ids": torch.cat([x["top_ids"] for x in samples]).long(),
        "top_logp": torch.cat([x["top_logp"] for x in samples]),
    }


# --------------------------------------------------------------------------- evaluation


@torch.inference_mode()
def acceptance(
    target: PreTrainedModel, draft: PreTrainedModel, samples: list[dict], pad: int, batch: int
) -> tuple[float, float, int]:
    """(α at T=1, greedy agreement, positions) over the generated positions of ``samples``."""
    overlap, agree, count = 0.0, 0, 0
    for i in range(0, len(samples), batch):
        b = collate(samples[i : i + batch], pad)
        p = target(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[b["pos"]].float()  # (N, V)
        q = draft(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[b["pos"]].float()
        overlap += float(torch.minimum(p.softmax(-1), q.softmax(-1)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        count += p.shape[0]
    return overlap / max(1, count), agree / max(1, count), count


@torch.inference_mode()
def staged_acceptance(draft: PreTrainedModel, samples: list[dict], pad: int, batch: int) -> tuple[float, float]:
    """(α, greedy agreement) of ``draft`` against the target's staged top-k: no target forward.

    α sums min(p, q) over the target's top-k ids only, so it falls short of the full
    α by at most the target's mass outside its top-k; the argmax is the first top-k id.
    """
    was_training = draft.training
    draft.eval()
    overlap, agree, count = 0.0, 0, 0
    for i in range(0, len(samples), batch):
        b = collate(samples[i : i + batch], pad)
        logq = draft(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[b["pos"]].float()
        logq = logq.log_softmax(-1)  # (N, V)
        p = b["top_logp"].float().exp()  # (N, k)
        overlap += float(torch.minimum(p, logq.gather(-1, b["top_ids"]).exp()).sum())
        agree += int((logq.argmax(-1) == b["top_ids"][:, 0]).sum())
        count += logq.shape[0]
    draft.train(was_training)
    return overlap / max(1, count), agree / max(1, count)
