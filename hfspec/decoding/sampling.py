"""The sampling math of speculative decoding, as pure functions on batch-first tensors.

Names follow Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding" (arXiv 2211.17192) and Chen et al. (arXiv 2302.01318): ``p`` is the
target distribution, ``q`` the draft distribution, ``gamma`` (γ) the number of
drafted tokens. Both ``p`` and ``q`` are the distributions *after* the same
logits processing, so that ``q`` is exactly what a draft token was drawn from.

Nothing here touches a model, a cache or a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# transformers' sampling warpers, in the order it applies them; they read the logits, never the token prefix.
_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


# The logit of an id a drafter cannot propose (outside an EAGLE-3 head's or a cut head's vocabulary): finite, so
# a row's sum stays finite (the loop refuses inf in raw logits), yet exp(OUTSIDE - max) underflows to exactly 0 in
# float32 after any temperature or penalty: q is 0 there.
OUTSIDE = -1e30


def process(
    processors: LogitsProcessorList,
    logits: torch.Tensor,
    prefixes: torch.Tensor | list[torch.Tensor],
) -> torch.Tensor:
    """Apply ``processors`` to next-token ``logits`` (B, V) given each row's token prefix.

    ``prefixes`` is a (B, T) tensor when all rows share a length, else a list of B
    1-D tensors; ragged rows are processed one at a time so that no processor ever
    sees a padding token as part of the text.
    """
    if not processors:
        return logits
    if torch.is_tensor(prefixes):
        return processors(prefixes, logits)
    rows = [processors(ids[None], logits[i : i + 1]) for i, ids in enumerate(prefixes)]
    return torch.cat(rows, dim=0)


def needs_context(processors: LogitsProcessorList) -> bool:
    """False when every processor ignores the token prefix (pure warpers), so any prefix will do."""
    return not all(isinstance(proc, _WARPERS) for proc in processors)


def probs_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Softmax in float32; processed logits of -inf become probability 0."""
    return torch.softmax(logits.float(), dim=-1)


@dataclass(frozen=True)
class Warpers:
    """The context-free end of a pipeline, applied in transformers' order: temperature, top-k, top-p, min-p.

    ``None`` skips a stage; filtered tokens get -inf, as with transformers' default ``filter_value``. Built from a
    validated ``hfspec.settings.SamplingParams`` (``warpers()``), so every stage is in its range.
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None


_TOPK_LIMIT = 1024  # above this k, torch.topk costs more than a value-only sort of 49k entries


def _ascending(x: torch.Tensor) -> torch.Tensor:
    """The values of each row of ``x`` (N, V) in ascending order: unique, whatever a sort does with ties."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        # numpy's vectorised sort is several times faster than torch.sort, which also builds indices.
        return torch.from_numpy(np.sort(x.detach().contiguous().numpy(), axis=-1))
    return torch.sort(x, dim=-1).values


def _top_p(x: torch.Tensor, top_p: float, keep: int) -> torch.Tensor:
    """TopPLogitsWarper on ``x`` (N, V), sorting values only, not indices.

    transformers sorts ascending, removes the positions whose cumulative probability is
    ``<= 1 - top_p`` (all but the last ``keep``) and maps them back through the sort
    indices. Softmax and cumsum of the same sorted values are the very numbers it
    computes, so the count of removed positions is the same; they hold exactly the
    tokens below the smallest kept value. Only where equal values straddle the cut does
    the sort's tie order choose the tokens: such rows go through transformers' warper.
    """
    ascending = _ascending(x)
    remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)  # a prefix: the cumsum never decreases
    remove[..., -keep:] = False
    cut = remove.sum(dim=-1, keepdim=True)  # (N, 1) removed positions
    smallest_kept = ascending.gather(-1, cut)
    largest_removed = ascending.gather(-1, (cut - 1).clamp(min=0))
    tie = ((cut > 0) & (largest_removed == smallest_kept) & (smallest_kept > -float("inf"))).squeeze(-1)
    out = x.masked_fill(x < smallest_kept, -float("inf"))
    if bool(tie.any()):
        warper = TopPLogitsWarper(top_p, min_tokens_to_keep=keep)
        out[tie] = warper(None, x[tie])
    return out


