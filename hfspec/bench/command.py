"""``hfspec bench`` on the command line: its options, loading the pair and the drafters, and the outputs."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel

from hfspec.bench.field import HYBRID, MAIN, USELESS, Mode, Settings, load_prompts
from hfspec.bench.formats import format_costs, formats_table
from hfspec.bench.measure import Bench
from hfspec.bench.report import format_table, plot
from hfspec.bench.runner import run_bench
from hfspec.commands.common import threads_value
from hfspec.cpu import draft_linear, fast
from hfspec.cpu import threads as cpu_threads
from hfspec.drafters.factory import draft_module, drafts_in_integer, load_draft, make_drafter
from hfspec.drafters.hybrid import with_ngram
from hfspec.drafters.loading import load_pair
from hfspec.errors import HfspecError
from hfspec.measure.timing import cpu_model
from hfspec.models.presets import load_preset
from hfspec.models.weights import DRAFT_BITS

DESCRIPTION = """\
Measure one target with its draft (and other drafters) in one process. Contenders, interleaved per prompt:
  plain             the target's own generate(), on torch's own linears (transformers' kernels)
  plain-kernel      the target's own generate() on hfspec's CPU kernels, where the target runs them: the
                    reference greedy hfspec equals token for token (in bfloat16 too)
  hfspec-g0         hfspec with γ = 0: the target alone in hfspec's loop, on the same kernels as hfspec
  assisted          transformers assisted generation, γ drafts per step, constant schedule
  assisted-default  transformers assisted generation with its defaults (what users get)
  prompt-lookup     transformers prompt lookup (prompt_lookup_num_tokens), with --drafters ngram
  hfspec-auto       hfspec with its default settings (gamma="auto", tree="auto": a chain or a tree per step)
  hfspec            hfspec, fixed γ
  hfspec-heuristic  hfspec, γ +2 after a fully accepted step, -1 otherwise
  hfspec-cost       hfspec, γ chosen by the cost model from the bench's measured c and v(γ)
  auto:NAME         hfspec's defaults with another drafter (--drafters): 'useless' (random weights of the
                    draft's own shape: the control), 'ngram', 'hybrid' (the draft plus n-gram lookup), or a
                    path (an EAGLE-3 head or another draft model); assisted-default:useless for transformers
Reported per contender and sampling mode: tokens/s (median and quartiles over
prompts), speed-up vs plain, vs hfspec-g0 (what speculation itself adds on the same
kernels), vs assisted at the same γ and vs assisted-default
(medians of per-prompt ratios), acceptance (acc: drafts accepted ÷ drafted; α: the
per-token rate of the cost model, fitted to tokens per target pass), tokens per
target pass, γ per step, the predicted speed-up (1-α^(γ+1))/((1-α)(γc+1)), the same
with v(γ) for the 1, and efficiency (measured ÷ predicted with v). For every hfspec
contender with gamma="auto": the costs it measured and the γ it chose, step by step
(a histogram). At greedy, every contender's tokens are checked against plain's and, where the target runs
hfspec's kernels, against plain-kernel's (the 'mism' column: differing prompts, 'against plain/plain-kernel').
Then a fixed-γ sweep (--gammas), a tree sweep (--trees: generate(tree=N), a draft tree
of N nodes per step; tokens per target pass, speed-ups and acceptance of tree steps by
depth; greedy tokens checked as above) and a batch row (--batch-size). The machine (CPU
model name, torch threads) is printed and saved with every result.

Kernels: the pair runs hfspec's CPU kernels where it sits on CPU in float32 or
bfloat16 (--no-fast-kernels: torch's own). transformers' contenders (plain, assisted,
prompt lookup) run torch's linears, the baseline users compare with (plain-kernel aside); the
target step and v(γ) are measured both with the kernel and without (costs: eager).

Lookup stores: an 'ngram' or 'hybrid' drafter (or --draft ngram) also drafts from a
store of earlier outputs. Before every call the bench rebuilds that store to hold
exactly the outputs of the drafter's earlier calls in the same mode (warm-up calls
included), oldest first, of every prompt other than the ones being generated: a
prompt never finds its own answer there (not its warm-up output, nor its greedy
output in the sample mode), and finds those of the prompts before it.
"""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("γ values must be integers >= 1")
    return values


def _tree_list(text: str) -> tuple[int, ...]:
    """Node budgets of the tree sweep; "none" (or nothing) for no tree sweep."""
    if text.strip().lower() in ("", "none"):
        return ()
    return _int_list(text)


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if len(set(names)) != len(names) or MAIN in names:
        raise argparse.ArgumentTypeError(f"drafter names must be distinct and not {MAIN!r}, got {text!r}")
    return names


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser``."""
    _pair_options(parser.add_argument_group("the pair"))
    _workload_options(parser.add_argument_group("the workload"))
    _output_options(parser.add_argument_group("timing"), parser.add_argument_group("output"))
    return parser


def _pair_options(pair: argparse._ArgumentGroup) -> None:
    pair.add_argument(
        "--target",
        default="offline",
        help="target model: a directory, a .gguf file, a hub name, or 'offline' for the SmolLM2-135M-Instruct "
        "built by hfspec.models.assets (default: offline)",
    )
    pair.add_argument(
        "--draft",
        default="shipped",
        help="draft model: a directory, a .gguf file, a hub name, or 'shipped' for the draft committed in the "
        "package (default: shipped; 'shipped-eagle3' is the EAGLE-3 head committed beside it, "
        "which --drafters takes too)",
    )
    pair.add_argument(
        "--drafters",
        type=_name_list,
        default=(),
        metavar="LIST",
        help="more drafters as contenders, each with hfspec's default settings, comma-separated: "
        "'useless' (random weights of the draft's own shape: the control), 'ngram' (model-free "
        "lookup; adds transformers' prompt lookup as a baseline), 'hybrid' (the draft plus n-gram "
        "lookup; for what their store of earlier outputs holds, see 'Lookup stores' above), or a "
        "directory (an EAGLE-3 head or another draft model)",
    )
    pair.add_argument(
        "--config",
        metavar="NAME",
        help="a pair preset (a name from hfspec/data/presets or a JSON path): sets the target and the "
        "draft, and the dtype and γ unless --dtype/--gamma are given",
    )
    pair.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="weights dtype for both models (default: the preset's with --config, else float32)",
    )
    pair.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    pair.add_argument(
        "--fast-kernels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run hfspec's contenders on hfspec's CPU linear kernel where the models sit on CPU in "
        "float32 or bfloat16 (default: on, or the preset's); transformers' contenders always "
        "run torch's own linears, and the costs are measured both ways",
    )
    pair.add_argument("--gguf-file", default=None, metavar="FILE", help="the target's GGUF file in --target")
    pair.add_argument("--draft-gguf-file", default=None, metavar="FILE", help="the draft's GGUF file in --draft")
    pair.add_argument(
        "--gguf-native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep GGUF models' blocks on CPU (default: on; --no-gguf-native dequantizes them to "
        "--dtype as transformers does)",
    )
    pair.add_argument(
        "--formats",
        choices=("on", "only"),
        default=None,
        help="time each GGUF block format the models hold on the quantized kernel against the same "
        "layers dequantized on the fp32 and bf16 kernels (step and v(k)); 'only' skips the rest",
    )


