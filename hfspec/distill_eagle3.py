"""Train an EAGLE-3 head (Li et al., arXiv 2503.01840) for a target causal LM on text the target generates.

The text is staged exactly as for ``hfspec distill`` (:mod:`hfspec.distill`: shards
``data/{split}-NNNNN.pt`` holding, per generated position, the top-k log-probabilities
of the target's T=1 distribution p). Then:

1. **features**: one teacher-forced target forward per staged sample captures the
   hidden states entering the decoder layers the head reads (``hidden_states[i]``,
   i in ``layer_ids``, by default 2, N//2, N-3), stored as bfloat16 in
   ``features/{split}-NNNNN.pt`` beside each data shard, for positions 0..L-3 of a
   sample of L tokens (the last two pair with no token to predict);
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
5. the head is written with :func:`hfspec.drafters.eagle3.save_head` in bfloat16,
   in the speculators layout that vLLM serves (or SafeAILab's, ``format="eagle"``),
   without the target's embedding (engines use the target's).

p is the target's distribution and q the draft's, as in Leviathan et al.
(arXiv 2211.17192). Everything lives under ``out_dir``; rerunning resumes.
"""
from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from hfspec.distill import (
    Optim, _check_settings, _claim, decode_step_seconds, fit, predicted_speedup, require_positive, resolve_target,
    stage_text,
)
from hfspec.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, default_layer_ids, save_head
from hfspec.models import decoder_layers, hidden_features, model_vocab_size

__all__ = ["Eagle3Report", "distill_eagle3", "draft_vocabulary", "model_card", "parse_layer_ids", "stage_features"]

