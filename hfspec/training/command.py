"""The ``hfspec distill`` command: train a small draft model (``--kind model``) or an EAGLE-3 head
(``--kind eagle3``) for a target, and print the run's report as JSON.

``hfspec.commands.cli`` registers it when this package is installed; ``python -m hfspec.training``
runs it on its own. Flags one kind does not read are refused rather than ignored, so a
mistyped run does not train something other than what was asked for.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from hfspec.errors import HfspecError
from hfspec.training.draft_model import train_draft_model
from hfspec.training.eagle3 import parse_layer_ids, train_eagle3_head

__all__ = ["EAGLE3_FLAGS", "KINDS", "MODEL_FLAGS", "add_parser", "main", "run"]

# Flags that only one --kind reads; the other refuses them instead of ignoring them.
MODEL_FLAGS = (
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "intermediate",
    "hard_weight",
    "negatives",
    "save_dtype",
    "init_from",
)
EAGLE3_FLAGS = ("draft_vocab", "unroll", "layer_ids", "format", "feature_batch")
KINDS = ("model", "eagle3")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``distill`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "distill",
        help="train a small draft model or an EAGLE-3 head for a target model",
        description="Distil a small draft (--kind model) or an EAGLE-3 head (--kind eagle3) for a target causal LM "
        "on text the target generates, then report acceptance (α), greedy agreement, cost ratio and predicted "
        "speedup.",
    )
    _add_common_flags(p)
    _add_model_flags(p)
    _add_eagle3_flags(p)
    p.set_defaults(func=run)
    return p


def _add_common_flags(p: argparse.ArgumentParser) -> None:
    """The flags both kinds read: the target, the staged text, the schedule and the run."""
    p.add_argument(
        "--kind",
        choices=KINDS,
        default="model",
        help="model: an independent small draft model (default); eagle3: an EAGLE-3 head that drafts "
        "from the target's own hidden states",
    )
    p.add_argument(
        "--target", required=True, help="local target model directory, or 'offline' for SmolLM2-135M-Instruct"
    )
    p.add_argument("--out", required=True, help="output directory (data, checkpoint, draft, report); reused to resume")
    p.add_argument("--tokens", type=int, default=200_000, help="target-generated training tokens (default 200000)")
    p.add_argument("--eval-tokens", type=int, default=10_000, help="held-out evaluation tokens (default 10000)")
    p.add_argument("--seq-len", type=int, default=128, help="longest continuation generated per prompt (default 128)")
    p.add_argument("--gen-batch", type=int, default=16, help="prompts generated together (default 16)")
    p.add_argument("--top-k", type=int, default=32, help="target log-probs kept per position (default 32)")
    p.add_argument("--batch", type=int, default=None, help="training sequences per step (default 16, eagle3: 8)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 2000, eagle3: 3000)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate, warm-up then cosine decay to 10%% (default 2e-3, eagle3: 1e-3)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="N",
        help="checkpoint and check the draft on held-out data every N steps; the weights with the "
        "best held-out α are the ones saved (default: a tenth of --steps, at most 200)",
    )
    p.add_argument(
        "--no-resume", dest="resume", action="store_false", help="retrain from scratch (staged data is kept)"
    )
    p.add_argument(
        "--data-only",
        action="store_true",
        help="only stage the data (and for eagle3 the target features), then exit; run beside a full "
        "run on the same --out to share the work",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags only a draft model reads: its architecture, loss and warm start."""
    model = p.add_argument_group("--kind model")
    model.add_argument("--hidden", type=int, default=None, help="draft hidden size (default 128)")
    model.add_argument("--layers", type=int, default=None, help="draft transformer layers (default 4)")
    model.add_argument("--heads", type=int, default=None, help="draft attention heads (default 4)")
    model.add_argument("--kv-heads", type=int, default=None, help="draft key/value heads (default: --heads)")
    model.add_argument("--intermediate", type=int, default=None, help="draft MLP size (default 4 x hidden)")
    model.add_argument(
        "--hard-weight", type=float, default=None, help="weight of the hard-label cross-entropy (default 0.5)"
    )
    model.add_argument(
        "--negatives",
        type=int,
        default=None,
        help="random vocabulary negatives per step for the sampled softmax; 0 = full vocabulary (default 4096)",
    )
    model.add_argument(
        "--save-dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="dtype of the saved draft weights (default float16)",
    )
    model.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from the weights of an earlier draft with the same architecture (new optimiser "
        "and schedule), to train it further on more data or for more steps",
    )


def _add_eagle3_flags(p: argparse.ArgumentParser) -> None:
    """The flags only an EAGLE-3 head reads: its vocabulary, unrolling, features and layout."""
    eagle = p.add_argument_group("--kind eagle3")
    eagle.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft vocabulary: the N most frequent generated tokens of the training text (default 8192)",
    )
    eagle.add_argument(
        "--unroll", type=int, default=None, help="draft steps unrolled in training, the training-time test (default 7)"
    )
    eagle.add_argument(
        "--layer-ids",
        default=None,
        metavar="I,J,K",
        help="target hidden_states indices the head reads (default: 2, N//2, N-3 of N layers)",
    )
    eagle.add_argument(
        "--format",
        default=None,
        choices=["speculators", "eagle"],
        help="layout of the saved head: speculators (vLLM, default) or eagle (SafeAILab/EAGLE, SGLang)",
    )
    eagle.add_argument(
        "--feature-batch", type=int, default=None, help="sequences per target forward when staging features (default 8)"
    )


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The flags among ``names`` that were given (None is argparse's 'not given': kind defaults apply)."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def run(args: argparse.Namespace) -> int:
    """Run the ``distill`` subcommand; prints the report as JSON."""
    kind = getattr(args, "kind", "model")
    model_only, eagle_only = _given(args, MODEL_FLAGS), _given(args, EAGLE3_FLAGS)
    wrong = eagle_only if kind == "model" else model_only
    if wrong:
        flags = ", ".join("--" + name.replace("_", "-") for name in wrong)
        other = "eagle3" if kind == "model" else "model"
        raise HfspecError(f"{flags} only apply to --kind {other}; drop them or pass --kind {other}")
    common = dict(
        tokens=args.tokens,
        eval_tokens=args.eval_tokens,
        seq_len=args.seq_len,
        gen_batch=args.gen_batch,
        top_k=args.top_k,
        seed=args.seed,
        resume=args.resume,
        data_only=args.data_only,
        eval_every=args.eval_every,
        progress=not args.quiet,
        **_given(args, ("batch", "steps", "lr")),
    )
    if kind == "eagle3":
        if "layer_ids" in eagle_only:
            eagle_only["layer_ids"] = parse_layer_ids(eagle_only["layer_ids"])
        report = train_eagle3_head(args.target, args.out, **common, **eagle_only)
    else:
        report = train_draft_model(args.target, args.out, **common, **model_only)
    if report is not None:
        print(json.dumps(report.to_dict(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hfspec.training ...``: the ``distill`` subcommand on its own."""
    parser = argparse.ArgumentParser(prog="python -m hfspec.training")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["distill", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)
