"""What an EAGLE-3 head trains on: the target's features beside the staged text, the draft vocabulary, and
batches that carry the labels of every unrolled draft step (Li et al., arXiv 2503.01840).

Features are the hidden states entering the target's decoder layers ``layer_ids``
(``hidden_states[i]``), from one teacher-forced target forward per staged sample,
stored as bfloat16 in ``features/{split}-NNNNN.pt`` beside each text shard
(:mod:`hfspec.training.staging`), for positions 0..L-3 of a sample of L tokens (the
last two pair with no token to predict). They are staged like the text: claimed with a
lock file per shard, written whole or not at all, shared by several processes, resumed.
p is the target's distribution, as in Leviathan et al. (arXiv 2211.17192).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hfspec.errors import HfspecError
from hfspec.measure.timing import now
from hfspec.models.adapter import hidden_features
from hfspec.training.staging import claim_lock

__all__ = ["Batch", "Labels", "StagedSplit", "draft_vocabulary", "embed_tokens", "make_batch", "stage_features"]

# --------------------------------------------------------------------------- features


def _shard_features(
    target: PreTrainedModel, samples: list[dict], layer_ids: tuple[int, ...], batch: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of positions 0..L-3 of each sample: (Σ (L-2), F) bfloat16 and offsets (n + 1,)."""
    seqs = [torch.cat([x["prompt"], x["gen"]]).long() for x in samples]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths together: less padding
    parts: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
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
    """A feature shard, memory-mapped; features of other layers than the run asks for are refused."""
    feats = torch.load(path, mmap=True, weights_only=True)
    if tuple(feats["layer_ids"]) != tuple(layer_ids):
        raise HfspecError(
            f"{path} holds features of target layers {list(feats['layer_ids'])}, not "
            f"{list(layer_ids)}; pass --layer-ids {','.join(map(str, feats['layer_ids']))} or delete "
            f"{path.parent} to stage them again"
        )
    return feats


def stage_features(
    target: PreTrainedModel,
    data_dir: Path,
    feature_dir: Path,
    split: str,
    layer_ids: tuple[int, ...],
    batch: int,
    pad: int,
    progress: bool = True,
) -> float:
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
                if out.is_file() or not claim_lock(lock):
                    continue
                try:
                    t0 = now(target.device)
                    values, offsets = _shard_features(target, torch.load(path)["samples"], layer_ids, batch, pad)
                    tmp = feature_dir / f".{path.name}.tmp"
                    torch.save(
                        {
                            "layer_ids": list(layer_ids),
                            "values": values,
                            "offsets": offsets,
                            "seconds": now(target.device) - t0,
                        },
                        tmp,
                    )
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


class StagedSplit:
    """The staged samples of one split that have features, with those features memory-mapped."""

    def __init__(self, data_dir: Path, feature_dir: Path, split: str, layer_ids: tuple[int, ...]) -> None:
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
                    self.features.append(values[offsets[i] : offsets[i + 1]])

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> int:
        """Target-generated tokens of the samples (prompt tokens are not counted)."""
        return sum(len(x["gen"]) for x in self.samples)


def draft_vocabulary(samples: list[dict], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` most frequent generated token ids of ``samples``, sorted (ties: lower ids first)."""
    counts = torch.bincount(torch.cat([x["gen"] for x in samples]).long(), minlength=vocab)[:vocab]
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


@dataclass(frozen=True)
class Labels:
    """One unrolled step's labelled positions: step k at column j predicts the token at j + k + 2."""

    index: torch.Tensor  # (N,) rows of the active positions
    draft_ids: torch.Tensor  # (N, m) the target's top-k ids as draft ids, -1 outside the draft vocabulary
    p: torch.Tensor  # (N, m) the target's probabilities of those ids, 0 outside the draft vocabulary
    argmax: torch.Tensor  # (N,) the target's most likely id (a target id)
    gen_pos: torch.Tensor  # (N,) row of the predicted token among the batch's generated tokens


@dataclass(frozen=True)
class Batch:
    """A training or held-out batch: every sample's features and tokens, padded, with each step's labels."""

    features: torch.Tensor  # (B, T, F) float32, T = the longest sample's L - 2
    tokens: torch.Tensor  # (B, T + max(2, K)) token ids from position 0 (0 past a row's end)
    valid: torch.Tensor  # (B, T) real positions
    active: torch.Tensor  # (B, T) positions from which some unrolled step predicts a generated token
    labels: tuple[Labels, ...]  # one per unrolled step


def make_batch(split: StagedSplit, idx: list[int], t2d: torch.Tensor, unroll: int) -> Batch:
    """The samples ``idx`` of ``split`` as one batch for ``unroll`` draft steps; ``t2d`` maps target ids to
    draft ids (-1 outside the draft vocabulary). Only generated tokens are labels: prompt tokens are context."""
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
        active[b, max(0, prompt - 1 - unroll) : length - 2] = True
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
        labels.append(
            Labels(where[torch.cat(rows[k]), torch.cat(cols[k])], ids, top_p[pos] * (ids >= 0), top_ids[pos, 0], pos)
        )
    return Batch(feats, tokens, valid, active, tuple(labels))


def embed_tokens(batch: Batch, embedding: torch.Tensor, width: int, unroll: int) -> torch.Tensor:
    """(B, T + K - 1, H) embeddings of the tokens at positions 1..T+K-1, as the head's step k reads them."""
    return F.embedding(batch.tokens[:, 1 : width + unroll], embedding)
