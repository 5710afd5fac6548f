"""Model plumbing: one forward adapter, pair compatibility checks, and loading.

Everything that differs between ``transformers`` architectures or versions is
absorbed here, so the decoding loop sees one ``forward`` and one vocabulary size.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.heads.files import head_kind

log = logging.getLogger(__name__)

# Vocabularies may differ by embedding padding (rows rounded up for hardware), not by more.
MAX_VOCAB_PADDING = 1024


@functools.cache
def cache_kwarg(model_class: type) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; ask the class which it takes."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | dict[str, torch.Tensor],
    position_ids: torch.Tensor,
    cache: Any,
    logits_to_keep: int = 0,
    output_hidden_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Run ``model`` on new tokens (B, k) with its cache; returns logits (B, k', V) in float32.

    ``attention_mask`` is the 2-D mask of cached and new columns, or what ``tree_attention``
    made (a 4-D mask, or one per layer type), which transformers uses as it is.

    Inputs are moved to the model's device; ``logits_to_keep=1`` computes the head for
    the last position only (prefill and the draft need no more). With
    ``output_hidden_states`` the result is (logits, hidden states).
    """
    device = model.device
    kwargs = {
        "input_ids": input_ids.to(device),
        "attention_mask": (
            {k: m.to(device) for k, m in attention_mask.items()}
            if isinstance(attention_mask, dict)
            else attention_mask.to(device)
        ),
        "position_ids": position_ids.to(device),
        cache_kwarg(type(model)): cache,
        "use_cache": True,
    }
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    if output_hidden_states:
        out = model(**kwargs, output_hidden_states=True)
        return out.logits.float(), out.hidden_states
    out = model(**kwargs)
    return out.logits.float()


def sliding_window(model: PreTrainedModel) -> int | None:
    """The reach of ``model``'s sliding-window layers, or None when every layer attends fully."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if (
        not window
        or (types is not None and "sliding_attention" not in types)
        or getattr(config, "use_sliding_window", True) is False
    ):
        return None
    return int(window)


def takes_mask_mapping(model: PreTrainedModel) -> bool:
    """True when the model's forward accepts one prepared mask per layer type (a dict), as Gemma-2 and
    Qwen2 do: a single prepared 4-D mask would reach sliding-window layers unwindowed."""
    base = getattr(model, model.base_model_prefix, model)
    try:
        return "causal_mask_mapping := attention_mask, dict" in inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False


def window_in_columns(model: PreTrainedModel) -> bool:
    """True when ``model`` has sliding-window layers and takes no mask per layer type (Mistral): transformers
    then counts the window in cache columns, so neither a masked hole nor a tree can be read exactly."""
    return sliding_window(model) is not None and not takes_mask_mapping(model)


def check_tree_attention(model: PreTrainedModel, role: str) -> None:
    """Refuse a model that cannot read a tree in one forward (a prepared 4-D mask and explicit positions)."""
    if window_in_columns(model):
        raise HfspecError(
            f"the {role} ({type(model).__name__}) has sliding-window layers and takes no mask per "
            "layer type, so a draft tree cannot be verified exactly; use tree=None (a chain)"
        )


def tree_attention(
    model: PreTrainedModel, full: torch.Tensor, sliding: torch.Tensor | None = None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """What ``forward`` takes as the attention mask for new columns that attend to what ``full`` (B, k, L)
    allows (``sliding``: the same within the sliding window): additive float masks (B, 1, k, L)."""
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32

    def bias(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )[:, None]

    if sliding is None:
        return bias(full)
    return {"full_attention": bias(full), "sliding_attention": bias(sliding)}


def decoder_layers(model: PreTrainedModel) -> Any:
    """The list of decoder layers (``model.model.layers`` for most architectures), or None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


class _Enough(Exception):
    """Raised once the highest requested layer input is captured: the layers above it are not needed."""


