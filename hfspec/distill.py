"""Distil a small draft model for a target causal LM.

The draft is a plain ``LlamaForCausalLM`` with the target's vocabulary and
tokenizer, tied embeddings initialised from a low-rank (SVD) projection of the
target's input embeddings, trained on text the target itself generates. For
every generated position the target's top-k log-probabilities are staged to
disk, so training minimises the cross-entropy to the target distribution ``p``
(a KL divergence up to a constant) plus the cross-entropy on the target's
sampled token; ``q`` is the draft distribution, as in Leviathan et al.
(arXiv 2211.17192) and Chen et al. (arXiv 2302.01318).

The evaluation reports what speculative decoding cares about on held-out
target text: the acceptance rate α = E[Σ_x min(p(x), q(x))] at temperature 1,
greedy agreement (draft argmax == target argmax), the cost ratio c of one
draft decode step to one target decode step, and the speedup predicted by
Leviathan et al. (eq. 1 and Theorem 3.8): (1 − α^(γ+1)) / ((1 − α)(γc + 1)).

Everything lives under ``out_dir``: ``data/`` (generated shards), ``train/``
(checkpoint), and finally the draft itself, its tokenizer and
``distill_report.json``. Rerunning with the same ``out_dir`` resumes.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from hfspec.models import cache_kwarg
from hfspec.policy import best_gamma

__all__ = [
    "DistillReport",
    "distill",
    "predicted_speedup",
    "decode_step_seconds",
    "add_parser",
    "run",
    "main",
]

log = logging.getLogger(__name__)

_PROMPTS = Path(__file__).resolve().parent / "prompts" / "distill.txt"
_RAW = "raw: "  # prompt-file prefix for text continued without the chat template
_DATA_VERSION = 1


@dataclass(frozen=True)
class DistillReport:
    """What a distillation run produced and how good the draft is."""

    target: str
    out_dir: str
    draft_params: int  # parameters of the draft, embeddings included once
    hidden: int
    layers: int
    train_tokens: int  # target-generated positions used for training
    eval_tokens: int  # held-out positions used for α and agreement
    steps: int
    best_step: int  # the step whose weights were kept: the best held-out α of the periodic checks
    gen_seconds: float  # time spent generating data, summed over shards (and processes)
    train_seconds: float  # wall time spent training (all runs summed)
    final_loss: float  # mean training loss over the last 10% of steps
    alpha: float  # E[Σ_x min(p, q)] at temperature 1
    greedy_agreement: float  # fraction of positions where argmax q == argmax p
    target_step_ms: float  # median batch-1 decode step of the target, KV cache
    draft_step_ms: float  # the same for the draft
    cost_ratio: float  # c = draft_step_ms / target_step_ms
    speedup_sampled: float  # predicted speedup with α at T=1, best γ
    gamma_sampled: int
    speedup_greedy: float  # predicted speedup with α = greedy agreement, best γ
    gamma_greedy: int
    heldout: tuple[tuple[int, float, float], ...] = ()  # (step, α, agreement) of each periodic check

    def to_dict(self) -> dict:
        d = asdict(self)
        d["heldout"] = [list(check) for check in self.heldout]  # as JSON reads it back
        return d


@dataclass(frozen=True)
class _Settings:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tokens: int
    eval_tokens: int
    seq_len: int
    gen_batch: int
    top_k: int
    batch: int
    steps: int
    lr: float
    hard_weight: float
    negatives: int
    seed: int
    save_dtype: str
    eval_every: int  # checkpoint and held-out check every this many steps
    init_from: str = ""  # a draft directory whose weights start training ("" = fresh)


# --------------------------------------------------------------------------- math


def predicted_speedup(alpha: float, cost_ratio: float, max_gamma: int = 8) -> tuple[float, int]:
    """Best expected walltime improvement over γ in 1..max_gamma and that γ.

    Leviathan et al. (arXiv 2211.17192), Theorem 3.8: (1 − α^(γ+1)) / ((1 − α)(γc + 1)).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be non-negative, got {cost_ratio}")
    gamma, speedup = best_gamma(alpha, cost_ratio, maximum=max_gamma)
    return speedup, gamma


