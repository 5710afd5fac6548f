"""Loading one model and its tokenizer: dtypes and devices, a causal LM's weights, hfspec's CPU kernels on them.

A GGUF model (a ``.gguf`` path, or ``gguf_file``) on CPU keeps its quantized blocks (``hfspec.models.gguf_native``)
where the caller asks for it (``native``), else transformers dequantizes it. ``accelerate`` puts a loaded model on
hfspec's CPU kernel (``hfspec.fast.accelerate_loaded``) and logs what it did. A GGUF model's tokenizer is read from
its directory's own tokenizer files when it has them, else converted from the file once and kept
(``hfspec.models.gguf_meta``). The checks of the loading options live here too, so that every loader says the same.
``hfspec.drafters.loading`` puts these together into a pair; ``hfspec.drafters.factory`` turns a draft into a drafter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hfspec.cpu import draft_linear, fast, int8
from hfspec.cpu.int8 import ARITHMETICS
from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.models import gguf_meta, gguf_native, head_cut
from hfspec.models.adapter import check_causal_lm, load_model
from hfspec.models.presets import DTYPES

log = logging.getLogger(__name__)

ARITHMETIC = None  # what a GGUF target kept in blocks computes by default: see default_arithmetic
DRAFT_BITS = 4  # a draft model's weights in integer arithmetic on CPU, by default (hfspec.cpu.draft_linear)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# -- dtypes, devices and the loading options -------------------------------------------------------


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | str:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` → ``torch.bfloat16``; ``"auto"`` stays ``"auto"``."""
    if value is None:
        return "auto"
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        name = DTYPES[value.lower()]
        return name if name == "auto" else getattr(torch, name)
    raise HfspecError(f"unknown dtype {value!r}; use one of {', '.join(DTYPES)}")


def check_device(device: str | torch.device | None, role: str) -> torch.device | None:
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise HfspecError(f"invalid {role} device {device!r}; use cpu, cuda, cuda:1 or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HfspecError(f"{role} device {device!r} asked for CUDA but torch sees no CUDA GPU; use --device cpu")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise HfspecError(f"{role} device {device!r} asked for MPS but it is not available; use --device cpu")
    return dev


def input_device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


def check_fast_kernels(value: Any) -> None:
    check_bool("fast_kernels", value, "False keeps torch's own linears")


def check_bool(name: str, value: Any, meaning: str) -> None:
    if not isinstance(value, bool):
        raise HfspecError(f"{name} must be True or False ({meaning}), got {value!r}")


def check_draft_vocab(value: Any) -> None:
    if not (value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)):
        raise HfspecError(f"draft_vocab must be a number of tokens >= 1 or None (the whole head), got {value!r}")


def check_draft_bits(value: Any) -> None:
    if value is not None and value not in draft_linear.BITS:
        raise HfspecError(f"draft_bits must be 4, 8 or None (the draft's own weights), got {value!r}")


def default_arithmetic() -> str:
    """``"int8"`` (llama.cpp's integer arithmetic) where hfspec's int8 kernel runs on this machine, else
    ``"float32"``: without the kernel, int8 would be computed by its torch reference, exact but many times slower."""
    return "int8" if int8.kernel() is not None else "float32"


def check_arithmetic(value: Any) -> None:
    if value is not None and value not in ARITHMETICS:
        raise HfspecError(
            f"arithmetic must be 'int8' (llama.cpp's integer arithmetic on a GGUF target's blocks) or 'float32' "
            f"(the dequantized model's), or None (int8 where hfspec's int8 kernel runs), got {value!r}"
        )


def on_cpu(device: torch.device | None) -> bool:
    return device is None or device.type == "cpu"


# -- models -----------------------------------------------------------------------------------------


def load_lm(
    path: str, role: str, gguf_file: str | None, *, native: bool, arithmetic: str | None = None, **kwargs: Any
) -> PreTrainedModel:
    """A causal LM by path or hub name; a GGUF one with its blocks kept where ``native`` and hfspec can
    (``hfspec.models.gguf_native``, its quantized linears in ``arithmetic``, None: :func:`default_arithmetic`), else
    dequantized by transformers."""
    if gguf_file is not None and native:
        model = gguf_native.load(
            path,
            gguf_file,
            role,
            dtype=kwargs.get("dtype", "auto"),
            revision=kwargs.get("revision"),
            trust_remote_code=kwargs.get("trust_remote_code", False),
            arithmetic=default_arithmetic() if arithmetic is None else arithmetic,
        )
        if model is not None:
            check_causal_lm(model, role)
            return model
    if arithmetic not in (None, "float32"):
        log.info("%s: %s arithmetic applies to GGUF blocks kept on CPU; this %s has none", role, arithmetic, role)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return load_model(path, role, **kwargs)


