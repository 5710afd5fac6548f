"""``hfspec generate``: its flags, the run of one prompt or a file of them, and the output (text, JSON, stats).

One PROMPT is continued and printed (``--stream``: as tokens are committed; ``--json``: one object with the
settings and statistics); ``--prompts-file`` decodes many prompts in batches and prints each batch's results, in
input order, as soon as it ends. The flags are checked before torch and transformers load: they are imported by
``run``, once the flags are known good.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfspec.commands.common import EXIT_INTERRUPTED, add_model_flags, load_kwargs, number, quiet_transformers
from hfspec.errors import HfspecError
from hfspec.models.presets import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRESET, Preset

if TYPE_CHECKING:
    from hfspec import api
    from hfspec.policy import GammaPolicy

__all__ = ["DEFAULT_BATCH_SIZE", "add_parser", "run"]

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8


# -- flags ----------------------------------------------------------------------------------------


_gamma_number = number(int, lambda v: v >= 1, ">= 1 or 'auto'")


def gamma_value(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _gamma_number(text)


_tree_number = number(int, lambda v: v >= 0, ">= 0 or 'auto'")


def tree_value(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _tree_number(text)


batch_value = number(int, lambda v: v >= 1, ">= 1")
count_value = number(int, lambda v: v >= 0, ">= 0")
temperature_value = number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0 (0 means greedy)")
top_p_value = number(float, lambda v: 0 < v <= 1, "in (0, 1]")
penalty_value = number(float, lambda v: 0 < v < math.inf, "a number > 0 (1 disables it)")
cost_value = number(float, lambda v: 0 < v < math.inf, "a number > 0")


def add_parser(sub) -> None:
    """Register ``hfspec generate`` on the command line's subparsers."""
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
    _add_flags(p)


def _add_flags(p: argparse.ArgumentParser) -> None:
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
        metavar="N",
        help="most new tokens to generate, >= 0 (default: the target's generation config's max_new_tokens, "
        f"else {DEFAULT_MAX_NEW_TOKENS})",
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
    p.set_defaults(func=run)


# -- prompts --------------------------------------------------------------------------------------


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


# -- running --------------------------------------------------------------------------------------


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
    from hfspec.decoding.config import settings

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


def run(args: argparse.Namespace) -> int:
    """Run ``hfspec generate``; returns the exit status."""
    _check_combination(args)
    items = _read_prompts_file(args.prompts_file) if args.prompts_file is not None else None
    prompt = _read_prompt(args.prompt) if items is None else None
    from hfspec import api  # here, not at the top: torch and transformers load once the flags are known good

    quiet_transformers(args.verbose)
    preset = api.resolve_preset(args.target, args.draft, args.config, args.ngram)
    if args.do_sample is None and not preset.do_sample and (args.temperature or args.top_k or args.top_p):
        log.warning("--temperature/--top-k/--top-p only apply when sampling; decoding greedily (add --do-sample)")
    gen = api.load(preset, threads=args.threads, **load_kwargs(args))
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

    from hfspec.decoding.stats import Stats  # (imports torch)

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


# -- output ---------------------------------------------------------------------------------------


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
