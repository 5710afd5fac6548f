"""Train an EAGLE-3 head (Li et al., arXiv 2503.01840) for a target causal LM on text the target generates.

The text is staged exactly as for a draft model (:mod:`hfspec.training.staging`: shards
``data/{split}-NNNNN.pt`` holding, per generated position, the top-k log-probabilities
of the target's T=1 distribution p). Then:

1. **features**: one teacher-forced target forward per staged sample captures the
   hidden states entering the decoder layers the head reads (``hidden_states[i]``,
   i in ``layer_ids``, by default 2, N//2, N-3), stored beside each data shard
   (:mod:`hfspec.training.eagle3_data`);
2. **draft vocabulary**: the ``draft_vocab`` most frequent *generated* tokens of the
   training text (prompt tokens are never drafted, so they are not counted), sorted
   by id; target id = draft id + d2t[draft id]. Other ids cannot be drafted (q = 0);
3. **training-time test**: ``unroll`` draft steps at every position at once, step k
   reading the head's own output of step k-1 and predicting the token k+1 places
   after the context position's next token. Loss Σ_k 0.8^k · CE(p, q), p the staged
   top-k restricted to the draft vocabulary and renormalised, on positions whose
   token the target generated (prompt positions are context only);
4. **evaluation** on the held-out split, per unrolled step: α = E[Σ_x min(p, q)] at
   T=1 and greedy agreement (argmax q = argmax p), with p from a target forward
   and q the head's distribution (0 outside the draft vocabulary); the cost ratio c
   of one head step to one target decode step;
5. the head is written with :func:`hfspec.heads.checkpoint.save_head` in bfloat16,
   in the speculators layout that vLLM serves (or SafeAILab's, ``format="eagle"``),
   without the target's embedding (engines use the target's).

p is the target's distribution and q the draft's, as in Leviathan et al.
(arXiv 2211.17192). Everything lives under ``out_dir``; rerunning resumes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from hfspec.errors import HfspecError
from hfspec.heads.checkpoint import save_head
from hfspec.heads.eagle3 import Eagle3Head, default_layer_ids
from hfspec.models.adapter import decoder_layers, model_vocab_size
from hfspec.training import eagle3_eval as evaluation
from hfspec.training import eagle3_ttt as ttt
from hfspec.training.eagle3_data import StagedSplit, draft_vocabulary, make_batch, stage_features
from hfspec.training.optim import Optim, fit
from hfspec.training.report import SpeedupForecast, final_loss, forecast_speedup, write_report
from hfspec.training.settings import check_settings, default_eval_every, require_positive
from hfspec.training.staging import stage_text
from hfspec.training.target import OFFLINE, load_target, resolve_target

__all__ = ["Eagle3Report", "parse_layer_ids", "train_eagle3_head"]

FORMATS = ("speculators", "eagle")
OFFLINE_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the word "offline" stands for
_FIXED = ("draft_vocab", "unroll", "layer_ids", "batch", "steps", "lr", "seed")  # a checkpoint depends on these


@dataclass(frozen=True)
class Eagle3Report:
    """What an EAGLE-3 training run produced and how well the head drafts on held-out text."""

    target: str
    out_dir: str
    format: str  # layout written: speculators or eagle
    layer_ids: tuple[int, ...]  # target hidden_states indices the head reads
    draft_vocab: int
    vocab_coverage: float  # mean target mass p on the draft vocabulary, held-out positions
    argmax_coverage: float  # share of held-out positions whose target argmax is in the draft vocabulary
    head_params: int
    head_bytes: int  # model.safetensors as written
    train_tokens: int  # target-generated tokens of the training samples
    eval_tokens: int  # held-out positions scored at the first draft step
    unroll: int
    steps: int
    best_step: int  # the step whose weights were kept: best held-out accepted length of the periodic checks
    gen_seconds: float  # generating the text, summed over shards (and processes)
    feature_seconds: float  # staging the target's features, summed over shards (and processes)
    train_seconds: float
    step_seconds: float  # mean wall time of one training step
    final_loss: float  # mean training loss over the last 10% of steps
    alpha: float  # α at T=1 of the first draft step
    greedy_agreement: float  # argmax q == argmax p at the first draft step
    alpha_by_depth: tuple[float, ...]  # α of unrolled step k, given the real text before it
    agreement_by_depth: tuple[float, ...]
    accepted_length: float  # Σ_k Π_{i<=k} α_i: expected accepted drafts per step with γ = unroll, at T=1
    target_step_ms: float  # median batch-1 decode step of the target, KV cache
    head_step_ms: float  # median cached head step, logits included
    cost_ratio: float  # c = head_step_ms / target_step_ms
    speedup_sampled: float  # predicted by Leviathan et al. with α of the first step, best γ
    gamma_sampled: int
    speedup_greedy: float  # the same with the first step's greedy agreement
    gamma_greedy: int
    heldout: tuple[tuple[int, float, float, float], ...] = ()  # (step, α, agreement, accepted length), staged p

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("layer_ids", "alpha_by_depth", "agreement_by_depth"):
            d[key] = list(d[key])
        d["heldout"] = [list(check) for check in self.heldout]
        return d


@dataclass(frozen=True)
class _Settings:
    """Everything that shapes a run; written to ``train/settings.json`` in this order."""

    tokens: int
    eval_tokens: int
    seq_len: int
    gen_batch: int
    top_k: int
    draft_vocab: int
    unroll: int
    layer_ids: tuple[int, ...]
    batch: int
    steps: int
    lr: float
    seed: int
    eval_every: int
    feature_batch: int


def parse_layer_ids(text: str) -> tuple[int, ...]:
    """``"2,15,27"`` -> (2, 15, 27): strictly increasing hidden_states indices."""
    try:
        ids = tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise HfspecError(f"layer ids must be comma-separated integers such as 2,15,27, got {text!r}") from None
    if not ids or any(i < 0 for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
        raise HfspecError(f"layer ids must be non-negative and strictly increasing, such as 2,15,27, got {text!r}")
    return ids


# --------------------------------------------------------------------------- training


def _train(
    head: Eagle3Head,
    train: StagedSplit,
    heldout: StagedSplit,
    t2d: torch.Tensor,
    embedding: torch.Tensor,
    train_dir: Path,
    s: _Settings,
    progress: bool,
) -> tuple[list[float], float, list[tuple], int]:
    """:func:`hfspec.training.optim.fit` the head with the training-time test. The periodic check scores the
    expected accepted length on ``heldout`` against the staged top-k (no target forward).
    Returns (losses, seconds, checks as (step, α, agreement, accepted length), best step).
    """

    def loss_of(idx: list[int]) -> torch.Tensor:
        batch = make_batch(train, idx, t2d, s.unroll)
        return ttt.loss(ttt.forward(head, batch, embedding, s.unroll), batch.labels)

    def check() -> tuple[float, tuple]:
        r = evaluation.evaluate(head, heldout, t2d, embedding, s.unroll, 2 * s.batch)
        return r.accepted, (round(r.alpha[0], 4), round(r.agreement[0], 4), round(r.accepted, 4))

    # EAGLE-3's AdamW betas and clip; no weight decay on a head this small.
    return fit(
        head,
        loss_of,
        check,
        len(train),
        train_dir,
        s,
        optim=Optim(betas=(0.9, 0.95), weight_decay=0.0, clip=0.5),
        desc="training EAGLE-3 head",
        progress=progress,
    )


# --------------------------------------------------------------------------- driver


def train_eagle3_head(
    target: str | Path,
    out_dir: str | Path,
    *,
    draft_vocab: int = 8192,
    unroll: int = 7,
    layer_ids: tuple[int, ...] | None = None,
    tokens: int = 200_000,
    eval_tokens: int = 10_000,
    seq_len: int = 128,
    gen_batch: int = 16,
    top_k: int = 32,
    batch: int = 8,
    steps: int = 3_000,
    lr: float = 1e-3,
    seed: int = 0,
    eval_every: int | None = None,
    format: str = "speculators",
    feature_batch: int = 8,
    resume: bool = True,
    data_only: bool = False,
    progress: bool = True,
) -> Eagle3Report | None:
    """Train an EAGLE-3 head for ``target`` into ``out_dir`` and report how well it drafts
    (``hfspec distill --kind eagle3``).

    ``target`` is a local model directory or ``"offline"`` (SmolLM2-135M-Instruct).
    Text is staged as for a draft model (:func:`hfspec.training.staging.stage_text`: ``tokens``,
    ``eval_tokens``, ``seq_len``, ``gen_batch``, ``top_k``), then the target's features at
    ``layer_ids`` (default 2, N//2, N-3) with ``feature_batch`` sequences per forward.
    ``steps`` batches of ``batch`` sequences train the head with ``unroll`` draft
    steps (the training-time test) over a ``draft_vocab``-token draft vocabulary, at
    peak learning rate ``lr``; every ``eval_every`` steps (default: a tenth of the
    steps, at most 200) it is checked on held-out text and the best weights are kept.
    The head is written to ``out_dir`` in ``format`` (``speculators`` or ``eagle``) in
    bfloat16. With ``data_only`` it returns None once text and features are staged.
    """
    eval_every = default_eval_every(steps) if eval_every is None else eval_every
    require_positive(
        draft_vocab=draft_vocab,
        unroll=unroll,
        tokens=tokens,
        eval_tokens=eval_tokens,
        seq_len=seq_len,
        gen_batch=gen_batch,
        top_k=top_k,
        batch=batch,
        steps=steps,
        eval_every=eval_every,
        feature_batch=feature_batch,
    )
    if not lr > 0:
        raise HfspecError(f"lr must be positive, got {lr}")
    if format not in FORMATS:
        raise HfspecError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    target_path = resolve_target(target, progress)
    out = Path(out_dir)
    target_model, tokenizer, pad = load_target(target_path)
    vocab = model_vocab_size(target_model)
    for name, size in (("draft_vocab", draft_vocab), ("top_k", top_k)):
        if size > vocab:
            raise HfspecError(f"{name} ({size}) must not exceed the target vocabulary ({vocab})")
    layer_ids = _layer_ids(target_model, layer_ids)
    s = _Settings(
        tokens,
        eval_tokens,
        seq_len,
        gen_batch,
        top_k,
        draft_vocab,
        unroll,
        layer_ids,
        batch,
        steps,
        lr,
        seed,
        eval_every,
        feature_batch,
    )
    out.mkdir(parents=True, exist_ok=True)
    if not data_only:
        check_settings(out / "train" / "settings.json", s, resume, _FIXED)

    # 1. Stage target-generated text, then the target's features on it.
    _, gen_seconds = stage_text(target_model, tokenizer, out / "data", s, progress)
    feature_seconds = sum(
        stage_features(target_model, out / "data", out / "features", split, layer_ids, feature_batch, pad, progress)
        for split in ("train", "eval")
    )
    if data_only:
        return None
    train, heldout = (StagedSplit(out / "data", out / "features", split, layer_ids) for split in ("train", "eval"))
    if not len(train) or not len(heldout):
        raise HfspecError(f"{out / 'data'} has no usable train or eval samples; stage more text")

    # 2. The draft vocabulary, fixed at the first run so that a resumed run keeps it.
    vocab_ids = _draft_vocabulary_ids(out / "train" / "vocab.pt", train, draft_vocab, vocab, resume)
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[vocab_ids] = torch.arange(len(vocab_ids))
    embedding = target_model.get_input_embeddings().weight.detach().float()

    # 3. Train with the training-time test.
    head = ttt.build_head(target_model, vocab_ids, layer_ids, seed)
    fitted = _train(head, train, heldout, t2d, embedding, out / "train", s, progress)

    # 4. Measure it: α and agreement per step against the target's exact p, and the cost ratio.
    final = evaluation.evaluate(head, heldout, t2d, embedding, unroll, 4, target=target_model, pad=pad)
    context = torch.cat([heldout.samples[0]["prompt"], heldout.samples[0]["gen"]]).tolist()[:64]
    t_target, t_head = evaluation.step_times(target_model, head, context)
    forecast = forecast_speedup(final.alpha[0], final.agreement[0], t_target, t_head)

    # 5. Write the head in bfloat16; engines read the target's embedding, so it is not stored.
    verifier = OFFLINE_VERIFIER if str(target) == OFFLINE else str(target)
    save_head(
        head,
        out,
        layout=format,
        dtype=torch.bfloat16,
        target=target_model,
        verifier=verifier,
        speculative_tokens=forecast.gamma_greedy,
    )
    report = _report(
        head,
        s,
        final,
        forecast,
        fitted,
        (t_target, t_head),
        dict(
            target=str(target_path),
            out_dir=str(out),
            format=format,
            train_tokens=train.tokens,
            gen_seconds=round(gen_seconds, 1),
            feature_seconds=round(feature_seconds, 1),
        ),
    )
    write_report(out, report, "EAGLE-3 head")
    return report


def _layer_ids(target: PreTrainedModel, layer_ids: tuple[int, ...] | None) -> tuple[int, ...]:
    """The target hidden_states indices the head reads: ``layer_ids`` checked, or EAGLE-3's default three."""
    num_layers = len(decoder_layers(target) or ()) or int(target.config.get_text_config().num_hidden_layers)
    if layer_ids is None:
        if num_layers < 3:
            raise HfspecError(
                f"the target has {num_layers} decoder layers; EAGLE-3's default features need 3 or "
                "more: pass layer_ids (--layer-ids)"
            )
        layer_ids = default_layer_ids(num_layers)
    layer_ids = tuple(int(i) for i in layer_ids)
    if not all(0 <= i < num_layers for i in layer_ids) or list(layer_ids) != sorted(set(layer_ids)):
        raise HfspecError(
            f"layer_ids must be strictly increasing inputs of the target's {num_layers} decoder "
            f"layers (0..{num_layers - 1}), got {list(layer_ids)}"
        )
    return layer_ids


def _draft_vocabulary_ids(vocab_file: Path, train: StagedSplit, size: int, vocab: int, resume: bool) -> torch.Tensor:
    """The draft vocabulary saved in ``vocab_file`` when resuming, else chosen from ``train`` and saved there:
    a resumed run must keep the vocabulary its checkpoint was trained over."""
    if vocab_file.is_file() and resume:
        return torch.load(vocab_file)
    vocab_ids = draft_vocabulary(train.samples, size, vocab)
    torch.save(vocab_ids, vocab_file)
    return vocab_ids


def _report(
    head: Eagle3Head,
    s: _Settings,
    final: evaluation.Heldout,
    forecast: SpeedupForecast,
    fitted: tuple[list[float], float, list[tuple], int],
    step_seconds: tuple[float, float],
    run: dict,
) -> Eagle3Report:
    """The report of a finished run; ``run`` holds the fields known before training."""
    losses, train_seconds, checks, best_step = fitted
    t_target, t_head = step_seconds
    return Eagle3Report(
        **run,
        layer_ids=s.layer_ids,
        draft_vocab=head.config.draft_vocab_size,
        vocab_coverage=round(final.coverage, 4),
        argmax_coverage=round(final.argmax_coverage, 4),
        head_params=sum(p.numel() for p in head.parameters()),
        head_bytes=(Path(run["out_dir"]) / "model.safetensors").stat().st_size,
        eval_tokens=final.positions,
        unroll=s.unroll,
        steps=len(losses),
        best_step=best_step,
        train_seconds=round(train_seconds, 1),
        step_seconds=round(train_seconds / max(1, len(losses)), 3),
        final_loss=final_loss(losses),
        alpha=round(final.alpha[0], 4),
        greedy_agreement=round(final.agreement[0], 4),
        alpha_by_depth=tuple(round(a, 4) for a in final.alpha),
        agreement_by_depth=tuple(round(a, 4) for a in final.agreement),
        accepted_length=round(final.accepted, 3),
        target_step_ms=round(1000 * t_target, 3),
        head_step_ms=round(1000 * t_head, 3),
        **asdict(forecast),
        heldout=tuple(tuple(check) for check in checks),
    )
