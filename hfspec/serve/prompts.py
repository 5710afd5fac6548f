"""OpenAI prompts to token ids: chat messages through the tokenizer's chat template, completions as they are,
fill-in-the-middle with the tokenizer's FIM tokens; and the budget check against the context window."""

from __future__ import annotations

from typing import Any

from hfspec.serve.errors import ApiError
from hfspec.serve.protocol import ChatCompletionRequest, CompletionRequest

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")  # Qwen2.5-Coder's spelling, StarCoder's too
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's and vLLM's


def chat_ids(tokenizer: Any, request: ChatCompletionRequest) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template may refuse an order of roles (raise_exception in Jinja)
        raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def fim_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the three FIM tokens, or None where the tokenizer lacks one."""
    vocab = tokenizer.get_vocab()
    ids = tuple(vocab.get(t) for t in FIM_TOKENS)
    return None if None in ids else ids  # type: ignore[return-value]


def completion_ids(tokenizer: Any, request: CompletionRequest) -> list[list[int]]:
    """One list of ids per prompt; with ``suffix``, each laid out for fill-in-the-middle."""
    vocab_size = len(tokenizer)
    prompts = request.prompts()
    for p in prompts:
        if isinstance(p, list) and any(not 0 <= i < vocab_size for i in p):
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size})", param="prompt")
    if request.suffix is None:
        return [p if isinstance(p, list) else list(tokenizer(p)["input_ids"]) for p in prompts]
    fim = fim_ids(tokenizer)
    if fim is None:
        raise ApiError(
            400,
            f"suffix (fill-in-the-middle) needs a tokenizer with {', '.join(FIM_TOKENS)}; this model's has not "
            "all of them: drop suffix or serve a code model that has them (Qwen2.5-Coder)",
            param="suffix",
        )
    prefix_id, suffix_id, middle_id = fim
    suffix = tokenizer(request.suffix, add_special_tokens=False)["input_ids"]
    out = []
    for p in prompts:
        prefix = p if isinstance(p, list) else tokenizer(p, add_special_tokens=False)["input_ids"]
        out.append([prefix_id, *prefix, suffix_id, *suffix, middle_id])
    return out


def budget(prompt_ids: list[list[int]], asked: int | None, context: int, default: int | None) -> int:
    """New tokens each prompt may take: ``asked``, else ``default``, else what the context leaves; a 400 where the
    longest prompt and that budget do not fit the context."""
    longest = max(len(p) for p in prompt_ids)
    if longest >= context:
        raise ApiError(
            400,
            f"the prompt has {longest} tokens; this model's context holds {context}, completion included",
            param="messages" if default is None else "prompt",
            code="context_length_exceeded",
        )
    room = context - longest
    if asked is None:
        return min(default, room) if default is not None else room
    if asked > room:
        raise ApiError(
            400,
            f"max_tokens {asked} and the prompt's {longest} tokens exceed this model's context of {context} tokens; "
            f"ask for at most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked
