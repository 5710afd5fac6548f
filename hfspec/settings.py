"""One request's sampling settings: a frozen value, validated once where it is built, carried to the math per row.

As vLLM's ``SamplingParams``: each boundary (``hfspec.generate`` and ``SpeculativeGenerator.generate``'s keywords,
a ``GenerationConfig``, the target's own generation config, a preset, the command line, transformers'
``custom_generate``, a server request) builds one ``SamplingParams`` (``hfspec.decoding.config.resolve`` from
generation configs); from then on nothing re-reads an option list. ``Scoring`` (``hfspec.decoding.scoring``) turns
it into the processing of a row's logits: ``processors()``, the ones that read the text so far (penalties, bad words,
the caller's own), in transformers' order, then ``warpers()``, which ``hfspec.decoding.sampling.warped_probs``
applies (temperature, top-k, top-p, min-p). The server's batch keeps one value per row, so that greedy rows sit
beside sampled rows of different temperatures. ``key()`` is the setting under which ``gamma="auto"`` remembers how
well drafts are accepted (greedy and each temperature accept differently).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from hfspec.decoding.sampling import Warpers, needs_context
from hfspec.errors import HfspecError, HfspecTypeError

# The rule of each setting, said once: what the error message quotes.
RULES = {
    "temperature": "a finite number >= 0 (0: greedy)",
    "top_p": "in (0, 1] (1: off)",
    "top_k": "an integer >= 0 (0: off)",
    "min_p": "in [0, 1] (0: off)",
    "repetition_penalty": "a finite number > 0 (1.0: off)",
    "no_repeat_ngram_size": "an integer >= 0 (0: off)",
    "bad_words_ids": "lists of token ids >= 0, each non-empty",
    "suppress_tokens": "token ids >= 0",
    "logits_processor": "transformers LogitsProcessor objects",
    "seed": "an integer or None",
    "max_new_tokens": "an integer >= 0",
    "stop": "non-empty strings",
    "stop_token_ids": "token ids >= 0",
    "pad_token_id": "a token id >= 0 or None",
}
# Settings held as tuples: a list passed in is kept as a tuple (of tuples for bad_words_ids).
_SEQUENCES = ("bad_words_ids", "suppress_tokens", "logits_processor", "stop", "stop_token_ids")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples, and when it ends.

    ``temperature=0`` is greedy (the exact argmax, not a tiny temperature); then top-p, top-k and min-p are unused,
    while the processors (repetition penalty, n-gram and bad-word bans, suppressed tokens, ``logits_processor``)
    apply to greedy decoding too. ``seed`` gives a server request a random stream of its own: the same tokens
    whatever else runs beside it. ``stop``: strings that end the completion (the text returned stops before them);
    ``stop_token_ids``: ids that end it (a server adds the model's own EOS ids; the library's boundary puts the
    generation config's ``eos_token_id`` here). ``pad_token_id`` right-pads finished rows (None: the first stop id).
    """

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    no_repeat_ngram_size: int = 0  # 0: off
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    logits_processor: tuple[LogitsProcessor, ...] = ()  # the caller's own, between the penalties and the warpers
    seed: int | None = None
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in _SEQUENCES:
            value = getattr(self, name)
            if isinstance(value, list):
                if name == "bad_words_ids":
                    value = [tuple(v) if isinstance(v, list) else v for v in value]
                object.__setattr__(self, name, tuple(value))
        typed, ranged = self._checks()
        bad = [name for name in RULES if not (typed[name] and ranged[name])]
        if bad:
            error = HfspecTypeError if any(not typed[name] for name in bad) else HfspecError
            raise error("; ".join(f"{name} must be {RULES[name]}, got {getattr(self, name)!r}" for name in bad))

    def _checks(self) -> tuple[dict[str, bool], dict[str, bool]]:
        """Whether each setting has the right type, and then whether it is in its range (``RULES``)."""
        typed = {
            "temperature": _number(self.temperature),
            "top_p": _number(self.top_p),
            "top_k": _integer(self.top_k),
            "min_p": _number(self.min_p),
            "repetition_penalty": _number(self.repetition_penalty),
            "no_repeat_ngram_size": _integer(self.no_repeat_ngram_size),
            "bad_words_ids": isinstance(self.bad_words_ids, tuple)
            and all(isinstance(w, tuple) and all(map(_integer, w)) for w in self.bad_words_ids),
            "suppress_tokens": isinstance(self.suppress_tokens, tuple) and all(map(_integer, self.suppress_tokens)),
            "logits_processor": isinstance(self.logits_processor, tuple) and all(map(callable, self.logits_processor)),
            "seed": self.seed is None or _integer(self.seed),
            "max_new_tokens": _integer(self.max_new_tokens),
            "stop": isinstance(self.stop, tuple) and all(isinstance(s, str) for s in self.stop),
            "stop_token_ids": isinstance(self.stop_token_ids, tuple) and all(map(_integer, self.stop_token_ids)),
            "pad_token_id": self.pad_token_id is None or _integer(self.pad_token_id),
        }
        ok = dict.fromkeys(RULES, True)
        if all(typed.values()):
            ok = {
                **ok,
                "temperature": math.isfinite(self.temperature) and self.temperature >= 0,
                "top_p": 0 < self.top_p <= 1,
                "top_k": self.top_k >= 0,
                "min_p": 0 <= self.min_p <= 1,
                "repetition_penalty": math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "no_repeat_ngram_size": self.no_repeat_ngram_size >= 0,
                "bad_words_ids": all(w and min(w) >= 0 for w in self.bad_words_ids),
                "suppress_tokens": all(t >= 0 for t in self.suppress_tokens),
                "max_new_tokens": self.max_new_tokens >= 0,
                "stop": all(self.stop),
                "stop_token_ids": all(t >= 0 for t in self.stop_token_ids),
                "pad_token_id": self.pad_token_id is None or self.pad_token_id >= 0,
            }
        return typed, ok

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def processors(self) -> LogitsProcessorList:
        """The processors that run before the warpers, in transformers' order; they apply to greedy decoding too
        and may read the row's text so far (``reads_context``)."""
        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(float(self.repetition_penalty)))
        if self.no_repeat_ngram_size:
            out.append(NoRepeatNGramLogitsProcessor(self.no_repeat_ngram_size))
        if self.bad_words_ids:
            eos = list(self.stop_token_ids) or None
            out.append(NoBadWordsLogitsProcessor([list(w) for w in self.bad_words_ids], eos))
        if self.suppress_tokens:
            out.append(SuppressTokensLogitsProcessor(list(self.suppress_tokens)))
        out.extend(self.logits_processor)
        return out

    def reads_context(self) -> bool:
        """Whether a processor reads the text so far: then a draft tree's nodes would each need their own path."""
        return needs_context(self.processors())

    def warpers(self) -> Warpers | None:
        """The stages ``sampling.warped_probs`` applies, off where they change nothing; None when greedy."""
        if self.greedy:
            return None
        return Warpers(
            temperature=None if self.temperature == 1.0 else float(self.temperature),
            top_k=self.top_k or None,
            top_p=None if self.top_p >= 1.0 else float(self.top_p),
            min_p=self.min_p or None,
        )

    def pad(self) -> int:
        """What right-pads finished rows: pad_token_id, else the first stop token id, else 0."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.stop_token_ids[0] if self.stop_token_ids else 0

    def key(self) -> Any:
        """The setting ``gamma="auto"`` keeps acceptance evidence under: False when greedy, else the warpers."""
        return False if self.greedy else (True, self.temperature, self.top_k, self.top_p, self.min_p)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
