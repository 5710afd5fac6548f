"""Eager torch against hfspec's CPU linear kernel (hfspec.fast) on the offline target, SmolLM2-135M (fp32 or bf16).

Sections (each eager/kernel pair alternates within every round, so load from other jobs hits both alike;
on a shared machine compare the two from the same run, and read ratios rather than absolute times):
  build     seconds to compile the kernel into an empty directory (cold) and to load it when cached (warm);
  linear    single layers in isolation (576->1536, 1536->576 and the 576->49152 head) for M rows;
  model     a cached forward over k new tokens (all logits), k = 1 (the decoding step) and the --sizes;
            v(k) = t(k) / t(1) is what verifying k tokens costs in steps;
  numerics  max |logit difference| over --positions positions fed in chunks of --chunk tokens, and the
            greedy agreement of generate(do_sample=False) over --prompts prompts x --new-tokens tokens;
  hfspec    greedy hfspec as users load it (load_pair: the kernel on, --draft) against the eager target's
            generate() and the loaded target's own, stopping at EOS, prompts encoded as the bench does.
Prints one JSON object (with lscpu's model name, torch's threads and the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hfspec import SpeculativeGenerator  # noqa: E402
from hfspec.bench import encode  # noqa: E402
from hfspec.cpu import fast, kernels, toolchain  # noqa: E402
from hfspec.measure.costs import forward_seconds  # noqa: E402
from hfspec.measure.timing import cpu_model, timed  # noqa: E402
from hfspec.models.adapter import forward  # noqa: E402
from hfspec.models.assets import offline_target_float32  # noqa: E402
from hfspec.models.kv_cache import KVState  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "hfspec" / "prompts" / "bench.jsonl"


def alternate(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each of ``fns`` over ``repeats`` rounds (after one warm-up round), taking turns."""
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeats + 1):
        for fn, spent in zip(fns, times):
            seconds = timed(fn)[1]
            if round_:
                spent.append(seconds)
    return [statistics.median(t) for t in times]


def build_costs() -> dict:
    """Cold: a fresh compile into an empty directory. Warm: finding and loading the cached library."""
    t0 = time.perf_counter()
    library = kernels.load()
    warm = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        cold = toolchain.build(Path(tmp) / "linear.so", toolchain.compiler())
    return {
        "cold_s": round(cold, 3),
        "first_load_in_process_s": round(warm, 4),
        "first_load_compiled": bool(library and library.build_seconds),
        "isa": library and library.isa,
    }


@torch.inference_mode()
def linear_layers(sizes: list[int], repeats: int) -> list[dict]:
    """Each layer shape alone: F.linear against the kernel for M rows."""
    library = kernels.load()
    rows = []
    for k, n in [(576, 1536), (1536, 576), (576, 49152)]:
        w = torch.randn(n, k)
        for m in sizes:
            x = torch.randn(m, k)
            eager, kernel = alternate([lambda: F.linear(x, w), lambda: kernels.linear(library, x, w)], repeats)
            rows.append(
                {
                    "in": k,
                    "out": n,
                    "rows": m,
                    "eager_ms": round(eager * 1e3, 3),
                    "kernel_ms": round(kernel * 1e3, 3),
                    "speedup": round(eager / kernel, 2),
                }
            )
    return rows


def model_steps(model, context: list[int], sizes: list[int], rounds: int) -> dict:
    """Cached forwards over k new tokens, eager and kernel taking turns for ``rounds`` rounds."""
    times = {mode: {k: [] for k in sizes} for mode in ("eager", "kernel")}
    for _ in range(rounds):
        for mode in ("eager", "kernel"):
            if mode == "kernel":
                fast.accelerate(model)
            try:
                for k, s in forward_seconds(model, context, sizes, 3, torch.device("cpu")).items():
                    times[mode][k].append(s)
            finally:
                fast.restore(model)
    out = {}
    for mode, by_k in times.items():
        med = {k: statistics.median(v) for k, v in by_k.items()}
        out[mode] = {
            "step_ms": round(med[1] * 1e3, 2),
            "v": {k: round(med[k] / med[1], 3) for k in sizes if k != 1},
            "ms": {k: round(t * 1e3, 2) for k, t in med.items()},
        }
    out["step_speedup"] = round(out["eager"]["step_ms"] / out["kernel"]["step_ms"], 2)
    return out


