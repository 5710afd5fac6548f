"""The ``hfspec`` command line: ``generate``, plus ``distill`` and ``bench`` when installed.

Every user error (``hfspec.errors``: a bad flag, file, setting or setup) ends as one line ``hfspec: error: ...``
on stderr and exit status 2; anything else is a bug in hfspec (or below it) and shows its traceback, a line asking
for a report, and exit status 1. Ctrl-C ends with status 130 after printing what was already generated.

The parser is built from light modules only: torch and transformers are imported by the command that runs a
model, so ``--help`` and a bad flag answer at once. An optional command's module is imported only when that
command is the one run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import sys
import traceback
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from hfspec import __version__, cache_command
from hfspec.errors import HfspecError, NumericalFault
from hfspec.presets import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRESET, DTYPES, Preset, preset_names

if TYPE_CHECKING:
    from hfspec import api
    from hfspec.policy import GammaPolicy

log = logging.getLogger(__name__)

EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# Errors a user can fix: hfspec's own, which its checks raise at every boundary (a model that gives NaN, memory
# that runs out included; torch's CUDA out-of-memory too, see _user_errors). Anything else is a bug and keeps its
# traceback: a ValueError from deep inside is no bad flag.
USER_ERRORS = (HfspecError, NumericalFault, MemoryError)
# Commands whose modules may be absent from an installation: command name -> module.
OPTIONAL_COMMANDS = {"distill": "hfspec.training", "bench": "hfspec.bench", "serve": "hfspec.serve.command"}
# Their line in 'hfspec --help', which lists them without importing their modules.
OPTIONAL_HELP = {
    "distill": "train a small draft model or an EAGLE-3 head for a target model",
    "bench": "measure hfspec against generate() and transformers assisted generation",
    "serve": "serve a pair over HTTP with OpenAI's API (chat, completions, streaming, metrics, a page)",
}
DEFAULT_BATCH_SIZE = 8


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage plus message."""

    def error(self, message: str) -> NoReturn:
        _error(f"{message} (see '{self.prog} --help')")
        raise SystemExit(EXIT_USAGE)


def _error(message: str) -> None:
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    sys.stderr.write(f"hfspec: error: {lines[0] if lines else 'unknown error'}\n")


# -- flag values, checked as they are parsed -----------------------------------------------------


def _number(kind: type, check, rule: str):
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


_gamma_number = _number(int, lambda v: v >= 1, ">= 1 or 'auto'")


