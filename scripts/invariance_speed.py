"""What the row-count-invariant forward costs: the accelerated model before and after, side by side in one run.

"before" is hfspec.fast as it was: the linear kernel for up to 48 rows in bf16 (2048 in fp32) and torch's GEMM past
that, transformers' sdpa attention with grouped heads read in place for masked queries (a copy of the old
``gqa_sdpa``, below), torch's activations and Conv1D. "after" is hfspec.fast now: every row on the linear kernel,
hfspec's attention, activations and Conv1D. Both take turns within every round, so load from other jobs hits both
alike; read the ratios.

  step / v(k)  a cached forward over k new tokens (all logits) after --context tokens: the decoding step (k = 1)
               and what verifying k tokens costs in steps, v(k) = t(k) / t(1);
  prefill      one forward over a --prefill-token prompt (the last logits), the cost of prompts on the kernel.

Models: random weights of real shapes (--shape smollm2-135m, qwen2.5-1.5b), or a GGUF file (--gguf PATH, loaded by
transformers and dequantized). Prints one JSON object, with lscpu's model name and torch's threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hfspec.cpu import activations, conv1d, fast  # noqa: E402
from hfspec.measure.costs import forward_seconds  # noqa: E402
from hfspec.measure.timing import cpu_model  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
}
BEFORE = "before_gqa_sdpa"


def before_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """hfspec's attention before: transformers' sdpa, with grouped heads read in place for masked queries."""
    if (
        getattr(module, "num_key_value_groups", 1) == 1
        or query.shape[2] == 1
        or attention_mask is None
        or not query.is_cpu
        or dropout
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions")
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(BEFORE, before_gqa_sdpa)
AttentionMaskInterface.register(BEFORE, sdpa_mask)


def switch(model, mode: str) -> None:
    """Put ``model`` in ``mode`` ("before" or "after"), from whatever it ran."""
    if model.config._attn_implementation == BEFORE:
        model.set_attn_implementation("sdpa")
    fast.restore(model)
    if mode == "after":
        fast.accelerate(model)
        return
    fast.accelerate(model, max_rows=48 if model.dtype == torch.bfloat16 else 2048)
    activations.unuse(model)
    conv1d.unuse(model)
    model.set_attn_implementation(BEFORE)


@torch.inference_mode()
def prefill_seconds(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    model(x, attention_mask=torch.ones_like(x), logits_to_keep=1)
    return time.perf_counter() - t0


def measure(model, context: list[int], sizes: list[int], prefill: list[int], rounds: int) -> dict:
    modes = ("before", "after")
    steps = {m: {k: [] for k in sizes} for m in modes}
    prefills = {m: [] for m in modes}
    for r in range(rounds + 1):  # round 0 warms up (page faults, allocations, the kernels' plan)
        for mode in modes if r % 2 == 0 else modes[::-1]:
            switch(model, mode)
            assert model.config._attn_implementation == (BEFORE if mode == "before" else "hfspec_sdpa"), mode
            for k, s in forward_seconds(model, context, sizes, 3, torch.device("cpu")).items():
                if r:
                    steps[mode][k].append(s)
            if prefill:
                seconds = prefill_seconds(model, prefill)
                if r:
                    prefills[mode].append(seconds)
    fast.restore(model)
    out = {}
    for mode in modes:
        med = {k: statistics.median(v) for k, v in steps[mode].items()}
        out[mode] = {"step_ms": round(med[1] * 1e3, 2), "v": {k: round(med[k] / med[1], 3) for k in sizes if k > 1}}
        if prefill:
            out[mode]["prefill_s"] = round(statistics.median(prefills[mode]), 3)
    out["after_over_before"] = {"step": round(out["after"]["step_ms"] / out["before"]["step_ms"], 3)}
    if prefill:
        out["after_over_before"]["prefill"] = round(out["after"]["prefill_s"] / out["before"]["prefill_s"], 3)
    return out


def load(args) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.gguf:
        path = Path(args.gguf)
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    conf = dict(SHAPES[args.shape])
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--gguf", default=None, help="a GGUF file to load instead of random weights")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=250, help="cached tokens before the timed forwards")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4, 5, 8, 9], help="k new tokens for v(k)")
    parser.add_argument("--prefill", type=int, default=128, help="prompt tokens of the prefill (0: skip)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load(args)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    context = torch.randint(100, vocab - 100, (args.context,), generator=g).tolist()
    prefill = torch.randint(100, vocab - 100, (args.prefill,), generator=g).tolist()
    result = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "model": args.gguf or args.shape,
        "context": args.context,
        "load_before": os.getloadavg(),
    }
    result.update(measure(model, context, [1, *args.sizes], prefill, args.rounds))
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