def warped_probs(scores: torch.Tensor, warpers: Warpers) -> torch.Tensor:
    """``softmax(warpers(scores))`` for rows ``scores`` (N, V), as float32: bit for bit what transformers'
    warpers followed by a float32 softmax give, at a fraction of the cost.

    The costly parts of the reference are a sort of every row with its indices (top-p),
    and the softmaxes of the warpers and of the caller. Here top-p sorts values only,
    top-k finds its threshold with ``topk`` or a value-only sort, and min-p's softmax is
    the result when it removes nothing.
    """
    x = scores
    if warpers.temperature is not None:
        x = x / warpers.temperature  # the very operation TemperatureLogitsWarper does
    vocab = x.shape[-1]
    if warpers.top_k is not None and warpers.top_k < vocab:  # a k >= V keeps every token
        k = warpers.top_k
        # The k-th largest value is TopKLogitsWarper's threshold; for a large k the value-only sort is cheaper.
        kth = torch.topk(x, k)[0][..., -1, None] if k <= _TOPK_LIMIT else _ascending(x)[..., vocab - k, None]
        x = x.masked_fill(x < kth, -float("inf"))
    if warpers.top_p is not None:
        x = _top_p(x, warpers.top_p, keep=1)  # TopPLogitsWarper's default min_tokens_to_keep
    if warpers.min_p is None:
        return probs_from_logits(x)
    probs = torch.softmax(x, dim=-1)
    # MinPLogitsWarper also keeps the argmax, which this comparison never removes (min_p <= 1).
    remove = probs < warpers.min_p * probs.amax(dim=-1, keepdim=True)
    if x.dtype == torch.float32 and not bool(remove.any()):
        return probs
    return probs_from_logits(x.masked_fill(remove, -float("inf")))