def gamma_value(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _gamma_number(text)


_tree_number = _number(int, lambda v: v >= 0, ">= 0 or 'auto'")


def tree_value(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _tree_number(text)


batch_value = _number(int, lambda v: v >= 1, ">= 1")
threads_value = _number(int, lambda v: v >= 1, ">= 1")
count_value = _number(int, lambda v: v >= 0, ">= 0")
temperature_value = _number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0 (0 means greedy)")
top_p_value = _number(float, lambda v: 0 < v <= 1, "in (0, 1]")
penalty_value = _number(float, lambda v: 0 < v < math.inf, "a number > 0 (1 disables it)")
cost_value = _number(float, lambda v: 0 < v < math.inf, "a number > 0")


# -- the parser ---------------------------------------------------------------------------------


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. The optional commands get their own flags only where ``command`` names them
    (their modules import torch); the others are listed by name and help line."""
    parser = _Parser(
        prog="hfspec",
        description="Lossless speculative decoding for Hugging Face causal language models: a small draft "
        "model proposes tokens, the target model verifies them in one pass, and the output is distributed "
        "exactly as the target's own sampling (greedy output is the target's own generate(), token for token, on "
        "hfspec's CPU kernels).",
        epilog="Run 'hfspec COMMAND --help' for the flags of a command.",
    )
    parser.add_argument("--version", action="version", version=f"hfspec {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log progress to stderr and show full tracebacks on errors"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_generate(sub)
    cache_command.add_parser(sub)
    for name in OPTIONAL_COMMANDS:
        if name == command:
            _add_optional(sub, name)
        elif find_spec(OPTIONAL_COMMANDS[name]) is not None:
            _add_listed(sub, name)
    return parser


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Continue PROMPT (or each prompt of --prompts-file) with a target model, a draft model "
        "proposing γ tokens per step. "
        f"With no --target/--draft/--config the offline default pair ({DEFAULT_PRESET}: "
        "SmolLM2-135M-Instruct and the EAGLE-3 head shipped with hfspec) is used; its target is built "
        "once from PyPI without a model hub.",
    )
    p.add_argument(
        "prompt",
        metavar="PROMPT",
        nargs="?",
        help="the prompt text, or '-' to read it from stdin (or --prompts-file for many prompts)",
    )
    add_model_flags(p)
    _add_generate_flags(p)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose and load the pair (``hfspec generate``, ``hfspec serve``); ``_load_kwargs`` reads them."""
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
        type=_draft_vocab,
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
        help="what a GGUF target kept in blocks on CPU computes: 'int8', llama.cpp's integer arithmetic "
        "(faster; speculation stays exact to that model), or 'float32' (default), the dequantized model's",
    )


def _add_generate_flags(p: argparse.ArgumentParser) -> None:
    spec = p.add_argument_group("speculation")
    spec.add_argument(
        "--gamma",
        type=gamma_value,
        metavar="N|auto",
        help="γ: draft tokens per verification step, >= 1, "
        "or 'auto' to choose γ from 0 (plain decoding) upwards at every step from costs measured on "
        "this machine and the acceptance seen so far "
        "(default: the preset's, which is auto for every shipped preset; with --adaptive heuristic "
        "the starting value)",
    )
    spec.add_argument(
        "--adaptive",
        choices=["heuristic", "cost"],
        help="choose γ as decoding goes: 'heuristic' grows γ after fully accepted steps and "
        "shrinks it otherwise; 'cost' picks the γ with the best predicted speedup from the "
        "running acceptance rate and --draft-cost",
    )
    spec.add_argument(
        "--ngram",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add n-gram lookup to the draft model: each step, per prompt, the lookup's proposal "
        "where it is expected to get more tokens accepted, the model's otherwise; no draft forward "
        "when every prompt takes the lookup (default: the preset's, else off)",
    )
    spec.add_argument(
        "--tree",
        type=tree_value,
        metavar="N|auto",
        default="auto",
        help="draft a tree of N nodes per step (several candidates per depth), verified in one target "
        "forward; 0 a chain; 'auto' lets --gamma auto choose each step between the chain and trees "
        "where they pay (attention-only targets; default: auto)",
    )
    spec.add_argument(
        "--draft-cost",
        type=cost_value,
        metavar="C",
        help="with --adaptive cost: time of one draft step / one target step (default: estimated "
        "from the parameter counts)",
    )

    sampling = p.add_argument_group("sampling (greedy unless --do-sample, or a preset that samples)")
    sampling.add_argument(
        "--max-new-tokens",
        type=count_value,
        default=DEFAULT_MAX_NEW_TOKENS,
        metavar="N",
        help=f"most new tokens to generate, >= 0 (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    sampling.add_argument(
        "--do-sample",
        action="store_true",
        default=None,
        help="sample instead of greedy decoding (still exactly the target's distribution)",
    )
    sampling.add_argument(
        "--temperature", type=temperature_value, metavar="T", help="sampling temperature, >= 0; 0 means greedy"
    )
    sampling.add_argument(
        "--top-k", type=count_value, metavar="K", help="keep the k most likely tokens, >= 0 (0 disables)"
    )
    sampling.add_argument("--top-p", type=top_p_value, metavar="P", help="nucleus sampling mass, in (0, 1]")
    sampling.add_argument(
        "--repetition-penalty", type=penalty_value, metavar="R", help="penalty for repeated tokens, > 0 (1 disables it)"
    )
    sampling.add_argument(
        "--seed",
        type=count_value,
        metavar="S",
        help="random seed, >= 0: the same seed and settings give "
        "the same text (with --prompts-file, batch k is seeded with S + k)",
    )

    prompt = p.add_argument_group("prompt format")
    prompt.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap PROMPT as a user turn in the tokenizer's chat template "
        "(default: the preset's; on for the default pair)",
    )
    prompt.add_argument("--system", metavar="TEXT", help="system message for the chat template (needs chat on)")

    many = p.add_argument_group("many prompts (instead of PROMPT)")
    many.add_argument(
        "--prompts-file",
        metavar="PATH",
        help="read the prompts from PATH ('-' for stdin): one prompt per line (blank lines skipped), "
        'or JSONL with a "prompt" string and an optional "id" on every line (the id defaults '
        "to the line number); results come out in input order",
    )
    many.add_argument(
        "--batch-size",
        type=batch_value,
        metavar="N",
        help=f"with --prompts-file: prompts decoded together, >= 1 (default {DEFAULT_BATCH_SIZE}); "
        "greedy text does not depend on it",
    )

    out = p.add_argument_group("output")
    out.add_argument("--stream", action="store_true", help="print the text as tokens are committed (one PROMPT only)")
    out.add_argument(
        "--stats",
        action="store_true",
        help="print acceptance rate, mean accepted length and tokens/s to stderr (totals over all "
        "prompts with --prompts-file)",
    )
    out.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, tokens, stats and settings; with --prompts-file, one JSON "
        "line per prompt: id, prompt, text, tokens (the count), stop_reason, accepted, "
        "target_passes, mean_accepted_length",
    )
    p.set_defaults(func=run_generate)


