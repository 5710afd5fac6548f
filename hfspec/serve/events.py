"""What passes between the HTTP layer and the engine: a request in, a stream of events out.

The HTTP layer turns an OpenAI request into a ``Request`` (token ids, sampling settings, stop strings), submits it
to the engine and reads the ``Handle``'s events until ``Done``. The engine owns the models on a thread of its own;
requests join its running batch at a step boundary and leave it as soon as they finish or are cancelled. Nothing
here imports torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

# How a committed token was decided in its step (Leviathan et al., arXiv 2211.17192): a draft the target accepted,
# the token drawn from the residual max(0, p - q) at a rejection (greedy: the target's argmax there), or the token
# drawn from p after every draft of the step was accepted (the bonus; a step with no drafts gives only this one).
Origin = Literal["accepted", "resampled", "bonus"]
FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class Request:
    """One completion to run: ``prompt_ids`` already templated and tokenized by the HTTP layer."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy, exact argmax
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the completion; the text returned stops before them
    stop_token_ids: tuple[int, ...] = ()  # besides the model's own EOS ids
    gamma: int | str = "auto"  # drafts per step for this row: "auto" or a number (0: plain decoding)


@dataclass(frozen=True)
class Delta:
    """Tokens one step committed for a request, with their text (decoded incrementally, stop strings cut)."""

    token_ids: tuple[int, ...]
    origins: tuple[Origin, ...]  # one per token id
    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    drafted: int  # draft tokens proposed for this request
    accepted: int  # of them, accepted by the target
    target_passes: int  # target forwards this request took part in (its prefill not counted)


@dataclass(frozen=True)
class Done:
    finish_reason: FinishReason
    usage: Usage
    error: str | None = None  # with finish_reason "error": what went wrong, for the log and the client


Event = Delta | Done


@dataclass
class Handle:
    """The HTTP side of one submitted request: its events, pushed by the engine's thread into the asyncio loop
    that submitted it; ``cancel()`` makes the engine drop the row at its next step boundary."""

    request: Request
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self.queue.get()
            yield event
            if isinstance(event, Done):
                return


class QueueFull(Exception):
    """The engine's batch and its waiting queue are full: the HTTP layer answers 503 with Retry-After."""


class Engine(Protocol):
    """What the HTTP layer needs of an engine."""

    model_name: str
    context_length: int  # prompt plus completion tokens a request may hold
    max_batch: int

    @property
    def ready(self) -> bool:
        """Whether the engine serves now: its models are loaded and its first measurements taken (``/health``)."""
        ...

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Handle:
        """Queue ``request``; raises ``QueueFull``. Thread-safe; events go to ``loop``."""
        ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 5.0) -> None:
        """Stop taking requests, end the rows in flight with ``Done("cancelled")`` and join the engine's thread."""
        ...

    @property
    def running(self) -> int:
        """Rows in the batch now."""
        ...

    @property
    def waiting(self) -> int:
        """Requests queued behind the batch."""
        ...
