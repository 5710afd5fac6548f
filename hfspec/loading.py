"""Loading a target/draft pair and its tokenizer, turning a draft into a drafter, and reading pair presets.

A *preset* is one JSON file naming a target, a draft and the settings that suit
them (γ, dtype, chat, sampling defaults). Presets ship in ``hfspec/configs/``
and are found by name; any other JSON file works by path.

Four model names are special: ``"offline"`` as the target is SmolLM2-135M-Instruct,
built without a model hub (``hfspec.assets.offline_target_path``);
``"shipped"`` as the draft is the draft model committed with the package for it
(``hfspec.assets.shipped_draft_path``) and ``"shipped-eagle3"`` the EAGLE-3 head
(``hfspec.assets.shipped_head_path``); ``"ngram"`` as the draft is model-free
lookup (``hfspec.drafters.ngram``), with no model to load.

``make_drafter`` turns whatever a user passes as the draft (a drafter, a loaded
model, an EAGLE-3 head, a path or one of those names) into a drafter. It lives here,
above every drafter and beside the loaders it needs for a path, so that
``hfspec.drafters`` stays the interface and imports no drafter.

The models loaded here run hfspec's CPU kernel (``hfspec.fast.accelerate_loaded``: on CPU with
fp32 or bf16 weights) unless ``fast_kernels=False``; a model a caller built and passed in is
never changed (``make_drafter`` loads a draft path as it is). A GGUF target or draft
(``gguf_file``, ``draft_gguf_file``) on CPU keeps its quantized blocks (``hfspec.gguf_native``)
unless ``gguf_native=False`` or ``fast_kernels=False``, which dequantize it as transformers does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hfspec import assets, gguf_meta, gguf_native, head_cut
from hfspec.cpu import draft_linear, fast
from hfspec.drafters import Drafter
from hfspec.drafters.cross_tokenizer import CrossTokenizerDrafter
from hfspec.drafters.eagle3 import Eagle3Drafter
from hfspec.drafters.hybrid import HybridDrafter, with_ngram
from hfspec.drafters.model import ModelDrafter
from hfspec.drafters.ngram import NgramDrafter
from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.heads.checkpoint import load_head
from hfspec.heads.eagle3 import Eagle3Head
from hfspec.heads.files import is_eagle3_dir
from hfspec.models import check_causal_lm, load_model, same_tokenizer
from hfspec.presets import DTYPES, Preset, load_preset, preset_names  # presets are read where pairs load

__all__ = [
    "DRAFT_BITS",
    "Preset",
    "draft_module",
    "drafts_in_integer",
    "load_draft",
    "load_pair",
    "load_preset",
    "make_drafter",
    "parse_dtype",
    "preset_names",
    "resolve_model",
]

log = logging.getLogger(__name__)

OFFLINE_TARGET = "offline"
SHIPPED_DRAFT = "shipped"
SHIPPED_HEAD = "shipped-eagle3"
NGRAM = "ngram"  # the draft name of model-free lookup
DRAFT_BITS = 4  # a draft model's weights in integer arithmetic on CPU, by default (hfspec.cpu.draft_linear)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# -- dtypes and devices ---------------------------------------------------------------------------


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | str:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` → ``torch.bfloat16``; ``"auto"`` stays ``"auto"``."""
    if value is None:
        return "auto"
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise HfspecError(f"unknown dtype {value!r}; use one of {', '.join(DTYPES)}")


def _check_device(device: str | torch.device | None, role: str) -> torch.device | None:
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


def _input_device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


# -- model names ----------------------------------------------------------------------------------


def resolve_model(name: str | Path, role: str) -> str:
    """Turn the special names ``offline`` (target), ``shipped`` and ``shipped-eagle3`` (draft), and the names of
    models fetched from registry wheels (``assets.WHEEL_MODELS``, either role) into local paths."""
    name = str(name)
    if Path(name).expanduser().exists():
        return name
    if role == "target" and name == OFFLINE_TARGET:
        return str(assets.offline_target_path())
    if name in assets.WHEEL_MODELS:
        return str(assets.wheel_model_dir(name))
    if role == "draft" and name in (SHIPPED_DRAFT, SHIPPED_HEAD):
        what = "draft" if name == SHIPPED_DRAFT else "EAGLE-3 head"
        path = Path(assets.shipped_draft_path() if name == SHIPPED_DRAFT else assets.shipped_head_path())
        if not (path / "config.json").is_file():
            raise HfspecError(
                f"the shipped {what} is not part of this installation (expected it at {path}); "
                "pass a draft model with --draft PATH"
            )
        return str(path)
    return name


