"""The drafter factory: whatever a user passes as the draft, turned into a ``Drafter``.

``make_drafter`` takes a drafter, a loaded model, an EAGLE-3 head, a path or one of the special names
(``"ngram"``, ``"shipped"``, ...); ``load_draft`` loads a draft by name for a loaded target. A draft model runs as a
``ModelDrafter``, an EAGLE-3 head as an ``Eagle3Drafter``, ``"ngram"`` as an ``NgramDrafter``, a draft with
another tokenizer as a ``CrossTokenizerDrafter``; ``ngram=True`` adds lookup (``HybridDrafter``). It sits above
every drafter and beside the loaders it needs for a path (``hfspec.models.weights``), so that ``hfspec.drafters`` stays
the interface and imports no drafter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hfspec.cpu import draft_linear
from hfspec.drafters import Drafter
from hfspec.drafters.cross_tokenizer import CrossTokenizerDrafter
from hfspec.drafters.eagle3 import Eagle3Drafter
from hfspec.drafters.hybrid import with_ngram
from hfspec.drafters.model import ModelDrafter
from hfspec.drafters.ngram import NgramDrafter
from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.heads.checkpoint import load_head
from hfspec.heads.eagle3 import Eagle3Head
from hfspec.heads.files import is_eagle3_dir
from hfspec.models.sources import NGRAM, locate, resolve_model
from hfspec.models.weights import (
    DRAFT_BITS,
    accelerate,
    check_bool,
    check_device,
    check_draft_bits,
    check_draft_vocab,
    check_fast_kernels,
    cut_draft_head,
    draft_tokenizer,
    input_device,
    load_lm,
    on_cpu,
    parse_dtype,
    tokenizer_gguf,
)

log = logging.getLogger(__name__)


def draft_module(draft: PreTrainedModel | Drafter | None) -> torch.nn.Module | None:
    """The module a draft runs: the model itself, a drafter's model, an EAGLE-3 head; None for lookup."""
    if isinstance(draft, Drafter):
        return draft.module
    return draft


def drafts_in_integer(draft: PreTrainedModel | Drafter | None, bits: int | None) -> bool:
    """Whether ``draft`` is put in integer arithmetic of ``bits`` (None: never) when it is loaded: a draft model (not
    an EAGLE-3 head: it is small, and reads the target's features) on CPU, where the draft kernel runs."""
    model = draft_module(draft)
    return (
        bits is not None
        and model is not None
        and not isinstance(model, Eagle3Head)
        and all(p.is_cpu for p in model.parameters())
        and draft_linear.kernel() is not None
    )


def accelerate_draft(draft: PreTrainedModel | Drafter | None, bits: int | None) -> None:
    """Run the draft on hfspec's CPU kernels, its linears in integer arithmetic where it runs so
    (``hfspec.cpu.draft_linear``; their block shapes are then not timed); log what happened."""
    integer = drafts_in_integer(draft, bits)
    accelerate(draft_module(draft), "draft", plan=not integer)
    if not integer:
        return
    report = draft_linear.quantize_for_drafting(draft_module(draft), bits)
    if report.layers:
        log.info(
            "draft: %d linear layers in %d-bit integer arithmetic on the %s kernel (%.0f MB read per step, was %.0f)",
            len(report.layers),
            bits,
            report.isa,
            report.bytes_after / 1e6,
            report.bytes_before / 1e6,
        )
    elif report.reason:
        log.info("draft: integer arithmetic off (%s)", report.reason)


