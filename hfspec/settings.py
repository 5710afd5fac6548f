"""One request's sampling settings: a frozen value, validated once where it is built, carried to the math per row.

As vLLM's ``SamplingParams``: the boundary (a server request, an API call) builds one ``SamplingParams``; from
then on nothing re-reads an option list. ``warpers()`` is what ``hfspec.decoding.sampling.warped_probs`` applies to a
row's logits (temperature, top-k, top-p, min-p, in transformers' order), and the server's batch keeps one value per
row, so that greedy rows sit beside sampled rows of different temperatures. ``key()`` is the setting under which
``gamma="auto"`` remembers how well drafts are accepted (greedy and each temperature accept differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfspec.decoding.sampling import Warpers
from hfspec.errors import HfspecError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples, and when it ends.

    ``temperature=0`` is greedy (the exact argmax, not a tiny temperature); then top-p, top-k and min-p are unused.
    ``seed`` gives the request a random stream of its own: the same tokens whatever else runs beside it.
    ``stop``: strings that end the completion (the text returned stops before them); ``stop_token_ids``: ids that
    end it besides the model's own EOS ids.
    """

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = [
            f"{name}={value!r}"
            for name, value, ok in (
                ("temperature", self.temperature, _number(self.temperature) and self.temperature >= 0),
                ("top_p", self.top_p, _number(self.top_p) and 0 < self.top_p <= 1),
                ("top_k", self.top_k, _integer(self.top_k) and self.top_k >= 0),
                ("min_p", self.min_p, _number(self.min_p) and 0 <= self.min_p <= 1),
                ("seed", self.seed, self.seed is None or _integer(self.seed)),
                ("max_new_tokens", self.max_new_tokens, _integer(self.max_new_tokens) and self.max_new_tokens >= 1),
                ("stop", self.stop, isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop)),
                (
                    "stop_token_ids",
                    self.stop_token_ids,
                    isinstance(self.stop_token_ids, tuple) and all(_integer(t) and t >= 0 for t in self.stop_token_ids),
                ),
            )
            if not ok
        ]
        if bad:
            raise HfspecError(
                f"invalid sampling settings {', '.join(bad)}: need temperature >= 0 (0: greedy), 0 < top_p <= 1, "
                "top_k >= 0 (0: off), 0 <= min_p <= 1, an integer seed or none, max_new_tokens >= 1, non-empty stop "
                "strings and token ids >= 0"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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

    def key(self) -> Any:
        """The setting ``gamma="auto"`` keeps acceptance evidence under: False when greedy, else the warpers."""
        return False if self.greedy else (True, self.temperature, self.top_k, self.top_p, self.min_p)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
