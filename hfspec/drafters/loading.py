"""Loading a target/draft pair and its tokenizer: ``load_pair``, above every drafter (``hfspec.drafters.factory``).

A *preset* is one JSON file naming a target, a draft and the settings that suit
them (γ, dtype, chat, sampling defaults). Presets ship in ``hfspec/data/presets/``
and are found by name (``hfspec.models.presets``); any other JSON file works by path.

A model is named by a local directory, a GGUF file, a hub name or one of four special names (``"offline"``,
``"shipped"``, ``"shipped-eagle3"``, ``"ngram"``): ``hfspec.models.sources.locate`` resolves each, in one place.
``hfspec.models.weights`` loads one model and its tokenizer; ``hfspec.drafters.factory`` turns whatever a user passes as
the draft (a drafter, a loaded model, an EAGLE-3 head, a path or one of those names) into a drafter
(``make_drafter``, ``load_draft``).

The models loaded here run hfspec's CPU kernel (``hfspec.fast.accelerate_loaded``: on CPU with
fp32 or bf16 weights) unless ``fast_kernels=False``; a model a caller built and passed in is
never changed (``make_drafter`` loads a draft path as it is). A GGUF target or draft
(a ``.gguf`` path, or ``gguf_file``/``draft_gguf_file``) on CPU keeps its quantized blocks
(``hfspec.models.gguf_native``) unless ``gguf_native=False`` or ``fast_kernels=False``, which dequantize it as
transformers does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hfspec.drafters import Drafter
from hfspec.drafters.factory import (
    accelerate_draft,
    cross_tokenizer_drafter,
    load_draft_path,
)
from hfspec.errors import HfspecError
from hfspec.models import assets
from hfspec.models.adapter import same_tokenizer
from hfspec.models.sources import OFFLINE_TARGET, locate
from hfspec.models.weights import (
    ARITHMETIC,
    DRAFT_BITS,
    accelerate,
    check_arithmetic,
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
    target_tokenizer,
    tokenizer_gguf,
)

__all__ = ["load_pair"]

log = logging.getLogger(__name__)


def load_pair(
    target: str | Path,
    draft: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    device_map: str | dict | None = None,
    draft_device: str | torch.device | None = None,
    draft_dtype: str | torch.dtype | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
    draft_gguf_file: str | None = None,
    gguf_native: bool = True,
    tokenizer: PreTrainedTokenizerBase | str | Path | None = None,
    fast_kernels: bool = True,
    draft_vocab: int | None = None,
    draft_bits: int | None = DRAFT_BITS,
    arithmetic: str | None = ARITHMETIC,
) -> tuple[PreTrainedModel, PreTrainedModel | Drafter, PreTrainedTokenizerBase]:
    """Load ``(target, draft, tokenizer)`` by hub name, local directory or GGUF file (``hfspec.models.sources.locate``);
    the draft may be a ``Drafter``.

    ``dtype`` applies to both models unless ``draft_dtype`` is given. ``device_map``
    (e.g. ``"auto"``) spreads the target with accelerate; the draft then goes to
    ``draft_device``, else ``device``, else the device of the target's embeddings.
    ``revision`` and ``gguf_file`` apply to the target and its tokenizer,
    ``draft_gguf_file`` to the draft and its tokenizer. On CPU a GGUF model keeps
    its quantized blocks and runs hfspec's quantized kernel (``gguf_native``, default
    on: the file's size in memory, every output as the float32 dequantized model's
    on the kernel); ``gguf_native=False`` dequantizes it to ``dtype`` as transformers
    does. The tokenizer is the target's unless ``tokenizer`` (an object or a path) is given.
    A draft model that ships a tokenizer other than that one comes back as a
    ``CrossTokenizerDrafter``, which drafts the tokens both tokenizers share.
    ``fast_kernels`` (default on) makes the target and the draft (model or EAGLE-3
    head) run hfspec's CPU kernel where they sit on CPU in fp32 or bf16
    (``hfspec.fast``); ``False`` keeps torch's own linears. ``draft_vocab`` cuts a draft model's LM head to that
    many of its lowest token ids and its special tokens (``hfspec.models.head_cut``: q is 0 for the others, which keeps
    the output exact); None (the default) keeps the whole head. ``draft_bits`` (4, the default, or 8) runs a draft
    model that sits on CPU with fast kernels on in integer arithmetic (``hfspec.cpu.draft_linear``: weights of that
    many bits, int8 activations): its step streams fewer bytes and computes cheaply, while the output stays
    exact, since q is whatever the draft computes; None keeps its own weights and arithmetic. ``arithmetic`` is what
    a target kept in GGUF blocks computes: ``"int8"``, llama.cpp's integer arithmetic on the blocks
    (``hfspec.cpu.int8``), every row computed alike, so speculation stays exact to that model; ``"float32"``, the
    dequantized model's products, token for token as transformers loads the file. None (the default) is ``"int8"``
    where hfspec's int8 kernel runs on this machine, else ``"float32"``. A target without blocks ignores it.
    """
    check_fast_kernels(fast_kernels)
    check_bool("gguf_native", gguf_native, "False dequantizes GGUF weights as transformers does")
    check_draft_vocab(draft_vocab)
    check_draft_bits(draft_bits)
    check_arithmetic(arithmetic)
    if device is not None and device_map is not None:
        raise HfspecError("pass device or device_map, not both (device_map='auto' places the target itself)")
    target_dev = check_device(device, "target")
    draft_dev = check_device(draft_device, "draft") or target_dev
    # The draft first: it is cheap, the offline target may need a download.
    draft_source = locate(draft, "draft", draft_gguf_file)
    target_source = locate(target, "target", gguf_file)
    draft_path, draft_gguf_file = draft_source.path, draft_source.gguf_file
    target_path, gguf_file = target_source.path, target_source.gguf_file

    common = {"trust_remote_code": trust_remote_code}
    target_kwargs: dict[str, Any] = {"dtype": parse_dtype(dtype), **common}
    if revision is not None:
        target_kwargs["revision"] = revision
    if device_map is not None:
        target_kwargs["device_map"] = device_map
    native = gguf_native and fast_kernels and device_map is None
    target_gguf = gguf_file
    if (
        gguf_file is None
        and str(target) == OFFLINE_TARGET
        and Path(target_path) == assets.offline_target_dir()
        and native
        and on_cpu(target_dev)
    ):
        target_gguf = assets.offline_target_gguf().name  # the offline target's own GGUF, kept beside its copy
    target_model = load_lm(
        target_path,
        "target",
        target_gguf,
        native=native and on_cpu(target_dev),
        arithmetic=arithmetic,
        **target_kwargs,
    )
    if target_dev is not None:
        target_model.to(target_dev)

    draft_dev = draft_dev if draft_dev is not None else input_device(target_model)
    draft_model = load_draft_path(
        draft_path,
        target_model,
        dtype=parse_dtype(draft_dtype if draft_dtype is not None else dtype),
        device=draft_dev,
        gguf_file=draft_gguf_file,
        gguf_native=native and on_cpu(draft_dev),
        **common,
    )

    tok = target_tokenizer(
        tokenizer, target, target_path, revision, tokenizer_gguf(target_path, gguf_file), trust_remote_code
    )
    if isinstance(draft_model, PreTrainedModel):
        draft_tok = draft_tokenizer(draft, draft_path, trust_remote_code, tokenizer_gguf(draft_path, draft_gguf_file))
        cut_draft_head(draft_model, draft_tok or tok, draft_vocab)
        if draft_tok is not None and not same_tokenizer(tok, draft_tok):
            draft_model = cross_tokenizer_drafter(draft_model, draft_tok, tok, target, draft)
    if fast_kernels:
        accelerate(target_model, "target")
        accelerate_draft(draft_model, draft_bits)
    log.info("loaded target %s (%s, %s) and draft %s", target, target_model.dtype, input_device(target_model), draft)
    return target_model, draft_model, tok
