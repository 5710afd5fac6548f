"""A draft's LM head cut to the tokens the target emits most (FR-Spec, Zhao et al., arXiv 2502.14856).

A small draft of a large-vocabulary family spends much of its step in its output layer: Qwen2.5-0.5B's
151,936 × 896 head is a quarter of its weights, read in full at every drafting step. Most of those rows
belong to tokens that rarely occur. :class:`FrequentHead` keeps only the rows of a chosen set of ids (the
most frequent ones) and scores every other id ``OUTSIDE``, a finite logit whose probability is exactly 0
after any processing. Losslessness does not depend on the choice: q is what the draft computed and drew
from, and a token with q = 0 is simply never drafted; the target still samples every token from its own p.
What the cut costs is acceptance where the target's next token lies outside the set; what it saves is the
draft's reading time. ``cut_head`` swaps a model's output layer for one; ``frequent_ids`` picks the set
from token counts (``count_tokens``), and ``first_ids`` without any: byte-pair vocabularies number their tokens
in the order their merges were learnt, most frequent first, so the lowest ids are a corpus-free stand-in for
the most frequent (on Qwen2.5's tokenizer the 32,768 lowest ids hold 92-96% of the tokens of English prose,
Python and C++; counting over 8 MB of Python's standard library first raised that by at most 2 points).

The cut is not free: a chain stops at the first token outside the set. Qwen2.5-Coder-0.5B drafting for the 1.5B
at γ = 5 on code prompts kept 4.73 tokens per target pass with its whole head, 4.31 with 65,536 tokens and 4.06
with 32,768, which costs more than the smaller head saves; hence it is asked for (``draft_vocab=``), not a default.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hfspec.cpu.quant import QuantLinear
from hfspec.decoding.sampling import OUTSIDE
from hfspec.errors import HfspecError, HfspecTypeError

__all__ = ["CutReport", "FrequentHead", "count_tokens", "cut_head", "first_ids", "frequent_ids"]


class FrequentHead(nn.Module):
    """An output layer over the rows ``ids`` of ``head`` only: logits (..., vocab) with ``OUTSIDE`` elsewhere.

    The kept rows are copied into a layer of the head's kind, a plain ``nn.Linear`` (which hfspec's CPU kernel can
    then run) or a ``QuantLinear`` over the same GGUF blocks; the kept logits are those ``head`` computes for these
    rows, bit for bit on the same kernel.
    """

    def __init__(self, head: nn.Linear | QuantLinear, ids: torch.Tensor):
        super().__init__()
        ids = torch.as_tensor(ids, dtype=torch.long, device=head.weight.device).unique(sorted=True)
        vocab = head.weight.shape[0]
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise HfspecError(f"the kept ids must be a non-empty set within the head's {vocab} rows")
        self.vocab_size = vocab
        bias = None if head.bias is None else head.bias.detach().index_select(0, ids)
        if isinstance(head, QuantLinear):
            self.kept = QuantLinear(
                head.weight.detach().index_select(0, ids), head.fmt, head.in_features, bias, head.arithmetic
            )
        else:
            self.kept = nn.Linear(
                head.in_features,
                ids.numel(),
                bias=head.bias is not None,
                device=head.weight.device,
                dtype=head.weight.dtype,
            )
            with torch.no_grad():
                self.kept.weight.copy_(head.weight.index_select(0, ids))
                if bias is not None:
                    self.kept.bias.copy_(bias)
        self.kept.requires_grad_(False)
        self.register_buffer("ids", ids, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.kept(hidden)
        outside = max(OUTSIDE, torch.finfo(kept.dtype).min)  # float16 cannot hold OUTSIDE: its own lowest
        full = torch.full((*kept.shape[:-1], self.vocab_size), outside, dtype=kept.dtype, device=kept.device)
        return full.index_copy_(-1, self.ids, kept)

    def extra_repr(self) -> str:
        return f"kept={self.ids.numel()}, vocab={self.vocab_size}"


@dataclass(frozen=True)
class CutReport:
    """What ``cut_head`` did: rows kept of the head's, and the bytes a drafting step no longer reads."""

    kept: int
    vocab: int
    bytes_saved: int


def cut_head(model: PreTrainedModel, ids: torch.Tensor | Iterable[int]) -> CutReport:
    """Replace ``model``'s output layer with a :class:`FrequentHead` over ``ids`` (in place).

    The head must be a plain ``nn.Linear`` (before hfspec's kernel swaps it) or a GGUF ``QuantLinear``; a head
    tied to the input embedding keeps the embedding as it is, the kept rows being a copy.
    """
    head = model.get_output_embeddings()
    if isinstance(head, FrequentHead):
        raise HfspecError("this model's head is already cut; cut the original model once")
    if type(head) not in (nn.Linear, QuantLinear):
        raise HfspecTypeError(
            f"cut_head needs the model's output layer as a plain nn.Linear or a QuantLinear, got "
            f"{type(head).__name__}; cut the head before the model is accelerated"
        )
    cut = FrequentHead(head, torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids))
    model.set_output_embeddings(cut)
    saved = (head.weight.shape[0] - cut.ids.numel()) * head.weight.shape[1] * head.weight.element_size()
    return CutReport(cut.ids.numel(), head.weight.shape[0], saved)


def count_tokens(
    tokenizer: PreTrainedTokenizerBase, texts: Iterable[str], vocab: int | None = None, batch: int = 256
) -> torch.Tensor:
    """How often each id occurs when ``texts`` are tokenized (no special tokens): (vocab,) long."""
    counts = torch.zeros(vocab or len(tokenizer), dtype=torch.long)
    chunk: list[str] = []

    def flush() -> None:
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            counts.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids), dtype=torch.long))
        chunk.clear()

    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            flush()
    if chunk:
        flush()
    return counts


def frequent_ids(counts: torch.Tensor, n: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``n`` ids counted most (ties broken by the lower id), plus ``always`` (e.g. the special tokens)."""
    if n < 1:
        raise HfspecError(f"keep at least one token, got {n}")
    order = torch.argsort(-counts, stable=True)[:n]  # stable: among equal counts, the lower id first
    return torch.cat([order, torch.as_tensor(list(always), dtype=torch.long)]).unique(sorted=True)


def first_ids(vocab: int, n: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``n`` lowest ids of a vocabulary of ``vocab`` (for byte-pair vocabularies, the tokens merged first: the
    most frequent in the tokenizer's own corpus), plus ``always`` (e.g. the special tokens)."""
    if n < 1:
        raise HfspecError(f"keep at least one token, got {n}")
    return frequent_ids(torch.zeros(vocab, dtype=torch.long), min(n, vocab), always)