def _workload_options(work: argparse._ArgumentGroup) -> None:
    work.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        help='prompts: JSONL with a "prompt" field, or plain text with one prompt per line '
        "(default: the package's data/prompts/bench.jsonl); prompts go through the target's "
        "chat template when it has one",
    )
    work.add_argument("--num-prompts", type=int, default=12, help="use the first N prompts (default: 12)")
    work.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default: 64)")
    work.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="γ, drafts per step, for hfspec fixed and transformers assisted "
        "(default: the preset's with --config, else 4)",
    )
    work.add_argument(
        "--gammas",
        type=_int_list,
        default=(1, 2, 3, 4, 6, 8),
        help="γ values of the hfspec fixed-γ sweep, comma-separated (default: 1,2,3,4,6,8)",
    )
    work.add_argument(
        "--trees",
        type=_tree_list,
        default=(8, 16, 32),
        metavar="LIST",
        help="node budgets of the hfspec tree sweep, comma-separated; 'none' skips it; pairs that "
        "cannot draft exact trees skip it too (default: 8,16,32)",
    )
    work.add_argument(
        "--modes",
        default="greedy,sample",
        help="which of 'greedy' and 'sample' to run, comma-separated (default: both)",
    )
    work.add_argument("--temperature", type=float, default=0.7, help="temperature of the sample mode (default: 0.7)")
    work.add_argument("--top-p", type=float, default=0.95, help="top-p of the sample mode (default: 0.95)")
    work.add_argument(
        "--top-k", type=int, default=0, help="top-k of the sample mode; 0 turns it off for every contender (default: 0)"
    )
    work.add_argument("--seed", type=int, default=0, help="base seed of the sample mode (default: 0)")
    work.add_argument(
        "--skip",
        type=_name_list,
        default=(),
        metavar="LIST",
        help="contenders of the main field to leave out, comma-separated (e.g. "
        "hfspec-heuristic,hfspec-cost); plain always runs",
    )
    work.add_argument(
        "--lookup-tokens",
        type=int,
        default=10,
        help="prompt_lookup_num_tokens of transformers' prompt-lookup contender (default: 10)",
    )
    work.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="prompts in the batch row (hfspec batched vs one at a time vs plain batched); 0 skips it (default: 8)",
    )
    work.add_argument("--batch-repeats", type=int, default=2, help="measured repeats of the batch row (default: 2)")