log = logging.getLogger(__name__)

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
        raise ValueError(f"layer ids must be comma-separated integers such as 2,15,27, got {text!r}") from None
    if not ids or any(i < 0 for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
        raise ValueError(f"layer ids must be non-negative and strictly increasing, such as 2,15,27, got {text!r}")
    return ids


# --------------------------------------------------------------------------- features


def _shard_features(target, samples: list[dict], layer_ids: tuple[int, ...], batch: int,
                    pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of positions 0..L-3 of each sample: (Σ (L-2), F) bfloat16 and offsets (n + 1,)."""
    seqs = [torch.cat([x["prompt"], x["gen"]]).long() for x in samples]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths together: less padding
    parts: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for start in range(0, len(order), batch):
        chunk = order[start: start + batch]
        width = max(len(seqs[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):  # right padding: causal attention keeps real positions exact
            ids[row, : len(seqs[i])] = seqs[i]
            mask[row, : len(seqs[i])] = 1
        feats = hidden_features(target, ids, mask, layer_ids)  # (b, W, F)
        for row, i in enumerate(chunk):
            parts[i] = feats[row, : max(0, len(seqs[i]) - 2)].to(torch.bfloat16)
    sizes = torch.tensor([len(p) for p in parts], dtype=torch.long)
    return torch.cat(parts), torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])


def _read_features(path: Path, layer_ids: tuple[int, ...]) -> dict:
    feats = torch.load(path, mmap=True, weights_only=True)
    if tuple(feats["layer_ids"]) != tuple(layer_ids):
        raise ValueError(f"{path} holds features of target layers {list(feats['layer_ids'])}, not "
                         f"{list(layer_ids)}; pass --layer-ids {','.join(map(str, feats['layer_ids']))} or delete "
                         f"{path.parent} to stage them again")
    return feats


def stage_features(target, data_dir: Path, feature_dir: Path, split: str, layer_ids: tuple[int, ...], batch: int,
                   pad: int, progress: bool = True) -> float:
    """Write ``feature_dir/{split}-NNNNN.pt`` for each data shard without one; returns the seconds they took.

    Resumable and shareable like the text staging: each shard is claimed with a lock
    file, so several processes can stage into one directory; this one returns when
    every shard present at its start has features (waiting for others' claims).
    """
    feature_dir.mkdir(parents=True, exist_ok=True)
    shards = sorted(data_dir.glob(f"{split}-*.pt"))
    with tqdm(total=len(shards), desc=f"target features ({split})", unit="shard", disable=not progress) as bar:
        while missing := [p for p in shards if not (feature_dir / p.name).is_file()]:
            bar.update(len(shards) - len(missing) - bar.n)
            done = 0
            for path in missing:
                out, lock = feature_dir / path.name, feature_dir / f".{path.stem}.lock"
                if out.is_file() or not _claim(lock):
                    continue
                try:
                    t0 = time.perf_counter()
                    values, offsets = _shard_features(target, torch.load(path)["samples"], layer_ids, batch, pad)
                    tmp = feature_dir / f".{path.name}.tmp"
                    torch.save({"layer_ids": list(layer_ids), "values": values, "offsets": offsets,
                                "seconds": time.perf_counter() - t0}, tmp)
                    tmp.replace(out)  # a feature shard is either whole or absent
                finally:
                    lock.unlink(missing_ok=True)
                done += 1
                bar.update()
            if not done:  # the rest are claimed by live processes
                time.sleep(5)
        bar.update(len(shards) - bar.n)
    return sum(float(_read_features(feature_dir / p.name, layer_ids)["seconds"]) for p in shards)


# --------------------------------------------------------------------------- data


class _Split:
    """The staged samples of one split that have features, with those features memory-mapped."""

    def __init__(self, data_dir: Path, feature_dir: Path, split: str, layer_ids: tuple[int, ...]):
        self.samples: list[dict] = []
        self.features: list[torch.Tensor] = []  # per sample (L-2, F) bfloat16
        for path in sorted(data_dir.glob(f"{split}-*.pt")):
            if not (feature_dir / path.name).is_file():
                continue  # a shard staged after the features: the next run picks it up
            feats = _read_features(feature_dir / path.name, layer_ids)
            values, offsets = feats["values"], feats["offsets"].tolist()
            for i, sample in enumerate(torch.load(path)["samples"]):
                if len(sample["prompt"]) + len(sample["gen"]) >= 3:  # else no position predicts a token
                    self.samples.append(sample)
                    self.features.append(values[offsets[i]: offsets[i + 1]])

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(x["gen"]) for x in self.samples)


def draft_vocabulary(samples: list[dict], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` most frequent generated token ids of ``samples``, sorted (ties: lower ids first)."""
    counts = torch.bincount(torch.cat([x["gen"] for x in samples]).long(), minlength=vocab)[:vocab]
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


@dataclass(frozen=True)
class _Labels:
    """One unrolled step's labelled positions: step k at column j predicts the token at j + k + 2."""

    index: torch.Tensor  # (N,) rows of the active positions
    draft_ids: torch.Tensor  # (N, m) the target's top-k ids as draft ids, -1 outside the draft vocabulary
    p: torch.Tensor  # (N, m) the target's probabilities of those ids, 0 outside the draft vocabulary
    argmax: torch.Tensor  # (N,) the target's most likely id (a target id)
    gen_pos: torch.Tensor  # (N,) row of the predicted token among the batch's generated tokens


@dataclass(frozen=True)
class _Batch:
    features: torch.Tensor  # (B, T, F) float32, T = the longest sample's L - 2
    tokens: torch.Tensor  # (B, T + max(2, K)) token ids from position 0 (0 past a row's end)
    valid: torch.Tensor  # (B, T) real positions
    active: torch.Tensor  # (B, T) positions from which some unrolled step predicts a generated token
    labels: tuple[_Labels, ...]  # one per unrolled step


def _make_batch(split: _Split, idx: list[int], t2d: torch.Tensor, unroll: int) -> _Batch:
    samples = [split.samples[i] for i in idx]
    lengths = [len(x["prompt"]) + len(x["gen"]) for x in samples]
    width = max(lengths) - 2
    feats = torch.zeros(len(idx), width, split.features[idx[0]].shape[1])
    tokens = torch.zeros(len(idx), width + max(2, unroll), dtype=torch.long)  # every row's L tokens fit
    valid = torch.zeros(len(idx), width, dtype=torch.bool)
    active = torch.zeros_like(valid)
    cols: list[list[torch.Tensor]] = [[] for _ in range(unroll)]
    rows: list[list[torch.Tensor]] = [[] for _ in range(unroll)]
    gen_pos: list[list[torch.Tensor]] = [[] for _ in range(unroll)]
    offset = 0
    for b, (i, x, length) in enumerate(zip(idx, samples, lengths)):
        prompt, gen = len(x["prompt"]), len(x["gen"])
        feats[b, : length - 2] = split.features[i].float()
        tokens[b, :length] = torch.cat([x["prompt"], x["gen"]]).long()
        valid[b, : length - 2] = True
        active[b, max(0, prompt - 1 - unroll): length - 2] = True
        for k in range(unroll):  # columns j whose step-k token j + k + 2 is generated token t
            j = torch.arange(max(0, prompt - 2 - k), length - 2 - k)
            cols[k].append(j)
            rows[k].append(torch.full_like(j, b))
            gen_pos[k].append(offset + j + k + 2 - prompt)
        offset += gen
    where = torch.full(valid.shape, -1, dtype=torch.long)
    where[active] = torch.arange(int(active.sum()))
    top_ids = torch.cat([x["top_ids"] for x in samples]).long()  # (G, m)
    top_p = torch.cat([x["top_logp"] for x in samples]).float().exp()
    labels = []
    for k in range(unroll):
        pos = torch.cat(gen_pos[k])
        ids = t2d[top_ids[pos]]
        labels.append(_Labels(where[torch.cat(rows[k]), torch.cat(cols[k])], ids, top_p[pos] * (ids >= 0),
                              top_ids[pos, 0], pos))
    return _Batch(feats, tokens, valid, active, tuple(labels))


def _embed(batch: _Batch, embedding: torch.Tensor, width: int, unroll: int) -> torch.Tensor:
    """(B, T + K - 1, H) embeddings of the tokens at positions 1..T+K-1, as the head's step k reads them."""
    return F.embedding(batch.tokens[:, 1: width + unroll], embedding)


# --------------------------------------------------------------------------- the training-time test


def _unroll(head: Eagle3Head, fused: torch.Tensor, embeds: torch.Tensor, valid: torch.Tensor, active: torch.Tensor,
            steps: int) -> list[torch.Tensor]:
    """:meth:`Eagle3Head.unroll` computed only where it is needed; per step the pre-norm outputs (A, H) of the
    ``active`` positions, in row-major order.

    Step 0 needs keys and values at every real position, but the rest of the layer
    only at active ones. A later step's query sees the step-0 keys causally and its
    own column's keys of steps 1..k, so those are scored as one dot product per
    column instead of k more (T, T) blocks.
    """
    batch, length, _ = fused.shape
    attn = head.layer.self_attn
    repeat, scale = attn.heads // attn.kv_heads, attn.head_dim ** -0.5
    rows, cols = active.nonzero(as_tuple=True)
    positions = torch.arange(length)[None].expand(batch, length)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = ((causal[None] & valid[:, None, :]) | torch.eye(length, dtype=torch.bool))[:, None]  # (B, 1, T, T)
    hidden, own_keys, own_values, outs = fused, [], [], []
    for k in range(steps):
        cos, sin = head.rope(hidden, positions + k)
        q, key, value = head.layer.qkv(embeds[:, k: k + length], hidden, cos, sin)
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
            mixed = mixed + probs[..., length + i: length + i + 1] * value_i
        h = hidden[rows, cols] + attn.o_proj(mixed[rows, :, cols].flatten(1))  # (A, H)
        h = h + head.layer.mlp(head.layer.post_attention_layernorm(h))
        outs.append(h)
        if k + 1 < steps:  # the next step reads this step's outputs; inactive columns stay zero
            hidden = fused.new_zeros(fused.shape).index_put((rows, cols), h)
    return outs


def _forward(head: Eagle3Head, batch: _Batch, embedding: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """Per unrolled step, the draft-vocabulary logits (N_k, Vd) at its labelled positions."""
    width = batch.valid.shape[1]
    outs = _unroll(head, head.fuse(batch.features), _embed(batch, embedding, width, unroll), batch.valid,
                   batch.active, unroll)
    return [head.logits(out[labels.index]) for out, labels in zip(outs, batch.labels)]


def _loss(logits: list[torch.Tensor], labels: tuple[_Labels, ...]) -> torch.Tensor:
    """Σ_k 0.8^k · cross-entropy to the target's top-k restricted to the draft vocabulary, renormalised."""
    total = logits[0].new_zeros(())
    for k, (lk, lab) in enumerate(zip(logits, labels)):
        mass = lab.p.sum(-1)
        keep = mass > 0  # a position whose top-k lies wholly outside the draft vocabulary teaches nothing
        if not bool(keep.any()):
            continue
        p = lab.p[keep] / mass[keep, None]  # (N, m)
        logq = F.log_softmax(lk[keep].float(), dim=-1)
        total = total + DEPTH_WEIGHT ** k * -(p * logq.gather(-1, lab.draft_ids[keep].clamp(min=0))).sum(-1).mean()
    return total


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class _Heldout:
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
def _evaluate(head: Eagle3Head, split: _Split, t2d: torch.Tensor, embedding: torch.Tensor, unroll: int,
              batch: int, target=None, pad: int = 0) -> _Heldout:
    """Held-out α and agreement per step: p from the staged top-k (a lower bound on α, missing the mass outside
    the top-k), or with ``target`` exactly, from a target forward over each sample."""
    was_training = head.training
    head.eval()
    ids = head.target_ids()
    overlap, agree, count = [0.0] * unroll, [0] * unroll, [0] * unroll
    covered, argmax_in = 0.0, 0
    for start in range(0, len(split), batch):
        idx = list(range(start, min(len(split), start + batch)))
        b = _make_batch(split, idx, t2d, unroll)
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
    return _Heldout(tuple(o / c for o, c in zip(overlap, n)), tuple(a / c for a, c in zip(agree, n)),
                    covered / n[0], argmax_in / n[0], count[0])


def _target_probs(target, samples: list[dict], pad: int) -> torch.Tensor:
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
    rows = [logits[r, len(x["prompt"]) - 1: len(x["prompt"]) - 1 + len(x["gen"])] for r, x in enumerate(samples)]
    return torch.cat(rows).float().softmax(-1)


def _step_times(target, head: Eagle3Head, context: list[int], rounds: int = 3) -> tuple[float, float]:
    """Median seconds of one target decode step and one cached head step, taken in turns."""
    drafter = Eagle3Drafter(head, target)
    device = drafter.device
    t_target, t_head = [], []
    for _ in range(rounds):  # in turns, so that both see the same background load
        t_target.append(decode_step_seconds(target, context=len(context), steps=16, warmup=4)[0])
        t_head.append(drafter.step_seconds(context, device, repeats=16))
    return statistics.median(t_target), statistics.median(t_head)


# --------------------------------------------------------------------------- model


def _head_config(target, draft_vocab: int, layer_ids: tuple[int, ...]) -> Eagle3Config:
    """A head with the target's layer shape (EAGLE-3 uses the target's own decoder-layer config)."""
    from hfspec.distill import _rope_theta

    tc = target.config.get_text_config()
    heads = int(tc.num_attention_heads)
    hidden = int(tc.hidden_size)
    default = default_layer_ids(len(decoder_layers(target) or ()) or int(tc.num_hidden_layers))
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=int(getattr(tc, "intermediate_size", None) or 4 * hidden),
        num_attention_heads=heads, num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
        vocab_size=model_vocab_size(target), draft_vocab_size=draft_vocab,
        head_dim=getattr(tc, "head_dim", None) or hidden // heads,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(tc)},
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", None) or 2048),
        layer_ids=None if tuple(layer_ids) == default else tuple(layer_ids),  # default: engines need no ids
    )


def _build_head(target, vocab_ids: torch.Tensor, layer_ids: tuple[int, ...], seed: int) -> Eagle3Head:
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


def _train(head: Eagle3Head, train: _Split, heldout: _Split, t2d: torch.Tensor, embedding: torch.Tensor,
           train_dir: Path, s: _Settings, progress: bool) -> tuple[list[float], float, list[tuple], int]:
    """:func:`hfspec.distill.fit` the head with the training-time test. The periodic check scores the
    expected accepted length on ``heldout`` against the staged top-k (no target forward).
    Returns (losses, seconds, checks as (step, α, agreement, accepted length), best step).
    """
    def loss_of(idx: list[int]) -> torch.Tensor:
        batch = _make_batch(train, idx, t2d, s.unroll)
        return _loss(_forward(head, batch, embedding, s.unroll), batch.labels)

    def check() -> tuple[float, tuple]:
        r = _evaluate(head, heldout, t2d, embedding, s.unroll, 2 * s.batch)
        return r.accepted, (round(r.alpha[0], 4), round(r.agreement[0], 4), round(r.accepted, 4))

    # EAGLE-3's AdamW betas and clip; no weight decay on a head this small.
    return fit(head, loss_of, check, len(train), train_dir, s, optim=Optim(betas=(0.9, 0.95), weight_decay=0.0,
                                                                          clip=0.5),
               desc="training EAGLE-3 head", progress=progress)


# --------------------------------------------------------------------------- driver


def distill_eagle3(
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
    """Train an EAGLE-3 head for ``target`` into ``out_dir`` and report how well it drafts.

    ``target`` is a local model directory or ``"offline"`` (SmolLM2-135M-Instruct).
    Text is staged as by :func:`hfspec.distill.distill` (``tokens``, ``eval_tokens``,
    ``seq_len``, ``gen_batch``, ``top_k``), then the target's features at
    ``layer_ids`` (default 2, N//2, N-3) with ``feature_batch`` sequences per forward.
    ``steps`` batches of ``batch`` sequences train the head with ``unroll`` draft
    steps (the training-time test) over a ``draft_vocab``-token draft vocabulary, at
    peak learning rate ``lr``; every ``eval_every`` steps (default: a tenth of the
    steps, at most 200) it is checked on held-out text and the best weights are kept.
    The head is written to ``out_dir`` in ``format`` (``speculators`` or ``eagle``) in
    bfloat16. With ``data_only`` it returns None once text and features are staged.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eval_every = max(1, min(200, steps // 10)) if eval_every is None else eval_every
    require_positive(draft_vocab=draft_vocab, unroll=unroll, tokens=tokens, eval_tokens=eval_tokens, seq_len=seq_len,
                     gen_batch=gen_batch, top_k=top_k, batch=batch, steps=steps, eval_every=eval_every,
                     feature_batch=feature_batch)
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    target_path = resolve_target(target, progress)
    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target_model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    vocab = model_vocab_size(target_model)
    if draft_vocab > vocab:
        raise ValueError(f"draft_vocab ({draft_vocab}) must not exceed the target vocabulary ({vocab})")
    if top_k > vocab:
        raise ValueError(f"top_k ({top_k}) must not exceed the target vocabulary ({vocab})")
    num_layers = len(decoder_layers(target_model) or ()) or int(target_model.config.get_text_config().num_hidden_layers)
    if layer_ids is None:
        if num_layers < 3:
            raise ValueError(f"the target has {num_layers} decoder layers; EAGLE-3's default features need 3 or "
                             "more: pass layer_ids (--layer-ids)")
        layer_ids = default_layer_ids(num_layers)
    layer_ids = tuple(int(i) for i in layer_ids)
    if not all(0 <= i < num_layers for i in layer_ids) or list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"layer_ids must be strictly increasing inputs of the target's {num_layers} decoder "
                         f"layers (0..{num_layers - 1}), got {list(layer_ids)}")
    s = _Settings(tokens, eval_tokens, seq_len, gen_batch, top_k, draft_vocab, unroll, layer_ids, batch, steps, lr,
                  seed, eval_every, feature_batch)
    out.mkdir(parents=True, exist_ok=True)
    if not data_only:
        _check_settings(out / "train" / "settings.json", s, resume, _FIXED)

    # 1. Stage target-generated text, then the target's features on it.
    _, gen_seconds = stage_text(target_model, tokenizer, out / "data", s, progress)
    feature_seconds = sum(stage_features(target_model, out / "data", out / "features", split, layer_ids,
                                         feature_batch, pad, progress) for split in ("train", "eval"))
    if data_only:
        return None
    train, heldout = (_Split(out / "data", out / "features", split, layer_ids) for split in ("train", "eval"))
    if not len(train) or not len(heldout):
        raise ValueError(f"{out / 'data'} has no usable train or eval samples; stage more text")

    # 2. The draft vocabulary, fixed at the first run so that a resumed run keeps it.
    vocab_file = out / "train" / "vocab.pt"
    if vocab_file.is_file() and resume:
        vocab_ids = torch.load(vocab_file)
    else:
        vocab_ids = draft_vocabulary(train.samples, draft_vocab, vocab)
        torch.save(vocab_ids, vocab_file)
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[vocab_ids] = torch.arange(len(vocab_ids))
    embedding = target_model.get_input_embeddings().weight.detach().float()

    # 3. Train with the training-time test.
    head = _build_head(target_model, vocab_ids, layer_ids, seed)
    losses, train_seconds, checks, best_step = _train(head, train, heldout, t2d, embedding, out / "train", s,
                                                      progress)

    # 4. Measure it: α and agreement per step against the target's exact p, and the cost ratio.
    final = _evaluate(head, heldout, t2d, embedding, unroll, 4, target=target_model, pad=pad)
    context = torch.cat([heldout.samples[0]["prompt"], heldout.samples[0]["gen"]]).tolist()[:64]
    t_target, t_head = _step_times(target_model, head, context)
    c = t_head / t_target
    sp_a, g_a = predicted_speedup(final.alpha[0], c)
    sp_g, g_g = predicted_speedup(final.agreement[0], c)

    # 5. Write the head in bfloat16; engines read the target's embedding, so it is not stored.
    verifier = OFFLINE_VERIFIER if str(target) == "offline" else str(target)
    save_head(head, out, layout=format, dtype=torch.bfloat16, target=target_model, verifier=verifier,
              speculative_tokens=g_g)
    tail = losses[-max(1, len(losses) // 10):]
    report = Eagle3Report(
        target=str(target_path), out_dir=str(out), format=format, layer_ids=layer_ids, draft_vocab=len(vocab_ids),
        vocab_coverage=round(final.coverage, 4), argmax_coverage=round(final.argmax_coverage, 4),
        head_params=sum(p.numel() for p in head.parameters()),
        head_bytes=(out / "model.safetensors").stat().st_size, train_tokens=train.tokens,
        eval_tokens=final.positions, unroll=unroll, steps=len(losses), best_step=best_step,
        gen_seconds=round(gen_seconds, 1), feature_seconds=round(feature_seconds, 1),
        train_seconds=round(train_seconds, 1), step_seconds=round(train_seconds / max(1, len(losses)), 3),
        final_loss=round(sum(tail) / len(tail), 4), alpha=round(final.alpha[0], 4),
        greedy_agreement=round(final.agreement[0], 4),
        alpha_by_depth=tuple(round(a, 4) for a in final.alpha),
        agreement_by_depth=tuple(round(a, 4) for a in final.agreement), accepted_length=round(final.accepted, 3),
        target_step_ms=round(1000 * t_target, 3), head_step_ms=round(1000 * t_head, 3), cost_ratio=round(c, 4),
        speedup_sampled=round(sp_a, 3), gamma_sampled=g_a, speedup_greedy=round(sp_g, 3), gamma_greedy=g_g,
        heldout=tuple(tuple(check) for check in checks),
    )
    (out / "distill_report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    log.info("EAGLE-3 head saved to %s: %s", out, report.to_dict())
    return report


# --------------------------------------------------------------------------- model card


def model_card(out_dir: str | Path, title: str = "EAGLE-3 head", note: str = "") -> str:
    """A README (markdown) for the head in ``out_dir``: how it was trained and what it measures, from the
    run's own ``distill_report.json`` and ``train/settings.json``; ``note`` is a paragraph added after the
    first one (say, what exactly the target was)."""
    out = Path(out_dir)
    r = json.loads((out / "distill_report.json").read_text())
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

`hfspec distill --kind eagle3` (`hfspec/distill_eagle3.py`, recipe in `scripts/train_eagle3_head.sh`):

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
- **time**: text generation {_hours(r["gen_seconds"])} and features {_hours(r["feature_seconds"])} (summed over
  the processes that staged them), training {_hours(r["train_seconds"])} ({r["step_seconds"]:.2f} s per step,
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


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"