# -- the pair -------------------------------------------------------------------------------------


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
) -> tuple[PreTrainedModel, PreTrainedModel | Drafter, PreTrainedTokenizerBase]:
    """Load ``(target, draft, tokenizer)`` by hub name or local path; the draft may be a ``Drafter``.

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
    many of its lowest token ids and its special tokens (``hfspec.head_cut``: q is 0 for the others, which keeps
    the output exact); None (the default) keeps the whole head. ``draft_bits`` (4, the default, or 8) runs a draft
    model that sits on CPU with fast kernels on in integer arithmetic (``hfspec.cpu.draft_linear``: weights of that
    many bits, int8 activations): its step streams fewer bytes and computes cheaply, while the output stays
    exact, since q is whatever the draft computes; None keeps its own weights and arithmetic.
    """
    _check_fast_kernels(fast_kernels)
    _check_bool("gguf_native", gguf_native, "False dequantizes GGUF weights as transformers does")
    _check_draft_vocab(draft_vocab)
    _check_draft_bits(draft_bits)
    if device is not None and device_map is not None:
        raise HfspecError("pass device or device_map, not both (device_map='auto' places the target itself)")
    target_dev = _check_device(device, "target")
    draft_dev = _check_device(draft_device, "draft") or target_dev
    draft_path = resolve_model(draft, "draft")  # first: it is cheap, the offline target may need a download
    target_path = resolve_model(target, "target")

    common = {"trust_remote_code": trust_remote_code}
    target_kwargs: dict[str, Any] = {"dtype": parse_dtype(dtype), **common}
    if revision is not None:
        target_kwargs["revision"] = revision
    if device_map is not None:
        target_kwargs["device_map"] = device_map
    native = gguf_native and fast_kernels and device_map is None
    gguf_file = gguf_file or lone_gguf(target_path)
    draft_gguf_file = draft_gguf_file or lone_gguf(draft_path)
    target_gguf = gguf_file
    if (
        gguf_file is None
        and str(target) == OFFLINE_TARGET
        and Path(target_path) == assets.offline_target_dir()
        and native
        and _on_cpu(target_dev)
    ):
        target_gguf = assets.offline_target_gguf().name  # the offline target's own GGUF, kept beside its copy
    target_model = _load_lm(target_path, "target", target_gguf, native=native and _on_cpu(target_dev), **target_kwargs)
    if target_dev is not None:
        target_model.to(target_dev)

    draft_dev = draft_dev if draft_dev is not None else _input_device(target_model)
    draft_model = _load_draft(
        draft_path,
        target_model,
        dtype=parse_dtype(draft_dtype if draft_dtype is not None else dtype),
        device=draft_dev,
        gguf_file=draft_gguf_file,
        gguf_native=native and _on_cpu(draft_dev),
        **common,
    )

    tok = _target_tokenizer(
        tokenizer, target, target_path, revision, _tokenizer_gguf(target_path, gguf_file), trust_remote_code
    )
    if isinstance(draft_model, PreTrainedModel):
        draft_tok = _draft_tokenizer(draft, draft_path, trust_remote_code, _tokenizer_gguf(draft_path, draft_gguf_file))
        _cut_draft_head(draft_model, draft_tok or tok, draft_vocab)
        if draft_tok is not None and not same_tokenizer(tok, draft_tok):
            draft_model = _cross_tokenizer_drafter(draft_model, draft_tok, tok, target, draft)
    if fast_kernels:
        _accelerate(target_model, "target")
        _accelerate_draft(draft_model, draft_bits)
    log.info("loaded target %s (%s, %s) and draft %s", target, target_model.dtype, _input_device(target_model), draft)
    return target_model, draft_model, tok


def _check_draft_vocab(value: Any) -> None:
    if not (value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)):
        raise HfspecError(f"draft_vocab must be a number of tokens >= 1 or None (the whole head), got {value!r}")


def _cut_draft_head(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, draft_vocab: int | None) -> None:
    """Cut ``model``'s head to ``draft_vocab`` of its lowest ids, its special tokens and those of ``tokenizer``
    (``hfspec.head_cut``)."""
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


def _check_draft_bits(value: Any) -> None:
    if value is not None and value not in draft_linear.BITS:
        raise HfspecError(f"draft_bits must be 4, 8 or None (the draft's own weights), got {value!r}")


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


def _accelerate_draft(draft: PreTrainedModel | Drafter | None, bits: int | None) -> None:
    """Run the draft on hfspec's CPU kernels, its linears in integer arithmetic where it runs so
    (``hfspec.cpu.draft_linear``; their block shapes are then not timed); log what happened."""
    integer = drafts_in_integer(draft, bits)
    _accelerate(draft_module(draft), "draft", plan=not integer)
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


def _check_fast_kernels(value: Any) -> None:
    _check_bool("fast_kernels", value, "False keeps torch's own linears")


def _check_bool(name: str, value: Any, meaning: str) -> None:
    if not isinstance(value, bool):
        raise HfspecError(f"{name} must be True or False ({meaning}), got {value!r}")


_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")