@torch.inference_mode()
def chunked_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits (T, V) of ``ids`` fed ``chunk`` tokens at a time through the cache, as verification does."""
    kv = KVState(1, torch.device("cpu"), model)
    out = []
    for start in range(0, len(ids), chunk):
        feed = torch.tensor([ids[start : start + chunk]])
        positions = torch.arange(start, start + feed.shape[1])[None]
        out.append(forward(model, feed, kv.extend_mask(torch.ones_like(feed)), positions, kv.cache)[0])
    return torch.cat(out)


def numerics(model, tok, prompts: list[str], positions: int, chunk: int, new_tokens: int) -> dict:
    """Logit differences over ``positions`` positions, and greedy generate() agreement per prompt."""
    text = " ".join(prompts)
    ids = tok(text).input_ids[:positions]
    eager = chunked_logits(model, ids, chunk)
    with fast.accelerated(model):
        kernel = chunked_logits(model, ids, chunk)
    diff = (eager - kernel).abs()
    same, first_diff = 0, []
    for prompt in prompts:
        batch = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        args = dict(**batch, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        ref = model.generate(**args)[0]
        with fast.accelerated(model):
            got = model.generate(**args)[0]
        n = min(len(ref), len(got))
        mismatch = (ref[:n] != got[:n]).nonzero()
        same += int(len(mismatch) == 0 and len(ref) == len(got))
        first_diff.append(None if len(mismatch) == 0 else int(mismatch[0]) - batch["input_ids"].shape[1])
    return {
        "positions": len(ids),
        "chunk": chunk,
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "max_abs_logit": float(eager.abs().max()),
        "argmax_agreement": float((eager.argmax(-1) == kernel.argmax(-1)).float().mean()),
        "greedy_identical": f"{same}/{len(prompts)}",
        "greedy_first_difference": first_diff,
    }


@torch.inference_mode()
def hfspec_agreement(eager_model, tok, prompts: list[str], new_tokens: int, draft: str, dtype: str) -> dict:
    """Greedy hfspec with the pair load_pair gives (kernel on) against eager and same-kernel generate()."""
    gen = SpeculativeGenerator.from_pretrained("offline", draft, dtype=dtype)
    same_eager, same_kernel, first_diff = 0, 0, []
    for prompt in prompts:
        ids = torch.tensor([encode(tok, prompt)])
        args = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
        eager = eager_model.generate(ids, **args)[0].tolist()
        kernel = gen.target.generate(ids, **args)[0].tolist()
        out = gen.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        got = out.sequences[0, : ids.shape[1] + out.stats.rows[0].committed].tolist()
        same_eager += got == eager
        same_kernel += got == kernel
        first_diff.append(next((i - ids.shape[1] for i, (a, b) in enumerate(zip(eager, got)) if a != b), None))
    return {
        "draft": draft,
        "kernels": gen.describe()["fast_kernels"],
        "prompts": len(prompts),
        "identical_to_eager_generate": f"{same_eager}/{len(prompts)}",
        "identical_to_same_kernel_generate": f"{same_kernel}/{len(prompts)}",
        "first_difference_from_eager": first_diff,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4, 8], help="k new tokens for v(k)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="M rows for 'linear'")
    parser.add_argument("--rounds", type=int, default=5, help="eager/kernel rounds for 'model'")
    parser.add_argument("--repeats", type=int, default=15, help="alternating calls per case for 'linear'")
    parser.add_argument("--context", type=int, default=64, help="cached tokens before the timed forwards")
    parser.add_argument("--positions", type=int, default=300, help="positions for the logit difference")
    parser.add_argument("--chunk", type=int, default=8, help="tokens per forward for the logit difference")
    parser.add_argument("--prompts", type=int, default=10, help="prompts for greedy agreement")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--draft", default="shipped-eagle3", help="the draft of the 'hfspec' section")
    parser.add_argument("--skip", nargs="*", default=[], choices=["build", "linear", "model", "numerics", "hfspec"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernel runs torch.get_num_threads() threads as well
    path = offline_target_float32()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = (prompts * args.prompts)[: args.prompts]
    result = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "load_before": os.getloadavg(),
    }
    if "build" not in args.skip:
        result["build"] = build_costs()
    if "linear" not in args.skip:
        result["linear"] = linear_layers(args.rows, args.repeats)
    if "model" not in args.skip:
        context = tok(" ".join(prompts)).input_ids[: args.context]
        result["model"] = model_steps(model, context, [1, *args.sizes], args.rounds)
    if "numerics" not in args.skip:
        result["numerics"] = numerics(model, tok, prompts, args.positions, args.chunk, args.new_tokens)
    if "hfspec" not in args.skip:
        result["hfspec"] = hfspec_agreement(model, tok, prompts, args.new_tokens, args.draft, args.dtype)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
