"""The tokens two tokenizers share: what a draft with its own tokenizer may propose to the target.

Two tokens are the same when they stand for the same bytes of text. A token's bytes are read
from its tokenizer's own vocabulary and decoder: byte-level BPE (GPT-2, Llama 3, Qwen) maps
each byte to a printable character (``Ġ`` is a space), SentencePiece-style tokenizers write a
space as ``▁`` and single bytes as ``<0x0A>``; added tokens stand for their content as
written. Special tokens (BOS, EOS, chat markers) are matched by content, never by bytes of
text, and the draft's EOS always maps to the target's EOS, so that a draft can end the text.

The map is one to one: where several tokens of one side share the same bytes (a byte-fallback
token and a character, say), the lowest id is kept. Which token is kept never affects
correctness: the map only decides what the draft may propose (Timor et al., ICML 2025,
"lossless speculative decoding algorithms for heterogeneous vocabularies": token-level
intersection).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from hfspec.errors import HfspecError

log = logging.getLogger(__name__)

# Below this share of the smaller vocabulary, almost every draft would be a token the target
# never sees as one piece: drafting could only waste time, so the pair is refused.
MIN_SHARED_FRACTION = 0.1

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable character → byte (the inverse of GPT-2's ``bytes_to_unicode``)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_steps(spec: dict | None) -> list[dict]:
    """The decoder of a ``tokenizers`` JSON spec as a flat list of steps."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [step for part in spec.get("decoders", []) for step in _decoder_steps(part)]
    return [spec]


def _fast_spec(tokenizer: PreTrainedTokenizerBase) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise HfspecError(
            f"pairs with different tokenizers need fast tokenizers (got {type(tokenizer).__name__}); "
            "load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    return json.loads(backend.to_str())


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> list[bytes | None]:
    """The bytes of text each id stands for, indexed by id (``None`` for ids the vocabulary skips).

    Special tokens stand for their content as it appears in decoded text (``"<|im_end|>"``).
    """
    steps = _decoder_steps(_fast_spec(tokenizer).get("decoder"))
    kinds = {step.get("type") for step in steps}
    replace = [
        (step["pattern"].get("String", ""), step.get("content", ""))
        for step in steps
        if step.get("type") == "Replace" and isinstance(step.get("pattern"), dict)
    ]
    replace += [(step.get("replacement", "▁"), " ") for step in steps if step.get("type") == "Metaspace"]
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    decode = byte_decoder()
    vocab = tokenizer.get_vocab()
    out: list[bytes | None] = [None] * (max(vocab.values()) + 1 if vocab else 0)
    for piece, i in vocab.items():
        if i in added:
            out[i] = added[i].encode()
        elif "ByteLevel" in kinds:
            out[i] = bytes(decode[c] for c in piece) if all(c in decode for c in piece) else None
        elif "ByteFallback" in kinds and _BYTE_TOKEN.fullmatch(piece):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            for pattern, content in replace:
                piece = piece.replace(pattern, content)
            out[i] = piece.encode()
    return out


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


@dataclass(frozen=True)
class VocabMap:
    """The shared tokens of a draft and a target tokenizer, as two id maps (-1 where a token is not shared).

    ``draft_ids`` and ``target_ids`` (S,) list the S shared pairs; ``to_draft`` (V_target,) and
    ``to_target`` (V_draft,) map single ids.
    """

    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    to_draft: torch.Tensor
    to_target: torch.Tensor

    @property
    def shared(self) -> int:
        return int(self.draft_ids.numel())

    def to(self, device: torch.device) -> VocabMap:
        return VocabMap(*(t.to(device) for t in (self.draft_ids, self.target_ids, self.to_draft, self.to_target)))


def _pairs(
    target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, target_vocab: int, draft_vocab: int
) -> dict[int, int]:
    """draft id → target id for every shared token: specials by content, the rest by bytes."""
    t_special, d_special = _special_ids(target), _special_ids(draft)
    t_bytes, d_bytes = token_bytes(target), token_bytes(draft)
    by_text: dict[bytes, int] = {}
    by_special: dict[bytes, int] = {}
    for i, b in enumerate(t_bytes[:target_vocab]):
        if b:  # lowest id first: the map stays one to one
            (by_special if i in t_special else by_text).setdefault(b, i)
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    eos_d, eos_t = draft.eos_token_id, target.eos_token_id
    if eos_d is not None and eos_t is not None and eos_d < draft_vocab and eos_t < target_vocab:
        pairs[eos_d] = eos_t
        taken.add(eos_t)
    for i, b in enumerate(d_bytes[:draft_vocab]):
        j = (by_special if i in d_special else by_text).get(b) if b else None
        if j is not None and i not in pairs and j not in taken:
            pairs[i] = j
            taken.add(j)
    return pairs


def vocab_map(
    target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, target_vocab: int, draft_vocab: int
) -> VocabMap:
    """The shared tokens of ``draft`` and ``target`` with ids below each side's vocabulary size.

    Refuses (``HfspecError``) a pair that shares fewer than ``MIN_SHARED_FRACTION`` of the
    smaller vocabulary's ordinary tokens: no draft worth verifying could come from it.
    """
    pairs = _pairs(target, draft, target_vocab, draft_vocab)
    # Ordinary tokens of each side (padded rows of an output layer are no tokens).
    ordinary = min(
        min(target_vocab, len(target)) - len(_special_ids(target)),
        min(draft_vocab, len(draft)) - len(_special_ids(draft)),
    )
    shared = sum(1 for d in pairs if d not in _special_ids(draft))
    if shared < MIN_SHARED_FRACTION * max(ordinary, 1) or not shared:
        raise HfspecError(
            f"the draft's and the target's tokenizers share only {shared} ordinary tokens of {max(ordinary, 0)} "
            f"(under {MIN_SHARED_FRACTION:.0%}), so nearly every draft would be a token the target does not have; "
            "pick a draft trained with the target's tokenizer, or one whose tokenizer shares most of its vocabulary "
            "(a model of the same family), or draft without a model (draft='ngram')"
        )
    draft_ids = torch.tensor(sorted(pairs), dtype=torch.long)
    target_ids = torch.tensor([pairs[i] for i in sorted(pairs)], dtype=torch.long)
    to_draft = torch.full((target_vocab,), -1, dtype=torch.long)
    to_draft[target_ids] = draft_ids
    to_target = torch.full((draft_vocab,), -1, dtype=torch.long)
    to_target[draft_ids] = target_ids
    log.info("draft and target tokenizers share %d tokens (draft %d, target %d)", shared, draft_vocab, target_vocab)
    return VocabMap(draft_ids, target_ids, to_draft, to_target)
