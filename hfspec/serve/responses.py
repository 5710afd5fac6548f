"""OpenAI's response bodies and stream chunks, as plain dicts: what a choice, a chunk and a usage look like.

Each streamed choice carries, besides OpenAI's fields, ``"hfspec": {"token_ids": [...], "origins": [...]}``: the
tokens of that chunk and how each was committed ("accepted", "resampled", "bonus"). OpenAI clients ignore it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hfspec.serve.events import Delta, Usage

CHAT, TEXT = "chat.completion", "text_completion"


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage_dict(usages: list[Usage]) -> dict[str, Any]:
    """OpenAI's usage, summed over choices, with hfspec's section."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "hfspec": {
            "drafted": sum(u.drafted for u in usages),
            "accepted": sum(u.accepted for u in usages),
            "target_passes": sum(u.target_passes for u in usages),
        },
    }


def tags(delta: Delta, pieces: list[str] | None = None) -> dict[str, Any]:
    """The extension field of a chunk: its tokens, their origins and, where each token's own text adds up to the
    chunk's text, that text token by token (for a page that colours each token)."""
    out: dict[str, Any] = {"token_ids": list(delta.token_ids), "origins": list(delta.origins)}
    if pieces is not None:
        out["pieces"] = pieces
    return out


@dataclass
class Choice:
    """One choice as it builds up from the engine's events."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.origins.extend(delta.origins)

    def body(self, kind: str) -> dict[str, Any]:
        extra = {"hfspec": {"token_ids": self.token_ids, "origins": self.origins}}
        if kind == CHAT:
            message = {"role": "assistant", "content": self.text}
            return {
                "index": self.index,
                "message": message,
                "logprobs": None,
                "finish_reason": self.finish_reason,
                **extra,
            }
        return {"index": self.index, "text": self.text, "logprobs": None, "finish_reason": self.finish_reason, **extra}


@dataclass(frozen=True)
class Envelope:
    """What every response and chunk of one request shares."""

    id: str
    created: int
    model: str
    kind: str  # CHAT or TEXT

    def response(self, choices: list[Choice], usages: list[Usage]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": [c.body(self.kind) for c in choices],
            "usage": usage_dict(usages),
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.kind == CHAT else TEXT
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def first(self, index: int) -> dict[str, Any] | None:
        """The chunk that opens a chat choice (its role); completions have none."""
        if self.kind != CHAT:
            return None
        delta = {"role": "assistant", "content": ""}
        return self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])

    def piece(self, index: int, delta: Delta, pieces: list[str] | None = None) -> dict[str, Any]:
        if self.kind == CHAT:
            choice = {"index": index, "delta": {"content": delta.text}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": index, "text": delta.text, "logprobs": None, "finish_reason": None}
        return self.chunk([{**choice, "hfspec": tags(delta, pieces)}])

    def last(self, index: int, finish_reason: str) -> dict[str, Any]:
        if self.kind == CHAT:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}
        return self.chunk([choice])