def _add_optional(sub, name: str) -> None:
    """Register ``hfspec NAME`` from its module in :data:`OPTIONAL_COMMANDS` if it is there and imports."""
    try:
        module = importlib.import_module(OPTIONAL_COMMANDS[name])
    except ModuleNotFoundError as exc:
        if exc.name == OPTIONAL_COMMANDS[name]:
            return  # not part of this installation
        reason = f"it needs the missing package {exc.name!r}; install it with pip"
        _add_unavailable(sub, name, reason)
        return
    except Exception as exc:  # a broken optional command must not take the others down
        _add_unavailable(sub, name, f"{type(exc).__name__}: {exc}")
        return
    module.add_parser(sub)
    sub.choices[name].set_defaults(func=module.run)


def _add_listed(sub, name: str) -> None:
    """List ``hfspec NAME`` without importing its module; main builds the parser again with it when it runs."""
    p = sub.add_parser(name, help=OPTIONAL_HELP[name], add_help=False)
    p.set_defaults(accepts_extra=True)


def _add_unavailable(sub, name: str, reason: str) -> None:
    p = sub.add_parser(name, help=f"(unavailable: {reason})", add_help=False)
    p.set_defaults(accepts_extra=True)  # whatever flags follow, the answer is the same

    def unavailable(args: argparse.Namespace) -> int:
        raise HfspecError(f"'hfspec {name}' is unavailable: {reason}")

    p.set_defaults(func=unavailable)


# -- generate -------------------------------------------------------------------------------------


def _streamer(tokenizer: Any) -> Any:
    """A TextStreamer that writes to the current stdout and remembers whether a line is open."""
    from transformers import TextStreamer  # here, not at the top: the parser answers without transformers

    class Streamer(TextStreamer):
        def __init__(self, tokenizer: Any):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.line_open = False
            self.ended = False

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            sys.stdout.write(text + ("\n" if stream_end else ""))
            sys.stdout.flush()
            if text:
                self.line_open = True
            if stream_end:
                self.line_open, self.ended = False, True

        def close_line(self) -> None:
            """After an interruption: flush what is decoded and end the line."""
            if not self.ended:
                self.end()
            elif self.line_open:
                sys.stdout.write("\n")
                sys.stdout.flush()

    return Streamer(tokenizer)


def _check_combination(args: argparse.Namespace) -> None:
    if args.config is not None and (args.target is not None or args.draft is not None):
        raise HfspecError("use --config or --target/--draft, not both")
    if (args.target is None) != (args.draft is None):
        missing = "--draft" if args.draft is None else "--target"
        raise HfspecError(
            f"{missing} is missing: give --target and --draft together "
            "(or --config NAME, or neither for the default pair)"
        )
    if args.stream and args.json:
        raise HfspecError("--stream and --json both write to stdout; pick one")
    if args.draft_cost is not None and args.adaptive != "cost":
        raise HfspecError("--draft-cost only applies with --adaptive cost")
    if args.prompts_file is not None:
        if args.prompt is not None:
            raise HfspecError("give PROMPT or --prompts-file, not both")
        if args.stream:
            raise HfspecError("--stream needs a single PROMPT; drop it with --prompts-file")
    elif args.prompt is None:
        raise HfspecError("no prompt: give PROMPT ('-' reads stdin) or --prompts-file PATH")
    elif args.batch_size is not None:
        raise HfspecError("--batch-size only applies with --prompts-file")


def _read_prompt(text: str) -> str:
    if text != "-":
        return text
    prompt = sys.stdin.read()
    return prompt[:-1] if prompt.endswith("\n") else prompt