def lone_gguf(path: str) -> str | None:
    """The GGUF file of a local directory that holds one and no other weights (a model fetched by name, a user's
    folder with a single GGUF, the offline target beside its config and tokenizer): it is the model, so it needs no
    ``gguf_file=``. None otherwise."""
    local = Path(path).expanduser()
    if not local.is_dir() or any(next(local.glob(pattern), None) for pattern in _WEIGHTS):
        return None
    found = sorted(local.glob("*.gguf"))
    return found[0].name if len(found) == 1 else None


def _tokenizer_gguf(path: str, gguf_file: str | None) -> str | None:
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


def _on_cpu(device: torch.device | None) -> bool:
    return device is None or device.type == "cpu"


def _load_lm(path: str, role: str, gguf_file: str | None, *, native: bool, **kwargs: Any) -> PreTrainedModel:
    """A causal LM by path or hub name; a GGUF one with its blocks kept where ``native`` and hfspec can
    (``hfspec.gguf_native``), else dequantized by transformers."""
    if gguf_file is not None and native:
        model = gguf_native.load(
            path,
            gguf_file,
            role,
            dtype=kwargs.get("dtype", "auto"),
            revision=kwargs.get("revision"),
            trust_remote_code=kwargs.get("trust_remote_code", False),
        )
        if model is not None:
            check_causal_lm(model, role)
            return model
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return load_model(path, role, **kwargs)


def _accelerate(model: torch.nn.Module | None, role: str, plan: bool = True) -> None:
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


def draft_module(draft: PreTrainedModel | Drafter | None) -> torch.nn.Module | None:
    """The module a draft runs: the model itself, a drafter's model, an EAGLE-3 head; None for lookup."""
    if isinstance(draft, HybridDrafter):
        return draft_module(draft.main)
    if isinstance(draft, Eagle3Drafter):
        return draft.head
    if isinstance(draft, Drafter):
        return draft.model
    return draft


def _load_draft(
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
    if is_eagle3_dir(draft_path):
        head = load_head(draft_path, dtype=target_model.dtype if dtype == "auto" else dtype, device=device)
        return Eagle3Drafter(head, target_model)
    model = _load_lm(
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
    """Load the draft named ``draft`` (hub name, path, ``"shipped"``, ``"shipped-eagle3"``, a model fetched by name)
    for an already loaded target.

    It goes to ``device``, else to the device of the target's embeddings; ``fast_kernels``, ``gguf_file``
    (the draft's), ``gguf_native``, ``draft_vocab`` and ``draft_bits`` as in ``load_pair``.
    """
    _check_fast_kernels(fast_kernels)
    _check_bool("gguf_native", gguf_native, "False dequantizes GGUF weights as transformers does")
    _check_draft_vocab(draft_vocab)
    _check_draft_bits(draft_bits)
    dev = _check_device(device, "draft") or _input_device(target_model)
    path = resolve_model(draft, "draft")
    gguf_file = gguf_file or lone_gguf(path)
    loaded = _load_draft(
        path,
        target_model,
        dtype=parse_dtype(dtype),
        device=dev,
        trust_remote_code=trust_remote_code,
        gguf_file=gguf_file,
        gguf_native=gguf_native and fast_kernels and _on_cpu(dev),
    )
    if isinstance(loaded, PreTrainedModel):
        _cut_draft_head(
            loaded, _draft_tokenizer(draft, path, trust_remote_code, _tokenizer_gguf(path, gguf_file)), draft_vocab
        )
    if fast_kernels:
        _accelerate_draft(loaded, draft_bits)
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


def _target_tokenizer(
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
            return _tokenizer(source, kwargs)
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


def _tokenizer(source: str, kwargs: dict[str, Any]) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(source, **kwargs)``; one converted from a local GGUF file is kept
    (``hfspec.gguf_meta``): converting a large vocabulary takes seconds at every load."""
    gguf = kwargs.get("gguf_file")
    local = gguf_native.local_file(source, gguf) if gguf else None
    if local is None:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    return gguf_meta.tokenizer(
        local, lambda: AutoTokenizer.from_pretrained(source, **kwargs), kwargs.get("trust_remote_code", False)
    )


def _draft_tokenizer(
    draft: Any, draft_path: str, trust_remote_code: bool, gguf_file: str | None = None
) -> PreTrainedTokenizerBase | None:
    """The draft's own tokenizer (from its GGUF file, if it has one), or None where it ships none (it then uses
    the target's)."""
    local = Path(draft_path).expanduser()
    if local.is_dir() and gguf_file is None and not any((local / f).is_file() for f in _TOKENIZER_FILES):
        return None  # a bare draft directory: it can only be used with the target's tokenizer
    kwargs = {"trust_remote_code": trust_remote_code} | ({} if gguf_file is None else {"gguf_file": gguf_file})
    try:
        return _tokenizer(draft_path, kwargs)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # KeyError: a GGUF without a tokenizer
        log.debug("draft %s: no tokenizer to compare (%s)", draft, exc)
        return None


def _cross_tokenizer_drafter(
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