def draw_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the draws (uniforms, cumulative sums): float64, or float32 on a device without it (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from ``probs`` (B, V) -> (B,) long, by inverse CDF.

    One uniform u per row, in float64: token i is drawn when ``u * total`` falls in
    ``[cdf[i-1], cdf[i])``, so each token's chance is its probability up to ~1e-16 and a
    token of probability 0 (an empty interval) is never drawn. Rows need not sum to 1.
    On MPS, which has no float64, in float32 (``draw_dtype``): up to ~1e-7, zeros still never drawn.
    """
    dtype = draw_dtype(probs.device)
    cdf = probs.cumsum(dim=-1, dtype=dtype)  # (B, V)
    total = cdf[..., -1:]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample from a row without positive probability mass (all zero or NaN)")
    u = torch.rand(total.shape, generator=generator, dtype=dtype, device=probs.device)
    # A double u < 1 is at most 1 - 2^-53 (a float 1 - 2^-24), so u * total rounds to below total: a token is found.
    return torch.searchsorted(cdf, u * total, right=True).squeeze(-1)


def first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """Count of leading ``True`` per row of a (B, γ) bool tensor -> (B,) long."""
    return (accepted.long().cumsum(dim=-1) == torch.arange(1, accepted.shape[-1] + 1, device=accepted.device)).sum(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution ``max(0, p - q)`` renormalised (Leviathan et al., Algorithm 1).

    Its mass ``Z = Σ max(0, p - q)`` equals the rejection probability, so ``Z = 0``
    (``p == q``) means a rejection cannot happen in exact arithmetic. When rounding
    still produces one, we fall back to ``p`` itself, the limit of the residual
    as ``q -> p``.
    """
    r = torch.clamp(p - q, min=0.0)
    z = r.sum(dim=-1, keepdim=True)
    return torch.where(z > 0, r / z.clamp_min(torch.finfo(r.dtype).tiny), p)


def check_distribution(probs: torch.Tensor, name: str, tol: float = 1e-3) -> None:
    """Refuse rows that are not probability distributions: they would bias every acceptance."""
    if probs.numel() == 0:
        return
    sums = probs.sum(dim=-1)
    if not bool(((sums - 1).abs() <= tol).all() & (probs >= 0).all()):
        worst = float((sums - 1).abs().nan_to_num(float("inf")).max())
        raise ValueError(
            f"{name} is not a probability distribution (a row sums to 1 ± {worst:.3g} or has "
            "negative or NaN entries); pass softmax outputs of the processed logits"
        )


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The q of deterministic drafts: (B, γ) long -> (B, γ, V) float32 with a 1 at each token."""
    q = torch.zeros(*tokens.shape, vocab, dtype=torch.float32, device=tokens.device)
    return q.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def draft_mask(draft_tokens: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor | None:
    """(B, γ) bool, True where a row has a real draft; None when every row has γ."""
    if counts is None:
        return None
    return torch.arange(draft_tokens.shape[1], device=draft_tokens.device)[None, :] < counts[:, None]


def accept(q_x: torch.Tensor, p_x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Whether to keep each drafted token x, with probability min(1, p(x) / q(x)) (Leviathan et al., Alg. 1):
    ``u * q(x) < p(x)`` for u ~ U[0, 1), with no division.

    u is drawn in float64 and the comparison is strict: a token the target gives probability 0 is never kept, even
    when torch.rand returns exactly 0 (with ``<=`` it would be, once in 2^24 draws of a float32 u); a token with
    p(x) >= q(x) is kept but for a chance below 2^-52 (u * q rounding up to p).
    """
    u = torch.rand(q_x.shape, generator=generator, device=q_x.device, dtype=torch.float64)
    return u * q_x.double() < p_x.double()


def verify(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: accept each draft with probability min(1, p/q).

    Args:
        draft_tokens: (B, γ) long, the drafted tokens.
        q: (B, γ, V) the draft distributions the drafts were drawn from (one-hot for
            deterministic drafts: then x is kept with probability p(x), and a rejection
            resamples from p without x).
        p: (B, γ+1, V) the target distributions at the same positions plus one.
        generator: the only source of randomness.
        counts: (B,) drafts per row when rows drafted fewer than γ; later columns are
            padding, never accepted, and the token after a row's last draft is its bonus.

    Returns:
        ``(num_accepted, next_token)``, both (B,) long: the count of leading drafts
        accepted, and the token after them, drawn from the residual at the first
        rejection or, when all of a row's drafts were accepted, the bonus token from p.
    """
    batch, gamma = draft_tokens.shape
    if q.shape[:2] != (batch, gamma) or p.shape[:2] != (batch, gamma + 1) or q.shape[-1] != p.shape[-1]:
        raise ValueError(
            f"verify expects draft_tokens (B, γ), q (B, γ, V), p (B, γ+1, V); got "
            f"{tuple(draft_tokens.shape)}, {tuple(q.shape)}, {tuple(p.shape)}"
        )
    real = draft_mask(draft_tokens, counts)
    if real is not None:
        q = q * real[..., None]  # a padding column's residual is then p itself
    check_distribution(q if real is None else q[real], "q (draft)")
    check_distribution(p, "p (target)")
    idx = draft_tokens.unsqueeze(-1)
    q_x = q.gather(-1, idx).squeeze(-1)  # (B, γ)
    p_x = p[:, :gamma].gather(-1, idx).squeeze(-1)  # (B, γ)
    accepted = accept(q_x, p_x, generator)
    num_accepted = first_rejection(accepted if real is None else accepted & real)
    # A zero row after the last draft makes the residual at position γ equal p[:, γ]: the bonus token.
    q_ext = torch.cat([q, q.new_zeros(batch, 1, q.shape[-1])], dim=1)  # (B, γ+1, V)
    at = num_accepted.view(batch, 1, 1).expand(batch, 1, p.shape[-1])
    p_n = p.gather(1, at).squeeze(1)  # (B, V)
    q_n = q_ext.gather(1, at).squeeze(1)  # (B, V)
    next_token = sample(residual(p_n, q_n), generator)
    return num_accepted, next_token


def verify_greedy(
    draft_tokens: torch.Tensor,
    target_argmax: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact greedy verification: accept while the draft equals the target's argmax.

    ``target_argmax`` is (B, γ+1); the next token is the target's argmax after the
    accepted drafts, so the output equals the target's own greedy decoding.
    ``counts`` as in ``verify``.
    """
    accepted = draft_tokens == target_argmax[:, :-1]
    real = draft_mask(draft_tokens, counts)
    num_accepted = first_rejection(accepted if real is None else accepted & real)
    next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token
