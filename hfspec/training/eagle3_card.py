"""The model card (README) of a trained EAGLE-3 head, written from the run's own report and settings."""

from __future__ import annotations

import json
from pathlib import Path

from hfspec.training.report import REPORT, hours

__all__ = ["model_card"]


def model_card(out_dir: str | Path, title: str = "EAGLE-3 head", note: str = "") -> str:
    """A README (markdown) for the head in ``out_dir``: how it was trained and what it measures, from the
    run's own ``distill_report.json`` and ``train/settings.json``; ``note`` is a paragraph added after the
    first one (say, what exactly the target was)."""
    out = Path(out_dir)
    r = json.loads((out / REPORT).read_text())
    s = json.loads((out / "train" / "settings.json").read_text())
    conf = json.loads((out / "config.json").read_text())
    verifier = conf.get("speculators_config", {}).get("verifier", {}).get("name_or_path", r["target"])
    depth = " | ".join(str(k + 1) for k in range(len(r["alpha_by_depth"])))
    rule = "|".join(["---"] * (len(r["alpha_by_depth"]) + 1))
    return f"""# {title}

An EAGLE-3 draft head (Li et al., arXiv 2503.01840) for `{verifier}`: one decoder layer that drafts from the
target's own hidden states entering layers {", ".join(map(str, r["layer_ids"]))}, over a draft vocabulary of
{r["draft_vocab"]:,} tokens. {r["head_params"]:,} parameters, {r["head_bytes"] / 1e6:.1f} MB in bfloat16
({r["format"]} layout, without the target's embedding: engines use the target's).
{chr(10) + note.strip() + chr(10) if note.strip() else ""}
```python
from hfspec import SpeculativeGenerator

gen = SpeculativeGenerator.from_pretrained(TARGET, "path/to/this/directory")  # TARGET: the target's directory
```

```python
from vllm import LLM

llm = LLM(model="{verifier}",
          speculative_config={{"method": "eagle3", "model": "path/to/this/directory", "num_speculative_tokens": {r["gamma_greedy"]}}})
```

## How it was made

`hfspec distill --kind eagle3` (`hfspec/training/eagle3.py`, recipe in `scripts/train_eagle3_head.sh`):

- **text**: {r["train_tokens"]:,} tokens the target generated itself (continuations of up to {s["seq_len"]} tokens
  of the chat prompts in `hfspec/data/prompts/distill.txt`: greedy for a third of the first pass over the prompts,
  sampled at T in [0.7, 1] otherwise), with the target's top-{s["top_k"]} log-probabilities at every generated
  position; held out: {r["eval_tokens"]:,} positions of text from prompts not used in training;
- **features**: one teacher-forced target forward per sample, hidden states stored in bfloat16;
- **draft vocabulary**: the {r["draft_vocab"]:,} most frequent generated tokens of the training text (prompt tokens
  not counted), sorted by id;
- **training-time test**: {s["unroll"]} unrolled draft steps, each reading the head's own output of the step
  before; loss Σ_k 0.8^k · cross-entropy to the target's top-{s["top_k"]} distribution restricted to the draft
  vocabulary and renormalised, on generated positions only; AdamW (betas 0.9, 0.95), peak learning rate
  {s["lr"]:g} with warm-up and cosine decay to 10%, gradient clipping at 0.5, {r["steps"]:,} steps of
  {s["batch"]} sequences; the weights of the best held-out check (every {s["eval_every"]} steps, best at step
  {r["best_step"]:,}) are kept. fc starts by passing the highest feature through; norm and lm_head start as the
  target's final norm and output rows;
- **time**: text generation {hours(r["gen_seconds"])} and features {hours(r["feature_seconds"])} (summed over
  the processes that staged them), training {hours(r["train_seconds"])} ({r["step_seconds"]:.2f} s per step,
  held-out checks included).

## What it measures

On the held-out text, teacher-forced (the drafts before step k are the target's own tokens), against the
target's exact distribution p at T=1; q is the head's, zero outside the draft vocabulary:

| draft step | {depth} |
|{rule}|
| α = E[Σ min(p, q)] | {" | ".join(f"{a:.3f}" for a in r["alpha_by_depth"])} |
| greedy agreement (argmax q = argmax p) | {" | ".join(f"{a:.3f}" for a in r["agreement_by_depth"])} |

| | |
|---|---|
| target mass on the draft vocabulary | {r["vocab_coverage"]:.3f} (target argmax inside it: {r["argmax_coverage"]:.3f}) |
| expected accepted drafts per step at γ = {r["unroll"]}, T=1 | {r["accepted_length"]:.2f} |
| decode step, batch 1: target / head | {r["target_step_ms"]:.1f} ms / {r["head_step_ms"]:.2f} ms |
| cost ratio c | {r["cost_ratio"]:.3f} |
| predicted speedup (Leviathan et al.), greedy / T=1 | {r["speedup_greedy"]:.2f}× at γ={r["gamma_greedy"]} / {r["speedup_sampled"]:.2f}× at γ={r["gamma_sampled"]} |

Decoding with it stays exactly lossless whatever these numbers are: the head only changes speed.
"""
