"""Token ids to text as they come, with stop strings: what an engine puts in each ``Delta.text``.

The whole completion is decoded again at every step (a tokenizer may merge or split characters across tokens),
and only what is certain goes out: text that could still be the start of a stop string, or that ends in half a
character (U+FFFD), waits for the next step. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a tokenizer decodes half a UTF-8 character to


class TextStream:
    """One completion's text: ``push(ids)`` gives the new text that is certain, and whether a stop string ended it."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """Add ``ids``; the text that follows what was handed out, up to a stop string (then ``stopped`` is set)."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._take(text, cut)
        end = len(text) - self._held(text)
        return self._take(text, end)

    def flush(self) -> str:
        """At the end of the completion: the text held back for a stop string that never came."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._take(text, len(text))

    def _take(self, text: str, end: int) -> str:
        out = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string starts in the text not yet handed out (or straddling it)."""
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self.sent - longest + 1)
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` to keep back: a half character, or a possible start of a stop string."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        body = text[: len(text) - held]
        for s in self.stop:
            for n in range(min(len(s) - 1, len(body)), 0, -1):
                if body.endswith(s[:n]):
                    held = max(held, len(text) - len(body) + n)
                    break
        return held