def _distill_loss(
    logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor, token: torch.Tensor, hard_weight: float
) -> torch.Tensor:
    """Soft cross-entropy to the target's top-k plus hard cross-entropy on its token.

    logits (N, V) from the draft; top_ids/top_logp (N, k) from the target; token (N,).
    """
    logq = F.log_softmax(logits.float(), dim=-1)  # (N, V)
    p = top_logp.float().exp()  # (N, k), mass outside the top-k is dropped
    soft = -(p * logq.gather(-1, top_ids)).sum(-1)  # (N,)
    hard = -logq.gather(-1, token[:, None]).squeeze(-1)  # (N,)
    return (soft + hard_weight * hard).mean()


def _candidate_logits(
    hidden: torch.Tensor, weight: torch.Tensor, top_ids: torch.Tensor, token: torch.Tensor, negatives: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits over a sampled subset of the vocabulary: the output layer dominates training cost.

    The subset is every id in the target's top-k or sampled, plus ``negatives`` uniform
    draws from the rest, whose logits get log((V − |U|)/|R|) added so that the softmax
    normaliser stays an unbiased estimate of the full one (sampled softmax).
    Returns (logits (N, C), top_ids and token re-indexed into the subset).
    """
    vocab = weight.shape[0]
    must = torch.unique(torch.cat([top_ids.flatten(), token]))  # (U,), sorted
    if negatives <= 0 or negatives >= vocab - must.numel():
        return hidden @ weight.T, top_ids, token
    draws = torch.randint(vocab, (negatives,), generator=generator)
    rest = torch.unique(draws[~torch.isin(draws, must)])  # (R,)
    cand = torch.cat([must, rest])
    logits = hidden @ weight[cand].T  # (N, U + R)
    correction = torch.zeros(cand.numel())
    correction[must.numel():] = math.log((vocab - must.numel()) / max(1, rest.numel()))
    # Every top-k id and token is in ``must``, which leads ``cand``, so its position is its index.
    top_idx = torch.searchsorted(must, top_ids.contiguous())
    return logits + correction, top_idx, torch.searchsorted(must, token.contiguous())


# --------------------------------------------------------------------------- prompts


def _load_prompts(path: Path = _PROMPTS) -> list[str]:
    lines = [ln.rstrip("\n") for ln in path.read_text(encoding="utf-8").splitlines()]
    return [ln.replace("\\n", "\n") for ln in lines if ln.strip()]


def _split_prompts(prompts: list[str], seed: int) -> tuple[list[str], list[str]]:
    """Hold out about 5% of distinct prompts for evaluation; no text is in both."""
    distinct = sorted(set(prompts))
    random.Random(seed).shuffle(distinct)
    held = set(distinct[: max(1, len(distinct) // 20)])
    train = [p for p in prompts if p not in held]
    return train, sorted(held)


def _encode(tokenizer, prompt: str) -> list[int]:
    if prompt.startswith(_RAW):
        ids = tokenizer(prompt[len(_RAW):], add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + ids
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])
    return tokenizer(prompt)["input_ids"]


# --------------------------------------------------------------------------- data


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
def _generate_shard(target, tokenizer, prompts: list[str], temperature: float, s: _Settings, seed: int) -> dict:
    """Generate continuations for a batch of prompts, keeping the target's top-k log-probs."""
    enc = [_encode(tokenizer, p) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
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


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def _shard_tokens(shard: dict) -> int:
    return sum(len(x["gen"]) for x in shard["samples"])


def _stage_data(
    target, tokenizer, prompts: list[str], data_dir: Path, split: str, budget: int, s: _Settings, progress: bool
) -> tuple[int, float]:
    """Generate shards ``{split}-NNNNN.pt`` until ``budget`` tokens exist; returns (tokens, generation seconds).

    Each shard is claimed with a lock file first, so several processes staging into
    the same directory share the work; a lock whose process is gone is taken over.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    seed = s.seed + (0 if split == "train" else 1_000_003)
    seen: dict[Path, tuple[int, float]] = {}  # shard -> (tokens, seconds), whoever wrote it

    def staged() -> tuple[int, float]:
        for path in data_dir.glob(f"{split}-*.pt"):
            if path not in seen:
                shard = torch.load(path)
                seen[path] = (shard["tokens"], shard.get("seconds", 0.0))
        return sum(n for n, _ in seen.values()), sum(t for _, t in seen.values())

    index = 0
    with tqdm(total=budget, desc=f"generating {split} data", unit="tok", disable=not progress) as bar:
        while (have := staged()[0]) < budget:
            bar.update(have - bar.n)
            path = data_dir / f"{split}-{index:05d}.pt"
            lock = data_dir / f".{split}-{index:05d}.lock"
            if not path.is_file() and _claim(lock):  # else written, or being written by another process
                t0 = time.perf_counter()
                chosen, temperature = _shard_plan(index, len(prompts), s.gen_batch, seed)
                shard = _generate_shard(target, tokenizer, [prompts[i] for i in chosen], temperature, s, seed + index)
                shard["tokens"] = _shard_tokens(shard)
                shard["seconds"] = time.perf_counter() - t0
                tmp = data_dir / f".{split}-{index:05d}.pt.tmp"
                torch.save(shard, tmp)
                tmp.replace(path)  # a shard is either whole or absent
                lock.unlink(missing_ok=True)
            index += 1
        bar.update(have - bar.n)
    return staged()


def _claim(lock: Path) -> bool:
    """Atomically create ``lock`` holding our pid; take it over if its process has died."""
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


def stage_text(target, tokenizer, data_dir: Path, s, progress: bool) -> tuple[int, float]:
    """Stage the train and eval splits into ``data_dir``; returns (train tokens, generation seconds of both).

    ``s`` carries ``tokens``, ``eval_tokens``, ``seq_len``, ``gen_batch``, ``top_k`` and ``seed``;
    every kind of draft trains on the same staged text.
    """
    train_prompts, eval_prompts = _split_prompts(_load_prompts(), s.seed)
    n_train, gen_train = _stage_data(target, tokenizer, train_prompts, data_dir, "train", s.tokens, s, progress)
    _, gen_eval = _stage_data(target, tokenizer, eval_prompts, data_dir, "eval", s.eval_tokens, s, progress)
    return n_train, gen_train + gen_eval


def resolve_target(target: str | Path, progress: bool) -> Path:
    """A local target directory; the word ``"offline"`` names SmolLM2-135M-Instruct from hfspec.assets."""
    if str(target) == "offline":
        from hfspec.assets import offline_target_path

        target = offline_target_path(progress=progress)
    path = Path(target)
    if not (path / "config.json").is_file():
        raise ValueError(f"target must be a local model directory with a config.json (or 'offline'), got {target!s}")
    return path


def _load_samples(data_dir: Path, split: str) -> list[dict]:
    samples = []
    for path in sorted(data_dir.glob(f"{split}-*.pt")):
        samples.extend(torch.load(path)["samples"])
    return samples


def _collate(samples: list[dict], pad: int) -> dict:
    """Right-pad prompt+generation rows; ``pos`` marks positions that predict a generated token."""
    rows = [torch.cat([x["prompt"], x["gen"]]).long() for x in samples]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    rows_idx, cols_idx = [], []
    for i, (r, x) in enumerate(zip(rows, samples)):
        input_ids[i, : len(r)] = r
        attention_mask[i, : len(r)] = 1
        start = len(x["prompt"]) - 1  # the last prompt position predicts the first generated token
        rows_idx.append(torch.full((len(x["gen"]),), i))
        cols_idx.append(torch.arange(start, start + len(x["gen"])))
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pos": (torch.cat(rows_idx), torch.cat(cols_idx)),
        "token": torch.cat([x["gen"] for x in samples]).long(),
        "top_ids": torch.cat([x["top_ids"] for x in samples]).long(),
        "top_logp": torch.cat([x["top_logp"] for x in samples]),
    }


# --------------------------------------------------------------------------- model


def _build_draft(target, s: _Settings):
    """A small Llama with the target's vocabulary and SVD-projected, tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    config = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        rope_theta=_rope_theta(tc),
        tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=tc.pad_token_id,
    )
    torch.manual_seed(s.seed)
    draft = LlamaForCausalLM(config)
    emb = target.get_input_embeddings().weight.detach().float()  # (V, D)
    if s.hidden <= emb.shape[1]:
        # Top principal directions of the target's token embeddings: similar tokens stay close.
        _, _, v = torch.svd_lowrank(emb, q=s.hidden, niter=4)
        init = emb @ v  # (V, hidden)
        init = init * (config.initializer_range * math.sqrt(s.hidden) / init.norm(dim=-1).mean())
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(init)
    draft.tie_weights()
    return draft


def _warm_start(draft, path: Path) -> None:
    """Copy the weights of the draft saved at ``path`` into ``draft``; the architectures must match."""
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = AutoConfig.from_pretrained(path)
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "tie_word_embeddings")
    differ = [f"{k} {getattr(saved, k, None)} vs {getattr(draft.config, k, None)}"
              for k in keys if getattr(saved, k, None) != getattr(draft.config, k, None)]
    if differ:
        raise ValueError(
            f"init_from {path} has a different architecture ({'; '.join(differ)}, saved vs requested); "
            "pass the same --hidden/--layers/--heads/--kv-heads/--intermediate as the draft it starts from"
        )
    source = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    draft.load_state_dict(source.state_dict())
    draft.tie_weights()


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def _lr_at(step: int, s: _Settings) -> float:
    warmup = max(1, min(100, s.steps // 10))
    if step < warmup:
        return s.lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, s.steps - warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


@dataclass(frozen=True)
class Optim:
    """AdamW settings and the gradient-norm clip of a training run."""

    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    clip: float = 1.0


def fit(
    model: torch.nn.Module,
    loss_of: Callable[[list[int]], torch.Tensor],
    check: Callable[[], tuple[float, tuple]],
    n_samples: int,
    train_dir: Path,
    s,
    *,
    optim: Optim = Optim(),
    generator: torch.Generator | None = None,
    desc: str = "training draft",
    progress: bool = True,
) -> tuple[list[float], float, list[tuple], int]:
    """Train ``model`` with AdamW, warm-up and cosine decay (:func:`_lr_at`) and clipping, checkpointing to ``train_dir``.

    Each step takes the loss of ``loss_of(sample indices)``, ``s.batch`` indices of a
    shuffled pass over ``n_samples`` (seeded by ``s.seed``). Every ``s.eval_every`` steps
    (and at the last) ``check()`` returns (score, row): the row is kept in the checks,
    and the weights with the best score are the ones left in ``model`` at the end (a
    small model trained for many epochs on fixed text overfits it). A checkpoint in
    ``train_dir`` resumes, with ``generator``'s state. Returns (losses, seconds, checks
    as (step, *row), best step).
    """
    train_dir.mkdir(parents=True, exist_ok=True)
    ckpt = train_dir / "checkpoint.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    step, losses, seconds = 0, [], 0.0
    checks: list[tuple] = []
    best: tuple[int, float, dict] | None = None  # (step, score, weights)
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, losses, seconds = state["step"], state["losses"], state["seconds"]
        checks, best = state.get("checks", []), state.get("best")
        if generator is not None:
            generator.set_state(state["sampler"])
        log.info("resuming training at step %d of %d", step, s.steps)
    batches = _batch_indices(n_samples, s.batch, s.seed, start=step)
    model.train()
    t_last = time.perf_counter()
    with tqdm(total=s.steps, initial=step, desc=desc, unit="step", disable=not progress) as bar:
        while step < s.steps:
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, s)
            loss = loss_of(next(batches))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip)
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if step % s.eval_every == 0 or step == s.steps:
                was_training = model.training
                model.eval()
                score, row = check()
                model.train(was_training)
                checks.append((step, *row))
                if best is None or score >= best[1]:  # on a tie, the later (longer trained) weights
                    best = (step, score, {k: v.detach().clone() for k, v in model.state_dict().items()})
                bar.set_postfix(loss=f"{losses[-1]:.3f}", heldout=f"{row[0]:.3f}", best=best[0])
                now = time.perf_counter()
                seconds += now - t_last
                t_last = now
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "losses": losses,
                         "seconds": seconds, "checks": checks, "best": best}
                if generator is not None:
                    state["sampler"] = generator.get_state()
                tmp = train_dir / "checkpoint.pt.tmp"
                torch.save(state, tmp)
                tmp.replace(ckpt)
    if best is not None:
        model.load_state_dict(best[2])
    model.eval()
    return losses, seconds, checks, best[0] if best is not None else step