def accelerate(model: torch.nn.Module | None, role: str, plan: bool = True) -> None:
    """Run ``model`` on hfspec's CPU kernel where it pays (``hfspec.fast.accelerate_loaded``; ``plan=False``: its
    linears are about to be replaced, no need to time block shapes on them); log what happened."""
    if model is None:
        return
    report = fast.accelerate_loaded(model, plan=plan)
    if report.quantized:
        log.info(
            "%s: %d quantized and %d other linear layers on the %s kernel",
            role,
            report.quantized,
            len(report.layers),
            report.isa,
        )
    elif report.layers:
        log.info("%s: %d linear layers on the %s kernel", role, len(report.layers), report.isa)
    else:
        log.info("%s: fast kernels %s", role, report.reason)


def cut_draft_head(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, draft_vocab: int | None) -> None:
    """Cut ``model``'s head to ``draft_vocab`` of its lowest ids, its special tokens and those of ``tokenizer``
    (``hfspec.models.head_cut``)."""
    head = model.get_output_embeddings()
    if draft_vocab is None or head is None:
        return
    vocab = head.weight.shape[0]
    if draft_vocab >= vocab:
        return
    special = [] if tokenizer is None else [*tokenizer.added_tokens_decoder, *tokenizer.all_special_ids]
    config = model.generation_config
    for token in (config.eos_token_id, config.bos_token_id, config.pad_token_id):
        special += token if isinstance(token, list) else [] if token is None else [token]
    always = [i for i in special if 0 <= i < vocab]
    report = head_cut.cut_head(model, head_cut.first_ids(vocab, draft_vocab, always))
    log.info(
        "draft: LM head cut to %d of its %d tokens (the rest are never drafted; %.0f MB less read per step)",
        report.kept,
        report.vocab,
        report.bytes_saved / 1e6,
    )


# -- tokenizers -------------------------------------------------------------------------------------


def tokenizer_gguf(path: str, gguf_file: str | None) -> str | None:
    """Where the tokenizer of a GGUF model comes from: the directory's own tokenizer files when it has them (saved
    once, read in a second), else the GGUF file (converted at every load)."""
    local = Path(path).expanduser()
    if (
        gguf_file is not None
        and local.is_dir()
        and (local / "tokenizer_config.json").is_file()
        and (local / "tokenizer.json").is_file()
    ):
        return None
    return gguf_file


def target_tokenizer(
    tokenizer: Any, target: Any, target_path: str, revision: str | None, gguf_file: str | None, trust_remote_code: bool
) -> PreTrainedTokenizerBase:
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        raise HfspecTypeError(f"tokenizer must be a transformers tokenizer or a path, got {type(tokenizer).__name__}")
    source = str(tokenizer) if tokenizer is not None else target_path
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if tokenizer is None:
        if revision is not None:
            kwargs["revision"] = revision
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
    try:
        try:
            return load_tokenizer(source, kwargs)
        except KeyError:  # a GGUF file without a tokenizer: the directory's own tokenizer files, if any
            if "gguf_file" not in kwargs:
                raise
            kwargs.pop("gguf_file")
            return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        where = f"tokenizer {source!r}" if tokenizer is not None else f"the target {str(target)!r}'s tokenizer"
        raise HfspecError(
            f"could not load {where}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; "
            "pass tokenizer= (a path or a loaded tokenizer)"
        ) from None


def load_tokenizer(source: str, kwargs: dict[str, Any]) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(source, **kwargs)``; one converted from a local GGUF file is kept
    (``hfspec.models.gguf_meta``): converting a large vocabulary takes seconds at every load."""
    gguf = kwargs.get("gguf_file")
    local = gguf_native.local_file(source, gguf) if gguf else None
    if local is None:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    return gguf_meta.tokenizer(
        local, lambda: AutoTokenizer.from_pretrained(source, **kwargs), kwargs.get("trust_remote_code", False)
    )


def draft_tokenizer(
    draft: Any, draft_path: str, trust_remote_code: bool, gguf_file: str | None = None
) -> PreTrainedTokenizerBase | None:
    """The draft's own tokenizer (from its GGUF file, if it has one), or None where it ships none (it then uses
    the target's)."""
    local = Path(draft_path).expanduser()
    if local.is_dir() and gguf_file is None and not any((local / f).is_file() for f in _TOKENIZER_FILES):
        return None  # a bare draft directory: it can only be used with the target's tokenizer
    kwargs = {"trust_remote_code": trust_remote_code} | ({} if gguf_file is None else {"gguf_file": gguf_file})
    try:
        return load_tokenizer(draft_path, kwargs)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # KeyError: a GGUF without a tokenizer
        log.debug("draft %s: no tokenizer to compare (%s)", draft, exc)
        return None
