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

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from hfspec.drafters.eagle3 import Eagle3Drafter
from hfspec.errors import HfspecError
from hfspec.heads.checkpoint import save_head
from hfspec.heads.eagle3 import Eagle3Config, Eagle3Head, default_layer_ids
from hfspec.models.adapter import decoder_layers, model_vocab_size
from hfspec.training.eagle3_data import (
    Batch,
    Labels,
    StagedSplit,
    draft_vocabulary,
    embed_tokens,
    make_batch,
    stage_features,
)
from hfspec.training.optim import Optim, fit
from hfspec.training.report import (
    REPORT,
    SpeedupForecast,
    decode_step_seconds,
    final_loss,
    forecast_speedup,
    hours,
    write_report,
)
from hfspec.training.settings import check_settings, default_eval_every, require_positive
from hfspec.training.staging import stage_text
from hfspec.training.target import OFFLINE, load_target, resolve_target, rope_theta

__all__ = ["Eagle3Report", "model_card", "parse_layer_ids", "train_eagle3_head"]

FORMATS = ("speculators", "eagle")
DEPTH_WEIGHT = 0.8  # EAGLE-3's loss weight of unrolled step k is 0.8^k
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


# --------------------------------------------------------------------------- the training-time test


def _unroll(
    head: Eagle3Head, fused: torch.Tensor, embeds: torch.Tensor, valid: torch.Tensor, active: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """:meth:`Eagle3Head.unroll` computed only where it is needed; per step the pre-norm outputs (A, H) of the
    ``active`` positions, in row-major order.

    Step 0 needs keys and values at every real position, but the rest of the layer
    only at active ones. A later step's query sees the step-0 keys causally and its
    own column's keys of steps 1..k, so those are scored as one dot product per
    column instead of k more (T, T) blocks.
    """
    batch, length, _ = fused.shape
    attn = head.layer.self_attn
    repeat, scale = attn.heads // attn.kv_heads, attn.head_dim**-0.5
    rows, cols = active.nonzero(as_tuple=True)
    positions = torch.arange(length)[None].expand(batch, length)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = ((causal[None] & valid[:, None, :]) | torch.eye(length, dtype=torch.bool))[:, None]  # (B, 1, T, T)
    hidden, own_keys, own_values, outs = fused, [], [], []
    for k in range(steps):
        cos, sin = head.rope(hidden, positions + k)
        q, key, value = head.layer.qkv(embeds[:, k : k + length], hidden, cos, sin)
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)  # (B, heads, T, D)
        if k == 0:
            keys, values = key, value
        else:
            own_keys.append(key)
            own_values.append(value)
        scores = (q @ keys.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))  # (B, heads, T, T)
        own = [(q * key_i).sum(-1, keepdim=True) * scale for key_i in own_keys]  # each (B, heads, T, 1)
        probs = torch.cat([scores, *own], dim=-1).softmax(-1)
        mixed = probs[..., :length] @ values
        for i, value_i in enumerate(own_values):
            mixed = mixed + probs[..., length + i : length + i + 1] * value_i
        h = hidden[rows, cols] + attn.o_proj(mixed[rows, :, cols].flatten(1))  # (A, H)
        h = h + head.layer.mlp(head.layer.post_attention_layernorm(h))
        outs.append(h)
        if k + 1 < steps:  # the next step reads this step's outputs; inactive columns stay zero
            hidden = fused.new_zeros(fused.shape).index_put((rows, cols), h)
    return outs


