"""The rows of one generate call: their committed tokens, their budgets, and when they finish.

Rows advance at different speeds (each keeps its own number of drafts per step) and
leave the batch as soon as they finish, so that they cost nothing more; ``index``
remembers which prompt each active row is. Everything here is per-row bookkeeping;
no model, cache or drafter is touched.
"""

from __future__ import annotations

import torch


class Rows:
    """The active rows: row b's committed tokens are ``tokens[b, :lengths[b]]``; the last one is pending
    (not yet fed to the target). Drafts are written after them, where processors read them as context."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, window: int | None, eos: list[int]):
        """``ids``, ``mask`` (B, T): the left-padded prompts; ``window``: the context the models can hold."""
        batch, device = ids.shape[0], ids.device
        self.prompt_lens = mask.sum(dim=1)
        self.lengths = self.prompt_lens.clone()
        self.budget = torch.full_like(self.prompt_lens, max_new_tokens)  # new tokens asked for, per row
        # Per-row budget of new tokens: max_new_tokens, or less where the context window ends first.
        self.limit = self.budget.clone()
        if window is not None:
            self.limit = torch.minimum(self.limit, window - self.prompt_lens)
        self.left = self.limit.clone()  # new tokens each row may still commit
        # Room for drafts past a row's end: γ never exceeds max_new_tokens - 1.
        self.tokens = torch.zeros(
            batch, int(self.prompt_lens.max()) + 2 * max_new_tokens + 2, dtype=torch.long, device=device
        )
        for b in range(batch):
            self.tokens[b, : self.prompt_lens[b]] = ids[b, mask[b].bool()]
        self.index = torch.arange(batch, device=device)  # the prompt each active row is
        self.eos = torch.tensor(eos, dtype=torch.long, device=device)[None].expand(batch, -1)  # (B, E): -1 pads
        self.outputs: dict[int, tuple[torch.Tensor, str]] = {}  # prompt -> (new tokens, stop reason)

    @property
    def active(self) -> int:
        return self.index.numel()

    def exhausted(self) -> torch.Tensor:
        """(B,) bool: the row has used its whole budget."""
        return self.left <= 0

    def pending(self) -> torch.Tensor:
        """(B, 1) each row's last committed token, which the target has not read yet."""
        return self.tokens.gather(1, (self.lengths - 1)[:, None])

    def write(self, block: torch.Tensor, offset: int = 0) -> None:
        """Write ``block`` (B, k) after each row's committed tokens (and ``offset`` more), uncommitted."""
        width = block.shape[1]  # one column (a draft being picked, once per draft) needs no arange
        shift = offset if width == 1 else torch.arange(offset, offset + width, device=block.device)
        cols = self.lengths[:, None] + shift
        self.tokens.scatter_(1, cols, block)

    def commit(self, block: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit row b's first ``count[b]`` tokens of ``block`` (B, k), cut at its budget and after its
        first EOS. Returns the tokens committed (B,) and whether the row reached EOS (B,)."""
        count = torch.minimum(count, self.left)
        has_eos = torch.zeros_like(count, dtype=torch.bool)
        if self.eos.numel():
            in_block = torch.arange(block.shape[1], device=block.device)[None, :] < count[:, None]
            hit_eos = (block[:, :, None] == self.eos[:, None, :]).any(dim=-1) & in_block
            has_eos = hit_eos.any(dim=1)
            count = torch.where(has_eos, hit_eos.long().argmax(dim=1) + 1, count)
        self.write(block)
        self.lengths += count
        self.left -= count
        return count, has_eos

    def finish(self, finished: torch.Tensor, has_eos: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Store the outputs of the rows ``finished`` (B,) marks; returns each one's (position, new tokens).
        They stay in the batch until ``select``."""
        done = []
        for b in finished.nonzero().flatten().tolist():
            if bool(has_eos[b]):
                why = "eos"
            else:
                why = "length" if int(self.limit[b]) == int(self.budget[b]) else "context"
            new_tokens = self.tokens[b, self.prompt_lens[b] : self.lengths[b]].clone()
            self.outputs[int(self.index[b])] = (new_tokens, why)
            done.append((b, new_tokens))
        return done

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (1-D long), in that order."""
        self.index, self.lengths, self.prompt_lens = self.index[keep], self.lengths[keep], self.prompt_lens[keep]
        self.limit, self.left, self.tokens = self.limit[keep], self.left[keep], self.tokens[keep]
        self.budget, self.eos = self.budget[keep], self.eos[keep]

    def merge(self, other: Rows) -> None:
        """Append ``other``'s rows after these (rows that joined a running batch); token buffers and EOS lists are
        padded to the wider of the two (EOS lists with -1, which no token is)."""

        def pad(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        for name in ("index", "lengths", "prompt_lens", "budget", "limit", "left"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        # Room for any row's drafts past its end: the step's γ is the widest row's, cut by that row's budget.
        need = int((self.prompt_lens + self.limit).max() + self.limit.max()) + 2
        width = max(self.tokens.shape[1], other.tokens.shape[1], need)
        self.tokens = torch.cat([pad(self.tokens, width, 0), pad(other.tokens, width, 0)])
        width = max(self.eos.shape[1], other.eos.shape[1])
        self.eos = torch.cat([pad(self.eos, width, -1), pad(other.eos, width, -1)])


def right_pad(rows: list[torch.Tensor], pad: int, device: torch.device) -> torch.Tensor:
    """(len(rows), longest): each 1-D tensor of ``rows`` followed by ``pad``."""
    out = torch.full((len(rows), max(t.numel() for t in rows)), int(pad), dtype=torch.long, device=device)
    for b, tokens in enumerate(rows):
        out[b, : tokens.numel()] = tokens
    return out
