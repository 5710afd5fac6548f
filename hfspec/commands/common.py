"""What the commands share: exit statuses, flag values checked as they are parsed, and the flags that load a pair.

``hfspec generate`` and ``hfspec serve`` take the same model flags (``add_model_flags``) and hand them to
``hfspec.api.load`` as ``load_kwargs(args)``. Light on purpose: it imports neither torch nor transformers, so that
the parser answers at once.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from hfspec.models.presets import DTYPES, preset_names

__all__ = [
    "EXIT_BUG",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "add_model_flags",
    "draft_vocab_value",
    "load_kwargs",
    "number",
    "quiet_transformers",
    "threads_value",
]

EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


# -- flag values, checked as they are parsed -----------------------------------------------------


def number(kind: type, check, rule: str):
    """The parser of a flag's value: a ``kind`` (int or float) that passes ``check``; ``rule`` says what it must
    be, in the error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'} {rule}, got {text!r}"
            ) from None
        if (kind is float and math.isnan(value)) or not check(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    return parse


threads_value = number(int, lambda v: v >= 1, ">= 1")


def draft_vocab_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 1, got {text!r}")
    return value


# -- the flags that load a pair ---------------------------------------------------------------------


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose and load the pair (``hfspec generate``, ``hfspec serve``); ``load_kwargs`` reads them."""
    pair = p.add_argument_group("models (--target and --draft together, or --config)")
    pair.add_argument("--target", help="target model: hub name, local directory, .gguf file, or 'offline'")
    pair.add_argument(
        "--draft",
        help="draft model: hub name, local directory, .gguf file "
        "(a causal LM, with the target's tokenizer or its own, or an EAGLE-3 head), 'shipped' (the draft model shipped for the offline target), "
        "'shipped-eagle3' (the EAGLE-3 head shipped for it), or 'ngram' to draft without a model, by lookup in the prompt, the text so far "
        "and earlier outputs (a directory named ngram is ./ngram)",
    )
    pair.add_argument(
        "--config",
        metavar="NAME|PATH",
        help=f"a pair preset: a shipped name ({', '.join(preset_names())}) or a JSON file",
    )
    pair.add_argument(
        "--ngram",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add n-gram lookup to the draft model: each step, per prompt, the lookup's proposal "
        "where it is expected to get more tokens accepted, the model's otherwise; no draft forward "
        "when every prompt takes the lookup (default: the preset's, else off)",
    )
    pair.add_argument(
        "--device",
        metavar="DEVICE",
        help="where to run: cpu, cuda, cuda:1, mps, or 'auto' to spread the target "
        "over the available devices (default: cpu)",
    )
    pair.add_argument(
        "-t",
        "--threads",
        type=threads_value,
        metavar="N",
        help="CPU threads to load and generate with, >= 1, as llama.cpp's -t (default: torch's, usually one per "
        "core; more than the CPUs is allowed, with a warning)",
    )
    pair.add_argument(
        "--dtype",
        type=str.lower,
        choices=list(DTYPES),
        metavar="DTYPE",
        help="weight dtype of both models: auto (as saved), float32, float16 or bfloat16 "
        "(default: the preset's, else auto)",
    )
    pair.add_argument(
        "--fast-kernels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run both models on hfspec's CPU linear kernel where they sit on CPU in float32 or "
        "bfloat16 (default: on; --no-fast-kernels keeps torch's own linears)",
    )
    pair.add_argument(
        "--gguf-file",
        metavar="FILE",
        help="the target's GGUF file, inside --target's directory or repository (default: the preset's; "
        "--target may name the .gguf file itself)",
    )
    pair.add_argument(
        "--draft-gguf-file",
        metavar="FILE",
        help="the draft's GGUF file, inside --draft's directory or repository (default: the preset's; "
        "--draft may name the .gguf file itself)",
    )
    pair.add_argument(
        "--gguf-native",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on CPU, keep GGUF models' quantized blocks and run hfspec's quantized kernel, exactly as "
        "the float32 dequantized model (default: on; --no-gguf-native dequantizes as transformers does)",
    )
    pair.add_argument(
        "--draft-vocab",
        type=draft_vocab_value,
        default=None,
        metavar="N",
        help="cut the draft model's LM head to its N lowest token ids and its special tokens: a "
        "smaller step for a large vocabulary, fewer tokens drafted (the others are never drafted; "
        "the output stays exact). Default: the whole head",
    )
    pair.add_argument(
        "--draft-bits",
        choices=("4", "8", "off"),
        default=None,
        help="on CPU, run the draft model in integer arithmetic with weights of 4 (default) or 8 bits "
        "and int8 activations: a cheaper drafting step, exact output all the same (q is whatever the "
        "draft computes); 'off' keeps the draft's own weights and arithmetic",
    )
    pair.add_argument(
        "--arithmetic",
        choices=("int8", "float32"),
        default=None,
        help="what a GGUF target kept in blocks on CPU computes: 'int8' (default where hfspec's int8 kernel "
        "builds), llama.cpp's integer arithmetic, faster, speculation exact to that model; or 'float32', "
        "the dequantized model's, token for token as transformers loads the file",
    )


def load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``hfspec.api.load`` that the flags of ``add_model_flags`` set."""
    kwargs: dict[str, Any] = {}
    if args.dtype is not None:
        kwargs["dtype"] = args.dtype
    if args.fast_kernels is not None:
        kwargs["fast_kernels"] = args.fast_kernels
    for name in ("gguf_file", "draft_gguf_file", "gguf_native"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "draft_vocab", None) is not None:
        kwargs["draft_vocab"] = args.draft_vocab
    if getattr(args, "draft_bits", None) is not None:
        kwargs["draft_bits"] = None if args.draft_bits == "off" else int(args.draft_bits)
    if getattr(args, "arithmetic", None) is not None:
        kwargs["arithmetic"] = args.arithmetic
    if args.device == "auto":
        kwargs["device_map"] = "auto"
    elif args.device is not None:
        kwargs["device"] = args.device
    return kwargs


def quiet_transformers(verbose: bool) -> None:
    """transformers' progress bars and info logs off unless --verbose. It acts where transformers is imported
    already: a command imports it when it needs it and calls this then."""
    if verbose or "transformers" not in sys.modules:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
