"""EAGLE-3 draft heads (Li et al., arXiv 2503.01840): the modules, apart from how they are stored or run.

A head is one decoder layer. At context position j it reads the target's hidden
states entering a few of its decoder layers (``hidden_states[i]`` in transformers'
numbering; by default i = 2, N//2, N-3: low, mid, high), concatenated and fused by
``fc``, paired with the embedding of the token at j + 1, at RoPE position j. Its
output predicts the token at j + 2. Later draft steps read the head's own pre-norm
output instead of target features, one position further each. Logits cover a draft
vocabulary that ``d2t`` maps to target ids (target id = draft id + d2t[draft id]).

The modules are shared by the drafter (``hfspec.drafters.eagle3``), which runs them
one cached step at a time over a cache of its own, and by training, which unrolls
draft steps with ``unroll``; reading and writing checkpoints is
``hfspec.heads.checkpoint``'s job. They know no cache, so this module imports nothing
of hfspec and sits on the ground floor, with the checkpoint code just above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

__all__ = ["Eagle3Attention", "Eagle3Config", "Eagle3Head", "Eagle3Layer", "default_layer_ids"]


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head; names follow Llama's config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's vocabulary: rows of t2d and of an own embedding
    draft_vocab_size: int  # rows of lm_head
    target_hidden_size: int | None = None  # width of each target feature; None: hidden_size
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 2048
    layer_ids: tuple[int, ...] | None = None  # target hidden_states indices; None: 2, N//2, N-3

    @property
    def num_features(self) -> int:
        return len(self.layer_ids) if self.layer_ids else 3

    @property
    def feature_width(self) -> int:
        """Input width of ``fc``: the concatenated target features."""
        return self.num_features * (self.target_hidden_size or self.hidden_size)

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def llama_config(self) -> LlamaConfig:
        """The 1-layer Llama config of the head's layer (RoPE, MLP)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=False,
            mlp_bias=False,
        )


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read 2H inputs; the caller supplies the keys and values to attend to."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.dim
        width = 2 * c.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, T, 2H) -> q (B, heads, T, D) and k, v (B, kv_heads, T, D), RoPE applied to q and k."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        allowed: torch.Tensor,
        kernel: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention of q (B, heads, T, D) over keys/values (B, kv_heads, S, D); ``allowed`` (B|1, 1|heads, T, S).
        ``kernel(q, keys, values, allowed)`` -> (B, T, heads, D) replaces torch's (the caller's own attention)."""
        if kernel is not None:
            return self.o_proj(kernel(q, keys, values, allowed).flatten(2))
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=allowed, enable_gqa=self.heads != self.kv_heads
        )  # (B, heads, T, D)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Eagle3Layer(nn.Module):
    """The head's decoder layer; parameter names match both layouts (``midlayer.*`` / ``layers.0.*``)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(c)
        self.mlp = LlamaMLP(c.llama_config())
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def qkv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of (B, T, H) token embeddings and hidden inputs; the embedding comes first."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        return self.self_attn.qkv(x, cos, sin)

    def finish(
        self,
        hidden: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        allowed: torch.Tensor,
        kernel: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The layer's pre-norm output (B, T, H); the residual is the un-normed hidden input (``kernel``: as in
        ``Eagle3Attention.attend``)."""
        h = hidden + self.self_attn.attend(q, keys, values, allowed, kernel)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """An EAGLE-3 head: ``fc`` fuses target features, one layer, ``norm`` and ``lm_head`` over the draft vocabulary.

    The pieces are public so that training code can unroll draft steps itself:
    ``fuse`` (target features -> hidden), ``rope``, ``layer.qkv``/``layer.finish``
    (with explicit keys and values), ``logits``; ``unroll`` runs the training-time test.
    The drafter runs the same pieces over its own cache (``hfspec.drafters.eagle3.cached_step``).
    ``embed_tokens`` is None when the head uses the target's embedding (the usual case).
    """

    def __init__(self, config: Eagle3Config, own_embedding: bool = False):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_width, config.hidden_size, bias=False)
        self.layer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if own_embedding else None
        rotary = LlamaRotaryEmbedding(config.llama_config())
        # Plain float32 attributes, not buffers: casting the head to bf16 must not round RoPE frequencies.
        self._inv_freq, self._rope_scale = rotary.inv_freq.float(), float(rotary.attention_scaling)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features (B, T, n·target_H) -> the hidden input (B, T, H)."""
        return self.fc(features)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, T, D) for RoPE positions (B, T), computed in float32, in ``x``'s dtype."""
        freqs = positions[..., None].float() * self._inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._rope_scale).to(x.dtype), (emb.sin() * self._rope_scale).to(x.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (..., Vd) of pre-norm outputs (..., H)."""
        return self.lm_head(self.norm(h))

    def target_ids(self) -> torch.Tensor:
        """(Vd,) the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def unroll(
        self, fused: torch.Tensor, embeds: torch.Tensor, steps: int, valid: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3, arXiv 2503.01840): ``steps`` draft steps at every position at once.

        ``fused`` (B, T, H): ``fuse(features)`` at positions 0..T-1; ``embeds`` (B, T+steps-1, H):
        embeddings of the tokens at positions 1..T+steps-1; ``valid`` (B, T): real positions.
        Step k reads ``embeds[:, k:k+T]`` and, from k = 1 on, the previous step's pre-norm
        output, at RoPE position j + k; its query at column j sees step-0 keys at columns
        <= j and the keys of steps 1..k at column j only, exactly as a draft step sees the
        context and the earlier drafts at inference. Returns per step the draft-vocabulary
        logits (B, T, Vd); step k at column j predicts the token at position j + k + 2.
        """
        batch, length, _ = fused.shape
        device = fused.device
        positions = torch.arange(length, device=device)[None].expand(batch, length)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        if valid is not None:
            causal = causal[None] & valid[:, None, :].bool()  # (B, T, T)
        same = torch.eye(length, dtype=torch.bool, device=device).expand_as(causal)
        hidden, keys, values, out = fused, [], [], []
        for k in range(steps):
            cos, sin = self.rope(hidden, positions + k)
            q, key, value = self.layer.qkv(embeds[:, k : k + length], hidden, cos, sin)
            keys.append(key)
            values.append(value)
            allowed = torch.cat([causal | same] + [same] * k, dim=-1)  # (T, (k+1)T) or (B, T, (k+1)T)
            allowed = allowed[:, None] if allowed.dim() == 3 else allowed
            hidden = self.layer.finish(hidden, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), allowed)
            out.append(self.logits(hidden))
        return out


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's features: the hidden states entering layers 2, N//2 and N-3, each once, in layer order."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))
