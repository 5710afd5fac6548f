"""Staging of target-generated text: what every kind of draft trains on.

The target continues the prompts of ``hfspec/data/prompts/distill.txt`` (chat prompts through
its chat template, ``raw: `` lines as plain text), greedy for a third of the first pass
and sampled at T in [0.7, 1] otherwise. For every generated position the top-k
log-probabilities of its T=1 distribution p are kept (Leviathan et al., arXiv
2211.17192: p is the target's distribution, q the draft's), so training can match p
without running the target again.

Shards ``data/{split}-NNNNN.pt`` are written whole or not at all, and each is claimed
with a lock file first: several processes staging into one directory share the work,
a process that died leaves a lock that is taken over, and a rerun resumes.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hfspec.measure.timing import now
from hfspec.models.paths import DATA
from hfspec.training.target import pad_id

__all__ = ["PROMPTS", "StagingSettings", "claim_lock", "load_samples", "stage_text"]

PROMPTS = DATA / "prompts" / "distill.txt"
_RAW = "raw: "  # prompt-file prefix for text continued without the chat template
EVAL_SEED_OFFSET = 1_000_003  # the eval split's shards draw from seeds the train split never uses


class StagingSettings(Protocol):
    """What staging reads from a run's settings; both kinds' settings dataclasses have these fields."""

    tokens: int  # target-generated positions to stage for training
    eval_tokens: int  # held-out positions
    seq_len: int  # longest continuation per prompt
    gen_batch: int  # prompts generated together
    top_k: int  # target log-probs kept per position
    seed: int


def stage_text(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, data_dir: Path, s: StagingSettings, progress: bool
) -> tuple[int, float]:
    """Stage the train and eval splits into ``data_dir``; returns (train tokens, generation seconds of both).

    About 5% of the distinct prompts are held out for the eval split, so no text is in both;
    every kind of draft trains on the same staged text.
    """
    train_prompts, eval_prompts = _split_prompts(_load_prompts(), s.seed)
    n_train, gen_train = _stage_split(target, tokenizer, train_prompts, data_dir, "train", s.tokens, s, progress)
    _, gen_eval = _stage_split(target, tokenizer, eval_prompts, data_dir, "eval", s.eval_tokens, s, progress)
    return n_train, gen_train + gen_eval


def load_samples(data_dir: Path, split: str) -> list[dict]:
    """Every staged sample of ``split``, shard by shard: dicts of int32 ``prompt`` and ``gen`` token ids,
    and the target's ``top_ids`` (int32) and ``top_logp`` (float16) at each generated position."""
    samples = []
    for path in sorted(data_dir.glob(f"{split}-*.pt")):
        samples.extend(torch.load(path)["samples"])
    return samples


def claim_lock(lock: Path) -> bool:
    """Atomically create ``lock`` holding our pid; take it over if its process has died.

    False means another live process holds it and is working on what it guards.
    """
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text() or 0)
                os.kill(pid, 0)
                return False  # alive: its owner is working on the shard
            except (ProcessLookupError, ValueError, FileNotFoundError):
                lock.unlink(missing_ok=True)  # stale
                continue
            except PermissionError:
                return False
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


# --------------------------------------------------------------------------- prompts


def _load_prompts(path: Path = PROMPTS) -> list[str]:
    lines = [ln.rstrip("\n") for ln in path.read_text(encoding="utf-8").splitlines()]
    return [ln.replace("\\n", "\n") for ln in lines if ln.strip()]


