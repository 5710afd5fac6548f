"""The draft kernel (hfspec.cpu.draft_linear) against a plain memory read and the exact quantized kernel.

Sections:
  layers  GB/s of weights streamed by one call for Qwen2.5-Coder-0.5B's 896->4864 and 4864->896 layers and its
          151936x896 head, at 1, 2, 4 and 8 rows: the draft kernel on its packed blocks, the exact kernel
          (hfspec.cpu.quant) on Q4_0 and Q5_0 blocks, and a plain read of the packed bytes (the bound). Calls rotate
          over copies of the layer totalling --total-mb, so that every call streams its weights from memory, not
          from cache. Each sweep of the copies takes every kernel and row count in turn, so that a neighbour's load
          hits all alike; a time is the least over --repeats sweeps.
  model   Qwen2.5-Coder-0.5B-Instruct (GGUF, hfspec.models.gguf_native, accelerated) before and after
          quantize_for_drafting: the decoding step with a 64-token cache (the two models take turns; the least of
          --rounds medians), and the agreement of their greedy next tokens over --positions positions of hfspec's
          own source, a proxy of acceptance. With --target, also the 1.5B target's step and its agreement with each,
          and with --generate N, greedy hfspec (SpeculativeGenerator, gamma "auto") with each draft against the
          target's own generate() on three prompts of N new tokens: tokens per second, acceptance, and whether
          every output is the target's.
Prints one JSON object (lscpu's model name, the threads, the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hfspec.cpu import draft_linear, fast, quant  # noqa: E402
from hfspec.measure.costs import forward_seconds  # noqa: E402
from hfspec.measure.timing import cpu_model  # noqa: E402
from hfspec.models import assets, gguf_native  # noqa: E402

SHAPES = [(896, 4864), (4864, 896), (896, 151936)]  # (in, out)
SOURCE = Path(__file__).resolve().parents[1] / "hfspec"
# A layer's weight repeats this many distinct rows (the gguf package takes long to quantize a whole head).
DISTINCT_ROWS = 4096


def rotation(first: torch.Tensor, total_bytes: int) -> list[torch.Tensor]:
    """``first`` and copies of it, about ``total_bytes`` in all: a call on each in turn reads memory, not cache."""
    count = max(2, total_bytes // (first.numel() * first.element_size()))
    return [first] + [first.clone() for _ in range(count - 1)]


def sweep_seconds(call: Callable[[torch.Tensor], object], copies: list[torch.Tensor]) -> float:
    """Seconds per call of ``call`` over ``copies``, one after the other."""
    t0 = time.perf_counter()
    for c in copies:
        call(c)
    return (time.perf_counter() - t0) / len(copies)


def tiled(block: torch.Tensor, rows: int) -> torch.Tensor:
    """``block`` repeated along its first dimension to ``rows`` rows."""
    return block.repeat((-(-rows // block.shape[0]),) + (1,) * (block.dim() - 1))[:rows].contiguous()


@torch.inference_mode()
def layers(threads: list[int], rows: list[int], total_mb: int, repeats: int) -> list[dict]:
    """Per shape and thread count: the plain read, then the draft kernel and the exact kernel on Q4_0 and Q5_0 for each
    row count, taking turns in every sweep (a neighbour's load hits all alike); the least time of ``repeats``."""
    dk, qk = draft_linear.kernel(), quant.kernel()
    read = dk.library.function(
        "hfspec_draft_read", [draft_linear._PTR, draft_linear._I64, draft_linear._INT], draft_linear._I64
    )
    out = []
    for k, n in SHAPES:
        layer = nn.Linear(k, min(n, DISTINCT_ROWS), bias=False)
        held = {"draft": rotation(tiled(draft_linear.pack(layer.weight), -(-n // draft_linear.LANES)), total_mb << 20)}
        held |= {
            fmt: rotation(tiled(quant.quantize_linear(layer, fmt.upper()).weight.data, n), total_mb << 20)
            for fmt in ("q4_0", "q5_0")
        }
        size = {name: copies[0].numel() for name, copies in held.items()}
        for t in threads:
            torch.set_num_threads(t)
            calls: dict[tuple[str, int], Callable[[torch.Tensor], object]] = {
                ("read", 0): lambda c: read(c.data_ptr(), c.numel() // 64 * 64, t)
            }
            for m in rows:
                x, y = torch.randn(m, k), torch.empty(m, n)
                calls[("draft", m)] = lambda c, x=x, y=y, m=m: dk.linear(
                    4, x.data_ptr(), k, c.data_ptr(), None, y.data_ptr(), n, m, n, k, t
                )
                for fmt in ("q4_0", "q5_0"):
                    calls[(fmt, m)] = lambda c, x=x, fmt=fmt: quant.linear(qk, x, c, quant.FORMATS[fmt.upper()])
            best = {key: float("inf") for key in calls}
            for _ in range(repeats):
                for (name, m), call in calls.items():
                    best[name, m] = min(best[name, m], sweep_seconds(call, held["draft" if name == "read" else name]))
            for m in rows:
                row = {
                    "threads": t,
                    "in": k,
                    "out": n,
                    "rows": m,
                    "read_gbs": round(size["draft"] / best["read", 0] / 1e9, 2),
                    "draft_of_read": round(best["read", 0] / best["draft", m], 3),
                }
                for name in ("draft", "q4_0", "q5_0"):
                    row[f"{name}_gbs"] = round(size[name] / best[name, m] / 1e9, 2)
                    row[f"{name}_ms"] = round(best[name, m] * 1e3, 3)
                out.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        del held
    return out


def source_ids(tokenizer, count: int) -> list[int]:
    text = "".join(
        (SOURCE / name).read_text()
        for name in ("decoding/sampling.py", "models/kv_cache.py", "decoding/loop.py", "generator.py")
    )
    ids = tokenizer(text).input_ids
    if len(ids) < count:
        raise SystemExit(f"the source text has {len(ids)} tokens, fewer than the {count} asked for")
    return ids[:count]


@torch.inference_mode()
def greedy(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """The greedy next token at every position of ``ids`` (one forward)."""
    return model(torch.tensor([ids])).logits[0].argmax(-1)


def load(name: str) -> nn.Module:
    directory = assets.wheel_model_dir(name, progress=False)
    model = gguf_native.load(str(directory), next(directory.glob("*.gguf")).name, "draft")
    fast.accelerate(model)
    return model


def generate(
    target: nn.Module, drafts: dict[str, nn.Module], tokenizer, prompts: list[list[int]], new_tokens: int
) -> dict:
    """Greedy hfspec with each draft, and the target alone, taking turns on each of ``prompts``: seconds, tokens/s,
    acceptance, and whether hfspec's output is the target's (the target's eos ends both alike)."""
    from hfspec import SpeculativeGenerator

    gens = {name: SpeculativeGenerator(target, draft, tokenizer) for name, draft in drafts.items()}
    seconds = dict.fromkeys(["target_alone", *drafts], 0.0)
    accepted: dict[str, list[float]] = {name: [] for name in drafts}
    exact = dict.fromkeys(drafts, True)
    made = 0
    for ids in prompts:
        feed = torch.tensor([ids])
        t0 = time.perf_counter()
        want = target.generate(feed, attention_mask=torch.ones_like(feed), max_new_tokens=new_tokens, do_sample=False)
        seconds["target_alone"] += time.perf_counter() - t0
        made += want.shape[1] - len(ids)
        for name, gen in gens.items():
            t0 = time.perf_counter()
            got = gen.generate(feed, max_new_tokens=new_tokens)
            seconds[name] += time.perf_counter() - t0
            exact[name] &= torch.equal(got.sequences, want)
            accepted[name].append(got.stats.acceptance_rate)
    out: dict = {name: {"s": round(s, 2), "tokens_per_s": round(made / s, 2)} for name, s in seconds.items()}
    for name in drafts:
        out[name] |= {"acceptance": round(sum(accepted[name]) / len(prompts), 3), "equals_target": exact[name]}
    out["tokens"] = made
    return out


def model(threads: list[int], positions: int, rounds: int, bits: int, target: bool, new_tokens: int) -> dict:
    from transformers import AutoTokenizer

    exact, converted = load("qwen2.5-coder-0.5b"), load("qwen2.5-coder-0.5b")
    torch.set_num_threads(threads[0])
    t0 = time.perf_counter()
    report = draft_linear.quantize_for_drafting(converted, bits)
    out: dict = {
        "bits": bits,
        f"pack_s_{threads[0]}_threads": round(time.perf_counter() - t0, 2),
        "layers": len(report.layers),
        "skipped": len(report.skipped),
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "isa": report.isa,
    }
    big = load("qwen2.5-coder-1.5b") if target else None
    directory = assets.wheel_model_dir("qwen2.5-coder-0.5b", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=next(directory.glob("*.gguf")).name)
    ids = source_ids(tokenizer, positions + 64)
    models = {"exact": exact, "converted": converted, **({"target": big} if big is not None else {})}
    for t in threads:
        torch.set_num_threads(t)
        medians: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(rounds):
            for name, m in models.items():
                medians[name].append(forward_seconds(m, ids[:64], [1], 5, torch.device("cpu"))[1])
        steps = {name: round(min(v) * 1e3, 2) for name, v in medians.items()}
        out[f"step_ms_{t}_threads"] = steps
        out[f"step_speedup_{t}_threads"] = round(steps["exact"] / steps["converted"], 2)
        if big is not None:
            out[f"c_{t}_threads"] = {name: round(steps[name] / steps["target"], 3) for name in ("exact", "converted")}
    torch.set_num_threads(max(threads))
    tokens = {name: greedy(m, ids[64:]) for name, m in models.items()}
    out["positions"] = positions
    out["agreement_with_exact"] = round((tokens["converted"] == tokens["exact"]).float().mean().item(), 4)
    if big is not None:
        out["agreement_with_target"] = {
            name: round((tokens[name] == tokens["target"]).float().mean().item(), 4) for name in ("exact", "converted")
        }
    if big is not None and new_tokens:
        prompts = [ids[start : start + 48] for start in (0, positions // 2, positions)]
        out["generate"] = generate(big, {"exact": exact, "converted": converted}, tokenizer, prompts, new_tokens)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="layers,model", help="comma-separated: layers, model")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--rows", default="1,2,4,8", help="rows per call in the layers section")
    p.add_argument("--total-mb", type=int, default=1024, help="bytes of copies a layer rotates over")
    p.add_argument("--repeats", type=int, default=3, help="sweeps per layer timing")
    p.add_argument("--positions", type=int, default=400, help="positions compared for agreement")
    p.add_argument("--rounds", type=int, default=3, help="rounds of step timings, the models taking turns")
    p.add_argument("--bits", type=int, default=4, choices=draft_linear.BITS)
    p.add_argument("--target", action="store_true", help="also the 1.5B target: its step, c and agreement")
    p.add_argument("--generate", type=int, default=0, help="with --target: new tokens per prompt of greedy hfspec")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    sections = set(args.sections.split(","))
    result: dict = {"cpu": cpu_model(), "threads": threads, "load_before": os.getloadavg()}
    if draft_linear.kernel() is None:
        raise SystemExit(f"the draft kernel is off: {draft_linear.unavailable()}")
    result["isa"] = draft_linear.kernel().isa
    if "layers" in sections:
        result["layers"] = layers(threads, [int(r) for r in args.rows.split(",")], args.total_mb, args.repeats)
    if "model" in sections:
        result["model"] = model(threads, args.positions, args.rounds, args.bits, args.target, args.generate)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