def _batch_indices(n: int, batch: int, seed: int, start: int = 0) -> Iterator[list[int]]:
    """Sample indices of each step: shuffled passes over ``n``, from step ``start`` on (a resumed run sees the same)."""
    rng = random.Random(seed)
    order: list[int] = []
    step = 0
    while True:
        if not order:
            order = list(range(n))
            rng.shuffle(order)
        chosen, order = order[:batch], order[batch:]
        if step >= start:
            yield chosen
        step += 1


def _train(
    draft, samples: list[dict], heldout: list[dict], train_dir: Path, pad: int, s: _Settings, progress: bool
) -> tuple[list[float], float, list[tuple[int, float, float]], int]:
    """:func:`fit` the draft; the periodic check is α on ``heldout`` against the staged target top-k
    (:func:`_staged_acceptance`, no target forward). Returns (losses, seconds, checks as (step, α,
    agreement), best step).
    """
    sampler = torch.Generator().manual_seed(s.seed)

    def loss_of(idx: list[int]) -> torch.Tensor:
        batch = _collate([samples[i] for i in idx], pad)
        hidden = draft.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        # Project only the positions that predict generated tokens, onto a sampled vocabulary.
        logits, top_ids, token = _candidate_logits(
            hidden[batch["pos"]], draft.lm_head.weight, batch["top_ids"], batch["token"], s.negatives, sampler
        )
        return _distill_loss(logits, top_ids, batch["top_logp"], token, s.hard_weight)

    def check() -> tuple[float, tuple]:
        alpha, agreement = _staged_acceptance(draft, heldout, pad, s.batch)
        return alpha, (round(alpha, 4), round(agreement, 4))

    return fit(draft, loss_of, check, len(samples), train_dir, s, generator=sampler, progress=progress)