def _json_object(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _read_prompts_file(path: str) -> list[tuple[Any, str]]:
    """(id, prompt) pairs: one prompt per line, or JSONL with a "prompt" (and optional "id") per line."""
    name = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise HfspecError(f"prompts file '{path}' does not exist") from None
    except OSError as exc:
        raise HfspecError(f"cannot read prompts file '{path}': {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise HfspecError(f"prompts file '{path}' is not UTF-8 text") from None
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise HfspecError(f"prompts file '{name}' has no prompts (every line is blank)")
    objects = [_json_object(line) for _, line in lines]
    if all(obj is None for obj in objects):
        return lines
    first = next(n for (n, _), obj in zip(lines, objects) if obj is not None)
    items = []
    for (n, _), obj in zip(lines, objects):
        if obj is None:
            raise HfspecError(
                f"{name}:{n}: not a JSON object, but line {first} is; a JSONL prompts file needs "
                '{"prompt": "..."} on every line'
            )
        if not isinstance(obj.get("prompt"), str):
            raise HfspecError(
                f'{name}:{n}: this JSON object has no "prompt" string; a JSONL prompts file needs '
                '{"prompt": "..."} on every line'
            )
        items.append((obj.get("id", n), obj["prompt"]))
    return items


def _draft_vocab(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 1, got {text!r}")
    return value


def _load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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


def _policy(args: argparse.Namespace, preset: Preset, gen) -> int | GammaPolicy | None:
    from hfspec.policy import CostModelGamma, HeuristicGamma  # here, not at the top: hfspec.policy imports torch

    if args.adaptive is None:
        return args.gamma
    if args.gamma == "auto":
        raise HfspecError("--adaptive chooses γ itself; give it a number (--gamma N) as the start, or drop --adaptive")
    start = args.gamma if args.gamma is not None else preset.gamma if isinstance(preset.gamma, int) else 4
    if args.adaptive == "heuristic":
        return HeuristicGamma(value=start)
    cost = args.draft_cost
    if cost is None:
        # Decoding is memory-bound, so parameter counts are a fair first guess at the step cost ratio;
        # lookup without a draft model costs next to nothing.
        parameters = gen.drafter.parameters
        if parameters is None:
            raise HfspecError(f"cannot estimate the cost of a {gen.drafter.kind} drafter; pass --draft-cost")
        cost = parameters / gen.target.num_parameters()
    return CostModelGamma(cost=cost, maximum=max(8, start))


def _quantized(kernel: dict[str, Any]) -> str:
    held = kernel.get("quantized")
    if not held:
        return ""
    formats = " ".join(f"{n} {name}" for name, n in held["formats"].items())
    return f"; GGUF blocks kept: {formats}, {held['bytes'] / 2**20:.0f} MiB"


def _stats_line(stats, gen) -> str:
    histogram = " ".join(f"{g}:{n}" for g, n in enumerate(stats.gamma_histogram) if n)
    kernels = ", ".join(
        f"{role} {k['isa']} ({k['layers']} layers{_quantized(k)})" if k["on"] else f"{role} {k['reason']}"
        for role, k in gen.describe()["fast_kernels"].items()
    )
    trees = ""
    if stats.tree_nodes:
        depths = " ".join(f"{d}:{n}" for d, n in enumerate(stats.depth_histogram) if n)
        trees = f" | {stats.tree_nodes} tree nodes verified, steps by accepted depth {depths}"
    return (
        f"hfspec: acceptance rate {stats.acceptance_rate:.1%} | mean accepted length "
        f"{stats.mean_accepted_length:.2f} tokens/pass | γ per step {stats.mean_gamma:.2f} "
        f"(steps by γ {histogram or '-'}) | {stats.tokens_per_second:.1f} tokens/s | "
        f"{stats.committed} tokens in {stats.time_total:.2f} s{trees} | fast kernels: {kernels}"
    )


def _complete(
    args: argparse.Namespace,
    preset: Preset,
    gen,
    prompts: list[str],
    *,
    gamma: int | GammaPolicy | None,
    seed: int | None,
    streamer: Any = None,
) -> api.Completion:
    from hfspec import api  # here, not at the top: the models' libraries load only for a command that runs them
    from hfspec.config import settings

    sampling = settings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
    )
    return api.complete(
        gen,
        prompts,
        preset=preset,
        generation_config=sampling,
        gamma=gamma,
        seed=seed,
        chat=args.chat,
        system=args.system,
        streamer=streamer,
        tree=args.tree,
        threads=args.threads,
    )


def run_generate(args: argparse.Namespace) -> int:
    _check_combination(args)
    items = _read_prompts_file(args.prompts_file) if args.prompts_file is not None else None
    prompt = _read_prompt(args.prompt) if items is None else None
    from hfspec import api  # here, not at the top: torch and transformers load once the flags are known good

    _quiet_transformers(args.verbose)
    preset = api.resolve_preset(args.target, args.draft, args.config, args.ngram)
    if args.do_sample is None and not preset.do_sample and (args.temperature or args.top_k or args.top_p):
        log.warning("--temperature/--top-k/--top-p only apply when sampling; decoding greedily (add --do-sample)")
    gen = api.load(preset, threads=args.threads, **_load_kwargs(args))
    if items is not None:
        return _generate_many(args, preset, gen, items)
    streamer = _streamer(gen.tokenizer) if args.stream else None
    try:
        result = _complete(
            args, preset, gen, [prompt], gamma=_policy(args, preset, gen), seed=args.seed, streamer=streamer
        )
    except KeyboardInterrupt:
        if streamer is not None:
            streamer.close_line()
        sys.stderr.write("hfspec: interrupted\n")
        return EXIT_INTERRUPTED
    if args.json:
        settings = {
            **result.settings,
            "device": args.device,
            "dtype": args.dtype or preset.dtype,
            "adaptive": args.adaptive,
        }
        print(
            json.dumps(
                {
                    "text": result.texts[0],
                    "tokens": list(result.tokens[0]),
                    "stats": result.stats.to_dict(),
                    "settings": settings,
                }
            )
        )
    elif not args.stream:
        print(result.texts[0])
    if args.stats:
        sys.stderr.write(_stats_line(result.stats, gen) + "\n")
    return 0


def _generate_many(args: argparse.Namespace, preset: Preset, gen, items: list[tuple[Any, str]]) -> int:
    """Decode ``items`` in batches; each batch's results are printed, in input order, as soon as it ends."""
    from tqdm.auto import tqdm  # here, not at the top: a tenth of a second that --help need not wait

    from hfspec.stats import Stats  # (imports torch)

    size = args.batch_size or DEFAULT_BATCH_SIZE
    batches = [items[i : i + size] for i in range(0, len(items), size)]
    policy = _policy(args, preset, gen)  # shared, so an adaptive γ keeps what it learned
    parts: list[Stats] = []
    # tqdm decides on None: a bar on an interactive stderr, none when stderr is redirected.
    with tqdm(total=len(batches), desc="batches", unit="batch", disable=True if len(batches) < 2 else None) as bar:
        for k, batch in enumerate(batches):
            seed = None if args.seed is None else args.seed + k
            result = _complete(args, preset, gen, [prompt for _, prompt in batch], gamma=policy, seed=seed)
            parts.append(result.stats)
            for (key, prompt), text, row in zip(batch, result.texts, result.stats.rows):
                if args.json:
                    line = json.dumps(
                        {
                            "id": key,
                            "prompt": prompt,
                            "text": text,
                            "tokens": row.committed,
                            "stop_reason": row.stop_reason,
                            "accepted": row.accepted,
                            "target_passes": row.target_passes,
                            "mean_accepted_length": row.mean_accepted_length,
                        }
                    )
                    bar.write(line, file=sys.stdout)
                else:
                    bar.write(text, file=sys.stdout, end="\n\n")
            sys.stdout.flush()
            bar.update(1)
    if args.stats:
        sys.stderr.write(_stats_line(Stats.combine(parts), gen) + f" | {len(items)} prompts\n")
    return 0


# -- entry point ----------------------------------------------------------------------------------


def _quiet_transformers(verbose: bool) -> None:
    """transformers' progress bars and info logs off unless --verbose. It acts where transformers is imported
    already: a command imports it when it needs it and calls this then."""
    if verbose or "transformers" not in sys.modules:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _user_errors() -> tuple[type[BaseException], ...]:
    """USER_ERRORS, and torch's CUDA out-of-memory where torch is imported (where it is not, none was raised)."""
    torch = sys.modules.get("torch")
    return USER_ERRORS if torch is None else (*USER_ERRORS, torch.cuda.OutOfMemoryError)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command in OPTIONAL_COMMANDS:  # read again, with that command's own flags
            parser = build_parser(args.command)
            args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "accepts_extra", False):
            where = f"hfspec {args.command}" if args.command else "hfspec"
            _error(f"unrecognized arguments: {' '.join(extra)} (see '{where} --help')")
            return EXIT_USAGE
    except SystemExit as exc:  # --help, --version, or a bad flag (already reported)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="hfspec: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    _quiet_transformers(args.verbose)  # an optional command's module has imported it
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("hfspec: interrupted\n")
        return EXIT_INTERRUPTED
    except _user_errors() as exc:
        if args.verbose:
            raise
        _error(str(exc) or type(exc).__name__)
        return EXIT_USAGE
    except Exception:
        traceback.print_exc()
        torch = sys.modules.get("torch")
        sys.stderr.write(
            f"hfspec: internal error (hfspec {__version__}, torch {torch.__version__ if torch else '-'}); this is a bug: "
            "please report it with the traceback above and the command that gave it\n"
        )
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
