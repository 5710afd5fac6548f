"""Turning what a caller passes as a prompt into left-padded ids and a mask, or a clear error."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hfspec.errors import HfspecError, HfspecTypeError


def _rows_from(input_ids: Any, attention_mask: Any) -> list[torch.Tensor]:
    """Each row's real tokens as a 1-D long tensor."""
    if isinstance(input_ids, str) or (
        isinstance(input_ids, (list, tuple)) and input_ids and any(isinstance(x, str) for x in input_ids)
    ):
        raise HfspecTypeError(
            "input_ids must be token ids; for text use hfspec.generate(prompt, ...) "
            "or tokenize it first with tokenizer(prompt, return_tensors='pt')"
        )
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise HfspecError(
                "attention_mask goes with a tensor of input_ids; a list of prompts is padded "
                "by hfspec itself, so drop attention_mask"
            )
        if any(torch.is_tensor(x) for x in input_ids) and not all(torch.is_tensor(x) for x in input_ids):
            raise HfspecTypeError("input_ids mixes tensors and lists; pass one tensor, or a list of lists of ids")
        if input_ids and all(isinstance(x, int) and not isinstance(x, bool) for x in input_ids):
            input_ids = [input_ids]
        rows = []
        for x in input_ids:
            t = x if torch.is_tensor(x) else torch.tensor(list(x), dtype=torch.long)
            if t.dim() != 1:
                raise HfspecError("a list of prompts must hold 1-D sequences of ids")
            rows.append(t)
        return rows
    if not torch.is_tensor(input_ids):
        raise HfspecTypeError(
            f"input_ids must be a tensor of token ids or a list of them, got {type(input_ids).__name__}"
        )
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise HfspecError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return list(input_ids)
    if not torch.is_tensor(attention_mask):
        raise HfspecTypeError("attention_mask must be a tensor like input_ids")
    if attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    if attention_mask.shape != input_ids.shape:
        raise HfspecError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids "
            f"{tuple(input_ids.shape)}; pass the mask the tokenizer returned with these ids"
        )
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise HfspecError("attention_mask must hold only 0 (padding) and 1 (token)")
    return [row[m.bool()] for row, m in zip(input_ids, attention_mask)]


def prepare_inputs(
    input_ids: Any,
    attention_mask: Any,
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
    context_window: int | None,
    max_new_tokens: int,
    bos_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate prompts and return left-padded ``(ids, mask)``, both (B, T) long."""
    if input_ids is None:
        raise HfspecError("input_ids is required: pass token ids, e.g. tokenizer(prompt, return_tensors='pt')")
    rows = _rows_from(input_ids, attention_mask)
    if not rows:
        raise HfspecError("no prompts given: pass at least one prompt")
    if bos_token_id is None and tokenizer is not None:
        bos_token_id = tokenizer.bos_token_id
    out = []
    for i, row in enumerate(rows):
        if row.dtype.is_floating_point or row.dtype == torch.bool:
            raise HfspecTypeError(f"input_ids must be integer token ids, got dtype {row.dtype}")
        row = row.long()
        if row.numel() == 0:
            if bos_token_id is None:
                raise HfspecError(
                    f"prompt {i} is empty and there is no BOS token to start from; give at least one token"
                )
            row = torch.tensor([bos_token_id], dtype=torch.long, device=row.device)
        bad = (row < 0) | (row >= vocab_size)
        if bool(bad.any()):
            raise HfspecError(
                f"prompt {i} holds token id {int(row[bad][0])} outside the vocabulary "
                f"[0, {vocab_size}); tokenize with the target's tokenizer"
            )
        if context_window is not None and row.numel() + max_new_tokens > context_window:
            what = "is longer than" if row.numel() > context_window else "plus max_new_tokens would run past"
            raise HfspecError(
                f"prompt {i} ({row.numel()} tokens) {what} the context window of {context_window} "
                f"tokens; shorten the prompt or lower max_new_tokens "
                f"(at most {max(0, context_window - row.numel())} here)"
            )
        out.append(row)
    width = max(r.numel() for r in out)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    device = out[0].device
    ids = torch.full((len(out), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(out), width), dtype=torch.long, device=device)
    for i, row in enumerate(out):
        ids[i, width - row.numel() :] = row.to(device)
        mask[i, width - row.numel() :] = 1
    return ids, mask