def _output_options(timing: argparse._ArgumentGroup, out: argparse._ArgumentGroup) -> None:
    timing.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="warm-up passes over every contender before measuring, per mode (default: 2)",
    )
    timing.add_argument(
        "--cost-repeats", type=int, default=20, help="timed forwards per measurement of c and v(γ) (default: 20)"
    )
    timing.add_argument(
        "-t",
        "--threads",
        type=threads_value,
        default=None,
        metavar="N",
        help="CPU threads for the whole run, >= 1, as llama.cpp's -t (default: torch's choice)",
    )
    out.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the results as JSON to PATH, or to stdout with a bare --json (the table then goes to stderr)",
    )
    out.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PATH",
        help="write a PNG: speed-up vs γ and acceptance by draft position",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hfspec bench`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="measure hfspec against generate() and transformers assisted generation",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    parser.set_defaults(func=run)
    return parser


def apply_preset(args: argparse.Namespace) -> None:
    """Fill --target, --draft, --dtype and --gamma from --config, unless given on the command line."""
    if not args.config:
        return
    preset = load_preset(args.config)
    args.target, args.draft = preset.target, preset.draft
    if args.dtype is None and preset.dtype != "auto":
        args.dtype = preset.dtype
    if args.gamma is None and isinstance(preset.gamma, int):  # "auto" is hfspec-auto's; fixed contenders take 4
        args.gamma = preset.gamma
    if getattr(args, "fast_kernels", None) is None:
        args.fast_kernels = preset.fast_kernels


def load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(target, draft, tokenizer) through hfspec.drafters.loading, which also resolves 'offline' and 'shipped'."""
    dtype = getattr(torch, args.dtype or "float32")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gguf = {
        "gguf_file": getattr(args, "gguf_file", None),
        "draft_gguf_file": getattr(args, "draft_gguf_file", None),
        "gguf_native": getattr(args, "gguf_native", True),
    }
    return load_pair(
        args.target, args.draft, dtype=dtype, device=device, fast_kernels=_fast_kernels(args), draft_bits=None, **gguf
    )


def integer_draft(draft: Any, fast_kernels: bool) -> Any:
    """The draft hfspec's contenders run: a copy in 4-bit integer arithmetic where load_pair would give a user one
    (a draft model on CPU with fast kernels on); transformers' contenders keep the draft as loaded."""
    if not fast_kernels or not isinstance(draft, PreTrainedModel) or not drafts_in_integer(draft, DRAFT_BITS):
        return draft
    twin = copy.deepcopy(draft)
    return twin if draft_linear.quantize_for_drafting(twin, DRAFT_BITS).layers else draft


def _fast_kernels(args: argparse.Namespace) -> bool:
    return getattr(args, "fast_kernels", None) is not False  # on unless --no-fast-kernels or the preset says so


def load_drafters(
    names: Sequence[str], target: Any, draft: Any, seed: int = 0, fast_kernels: bool = True
) -> dict[str, Any]:
    """The --drafters, by name: the useless control and the hybrid are built from the main ``draft`` (as hfspec
    runs it); models loaded here run the CPU kernel as the main pair does (``fast_kernels``)."""
    out: dict[str, Any] = {}
    for name in names:
        if name == USELESS:
            out[name] = useless_copy(draft, seed)
            bits = draft_linear.describe(draft)["bits"]
            if fast_kernels and (fast.is_accelerated(draft) or bits):
                fast.accelerate_loaded(out[name])  # the control costs what the draft costs
                if bits:
                    draft_linear.quantize_for_drafting(out[name], bits[0])
        elif name == HYBRID:
            out[name] = with_ngram(make_drafter(draft, target=target))
        else:  # "ngram", "shipped-eagle3" or a directory: whatever hfspec.drafters.loading makes of it
            device = target.get_output_embeddings().weight.device
            out[name] = load_draft(name, target, dtype=target.dtype, device=device, fast_kernels=fast_kernels)
    return out


def useless_copy(draft: Any, seed: int) -> PreTrainedModel:
    """A draft of ``draft``'s own architecture and size with random weights: it costs the same and helps nothing."""
    if not isinstance(draft, PreTrainedModel):
        raise HfspecError(
            f"the {USELESS!r} control needs a draft model (it copies the draft's shape); "
            f"--draft is a {type(draft).__name__}: leave {USELESS!r} out of --drafters"
        )
    torch.manual_seed(seed + 12345)
    model = AutoModelForCausalLM.from_config(draft.config).to(dtype=draft.dtype, device=draft.device)
    model.generation_config = copy.deepcopy(draft.generation_config)
    return model.eval()


def settings_from(args: argparse.Namespace) -> Settings:
    modes = []
    for name in (m.strip() for m in args.modes.split(",") if m.strip()):
        if name == "greedy":
            modes.append(Mode("greedy", False))
        elif name == "sample":
            modes.append(Mode("sample", True, args.temperature, args.top_p, args.top_k))
        else:
            raise SystemExit(f"unknown mode {name!r}; use greedy, sample or greedy,sample")
    if args.gamma < 1 or args.max_new_tokens < 2 or args.num_prompts < 1:
        raise SystemExit("--gamma must be >= 1, --max-new-tokens >= 2 and --num-prompts >= 1")
    return Settings(
        gamma=args.gamma,
        gammas=tuple(args.gammas),
        trees=tuple(args.trees),
        modes=tuple(modes),
        warmup=args.warmup,
        batch_size=args.batch_size,
        batch_repeats=max(1, args.batch_repeats),
        cost_repeats=max(1, args.cost_repeats),
        progress=not args.no_progress,
        lookup_tokens=args.lookup_tokens,
        skip=tuple(args.skip),
    )


def environment(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    """The machine and the software, saved with every result: only ratios measured side by side compare."""
    return {
        "command": " ".join(sys.argv),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "device": str(bench.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": str(bench.target.dtype).replace("torch.", ""),
        "target": str(args.target),
        "draft": str(args.draft),
        "drafters": list(getattr(args, "drafters", ())),
        "max_new_tokens": args.max_new_tokens,
        "gamma": args.gamma,
        "fast_kernels": bench.spec.describe()["fast_kernels"],
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hfspec bench``; returns the exit status."""
    if args.threads:  # the whole command runs on them: the kernels' block shapes are timed for this count
        torch.set_num_threads(cpu_threads.check(args.threads))
    apply_preset(args)
    if args.gamma is None:
        args.gamma = 4
    settings = settings_from(args)
    prompts = load_prompts(args.prompts_file)[: args.num_prompts]
    target, draft, tokenizer = load(args)
    formats = {}
    if getattr(args, "formats", None):
        for role, model in (("target", target), ("draft", draft_module(draft))):
            costs = format_costs(model) if model is not None else []
            title = f"{role}: GGUF block formats, ms per forward (1 row) and v(k)"
            print(formats_table(costs, title), file=sys.stderr)
            formats[role] = [dataclasses.asdict(c) for c in costs]
        if args.formats == "only":
            write_json(
                {"environment": {"cpu": cpu_model(), "threads": torch.get_num_threads()}, "formats": formats}, args.json
            )
            return 0
    hfspec_draft = integer_draft(draft, _fast_kernels(args))
    bench = Bench(
        target,
        hfspec_draft,
        tokenizer,
        max_new_tokens=args.max_new_tokens,
        gamma=args.gamma,
        seed=args.seed,
        assistant=draft if hfspec_draft is not draft else None,
        drafters=load_drafters(args.drafters, target, hfspec_draft, args.seed, _fast_kernels(args)),
    )
    result = {
        "environment": environment(args, bench),
        **run_bench(bench, prompts, settings),
        "prompts": [p["id"] for p in prompts],
        **({"formats": formats} if formats else {}),
    }
    write_outputs(result, args.json, args.plot)
    return 0


def write_json(result: dict[str, Any], json_path: str | None) -> None:
    if json_path == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
    elif json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def write_outputs(result: dict[str, Any], json_path: str | None, plot_path: Path | None) -> None:
    table = format_table(result)
    if json_path == "-":
        print(table, file=sys.stderr)
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if plot_path:
        plot(result, Path(plot_path))


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure(
        argparse.ArgumentParser(
            prog="hfspec bench", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    )
    return run(parser.parse_args(argv))