@contextlib.contextmanager
def _layer_inputs(blocks: Any, layers: tuple[int, ...], stop: bool) -> Iterator[dict[int, torch.Tensor]]:
    """Capture the input of ``blocks[i]`` for i in ``layers`` with pre-hooks, removed on exit.

    With ``stop`` the forward ends right after the highest one is captured.
    """
    captured: dict[int, torch.Tensor] = {}
    last = max(layers)

    def hook(_module, args, kwargs, i: int) -> None:
        captured[i] = args[0] if args else kwargs["hidden_states"]
        if stop and i == last:
            raise _Enough

    handles = [blocks[i].register_forward_pre_hook(functools.partial(hook, i=i), with_kwargs=True) for i in set(layers)]
    try:
        yield captured
    except _Enough:
        pass
    finally:
        for h in handles:
            h.remove()


def _has_layers(blocks: Any, layers: tuple[int, ...]) -> bool:
    return blocks is not None and all(0 <= i < len(blocks) for i in layers)


def forward_features(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
    layers: tuple[int, ...],
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward`` that also returns transformers' ``hidden_states[i]`` for i in ``layers``, concatenated.

    ``hidden_states[i]`` is the input of decoder layer i; it is read with pre-hooks on
    those layers, so no other hidden state is kept. Returns (logits, (B, k, F)).
    """
    blocks = decoder_layers(model)
    if not _has_layers(blocks, layers):  # unusual layout: ask transformers for every hidden state
        logits, hidden = forward(
            model, input_ids, attention_mask, position_ids, cache, logits_to_keep, output_hidden_states=True
        )
        return logits, torch.cat([hidden[i] for i in layers], dim=-1)
    with _layer_inputs(blocks, layers, stop=False) as captured:
        logits = forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep)
    return logits, torch.cat([captured[i] for i in layers], dim=-1)


@torch.inference_mode()
def hidden_features(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...]
) -> torch.Tensor:
    """transformers' ``hidden_states[i]`` for i in ``layers``, concatenated (B, T, F), from one forward without cache.

    The decoder runs up to the highest requested layer only: the layers above it and
    the LM head are skipped.
    """
    blocks = decoder_layers(model)
    if not _has_layers(blocks, layers):
        hidden = model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True
        ).hidden_states
        return torch.cat([hidden[i] for i in layers], dim=-1)
    with _layer_inputs(blocks, layers, stop=True) as captured:
        model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return torch.cat([captured[i] for i in layers], dim=-1)


def check_causal_lm(model: Any, role: str) -> None:
    """Raise a clear error unless ``model`` is a decoder-only ``PreTrainedModel`` with an LM head."""
    if not isinstance(model, PreTrainedModel):
        raise HfspecTypeError(
            f"the {role} must be a transformers PreTrainedModel (got {type(model).__name__}); "
            "load it with AutoModelForCausalLM.from_pretrained(...)"
        )
    if (
        getattr(model.config, "is_encoder_decoder", False)
        or not hasattr(model, "get_output_embeddings")
        or model.get_output_embeddings() is None
    ):
        raise HfspecTypeError(
            f"the {role} ({type(model).__name__}) is not a causal language model; "
            "use a decoder-only model loaded with AutoModelForCausalLM"
        )


def model_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output layer: the width of the logits the model returns."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def shared_vocab_size(
    target: PreTrainedModel,
    draft_vocab: int | None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> int:
    """The token ids both sides can score: ``[0, n)``.

    ``draft_vocab`` is the draft's logit width (None for a drafter without a vocabulary).
    Padded embeddings (extra rows no tokenizer id maps to) are cut off, so neither side
    can ever produce an id outside the tokenizer.
    """
    v_target = model_vocab_size(target)
    v_draft = v_target if draft_vocab is None else draft_vocab
    if tokenizer is not None:
        n = len(tokenizer)
        if min(v_target, v_draft) < n:
            short = "target" if v_target < n else "draft"
            raise HfspecError(
                f"the {short} has {min(v_target, v_draft)} output rows but the tokenizer has {n} tokens; "
                "the two models do not share this tokenizer, choose a draft trained with the target's tokenizer "
                "or pass the draft's own tokenizer as draft_tokenizer="
            )
        return n
    if abs(v_target - v_draft) > MAX_VOCAB_PADDING:
        raise HfspecError(
            f"target vocabulary ({v_target}) and draft vocabulary ({v_draft}) differ by more than padding; "
            "choose a draft that uses the target's tokenizer, or pass the target's tokenizer and the draft's own "
            "as SpeculativeGenerator(target, draft, tokenizer, draft_tokenizer=...)"
        )
    return min(v_target, v_draft)


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when both tokenizers map every token string to the same id."""
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()


def _refuse_draft_head(path: Path, role: str) -> None:
    """A draft head's directory is not a causal LM: loaded as one, it would run with random weights."""
    kind = head_kind(path)
    if kind == "eagle3":
        raise HfspecError(
            f"{role} directory {str(path)!r} holds an EAGLE-3 draft head, not a causal LM; "
            "pass it as the draft of the target it was trained for"
        )
    if kind is not None:
        raise HfspecError(
            f"{role} directory {str(path)!r} holds a speculators {kind!r} head, which hfspec does "
            'not run; EAGLE-3 heads (speculators_model_type "eagle3") are supported'
        )


def load_model(
    name_or_path: str | Path,
    role: str,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM by hub name or local path with a clear error for the usual mistakes."""
    from transformers import AutoModelForCausalLM

    path = Path(str(name_or_path)).expanduser()
    looks_local = path.exists() or str(name_or_path).startswith((".", "/", "~"))
    if looks_local and not path.exists():
        raise HfspecError(
            f"{role} path {str(name_or_path)!r} does not exist; pass a model directory, a .gguf file or a hub name"
        )
    if path.is_dir() and not (path / "config.json").exists() and not kwargs.get("gguf_file"):
        raise HfspecError(
            f"{role} directory {str(path)!r} holds no model (no config.json, and not a single .gguf file); pass a "
            "model directory (written by save_pretrained()), a .gguf file or a hub name, or the GGUF file's name as "
            "gguf_file="
        )
    _refuse_draft_head(path, role)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path) if looks_local else str(name_or_path), output_loading_info=True, **kwargs
        )
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise HfspecError(
                f"{role} {str(name_or_path)!r} is not a causal language model; "
                "choose a decoder-only model (AutoModelForCausalLM)"
            ) from None
        raise HfspecError(f"could not load the {role} {str(name_or_path)!r}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise HfspecError(f"could not load the {role} {str(name_or_path)!r}: {str(exc).splitlines()[0]}") from None
    check_causal_lm(model, role)
    _refuse_new_weights(model, info, name_or_path, role)
    return model.eval()


def _new_weights(info: dict[str, Any]) -> list[str]:
    """The weights ``from_pretrained`` initialised anew, from its loading report (``output_loading_info=True``).

    Missing from the checkpoint, or there in another shape; a weight tied to a loaded one
    (a tied ``lm_head``) is not among them, as transformers drops it once tied.
    """
    mismatched = {entry[0] for entry in info.get("mismatched_keys", ())}
    return sorted(set(info.get("missing_keys", ())) | mismatched)


def _refuse_new_weights(model: PreTrainedModel, info: dict[str, Any], name_or_path: str | Path, role: str) -> None:
    """Refuse a model that runs on random weights: its drafts or verdicts would be noise, with no error."""
    keys = _new_weights(info)
    if not keys:
        return
    shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    saved = (getattr(model.config, "architectures", None) or [None])[0]
    if saved and saved != type(model).__name__:
        why = (
            f"this checkpoint has no language-model head: it was saved as {saved}, not as a causal LM "
            f"({type(model).__name__}); pass a causal LM (a checkpoint of AutoModelForCausalLM)"
        )
    else:
        why = (
            "the checkpoint is incomplete (saved without these weights); pass a complete causal-LM checkpoint, "
            "saved with save_pretrained() from the whole model"
        )
    raise HfspecError(
        f"the {role} {str(name_or_path)!r} lacks {len(keys)} weight(s) that transformers would "
        f"initialise at random ({shown}); {why}"
    )
