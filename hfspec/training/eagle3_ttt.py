"""The EAGLE-3 head a run trains, and its training-time test (Li et al., arXiv 2503.01840).

:func:`build_head` makes a head with the target's layer shape that starts out reading like the target's last
layers. :func:`forward` runs the training-time test: ``unroll`` draft steps at every position at once, step k
reading the head's own output of step k-1; :func:`loss` weighs step k by 0.8^k against the target's staged top-k
restricted to the draft vocabulary. p is the target's distribution and q the draft's, as in Leviathan et al.
(arXiv 2211.17192).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from hfspec.heads.eagle3 import Eagle3Config, Eagle3Head, default_layer_ids
from hfspec.models.adapter import decoder_layers, model_vocab_size
from hfspec.training.eagle3_data import Batch, Labels, embed_tokens
from hfspec.training.target import rope_theta

__all__ = ["DEPTH_WEIGHT", "build_head", "forward", "head_config", "loss", "unrolled"]

DEPTH_WEIGHT = 0.8  # EAGLE-3's loss weight of unrolled step k is 0.8^k


# --------------------------------------------------------------------------- model


def head_config(target: PreTrainedModel, draft_vocab: int, layer_ids: tuple[int, ...]) -> Eagle3Config:
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


def build_head(target: PreTrainedModel, vocab_ids: torch.Tensor, layer_ids: tuple[int, ...], seed: int) -> Eagle3Head:
    """A fresh head that starts out reading like the target's last layers.

    ``fc`` passes the highest feature through (the target's residual stream entering
    layer N-3), and ``norm`` and ``lm_head`` are the target's final norm and its output
    rows of the draft vocabulary, so the head's output starts in the space the target
    predicts from. On SmolLM2-135M this beat a random fc and a random lm_head.
    """
    torch.manual_seed(seed)
    head = Eagle3Head(head_config(target, len(vocab_ids), layer_ids))
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


# --------------------------------------------------------------------------- the training-time test


def unrolled(
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


def forward(head: Eagle3Head, batch: Batch, embedding: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """Per unrolled step, the draft-vocabulary logits (N_k, Vd) at its labelled positions."""
    width = batch.valid.shape[1]
    outs = unrolled(
        head,
        head.fuse(batch.features),
        embed_tokens(batch, embedding, width, unroll),
        batch.valid,
        batch.active,
        unroll,
    )
    return [head.logits(out[labels.index]) for out, labels in zip(outs, batch.labels)]


def loss(logits: list[torch.Tensor], labels: tuple[Labels, ...]) -> torch.Tensor:
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
