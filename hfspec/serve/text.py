"""One request's text as it grows: incremental detokenization and stop strings.

Text is decoded from all of the request's new tokens each time (as transformers' ``TextStreamer`` does) and
handed out in pieces that never split a character: text ending in U+FFFD (the bytes of a character not all
decoded yet) is held back. With stop strings, the last ``len(longest) - 1`` characters are held back too, so that
a stop string split across steps is still found and cut; the completion then ends at the fewest tokens whose text
reaches the stop string, and the text handed out stops before it.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class TextStream:
    """Decodes one request's new tokens step by step; see the module docstring."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters handed out so far

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def find(self, text: str) -> int | None:
        """Where the first stop string in ``text`` begins (none ends in text already handed out), or None."""
        found = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def add(self, tokens: tuple[int, ...]) -> tuple[int, str, bool]:
        """Take a step's ``tokens``: (how many of them the completion keeps, the text to hand out, whether a stop
        string ended the completion)."""
        before = len(self.ids)
        self.ids.extend(tokens)
        text = self.decode(self.ids)
        cut = self.find(text) if self.stop else None
        if cut is not None:
            keep = next(
                k for k in range(1, len(tokens) + 1) if self.find(self.decode(self.ids[: before + k])) is not None
            )
            del self.ids[before + keep :]
            out, self.sent = text[self.sent : cut], cut
            return keep, out, True
        safe = text.rstrip(REPLACEMENT)
        upto = max(self.sent, len(safe) - self.hold)
        out, self.sent = safe[self.sent : upto], upto
        return len(tokens), out, False

    def flush(self) -> str:
        """The text not handed out yet, at the end of a completion that no stop string ended."""
        text = self.decode(self.ids)
        out, self.sent = text[self.sent :], len(text)
        return out