def load_draft_path(
    draft_path: str,
    target_model: PreTrainedModel,
    *,
    dtype: torch.dtype | str,
    device: torch.device,
    trust_remote_code: bool,
    gguf_file: str | None = None,
    gguf_native: bool = True,
) -> PreTrainedModel | Drafter:
    """The draft named by ``draft_path``, on ``device``: a causal LM, or another kind of drafter.

    An EAGLE-3 head's directory (either layout, recognised by its contents) becomes an
    ``Eagle3Drafter`` for ``target_model``, in the target's dtype unless ``dtype`` says
    otherwise; it never goes through ``AutoModelForCausalLM``. ``"ngram"`` is model-free
    lookup (a directory of that name is ``./ngram``). ``gguf_file`` names the draft's GGUF file
    (its blocks kept where ``gguf_native``).
    """
    if draft_path == NGRAM:
        if gguf_file is not None:
            raise HfspecError("draft_gguf_file names a GGUF file of a draft model; the 'ngram' draft has none")
        return NgramDrafter()
    if gguf_file is None and is_eagle3_dir(draft_path):
        head = load_head(draft_path, dtype=target_model.dtype if dtype == "auto" else dtype, device=device)
        return Eagle3Drafter(head, target_model)
    model = load_lm(
        draft_path, "draft", gguf_file, native=gguf_native, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return model.to(device)


def load_draft(
    draft: str | Path,
    target_model: PreTrainedModel,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    fast_kernels: bool = True,
    gguf_file: str | None = None,
    gguf_native: bool = True,
    draft_vocab: int | None = None,
    draft_bits: int | None = DRAFT_BITS,
) -> PreTrainedModel | Drafter:
    """Load the draft named ``draft`` (hub name, directory, GGUF file, ``"shipped"``, ``"shipped-eagle3"``, a model
    fetched by name) for an already loaded target.

    It goes to ``device``, else to the device of the target's embeddings; ``fast_kernels``, ``gguf_file``
    (the draft's), ``gguf_native``, ``draft_vocab`` and ``draft_bits`` as in ``load_pair``.
    """
    check_fast_kernels(fast_kernels)
    check_bool("gguf_native", gguf_native, "False dequantizes GGUF weights as transformers does")
    check_draft_vocab(draft_vocab)
    check_draft_bits(draft_bits)
    dev = check_device(device, "draft") or input_device(target_model)
    source = locate(draft, "draft", gguf_file)
    path, gguf_file = source.path, source.gguf_file
    loaded = load_draft_path(
        path,
        target_model,
        dtype=parse_dtype(dtype),
        device=dev,
        trust_remote_code=trust_remote_code,
        gguf_file=gguf_file,
        gguf_native=gguf_native and fast_kernels and on_cpu(dev),
    )
    if isinstance(loaded, PreTrainedModel):
        cut_draft_head(
            loaded, draft_tokenizer(draft, path, trust_remote_code, tokenizer_gguf(path, gguf_file)), draft_vocab
        )
    if fast_kernels:
        accelerate_draft(loaded, draft_bits)
    return loaded


def make_drafter(
    draft: Any,
    tokenizer: PreTrainedTokenizerBase | None = None,
    target: PreTrainedModel | None = None,
    *,
    ngram: bool = False,
) -> Drafter:
    """A drafter from what a user passes as the draft, for ``target``.

    A ``Drafter``; a loaded causal LM; an ``Eagle3Head``; ``"ngram"`` (model-free lookup
    in the context and earlier outputs, ``hfspec.drafters.ngram``); or a path that
    ``load_draft`` recognises (an EAGLE-3 head's directory, any causal LM).
    ``ngram=True`` adds n-gram lookup to any other drafter (``hfspec.drafters.hybrid``).
    """
    if isinstance(draft, Eagle3Drafter) and target is not None and draft.target is not target:
        raise HfspecError(
            "this EAGLE-3 drafter was built for another target model; build it with the target "
            "you generate with, or pass the head's directory as the draft"
        )
    if isinstance(draft, Drafter):
        drafter = draft
    elif isinstance(draft, PreTrainedModel):
        drafter = ModelDrafter(draft)
    elif isinstance(draft, str) and draft == NGRAM:
        drafter = NgramDrafter()
    elif isinstance(draft, (Eagle3Head, str, Path)):
        if target is None:
            raise HfspecTypeError(
                "an EAGLE-3 head or a draft path needs the target model: make_drafter(draft, tokenizer, target)"
            )
        if isinstance(draft, Eagle3Head):
            drafter = Eagle3Drafter(draft, target)
        else:
            if not Path(resolve_model(draft, "draft")).expanduser().exists():  # "shipped" names resolve to paths
                raise HfspecTypeError(
                    f"the draft {str(draft)!r} is neither 'ngram' nor an existing directory; pass 'ngram', a local "
                    "path or a loaded model, or load a hub model with SpeculativeGenerator.from_pretrained(target, "
                    "draft)"
                )
            # Loaded as it is: a generator built from the caller's objects changes no model behind their back.
            return make_drafter(load_draft(draft, target, fast_kernels=False), tokenizer, target, ngram=ngram)
    else:
        raise HfspecTypeError(
            f"the draft must be a transformers PreTrainedModel, an hfspec Drafter, 'ngram' or a path (got "
            f"{type(draft).__name__}); load models with AutoModelForCausalLM.from_pretrained(...) or use "
            "SpeculativeGenerator.from_pretrained"
        )
    return with_ngram(drafter) if ngram else drafter


def cross_tokenizer_drafter(
    model: PreTrainedModel, draft_tok: PreTrainedTokenizerBase, tok: PreTrainedTokenizerBase, target: Any, draft: Any
) -> Drafter:
    """A draft whose tokenizer differs from the target's drafts the tokens both share (lossless)."""
    try:
        drafter = CrossTokenizerDrafter(model, draft_tok, tok)
    except HfspecError as exc:
        raise HfspecError(
            f"the draft {str(draft)!r} and the target {str(target)!r} use different tokenizers: {exc}"
        ) from None
    log.info(
        "draft %s and target %s use different tokenizers: drafting the %d tokens they share",
        draft,
        target,
        drafter.map.shared,
    )
    return drafter
