"""The request bodies of the OpenAI API, as pydantic models: types and ranges checked before anything runs.

Fields OpenAI defines that hfspec does not use (logprobs, penalties, ...) are declared with their types, so that a
wrong type is still a 400; fields nobody defines are ignored, as OpenAI's and vLLM's servers ignore them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP = 4  # stop strings per request, as OpenAI allows

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _Sampling(BaseModel):
    """What chat and completions requests share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off, as vLLM takes it
    min_p: Probability = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Declared for their types only: accepted and not acted on.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _check(self) -> _Sampling:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings, got {len(self.stop)}")
        if self.n != 1:
            raise ValueError(f"n: only n=1 is supported, got {self.n}; send n requests instead")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: an empty list has nothing to complete")
        return self

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or token ids."""
        p: Any = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)