# --------------------------------------------------------------------------- evaluation


@torch.inference_mode()
def _acceptance(target, draft, samples: list[dict], pad: int, batch: int) -> tuple[float, float, int]:
    """(α at T=1, greedy agreement, positions) over the generated positions of ``samples``."""
    overlap, agree, count = 0.0, 0, 0
    for i in range(0, len(samples), batch):
        b = _collate(samples[i : i + batch], pad)
        p = target(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[b["pos"]].float()  # (N, V)
        q = draft(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[b["pos"]].float()
        overlap += float(torch.minimum(p.softmax(-1), q.softmax(-1)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        count += p.shape[0]
    return overlap / max(1, count), agree / max(1, count), count


@torch.inference_mode()
def _staged_acceptance(draft, samples: list[dict], pad: int, batch: int) -> tuple[float, float]:
    """(α, greedy agreement) of ``draft`` against the target's staged top-k: no target forward.

    α sums min(p, q) over the target's top-k ids only, so it falls short of the full
    α by at most the target's mass outside its top-k; the argmax is the first top-k id.
    """
    was_training = draft.training
    draft.eval()
    overlap, agree, count = 0.0, 0, 0
    for i in range(0, len(samples), batch):
        b = _collate(samples[i : i + batch], pad)
        logq = draft(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[b["pos"]].float()
        logq = logq.log_softmax(-1)  # (N, V)
        p = b["top_logp"].float().exp()  # (N, k)
        overlap += float(torch.minimum(p, logq.gather(-1, b["top_ids"]).exp()).sum())
        agree += int((logq.argmax(-1) == b["top_ids"][:, 0]).sum())
        count += logq.shape[0]
    draft.train(was_training)
    return overlap / max(1, count), agree / max(1, count)


@torch.inference_mode()
def decode_step_seconds(
    *models, context: int = 64, steps: int = 32, warmup: int = 8, seed: int = 0
) -> tuple[float, ...]:
    """Median wall time of one batch-1 decode step with a KV cache, after warm-up, per model.

    The models take their steps in turn, so that on a shared machine each sees the
    same background load and the ratio of their times stays fair.
    """
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(m.config.vocab_size for m in models), (1, context), generator=gen)
    state = []
    for model in models:
        cache = DynamicCache(config=model.config)
        key = cache_kwarg(type(model))
        token = model(input_ids=ids, use_cache=True, **{key: cache}).logits[:, -1:].argmax(-1)
        state.append([model, key, cache, token])
    times: list[list[float]] = [[] for _ in models]
    for i in range(warmup + steps):
        for j, (model, key, cache, token) in enumerate(state):
            t0 = time.perf_counter()
            state[j][3] = model(input_ids=token, use_cache=True, **{key: cache}).logits[:, -1:].argmax(-1)
            if i >= warmup:
                times[j].append(time.perf_counter() - t0)
    return tuple(statistics.median(t) for t in times)


# --------------------------------------------------------------------------- driver


def distill(
    target: str | Path,
    out_dir: str | Path,
    *,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    tokens: int = 200_000,
    eval_tokens: int = 10_000,
    seq_len: int = 128,
    gen_batch: int = 16,
    top_k: int = 32,
    batch: int = 16,
    steps: int = 2_000,
    lr: float = 2e-3,
    hard_weight: float = 0.5,
    negatives: int = 4096,
    seed: int = 0,
    save_dtype: str = "float16",
    resume: bool = True,
    data_only: bool = False,
    eval_every: int | None = None,
    init_from: str | Path | None = None,
    progress: bool = True,
) -> DistillReport | None:
    """Distil a draft for ``target`` into ``out_dir`` and report its quality.

    ``target`` is a local model directory (or the word ``"offline"`` for
    SmolLM2-135M-Instruct from :func:`hfspec.assets.offline_target_path`).
    ``tokens`` and ``eval_tokens`` count target-generated positions; ``seq_len``
    is the longest continuation per prompt; ``steps`` batches of ``batch``
    sequences are trained, each against the target's top-k plus ``negatives``
    sampled vocabulary entries (0 trains against the full vocabulary).
    With ``resume`` (the default) staged data and the training checkpoint in ``out_dir`` are reused, so rerunning continues.
    With ``data_only`` it returns None once the data is staged; such a run
    beside a full one on the same ``out_dir`` shares the generation work.
    Every ``eval_every`` steps (default: a tenth of the steps, at most 200) the draft
    is checked on the held-out data against the staged target top-k, and the weights
    with the best α are the ones saved.
    ``init_from`` names an earlier draft (same architecture) whose weights start
    training instead of a fresh initialisation, with a new optimiser and schedule:
    how to train a draft further on more data or for more steps.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kv_heads = heads if kv_heads is None else kv_heads
    eval_every = max(1, min(200, steps // 10)) if eval_every is None else eval_every
    intermediate = 4 * hidden if intermediate is None else intermediate
    require_positive(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                     tokens=tokens, eval_tokens=eval_tokens, seq_len=seq_len, gen_batch=gen_batch, top_k=top_k,
                     batch=batch, steps=steps, eval_every=eval_every)
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads}), and heads by kv_heads ({kv_heads})")
    if save_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"save_dtype must be float32, float16 or bfloat16, got {save_dtype!r}")
    target_path = resolve_target(target, progress)
    if init_from is not None and not (Path(init_from) / "config.json").is_file():
        raise ValueError(f"init_from must be a draft directory with a config.json, got {init_from!s}")
    s = _Settings(hidden, layers, heads, kv_heads, intermediate, tokens, eval_tokens, seq_len, gen_batch, top_k,
                  batch, steps, lr, hard_weight, negatives, seed, save_dtype, eval_every=eval_every,
                  init_from="" if init_from is None else str(Path(init_from).resolve()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not data_only:
        _check_settings(out / "train" / "settings.json", s, resume)

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target_model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if top_k > target_model.config.vocab_size:
        raise ValueError(f"top_k ({top_k}) must not exceed the target vocabulary ({target_model.config.vocab_size})")

    # 1. Stage target-generated text, resumably, for training and for held-out evaluation.
    n_train, gen_seconds = stage_text(target_model, tokenizer, out / "data", s, progress)
    if data_only:
        return None

    # 2. Train the draft against the target's distributions.
    draft = _build_draft(target_model, s)
    if s.init_from:
        _warm_start(draft, Path(s.init_from))  # a checkpoint in out_dir, if any, still wins: it resumes
    eval_samples = _load_samples(out / "data", "eval")
    losses, train_seconds, checks, best_step = _train(
        draft, _load_samples(out / "data", "train"), eval_samples, out / "train", pad, s, progress
    )

    # 3. Save it with the target's tokenizer so it loads by path on its own.
    draft.generation_config.pad_token_id = pad
    draft.to(getattr(torch, save_dtype)).save_pretrained(out)
    draft.float()
    tokenizer.save_pretrained(out)

    # 4. Measure acceptance on held-out prompts and the cost ratio.
    alpha, agreement, n_pos = _acceptance(target_model, draft, eval_samples, pad, batch)
    t_target, t_draft = decode_step_seconds(target_model, draft, steps=64)
    c = t_draft / t_target
    sp_a, g_a = predicted_speedup(alpha, c)
    sp_g, g_g = predicted_speedup(agreement, c)
    tail = losses[-max(1, len(losses) // 10):]
    report = DistillReport(
        target=str(target_path), out_dir=str(out), draft_params=sum(p.numel() for p in draft.parameters()),
        hidden=hidden, layers=layers, train_tokens=n_train, eval_tokens=n_pos, steps=len(losses), best_step=best_step,
        gen_seconds=round(gen_seconds, 1), train_seconds=round(train_seconds, 1),
        final_loss=round(sum(tail) / len(tail), 4), alpha=round(alpha, 4), greedy_agreement=round(agreement, 4),
        target_step_ms=round(1000 * t_target, 3), draft_step_ms=round(1000 * t_draft, 3), cost_ratio=round(c, 4),
        speedup_sampled=round(sp_a, 3), gamma_sampled=g_a, speedup_greedy=round(sp_g, 3), gamma_greedy=g_g,
        heldout=tuple(tuple(c) for c in checks),
    )
    (out / "distill_report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    log.info("distilled draft saved to %s: %s", out, report.to_dict())
    return report


_MODEL_FIXED = ("hidden", "layers", "heads", "kv_heads", "intermediate", "batch", "steps", "lr", "hard_weight",
                "negatives", "seed", "init_from")


def require_positive(**values: int) -> None:
    """Refuse any of ``values`` below 1, naming it."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")


def _check_settings(path: Path, s, resume: bool, fixed: tuple[str, ...] = _MODEL_FIXED) -> None:
    """Refuse to resume into a checkpoint made with different ``fixed`` settings (architecture, schedule)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(json.dumps(asdict(s)))  # as the saved file reads back (tuples become lists)
    if path.is_file() and resume:
        saved = json.loads(path.read_text())
        changed = [k for k in fixed if saved.get(k, "" if k == "init_from" else None) != current[k]]
        if changed and (path.parent / "checkpoint.pt").is_file():
            raise ValueError(
                f"{path.parent} holds a checkpoint trained with different {', '.join(changed)}; "
                "use a new out_dir, or pass resume=False (--no-resume) to retrain from scratch"
            )
    elif not resume:
        for stale in (path.parent / "checkpoint.pt",):
            stale.unlink(missing_ok=True)
    path.write_text(json.dumps(current, indent=2) + "\n")


# --------------------------------------------------------------------------- command line


# Flags that only one --kind reads; the other refuses them instead of ignoring them.
MODEL_FLAGS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "hard_weight", "negatives", "save_dtype",
               "init_from")
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
    p.add_argument("--kind", choices=KINDS, default="model",
                   help="model: an independent small draft model (default); eagle3: an EAGLE-3 head that drafts "
                   "from the target's own hidden states")
    p.add_argument("--target", required=True, help="local target model directory, or 'offline' for SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, help="output directory (data, checkpoint, draft, report); reused to resume")
    p.add_argument("--tokens", type=int, default=200_000, help="target-generated training tokens (default 200000)")
    p.add_argument("--eval-tokens", type=int, default=10_000, help="held-out evaluation tokens (default 10000)")
    p.add_argument("--seq-len", type=int, default=128, help="longest continuation generated per prompt (default 128)")
    p.add_argument("--gen-batch", type=int, default=16, help="prompts generated together (default 16)")
    p.add_argument("--top-k", type=int, default=32, help="target log-probs kept per position (default 32)")
    p.add_argument("--batch", type=int, default=None, help="training sequences per step (default 16, eagle3: 8)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 2000, eagle3: 3000)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate, warm-up then cosine decay to 10%% (default 2e-3, eagle3: 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="checkpoint and check the draft on held-out data every N steps; the weights with the "
                   "best held-out α are the ones saved (default: a tenth of --steps, at most 200)")
    p.add_argument("--no-resume", dest="resume", action="store_false", help="retrain from scratch (staged data is kept)")
    p.add_argument("--data-only", action="store_true",
                   help="only stage the data (and for eagle3 the target features), then exit; run beside a full "
                   "run on the same --out to share the work")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    model = p.add_argument_group("--kind model")
    model.add_argument("--hidden", type=int, default=None, help="draft hidden size (default 128)")
    model.add_argument("--layers", type=int, default=None, help="draft transformer layers (default 4)")
    model.add_argument("--heads", type=int, default=None, help="draft attention heads (default 4)")
    model.add_argument("--kv-heads", type=int, default=None, help="draft key/value heads (default: --heads)")
    model.add_argument("--intermediate", type=int, default=None, help="draft MLP size (default 4 x hidden)")
    model.add_argument("--hard-weight", type=float, default=None,
                       help="weight of the hard-label cross-entropy (default 0.5)")
    model.add_argument("--negatives", type=int, default=None,
                       help="random vocabulary negatives per step for the sampled softmax; 0 = full vocabulary "
                       "(default 4096)")
    model.add_argument("--save-dtype", default=None, choices=["float32", "float16", "bfloat16"],
                       help="dtype of the saved draft weights (default float16)")
    model.add_argument("--init-from", default=None, metavar="DIR",
                       help="start from the weights of an earlier draft with the same architecture (new optimiser "
                       "and schedule), to train it further on more data or for more steps")
    eagle = p.add_argument_group("--kind eagle3")
    eagle.add_argument("--draft-vocab", type=int, default=None,
                       help="draft vocabulary: the N most frequent generated tokens of the training text "
                       "(default 8192)")
    eagle.add_argument("--unroll", type=int, default=None,
                       help="draft steps unrolled in training, the training-time test (default 7)")
    eagle.add_argument("--layer-ids", default=None, metavar="I,J,K",
                       help="target hidden_states indices the head reads (default: 2, N//2, N-3 of N layers)")
    eagle.add_argument("--format", default=None, choices=["speculators", "eagle"],
                       help="layout of the saved head: speculators (vLLM, default) or eagle (SafeAILab/EAGLE, "
                       "SGLang)")
    eagle.add_argument("--feature-batch", type=int, default=None,
                       help="sequences per target forward when staging features (default 8)")
    p.set_defaults(func=run)
    return p


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def run(args: argparse.Namespace) -> int:
    """Run the ``distill`` subcommand; prints the report as JSON."""
    kind = getattr(args, "kind", "model")
    model_only, eagle_only = _given(args, MODEL_FLAGS), _given(args, EAGLE3_FLAGS)
    wrong = eagle_only if kind == "model" else model_only
    if wrong:
        flags = ", ".join("--" + name.replace("_", "-") for name in wrong)
        other = "eagle3" if kind == "model" else "model"
        raise ValueError(f"{flags} only apply to --kind {other}; drop them or pass --kind {other}")
    common = dict(tokens=args.tokens, eval_tokens=args.eval_tokens, seq_len=args.seq_len, gen_batch=args.gen_batch,
                  top_k=args.top_k, seed=args.seed, resume=args.resume, data_only=args.data_only,
                  eval_every=args.eval_every, progress=not args.quiet, **_given(args, ("batch", "steps", "lr")))
    if kind == "eagle3":
        from hfspec.distill_eagle3 import distill_eagle3, parse_layer_ids

        if "layer_ids" in eagle_only:
            eagle_only["layer_ids"] = parse_layer_ids(eagle_only["layer_ids"])
        report = distill_eagle3(args.target, args.out, **common, **eagle_only)
    else:
        report = distill(args.target, args.out, **common, **model_only)
    if report is not None:
        print(json.dumps(report.to_dict(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hfspec.distill ...``: the ``distill`` subcommand on its own."""
    parser = argparse.ArgumentParser(prog="python -m hfspec.distill")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["distill", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