def _split_prompts(prompts: list[str], seed: int) -> tuple[list[str], list[str]]:
    """Hold out about 5% of distinct prompts for evaluation; no text is in both."""
    distinct = sorted(set(prompts))
    random.Random(seed).shuffle(distinct)
    held = set(distinct[: max(1, len(distinct) // 20)])
    train = [p for p in prompts if p not in held]
    return train, sorted(held)


def _encode(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    if prompt.startswith(_RAW):
        ids = tokenizer(prompt[len(_RAW) :], add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + ids
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])
    return tokenizer(prompt)["input_ids"]


# --------------------------------------------------------------------------- shards


def _shard_plan(index: int, n_prompts: int, gen_batch: int, seed: int) -> tuple[list[int], float]:
    """Prompt indices and temperature (0 = greedy) for shard ``index``; deterministic for resuming."""
    per_pass = max(1, n_prompts // gen_batch)
    epoch, slot = divmod(index, per_pass)
    order = list(range(n_prompts))
    random.Random(seed * 7919 + epoch).shuffle(order)
    chosen = order[slot * gen_batch : (slot + 1) * gen_batch]
    # Greedy only on the first pass (a second greedy pass would repeat it); else T in [0.7, 1].
    if epoch == 0 and index % 3 == 0:
        return chosen, 0.0
    return chosen, 0.7 + 0.3 * random.Random(seed * 104729 + index).random()


@torch.inference_mode()
def _generate_shard(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    temperature: float,
    s: StagingSettings,
    seed: int,
) -> dict:
    """Generate continuations for a batch of prompts, keeping the target's top-k log-probs."""
    enc = [_encode(tokenizer, p) for p in prompts]
    pad = pad_id(tokenizer)
    width = max(len(e) for e in enc)
    # Left padding so every row's next token sits in the last column.
    input_ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
    attention_mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    torch.manual_seed(seed)  # one seed per shard so that a resumed run regenerates identically
    out = target.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=s.seq_len,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=None,
        top_p=None,
        pad_token_id=pad,
        return_dict_in_generate=True,
        output_logits=True,
    )
    gen = out.sequences[:, width:]  # (B, T)
    logits = torch.stack(out.logits, dim=1)  # (B, T, V), unprocessed: the T=1 distribution
    top_logp, top_ids = torch.log_softmax(logits.float(), dim=-1).topk(s.top_k, dim=-1)
    eos = _eos_ids(target, tokenizer)
    samples = []
    for row, prompt_ids in enumerate(enc):
        n = gen.shape[1]
        for t in range(n):
            if int(gen[row, t]) in eos:
                n = t + 1  # keep the end-of-sequence token itself
                break
        samples.append(
            {
                "prompt": torch.tensor(prompt_ids, dtype=torch.int32),
                "gen": gen[row, :n].to(torch.int32).clone(),
                "top_ids": top_ids[row, :n].to(torch.int32).clone(),
                "top_logp": top_logp[row, :n].to(torch.float16).clone(),
            }
        )
    return {"temperature": temperature, "samples": samples}


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def _shard_tokens(shard: dict) -> int:
    return sum(len(x["gen"]) for x in shard["samples"])


class _Staged:
    """Tokens and generation seconds of the shards of one split, whoever wrote them; each shard is read once."""

    def __init__(self, data_dir: Path, split: str):
        self.data_dir, self.split = data_dir, split
        self.seen: dict[Path, tuple[int, float]] = {}  # shard -> (tokens, seconds)

    def totals(self) -> tuple[int, float]:
        for path in self.data_dir.glob(f"{self.split}-*.pt"):
            if path not in self.seen:
                shard = torch.load(path)
                self.seen[path] = (shard["tokens"], shard.get("seconds", 0.0))
        return sum(n for n, _ in self.seen.values()), sum(t for _, t in self.seen.values())


def _stage_split(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    data_dir: Path,
    split: str,
    budget: int,
    s: StagingSettings,
    progress: bool,
) -> tuple[int, float]:
    """Generate shards ``{split}-NNNNN.pt`` until ``budget`` tokens exist; returns (tokens, generation seconds).

    Each shard is claimed with a lock file first, so several processes staging into
    the same directory share the work; a lock whose process is gone is taken over.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    seed = s.seed + (0 if split == "train" else EVAL_SEED_OFFSET)
    staged = _Staged(data_dir, split)
    index = 0
    with tqdm(total=budget, desc=f"generating {split} data", unit="tok", disable=not progress) as bar:
        while (have := staged.totals()[0]) < budget:
            bar.update(have - bar.n)
            path = data_dir / f"{split}-{index:05d}.pt"
            lock = data_dir / f".{split}-{index:05d}.lock"
            if not path.is_file() and claim_lock(lock):  # else written, or being written by another process
                t0 = now(target.device)
                chosen, temperature = _shard_plan(index, len(prompts), s.gen_batch, seed)
                shard = _generate_shard(target, tokenizer, [prompts[i] for i in chosen], temperature, s, seed + index)
                shard["tokens"] = _shard_tokens(shard)
                shard["seconds"] = now(target.device) - t0
                tmp = data_dir / f".{split}-{index:05d}.pt.tmp"
                torch.save(shard, tmp)
                tmp.replace(path)  # a shard is either whole or absent
                lock.unlink(missing_ok=True)
            index += 1
        bar.update(have - bar.n)
    return staged.totals()
