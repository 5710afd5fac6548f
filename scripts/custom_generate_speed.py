"""model.generate with and without ``custom_generate=hfspec.CUSTOM_GENERATE``, side by side, on the offline pair.

The target is SmolLM2-135M-Instruct (``hfspec.models.assets.offline_target_path``), the draft the model shipped with
hfspec (``hfspec.models.assets.shipped_draft_path``), both loaded by transformers in float32 and used as they are. For
the first --prompts chat prompts of hfspec/data/prompts/bench.jsonl, greedy, --new-tokens each, every round times in
turn (the order rotating from round to round):

- ``plain``: ``model.generate(ids)``, one prompt at a time;
- ``assisted``: transformers' assisted generation, ``model.generate(ids, assistant_model=draft)``;
- ``hook``: the same call with ``custom_generate=hfspec.CUSTOM_GENERATE, trust_remote_code=True``;
- ``hook+kernel``: the same on copies of both models that opted into hfspec's CPU kernel (``hfspec.fast.accelerate``);
- ``hook batch``: all prompts in one left-padded batch through the hook (transformers' assisted generation takes
  one prompt at a time);
- ``hook eagle3`` and ``hook eagle3+kernel``: the hook with the EAGLE-3 head shipped for this target as
  ``assistant_model`` (its directory: the hook takes anything ``SpeculativeGenerator`` takes as a draft), on the
  target as it is and on its copy with the kernel.

A first round warms every contender up (the hook's first call measures costs for gamma="auto") and is not counted.
Prints one JSON object: per contender the median over rounds of new tokens per second, its ratio to ``plain``, and on
how many prompts its greedy output equals ``plain``'s; with the CPU model and thread count.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hfspec  # noqa: E402
from hfspec import fast  # noqa: E402
from hfspec.models.assets import offline_target_float32, shipped_draft_path, shipped_head_path  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "hfspec" / "data" / "prompts" / "bench.jsonl"
HOOK = {"custom_generate": hfspec.CUSTOM_GENERATE, "trust_remote_code": True}


def cpu_model() -> str:
    out = (
        subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        if platform.system() == "Linux"
        else ""
    )
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = offline_target_float32(progress=False)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(shipped_draft_path(), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target_k, draft_k = copy.deepcopy(target), copy.deepcopy(draft)
    kernel = {"target": fast.accelerate(target_k).isa, "draft": fast.accelerate(draft_k).isa}
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][: args.prompts]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    singles = [tok(c, return_tensors="pt", add_special_tokens=False) for c in chats]
    batch = tok(chats, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    greedy = {"do_sample": False, "max_new_tokens": args.new_tokens}

    def one_at_a_time(model, **extra):
        return lambda: [model.generate(**s, **greedy, **extra)[0, s.input_ids.shape[1] :] for s in singles]

    def batched():
        out = target.generate(**batch, assistant_model=draft, **greedy, **HOOK)
        return list(out[:, batch.input_ids.shape[1] :])

    contenders = {
        "plain": one_at_a_time(target),
        "assisted": one_at_a_time(target, assistant_model=draft),
        "hook": one_at_a_time(target, assistant_model=draft, **HOOK),
        "hook+kernel": one_at_a_time(target_k, assistant_model=draft_k, **HOOK),
        "hook batch": batched,
        "hook eagle3": one_at_a_time(target, assistant_model=str(shipped_head_path()), **HOOK),
        "hook eagle3+kernel": one_at_a_time(target_k, assistant_model=str(shipped_head_path()), **HOOK),
    }
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    outputs: dict[str, list[torch.Tensor]] = {}
    names = list(contenders)
    for round_ in range(args.rounds + 1):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.perf_counter()
            rows = contenders[name]()
            seconds = time.perf_counter() - start
            outputs[name] = rows
            if round_:
                rates[name].append(sum(_new(r, tok) for r in rows) / seconds)
    plain = [_trimmed(r, tok) for r in outputs["plain"]]
    report = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "kernel_isa": kernel,
        "contenders": {
            name: {
                "tokens_per_second": round(statistics.median(r), 2),
                "vs_plain": round(statistics.median(r) / statistics.median(rates["plain"]), 3),
                "equal_to_plain": sum(_trimmed(a, tok) == b for a, b in zip(outputs[name], plain)),
            }
            for name, r in rates.items()
        },
    }
    print(json.dumps(report, indent=2))


def _trimmed(row: torch.Tensor, tok) -> list[int]:
    """A row's new tokens up to its EOS (the padding after it dropped)."""
    ids = row.tolist()
    eos = tok.eos_token_id
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _new(row: torch.Tensor, tok) -> int:
    return len(_trimmed(row, tok))


if __name__ == "__main__":
    main()
