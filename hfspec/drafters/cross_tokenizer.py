"""A draft causal LM with its own tokenizer: token-level intersection, lossless.

The draft reads the committed text in its own tokens and proposes target tokens. Its raw
logits over its own vocabulary become a row over the target's ids in which only the shared
tokens (``hfspec.drafters.vocabulary``) are possible: every other id gets ``IMPOSSIBLE``, a
finite logit whose probability after softmax is exactly 0 (the loop refuses non-finite raw
logits). The loop's ``Context.pick`` then processes and samples that row exactly as it
processes the target's, so ``q`` is exactly the distribution each draft was drawn from, in
target ids, after the same temperature, top-k, top-p and penalties, and the usual
verification (Leviathan et al., arXiv 2211.17192) keeps the output distributed as the
target's: this is TLI of Timor et al. (ICML 2025, "lossless speculative decoding
algorithms for heterogeneous vocabularies"). Greedy decoding takes the argmax of the same
row and is verified exactly. A drafted token is fed back to the draft as its own id.

``greedy="slem"`` drafts greedy decoding by text instead (their SLEM, string-level exact
match): the draft generates greedily in its own tokens, over its whole vocabulary, and that
text is spelled in target tokens after the committed text; the target verifies its own
tokens, so the output is its greedy output whatever the draft proposes.

The draft's context is the committed text, not the target's tokens. Per row the drafter
keeps the decoded committed text (bytes, decoded incrementally as streamers do, so a
character split over tokens waits for its last byte) and the draft tokens its cache holds.
Each step it re-tokenizes only a window at the end of the text: from a draft-token boundary a
few tokens back (a *prime* absorbs what a tokenizer does at the start of its input, such as
adding a space), keeping the window's tokens after a later boundary when their bytes are
exactly the rest of the text, else re-tokenizing the whole text. The cache is rolled back to
the longest common prefix of what it holds and the new tokens, and the rest is fed. The
draft's context only shapes q; the committed target tokens never change.

Cache invariant (checked every step): a row's unmasked cached positions are exactly its
draft tokens ``seq``. Drafts fed during a step are kept when the target accepted them and the
committed text begins with them.

Rows join a running batch (``fork``, ``prefill``, ``merge``: the server's continuous batching) with
their own text and cache rows; nothing is learnt across rows, so a row's q depends on its own text
alone where the draft runs on hfspec's kernels. Drafting ends early for every row when one drew a
token outside the shared vocabulary, which happens only where processing removed every shared
token (never under temperature, top-k, top-p or min-p: the top token left is a shared one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hfspec.cpu import draft_linear
from hfspec.drafters import Context, Drafter, Pick, Proposal, Stop, draft_chain, kept_drafts
from hfspec.drafters.vocabulary import VocabMap, token_bytes, vocab_map
from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.measure.costs import Price, forward_seconds
from hfspec.measure.timing import median_seconds
from hfspec.models.adapter import check_causal_lm, forward, model_vocab_size, same_tokenizer
from hfspec.models.kv_cache import KVState

# Logit of a target id the draft cannot produce: finite, so the loop's check passes, and
# exp(IMPOSSIBLE - max) is exactly 0 in float32 under any usable temperature; a row of 10^6
# of them still sums to a finite number.
IMPOSSIBLE = -1e30

REWORK = 4  # draft tokens at the end of the text that are always re-tokenized: more text may merge them
PRIME = 4  # draft tokens re-tokenized before those, whose tokens are thrown away (start-of-input effects)
HOLD = 4  # committed target tokens a split character may wait for before its bytes are taken as they are
PRIME_BYTES = 32  # committed text re-tokenized with a draft's text, for the target's tokens to line up
GREEDY = ("tli", "slem")  # greedy decoding: by the shared tokens (TLI) or by the draft's text (SLEM)


@dataclass
class _Row:
    """One row's view of the committed text and what the draft's cache holds of it."""

    prefix: int = -1  # target tokens before ``read`` decoded again for context (-1: not started)
    read: int = 0  # target tokens whose text is in ``text``
    text: bytes = b""
    origin: int = 0  # where in ``text`` the draft's context starts (after it outgrew the draft's window)
    seq: list[int] = field(default_factory=list)  # draft ids in the cache
    ends: list[int] = field(default_factory=list)  # end in ``text`` of each of the first len(ends) tokens
    behind: bool = False  # the last committed tokens end inside a character: their text is still to come


class CrossTokenizerDrafter(Drafter):
    """Drafts target tokens with ``model``, a causal LM whose tokenizer ``draft_tokenizer`` is not the target's."""

    kind = "cross-tokenizer"

    def __init__(
        self,
        model: PreTrainedModel,
        draft_tokenizer: PreTrainedTokenizerBase,
        target_tokenizer: PreTrainedTokenizerBase,
        greedy: str = "tli",
    ):
        if greedy not in GREEDY:
            raise HfspecError(f"greedy must be one of {', '.join(GREEDY)}, got {greedy!r}")
        check_causal_lm(model, "draft")
        if KVState.is_recurrent(model):
            raise HfspecError(
                "a draft with a recurrent state (Mamba, hybrids) cannot follow text re-tokenized "
                "each step; pick an attention-only draft for a target with another tokenizer"
            )
        self.model = model.eval()
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.vocab_size = len(target_tokenizer)  # the rows handed to the loop are over target ids
        self.map: VocabMap = vocab_map(target_tokenizer, draft_tokenizer, self.vocab_size, model_vocab_size(model))
        self.bytes = token_bytes(draft_tokenizer)
        self.greedy = greedy
        self.target_bytes = token_bytes(target_tokenizer)
        self.target_encoder = target_tokenizer.backend_tokenizer
        self.eos = (draft_tokenizer.eos_token_id, target_tokenizer.eos_token_id)
        self.encoder = draft_tokenizer.backend_tokenizer
        # What the draft's tokenizer puts before a text (its BOS), and a token to start from without one.
        self.lead = _leading_ids(draft_tokenizer)
        start = [i for i in (draft_tokenizer.bos_token_id, draft_tokenizer.eos_token_id, 0) if i is not None]
        self.start_id = start[0]
        self.window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.skip = {target_tokenizer.bos_token_id} - {None}  # the target's BOS: the draft has its own
        self.kv: KVState | None = None
        self.rows: list[_Row] = []
        self.drafts: torch.Tensor | None = None  # (B, k) the last proposal in target ids, until committed
        self.spelled_step = False  # the last proposal came from the draft's text (greedy, SLEM)

    # -- the loop's interface ------------------------------------------------------------------

    def start(self, batch: int, device: torch.device) -> None:
        self.kv = KVState(batch, device, self.model)
        self.rows = [_Row() for _ in range(batch)]
        self.drafts, self.spelled_step = None, False  # nothing of a call cut short is rolled back in this one
        self.device_map = self.map.to(device)

    def propose(self, ctx: Context, gamma: int, stop: Stop | None = None, price: Price | None = None) -> Proposal:
        if not ctx.sample and self.greedy == "slem":
            return self._propose_text(ctx, gamma, stop)

        def pick(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            return ctx.pick(self._target_row(logits.to(ctx.tokens.device)), i)

        tokens, qs = self._draft(ctx, gamma, stop, pick, shared=True)
        self.drafts = torch.stack(tokens, dim=1)
        return Proposal.chain(self.drafts, torch.stack(qs, dim=1) if ctx.sample else None)

    def _draft(
        self, ctx: Context, gamma: int, stop: Stop | None, pick: Pick, shared: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Catch up, then up to γ draft forwards (``draft_chain``); ``pick(logits (B, V_draft), i)`` takes draft i,
        in the target's ids where ``shared`` (read back through the shared vocabulary), else in the draft's own."""
        feed, valid, positions = self._catch_up(ctx, gamma)
        fed = torch.tensor([len(r.seq) for r in self.rows], device=feed.device)

        def step(i: int, token: torch.Tensor | None) -> torch.Tensor | None:
            if not i:
                logits = self._forward(feed, valid, positions)  # (B, V_draft)
                self.start_col = self.kv.length  # caught up: what follows are drafts, rolled back in commit
                return logits
            own = self.device_map.to_draft[token] if shared else token
            # A token outside the shared vocabulary is drawn only when processing removed every shared one;
            # its q is still exact, but the draft has no id to read it with: the step ends there.
            if shared and bool((own < 0).any()):
                return None
            return self._forward(own[:, None].to(feed.device), torch.ones_like(feed[:, :1]), (fed + (i - 1))[:, None])

        return draft_chain(step, pick, gamma, stop)

    def commit(self, ctx: Context, path: torch.Tensor) -> None:
        if self.spelled_step:  # the draft's own tokens: the next catch-up re-reads what was accepted
            self.kv.keep(torch.zeros_like(self.kv.mask[:, 0]), self.start_col)
            self.spelled_step = False
        if self.drafts is None:
            return
        fed = self.drafts.shape[1] - 1  # the last draft is never fed
        kept = kept_drafts(ctx, self.drafts, path, fed)
        self.kv.keep(kept.to(self.kv.mask.device), self.start_col)
        own = self.map.to_draft[self.drafts[:, :fed].cpu()].tolist()
        for row, ids, k in zip(self.rows, own, kept.tolist()):
            row.seq.extend(ids[:k])
        self.drafts = None

    def select_rows(self, keep: torch.Tensor) -> None:
        self.kv.select_rows(keep)
        self.rows = [self.rows[i] for i in keep.tolist()]

    def prefill(self, ctx: Context) -> None:
        """Read the committed text and feed its draft tokens but the last, which the next proposal feeds."""
        feed, valid, positions = self._catch_up(ctx, 0)
        if feed.shape[1] > 1:
            self._forward(feed[:, :-1], valid[:, :-1], positions[:, :-1])
        for row in self.rows:  # the cache holds every draft token but the last of each row
            row.seq = row.seq[:-1]
            row.ends = row.ends[: len(row.seq)]

    def merge(self, other: Drafter) -> None:
        assert isinstance(other, CrossTokenizerDrafter) and self.drafts is None and other.drafts is None
        assert not (self.spelled_step or other.spelled_step), "rows join between steps"
        self.kv.merge(other.kv)
        self.rows = self.rows + other.rows

    def check(self, ctx: Context) -> None:
        fed = torch.tensor([len(r.seq) for r in self.rows], device=self.kv.mask.device)
        self.kv.check(fed, "draft")
        assert all(len(r.ends) <= len(r.seq) for r in self.rows), "draft token ends past the cached tokens"

    def step_seconds(self, context: list[int], device: torch.device, repeats: int = 5) -> float:
        """Median seconds of one cached single-token draft forward plus the re-tokenization a step needs."""
        row = _Row()
        self._read(row, context[:-1])
        row.seq, row.ends, _ = self._full(row)

        def retokenize() -> None:
            probe = replace(row, seq=list(row.seq), ends=list(row.ends))
            self._read(probe, context)
            self._retokenize(probe)

        ids = row.seq or [self.start_id]
        return forward_seconds(self.model, ids, (1,), repeats, device, all_logits=False)[1] + median_seconds(
            retokenize, repeats
        )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": type(self.model).__name__,
            "parameters": draft_linear.weights(self.model),
            "shared_tokens": self.map.shared,
        }

    # -- greedy decoding by text (SLEM) --------------------------------------------------------

    def _propose_text(self, ctx: Context, gamma: int, stop: Stop | None) -> Proposal:
        """Greedy drafts in the draft's own tokens, spelled again in the target's after the committed text.

        Each row proposes the target tokens that spell the draft's text exactly, up to γ; a row whose first
        target token would straddle the committed text proposes none (SLEM: the target verifies its own
        tokens, so any proposal is exact under greedy verification).
        """

        def pick(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, None, torch.Tensor]:
            token = logits[:, : len(self.bytes)].argmax(dim=-1)  # padded rows of the head spell nothing
            return token, None, torch.softmax(logits, dim=-1).gather(1, token[:, None]).squeeze(1)

        drafted = self._draft(ctx, gamma, stop, pick, shared=False)[0]
        self.spelled_step = True
        own = torch.stack(drafted, dim=1).tolist()
        proposals = [self._spell(row, ids)[:gamma] for row, ids in zip(self.rows, own)]
        width = max(len(p) for p in proposals)
        tokens = torch.tensor(
            [p + [0] * (width - len(p)) for p in proposals], dtype=torch.long, device=ctx.tokens.device
        ).view(len(proposals), width)
        counts = torch.tensor([len(p) for p in proposals], device=ctx.tokens.device)
        return Proposal.chain(tokens, None, counts, forwards=len(drafted))

    def _spell(self, row: _Row, ids: list[int]) -> list[int]:
        """Target tokens that spell the text of draft tokens ``ids`` after the row's committed text, the
        draft's EOS as the target's; none where that text cannot be cut from the committed text."""
        eos_draft, eos_target = self.eos
        end = ids.index(eos_draft) if eos_draft in ids else len(ids)
        new = b"".join(self.bytes[t] or b"" for t in ids[:end])
        while new and not _complete(new):  # a character whose last bytes are still to be drafted
            new = new[:-1]
        start = max(len(row.text) - PRIME_BYTES, 0)
        while start > 0 and not _char_start(row.text, start):
            start -= 1
        try:
            context = (row.text[start:] + new).decode()
        except UnicodeDecodeError:
            return []
        tail = _spelling(self.target_encoder.encode(context, add_special_tokens=False).ids, self.target_bytes, new)
        if tail is None or row.behind:
            return []
        return tail + ([eos_target] if end < len(ids) and eos_target is not None else [])

    # -- the draft's context ---------------------------------------------------------------------

    def _catch_up(self, ctx: Context, gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Re-tokenize each row's committed text, roll the cache back to what still holds and return the
        rest as a right-aligned (B, K) block: (ids, valid, positions). At least one token per row is fed
        again, so that the forward gives every row its next-token logits."""
        keep, feeds = [], []
        lengths = ctx.lengths.tolist()
        for b, row in enumerate(self.rows):
            start = max(row.prefix, 0)
            self._read(row, ctx.tokens[b, start : lengths[b]].tolist(), start)
            seq, ends, known = self._retokenize(row)
            if self.window is not None and len(seq) + gamma + 1 > self.window:
                seq, ends, known = self._shorten(row, seq, ends, gamma)
            common = min(_common_prefix(seq, row.seq, known), len(seq) - 1)
            keep.append(common)
            feeds.append(seq[common:])
            row.seq, row.ends = seq, ends
        self._truncate(torch.tensor(keep, device=self.kv.mask.device))
        device = self.kv.mask.device
        width = max(len(f) for f in feeds)
        block = torch.tensor([[0] * (width - len(f)) + f for f in feeds], dtype=torch.long, device=device)
        cols = torch.arange(width, device=device)[None, :] - width
        lens = torch.tensor([len(f) for f in feeds], device=device)[:, None]
        valid = (cols >= -lens).long()
        positions = (torch.tensor(keep, device=device)[:, None] + lens + cols).clamp(min=0)
        return block, valid, positions

    def _truncate(self, keep: torch.Tensor) -> None:
        """Keep, per row, only the first ``keep[b]`` tokens the cache holds (holes stay holes)."""
        counts = self.kv.mask.cumsum(dim=1)  # (B, L) tokens held up to each column
        ends = (counts < keep[:, None]).sum(dim=1) + (keep > 0).long()  # column after each row's last kept token
        start = int(ends.min()) if ends.numel() else 0
        self.kv.keep(ends - start, start)

    def _read(self, row: _Row, ids: list[int], start: int = 0) -> None:
        """Add the text of the committed target tokens ``ids`` (those from ``start`` on) to ``row``.

        As incremental detokenizers do: the tokens from ``prefix`` are decoded together with the
        new ones, so that a decoder that drops a first token's space or joins split bytes sees the
        same context each time; text that ends in a split character waits for more tokens.
        """
        if row.prefix < 0:  # the first call: skip the target's BOS
            skip = 0
            while skip < len(ids) and ids[skip] in self.skip:
                skip += 1
            row.prefix = row.read = start + skip
        ids = ids[row.prefix - start :]
        done = row.read - row.prefix
        if len(ids) <= done:
            row.behind = False
            return
        decode = self.target_tokenizer.decode
        before = decode(ids[:done], skip_special_tokens=False, clean_up_tokenization_spaces=False) if done else ""
        after = decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        row.behind = after.endswith("\ufffd") and len(ids) - done <= HOLD
        if row.behind:
            return
        # A decoder that rewrites earlier text (rare) gives its new text from where the two differ.
        row.text += after[len(os.path.commonprefix([before, after])) :].encode()
        row.prefix, row.read = row.read, row.prefix + len(ids)

    def _retokenize(self, row: _Row) -> tuple[list[int], list[int], int]:
        """The draft tokens of the row's text and their ends: the cached ones up to a boundary, then a fresh
        window; and how many of the first tokens are known to equal the cached ones."""
        text, ends = row.text, row.ends
        base = len(self.lead) + PRIME
        k = len(ends) - REWORK
        while k > base and not (_char_start(text, ends[k - 1]) and _char_start(text, ends[k - 1 - PRIME])):
            k -= 1
        if k <= base or ends[k - 1 - PRIME] < row.origin:
            return self._full(row)
        begin, cut = ends[k - 1 - PRIME], ends[k - 1]
        window = self.encoder.encode(text[begin:].decode(), add_special_tokens=False).ids
        tail = _spelling(window, self.bytes, text[cut:])  # the window's tokens after ``cut``
        if tail is None:
            return self._full(row)
        return row.seq[:k] + tail, ends[:k] + _ends(tail, self.bytes, cut), k

    def _full(self, row: _Row) -> tuple[list[int], list[int], int]:
        """The draft tokens of the whole text from ``origin``, their ends counted back from the text's end
        (where a tokenizer adds a space at the start, only the first token's end is off)."""
        ids = self.encoder.encode(row.text[row.origin :].decode(), add_special_tokens=False).ids
        lengths = [len(self.bytes[t] or b"") for t in ids]
        ends, end = [], len(row.text)
        for n in reversed(lengths):
            ends.append(max(end, row.origin))
            end -= n
        seq = self.lead + ids
        if not seq:
            seq = [self.start_id]
        return seq, [row.origin] * (len(seq) - len(ids)) + ends[::-1], 0

    def _shorten(self, row: _Row, seq: list[int], ends: list[int], gamma: int) -> tuple[list[int], list[int], int]:
        """Past the draft's context window: start its context at a boundary that leaves half the window."""
        i = max(len(seq) - self.window // 2 + gamma, 1)
        while i < len(ends) and not _char_start(row.text, ends[i - 1]):
            i += 1
        if i >= len(ends) or self.window // 2 <= gamma + 1:
            raise HfspecError(
                f"the draft's context window ({self.window} tokens) is too small for γ={gamma}; "
                "lower gamma or pick a draft with a longer context"
            )
        row.origin = ends[i - 1]
        return self._full(row)

    # -- logits ------------------------------------------------------------------------------------

    def _forward(self, feed: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Last-position draft logits (B, V_draft) after feeding (B, k) draft tokens."""
        return forward(self.model, feed, self.kv.extend_mask(valid), positions, self.kv.cache, logits_to_keep=1)[:, -1]

    def _target_row(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits (B, V_draft) → (B, V_target): the shared tokens' logits, ``IMPOSSIBLE`` elsewhere."""
        row = logits.new_full((logits.shape[0], self.vocab_size), IMPOSSIBLE)
        row[:, self.device_map.target_ids] = logits[:, self.device_map.draft_ids]
        return row


def adapt(
    draft: Any, draft_tokenizer: PreTrainedTokenizerBase, target_tokenizer: PreTrainedTokenizerBase | None
) -> Any:
    """``draft`` as it should draft for a target with ``target_tokenizer``: itself when ``draft_tokenizer``
    is the same tokenizer, else a ``CrossTokenizerDrafter`` (which needs a loaded causal LM)."""
    if target_tokenizer is None:
        raise HfspecTypeError(
            "draft_tokenizer= needs the target's tokenizer too: SpeculativeGenerator(target, draft, "
            "tokenizer, draft_tokenizer=...)"
        )
    if same_tokenizer(draft_tokenizer, target_tokenizer):
        return draft
    if not isinstance(draft, PreTrainedModel):
        raise HfspecTypeError(
            f"a draft with its own tokenizer must be a loaded causal LM (got "
            f"{type(draft).__name__}); load it with AutoModelForCausalLM.from_pretrained, or load "
            "the pair with SpeculativeGenerator.from_pretrained(target, draft)"
        )
    return CrossTokenizerDrafter(draft, draft_tokenizer, target_tokenizer)


def _leading_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids a tokenizer puts before any text (its BOS), found by encoding a probe with and without them."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return list(full[:i])
    return []


def _complete(text: bytes) -> bool:
    """True when UTF-8 ``text`` does not end inside a character."""
    for back in range(1, min(4, len(text)) + 1):
        lead = text[-back]
        if lead & 0xC0 != 0x80:  # the first byte of the last character says how long it is
            return back >= (4 if lead >= 0xF0 else 3 if lead >= 0xE0 else 2 if lead >= 0xC0 else 1)
    return True


def _char_start(text: bytes, at: int) -> bool:
    """True when byte ``at`` of UTF-8 ``text`` begins a character (or is its end)."""
    return at >= len(text) or (text[at] & 0xC0) != 0x80


def _spelling(ids: list[int], spelled: list[bytes | None], rest: bytes) -> list[int] | None:
    """The last tokens of ``ids`` when they spell exactly ``rest`` (the tokens before end where it begins),
    else None (a token straddles that boundary, or a tokenizer rewrote the text)."""
    j, length = len(ids), 0
    while j > 0 and length < len(rest):
        j -= 1
        piece = spelled[ids[j]]
        if piece is None:
            return None
        length += len(piece)
    tail = ids[j:]
    if length != len(rest) or b"".join(spelled[t] for t in tail) != rest:
        return None
    return tail


def _ends(ids: list[int], spelled: list[bytes | None], start: int) -> list[int]:
    """Byte ends of ``ids`` spelled one after another from ``start``."""
    out = []
    for t in ids:
        start += len(spelled[t] or b"")
        out.append(start)
    return out


def _common_prefix(a: list[int], b: list[int], known: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, of which the first ``known`` are equal already."""
    n = max(min(known, len(a), len(b)), 0)
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
