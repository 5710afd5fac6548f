"""Distil a small draft model for a target causal LM.

The draft is a plain ``LlamaForCausalLM`` with the target's vocabulary and
tokenizer, tied embeddings initialised from a low-rank (SVD) projection of the
target's input embeddings, trained on text the target itself generates
(:mod:`hfspec.training.staging`). For every generated position the target's top-k
log-probabilities are staged to disk, so training minimises the cross-entropy to the
target distribution ``p`` (a KL divergence up to a constant) plus the cross-entropy on
the target's sampled token; ``q`` is the draft distribution, as in Leviathan et al.
(arXiv 2211.17192) and Chen et al. (arXiv 2302.01318). The loss, and α measured on held-out text, are
:mod:`hfspec.training.draft_objective`'s.

The evaluation reports what speculative decoding cares about on held-out
target text: the acceptance rate α = E[Σ_x min(p(x), q(x))] at temperature 1,
greedy agreement (draft argmax == target argmax), the cost ratio c of one
draft decode step to one target decode step, and the speedup predicted by
Leviathan et al. (:mod:`hfspec.training.report`).

Everything lives under ``out_dir``: ``data/`` (generated shards), ``train/``
(checkpoint), and finally the draft itself, its tokenizer and
``distill_report.json``. Rerunning with the same ``out_dir`` resumes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hfspec.errors import HfspecError
from hfspec.training import draft_objective as objective
from hfspec.training.optim import fit
from hfspec.training.report import decode_step_seconds, final_loss, forecast_speedup, write_report
from hfspec.training.settings import check_settings, default_eval_every, require_positive
from hfspec.training.staging import load_samples, stage_text
from hfspec.training.target import load_target, resolve_target, rope_theta

__all__ = ["DraftModelReport", "train_draft_model"]

SAVE_DTYPES = ("float32", "float16", "bfloat16")
# A checkpoint depends on these; resuming with any of them changed is refused.
_FIXED = (
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "intermediate",
    "batch",
    "steps",
    "lr",
    "hard_weight",
    "negatives",
    "seed",
    "init_from",
)


@dataclass(frozen=True)
class DraftModelReport:
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
    """Everything that shapes a run; written to ``train/settings.json`` in this order."""

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

    def validate(self) -> None:
        """Refuse settings no draft can be built or trained with, naming the fix."""
        require_positive(
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            intermediate=self.intermediate,
            tokens=self.tokens,
            eval_tokens=self.eval_tokens,
            seq_len=self.seq_len,
            gen_batch=self.gen_batch,
            top_k=self.top_k,
            batch=self.batch,
            steps=self.steps,
            eval_every=self.eval_every,
        )
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise HfspecError(
                f"hidden ({self.hidden}) must be divisible by heads ({self.heads}), and heads by "
                f"kv_heads ({self.kv_heads})"
            )
        if self.save_dtype not in SAVE_DTYPES:
            raise HfspecError(f"save_dtype must be float32, float16 or bfloat16, got {self.save_dtype!r}")


# --------------------------------------------------------------------------- model


def _build_draft(target: PreTrainedModel, s: _Settings) -> LlamaForCausalLM:
    """A small Llama with the target's vocabulary and SVD-projected, tied embeddings."""
    tc = target.config
    config = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        rope_theta=rope_theta(tc),
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


def _warm_start(draft: LlamaForCausalLM, path: Path) -> None:
    """Copy the weights of the draft saved at ``path`` into ``draft``; the architectures must match."""
    saved = AutoConfig.from_pretrained(path)
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "tie_word_embeddings",
    )
    differ = [
        f"{k} {getattr(saved, k, None)} vs {getattr(draft.config, k, None)}"
        for k in keys
        if getattr(saved, k, None) != getattr(draft.config, k, None)
    ]
    if differ:
        raise HfspecError(
            f"init_from {path} has a different architecture ({'; '.join(differ)}, saved vs requested); "
            "pass the same --hidden/--layers/--heads/--kv-heads/--intermediate as the draft it starts from"
        )
    source = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    draft.load_state_dict(source.state_dict())
    draft.tie_weights()


def _train(
    draft: LlamaForCausalLM,
    samples: list[dict],
    heldout: list[dict],
    train_dir: Path,
    pad: int,
    s: _Settings,
    progress: bool,
) -> tuple[list[float], float, list[tuple[int, float, float]], int]:
    """:func:`hfspec.training.optim.fit` the draft; the periodic check is α on ``heldout`` against the staged
    target top-k (:func:`hfspec.training.draft_objective.staged_acceptance`, no target forward). Returns (losses,
    seconds, checks as (step, α, agreement), best step).
    """
    sampler = torch.Generator().manual_seed(s.seed)

    def loss_of(idx: list[int]) -> torch.Tensor:
        batch = objective.collate([samples[i] for i in idx], pad)
        hidden = draft.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        # Project only the positions that predict generated tokens, onto a sampled vocabulary.
        logits, top_ids, token = objective.candidate_logits(
            hidden[batch["pos"]], draft.lm_head.weight, batch["top_ids"], batch["token"], s.negatives, sampler
        )
        return objective.distill_loss(logits, top_ids, batch["top_logp"], token, s.hard_weight)

    def check() -> tuple[float, tuple]:
        alpha, agreement = objective.staged_acceptance(draft, heldout, pad, s.batch)
        return alpha, (round(alpha, 4), round(agreement, 4))

    return fit(draft, loss_of, check, len(samples), train_dir, s, generator=sampler, progress=progress)


