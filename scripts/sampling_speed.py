"""Time the sampling path per row: transformers' warpers + softmax + multinomial vs hfspec's.

Cases (median of --repeats calls, old and new alternating, after a warm-up):
  rows=1      one row: warpers, softmax, one token drawn;
  verify      one verify of γ=4 (5 positions of one row): the old loop processed each position
              on its own, then one softmax over all, then one token drawn (the residual or bonus);
              the new path warps the 5 positions in one call;
  pick        the draft-side call: ``DraftContext.pick`` (new) against the same steps done the old way.
Both paths give identical probabilities (tests/test_warpers.py); only the cost differs.
Timings on a machine shared with other jobs are noisy: compare old and new from the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hfspec.decoding import sampling  # noqa: E402
from hfspec.decoding.rows import Rows  # noqa: E402
from hfspec.decoding.scoring import DraftContext, Scoring  # noqa: E402
from hfspec.measure.timing import cpu_model  # noqa: E402
from hfspec.settings import SamplingParams  # noqa: E402


def timed(fns: list[Callable[[], object]], repeats: int) -> list[tuple[float, float]]:
    """(median, fastest) milliseconds of each of ``fns`` over ``repeats`` rounds, after a warm-up round.

    The functions alternate within each round, so load from other jobs hits them alike; on
    a loaded machine the fastest call is the better estimate of the idle cost.
    """
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeats + 1):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            if round_:
                spent.append(time.perf_counter() - start)
    return [(statistics.median(spent) * 1e3, min(spent) * 1e3) for spent in times]


def old_pick(processors, logits: torch.Tensor, tokens: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The draft-side pick as it was: warpers, checks, softmax, multinomial, write, confidence."""
    scores = sampling.process(processors, logits, tokens[:, :1])
    assert bool(torch.isfinite(logits.sum())) and not bool((scores.amax(dim=-1) == float("-inf")).any())
    q = sampling.probs_from_logits(scores)
    token = torch.multinomial(q, 1, generator=g).squeeze(-1)
    tokens.scatter_(1, torch.ones_like(token)[:, None], token[:, None])
    return q.gather(1, token[:, None])


def new_context(params: SamplingParams, vocab: int, g: torch.Generator) -> DraftContext:
    """What ``pick`` reads: one row with one committed token."""
    rows = Rows(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), 3, None, [])
    return DraftContext(rows, Scoring(params), vocab, g, step=1)


def transformers_warpers(params: SamplingParams) -> LogitsProcessorList:
    """transformers' own warpers for ``params``, in generate()'s order: the old path."""
    out = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
    out += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    out += [TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []
    return LogitsProcessorList(out + ([MinPLogitsWarper(params.min_p)] if params.min_p else []))


def measure(args: argparse.Namespace) -> dict:
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k or 0, top_p=args.top_p, min_p=args.min_p or 0.0
    )
    processors, warpers = transformers_warpers(params), params.warpers()
    torch.manual_seed(args.seed)
    # Logits with an LM-like spread: a few large values over a broad mass of small ones.
    logits = torch.randn(5, args.vocab) * 2.0 + torch.empty(5, args.vocab).exponential_() * 2.0
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.zeros(1, 1, dtype=torch.long)

    def old_rows() -> None:
        p = sampling.probs_from_logits(sampling.process(processors, logits[:1], ids))
        torch.multinomial(p, 1, generator=g)

    def new_rows() -> None:
        sampling.sample(sampling.warped_probs(logits[:1], warpers), g)

    def old_verify() -> None:
        scores = torch.stack([sampling.process(processors, logits[i : i + 1], ids) for i in range(5)], dim=1)
        p = sampling.probs_from_logits(scores)  # (1, 5, V)
        torch.multinomial(p[:, 0], 1, generator=g)

    def new_verify() -> None:
        p = sampling.warped_probs(logits, warpers)  # (5, V)
        sampling.sample(p[:1], g)

    tokens = torch.zeros(1, 8, dtype=torch.long)
    ctx = new_context(params, args.vocab, g)
    cases = [
        ("rows=1", 1, old_rows, new_rows),
        ("verify γ=4", 5, old_verify, new_verify),
        ("pick", 1, lambda: old_pick(processors, logits[:1], tokens, g), lambda: ctx.pick(logits[:1], 0)),
    ]
    rows = []
    for name, n, old, new in cases:
        (old_median, old_best), (new_median, new_best) = timed([old, new], args.repeats)
        rows.append(
            {
                "case": name,
                "rows": n,
                "old_ms_per_row": old_median / n,
                "new_ms_per_row": new_median / n,
                "speedup": old_median / new_median,
                "old_best_ms_per_row": old_best / n,
                "new_best_ms_per_row": new_best / n,
                "speedup_best": old_best / new_best,
            }
        )
    return {
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "vocab": args.vocab,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeats": args.repeats,
        "cases": rows,
    }


def table(result: dict) -> str:
    lines = [
        f"cpu: {result['cpu']}   torch threads: {result['torch_threads']}   torch {result['torch']}",
        f"V={result['vocab']} temperature={result['temperature']} top_k={result['top_k']} "
        f"top_p={result['top_p']} min_p={result['min_p']}   {result['repeats']} calls each: median (fastest)",
        f"{'case':<12}{'rows':>5}{'old ms/row':>18}{'new ms/row':>18}{'speedup':>16}",
    ]
    for row in result["cases"]:
        old = f"{row['old_ms_per_row']:.3f} ({row['old_best_ms_per_row']:.3f})"
        new = f"{row['new_ms_per_row']:.3f} ({row['new_best_ms_per_row']:.3f})"
        speedup = f"{row['speedup']:.1f}x ({row['speedup_best']:.1f}x)"
        lines.append(f"{row['case']:<12}{row['rows']:>5}{old:>18}{new:>18}{speedup:>16}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size V (default: 49152, SmolLM2's)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=None, help="top-k (default: off)")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-p", type=float, default=None, help="min-p (default: off)")
    parser.add_argument("--repeats", type=int, default=100, help="timed calls per case (default: 100)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH ('-': stdout)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        result = measure(args)
    if args.json == "-":
        print(table(result), file=sys.stderr)
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