def _forward(head: Eagle3Head, batch: Batch, embedding: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """Per unrolled step, the draft-vocabulary logits (N_k, Vd) at its labelled positions."""
    width = batch.valid.shape[1]
    outs = _unroll(
        head,
        head.fuse(batch.features),
        embed_tokens(batch, embedding, width, unroll),
        batch.valid,
        batch.active,
        unroll,
    )
    return [head.logits(out[labels.index]) for out, labels in zip(outs, batch.labels)]


def _loss(logits: list[torch.Tensor], labels: tuple[Labels, ...]) -> torch.Tensor:
    """Σ_k 0.8^k · cross-entropy to the target's top-k restricted to the draft vocabulary, renormalised."""
    total = logits[0].new_zeros(())
    for k, (lk, lab) in enumerate(zip(logits, labels)):
        mass = lab.p.sum(-1)
        keep = mass > 0  # a position whose top-k lies wholly outside the draft vocabulary teaches nothing
        if not bool(keep.any()):
            continue
        p = lab.p[keep] / mass[keep, None]  # (N, m)
        logq = F.log_softmax(lk[keep].float(), dim=-1)
        total = total + DEPTH_WEIGHT**k * -(p * logq.gather(-1, lab.draft_ids[keep].clamp(min=0))).sum(-1).mean()
    return total


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class _Heldout:
    """How well the head drafts on held-out text, per unrolled step and over the draft vocabulary."""

    alpha: tuple[float, ...]  # per unrolled step
    agreement: tuple[float, ...]
    coverage: float  # mean p on the draft vocabulary
    argmax_coverage: float
    positions: int  # scored at step 0

    @property
    def accepted(self) -> float:
        """Σ_k Π_{i<=k} α_i: expected accepted drafts per step of γ = len(alpha), chaining the per-step α."""
        return sum(math.prod(self.alpha[: k + 1]) for k in range(len(self.alpha)))


@torch.inference_mode()
def _evaluate(
    head: Eagle3Head,
    split: StagedSplit,
    t2d: torch.Tensor,
    embedding: torch.Tensor,
    unroll: int,
    batch: int,
    target: PreTrainedModel | None = None,
    pad: int = 0,
) -> _Heldout:
    """Held-out α and agreement per step: p from the staged top-k (a lower bound on α, missing the mass outside
    the top-k), or with ``target`` exactly, from a target forward over each sample."""
    was_training = head.training
    head.eval()
    ids = head.target_ids()
    overlap, agree, count = [0.0] * unroll, [0] * unroll, [0] * unroll
    covered, argmax_in = 0.0, 0
    for start in range(0, len(split), batch):
        idx = list(range(start, min(len(split), start + batch)))
        b = make_batch(split, idx, t2d, unroll)
        p_full = _target_probs(target, [split.samples[i] for i in idx], pad) if target is not None else None
        for k, (logits, lab) in enumerate(zip(_forward(head, b, embedding, unroll), b.labels)):
            q = logits.float().softmax(-1)  # (N, Vd)
            if p_full is None:
                p, best = lab.p, lab.argmax
                overlap[k] += float(torch.minimum(p, q.gather(-1, lab.draft_ids.clamp(min=0))).sum())
            else:
                p_rows = p_full[lab.gen_pos]  # (N, V)
                p, best = p_rows[:, ids], p_rows.argmax(-1)
                overlap[k] += float(torch.minimum(p, q).sum())  # q is 0 outside the draft vocabulary
            agree[k] += int((ids[q.argmax(-1)] == best).sum())
            count[k] += q.shape[0]
            if k == 0:
                covered += float(p.sum())
                argmax_in += int((t2d[best] >= 0).sum())
    head.train(was_training)
    n = [max(1, c) for c in count]
    return _Heldout(
        tuple(o / c for o, c in zip(overlap, n)),
        tuple(a / c for a, c in zip(agree, n)),
        covered / n[0],
        argmax_in / n[0],
        count[0],
    )


def _target_probs(target: PreTrainedModel, samples: list[dict], pad: int) -> torch.Tensor:
    """(Σ G, V) the target's T=1 distribution at each generated position of ``samples``, in order."""
    seqs = [torch.cat([x["prompt"], x["gen"]]).long() for x in samples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
        mask[row, : len(s)] = 1
    logits = target(input_ids=ids, attention_mask=mask).logits
    # Position P + t - 1 predicts generated token t.
    rows = [logits[r, len(x["prompt"]) - 1 : len(x["prompt"]) - 1 + len(x["gen"])] for r, x in enumerate(samples)]
    return torch.cat(rows).float().softmax(-1)


def _step_times(target: PreTrainedModel, head: Eagle3Head, context: list[int], rounds: int = 3) -> tuple[float, float]:
    """Median seconds of one target decode step and one cached head step (as the drafter runs it, logits
    included), taken in turns; both timings wait for the device before reading the clock."""
    drafter = Eagle3Drafter(head, target)
    device = drafter.device
    t_target, t_head = [], []
    for _ in range(rounds):  # in turns, so that both see the same background load
        t_target.append(decode_step_seconds(target, context=len(context), steps=16, warmup=4)[0])
        t_head.append(drafter.step_seconds(context, device, repeats=16))
    return statistics.median(t_target), statistics.median(t_head)


# --------------------------------------------------------------------------- model


def _head_config(target: PreTrainedModel, draft_vocab: int, layer_ids: tuple[int, ...]) -> Eagle3Config:
    """A head with the target's layer shape (EAGLE-3 uses the target's own decoder-layer config)."""
    tc = target.config.get_text_config()
    heads = int(tc.num_attention_heads)
    hidden = int(tc.hidden_size)
    default = default_layer_ids(len(decoder_layers(target) or ()) or int(tc.num_hidden_layers))
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=int(getattr(tc, "intermediate_size", None) or 4 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
        vocab_size=model_vocab_size(target),
        draft_vocab_size=draft_vocab,
        head_dim=getattr(tc, "head_dim", None) or hidden // heads,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta(tc)},
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", None) or 2048),
        layer_ids=None if tuple(layer_ids) == default else tuple(layer_ids),  # default: engines need no ids
    )


def _build_head(target: PreTrainedModel, vocab_ids: torch.Tensor, layer_ids: tuple[int, ...], seed: int) -> Eagle3Head:
    """A fresh head that starts out reading like the target's last layers.

    ``fc`` passes the highest feature through (the target's residual stream entering
    layer N-3), and ``norm`` and ``lm_head`` are the target's final norm and its output
    rows of the draft vocabulary, so the head's output starts in the space the target
    predicts from. On SmolLM2-135M this beat a random fc and a random lm_head.
    """
    torch.manual_seed(seed)
    head = Eagle3Head(_head_config(target, len(vocab_ids), layer_ids))
    hidden = head.config.hidden_size
    with torch.no_grad():
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
        if head.config.feature_width == len(layer_ids) * hidden:
            head.fc.weight.zero_()
            head.fc.weight[:, -hidden:] = torch.eye(hidden)
        out = target.get_output_embeddings().weight
        if out.shape[1] == head.config.hidden_size:
            head.lm_head.weight.copy_(out[vocab_ids].float())
        norm = getattr(target.get_decoder(), "norm", None)
        if isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight.float())
    return head


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
        return _loss(_forward(head, batch, embedding, s.unroll), batch.labels)

    def check() -> tuple[float, tuple]:
        r = _evaluate(head, heldout, t2d, embedding, s.unroll, 2 * s.batch)
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
    head = _build_head(target_model, vocab_ids, layer_ids, seed)
    fitted = _train(head, train, heldout, t2d, embedding, out / "train", s, progress)

    # 4. Measure it: α and agreement per step against the target's exact p, and the cost ratio.
    final = _evaluate(head, heldout, t2d, embedding, unroll, 4, target=target_model, pad=pad)
    context = torch.cat([heldout.samples[0]["prompt"], heldout.samples[0]["gen"]]).tolist()[:64]
    t_target, t_head = _step_times(target_model, head, context)
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
    final: _Heldout,
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


# --------------------------------------------------------------------------- model card


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
  of the chat prompts in `hfspec/prompts/distill.txt`: greedy for a third of the first pass over the prompts,
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