# --------------------------------------------------------------------------- driver


def train_draft_model(
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
) -> DraftModelReport | None:
    """Distil a draft for ``target`` into ``out_dir`` and report its quality (``hfspec distill``).

    ``target`` is a local model directory (or the word ``"offline"`` for
    SmolLM2-135M-Instruct from :func:`hfspec.models.assets.offline_target_path`).
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
    s = _Settings(
        hidden,
        layers,
        heads,
        heads if kv_heads is None else kv_heads,
        4 * hidden if intermediate is None else intermediate,
        tokens,
        eval_tokens,
        seq_len,
        gen_batch,
        top_k,
        batch,
        steps,
        lr,
        hard_weight,
        negatives,
        seed,
        save_dtype,
        eval_every=default_eval_every(steps) if eval_every is None else eval_every,
        init_from="" if init_from is None else str(Path(init_from).resolve()),
    )
    s.validate()
    target_path = resolve_target(target, progress)
    if init_from is not None and not (Path(init_from) / "config.json").is_file():
        raise HfspecError(f"init_from must be a draft directory with a config.json, got {init_from!s}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not data_only:
        check_settings(out / "train" / "settings.json", s, resume, _FIXED)
    target_model, tokenizer, pad = load_target(target_path)
    if top_k > target_model.config.vocab_size:
        raise HfspecError(f"top_k ({top_k}) must not exceed the target vocabulary ({target_model.config.vocab_size})")

    # 1. Stage target-generated text, resumably, for training and for held-out evaluation.
    n_train, gen_seconds = stage_text(target_model, tokenizer, out / "data", s, progress)
    if data_only:
        return None

    # 2. Train the draft against the target's distributions.
    draft = _build_draft(target_model, s)
    if s.init_from:
        _warm_start(draft, Path(s.init_from))  # a checkpoint in out_dir, if any, still wins: it resumes
    eval_samples = load_samples(out / "data", "eval")
    fitted = _train(draft, load_samples(out / "data", "train"), eval_samples, out / "train", pad, s, progress)

    # 3. Save it with the target's tokenizer so it loads by path on its own.
    _save_draft(draft, tokenizer, out, pad, save_dtype)

    # 4. Measure acceptance on held-out prompts and the cost ratio.
    report = _measure(
        target_model,
        draft,
        eval_samples,
        pad,
        s,
        fitted,
        dict(target=str(target_path), out_dir=str(out), train_tokens=n_train, gen_seconds=round(gen_seconds, 1)),
    )
    write_report(out, report, "distilled draft")
    return report


def _save_draft(
    draft: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, pad: int, save_dtype: str
) -> None:
    """Write the draft in ``save_dtype`` with the target's tokenizer, so that it loads by path on its own."""
    draft.generation_config.pad_token_id = pad
    draft.to(getattr(torch, save_dtype)).save_pretrained(out)
    draft.float()  # measured in float32 below, like the target
    tokenizer.save_pretrained(out)


def _measure(
    target: PreTrainedModel,
    draft: LlamaForCausalLM,
    eval_samples: list[dict],
    pad: int,
    s: _Settings,
    fitted: tuple[list[float], float, list[tuple], int],
    run: dict,
) -> DraftModelReport:
    """The report: α and agreement against a target forward on held-out text, step times, predicted speedup.

    ``fitted`` is what :func:`_train` returned; ``run`` the report fields known before training.
    """
    losses, train_seconds, checks, best_step = fitted
    alpha, agreement, n_pos = objective.acceptance(target, draft, eval_samples, pad, s.batch)
    t_target, t_draft = decode_step_seconds(target, draft, steps=64)
    forecast = forecast_speedup(alpha, agreement, t_target, t_draft)
    return DraftModelReport(
        **run,
        draft_params=sum(p.numel() for p in draft.parameters()),
        hidden=s.hidden,
        layers=s.layers,
        eval_tokens=n_pos,
        steps=len(losses),
        best_step=best_step,
        train_seconds=round(train_seconds, 1),
        final_loss=final_loss(losses),
        alpha=round(alpha, 4),
        greedy_agreement=round(agreement, 4),
        target_step_ms=round(1000 * t_target, 3),
        draft_step_ms=round(1000 * t_draft, 3),
        **asdict(forecast),
        heldout=tuple(tuple(c) for c in checks),
    )
