"""EAGLE-3 draft heads (Li et al., arXiv 2503.01840): drafting from the target's own hidden states.

A head is one decoder layer. At context position j it reads the target's hidden
states entering a few of its decoder layers (``hidden_states[i]`` in transformers'
numbering; by default i = 2, N//2, N-3: low, mid, high), concatenated and fused by
``fc``, paired with the embedding of the token at j + 1, at RoPE position j. Its
output predicts the token at j + 2. Later draft steps read the head's own pre-norm
output instead of target features, one position further each. Logits cover a draft
vocabulary that ``d2t`` maps to target ids (target id = draft id + d2t[draft id]).

Two published layouts load here, recognised by their contents, not their names:
- SafeAILab/EAGLE: a 1-layer Llama ``config.json`` with ``draft_vocab_size``;
  tensors ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``.
- vllm-project/speculators: ``config.json`` with ``speculators_model_type: "eagle3"``,
  ``speculators_config`` and ``transformer_layer_config``; tensors ``layers.0.*``.

Exactness: draft logits go into a full-vocabulary row whose other entries are
-1e30, so after the float32 softmax q is exactly 0 outside the draft vocabulary and
the residual max(0, p - q) of Leviathan et al. (arXiv 2211.17192) stays exact.

Head cache invariant: the head's KV holds one entry per context position j < fed[b],
each built from target features. The fused features of committed positions not yet
fed (fed .. lengths - 2) wait in ``pending`` and are fed in the first head forward of
the next ``propose``, whose last output gives the first draft. Entries of later draft
steps (built from the head's own outputs) are rolled back at ``commit``; the accepted
positions come back from target features. No position is fed twice.
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from hfspec.cache import KVState
from hfspec.drafters import Context, Drafter, Features, Proposal, Stop
from hfspec.costs import sync
from hfspec.errors import HfspecError
from hfspec.models import decoder_layers, model_vocab_size

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Head", "head_kind", "is_eagle3_dir", "load_head", "save_head"]

log = logging.getLogger(__name__)

LAYOUTS = ("speculators", "eagle")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# speculators options that change the forward; hfspec runs the original EAGLE-3 layer only.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
# Architecture names of EAGLE-3 heads in the wild (vLLM, SGLang, speculators).
HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DraftModel", "Eagle3Speculator")
# Tensors some checkpoints carry that the forward does not use (t2d only serves training).
IGNORED_TENSORS = ("t2d", "verifier_lm_head.weight", "verifier_norm.weight")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # position-independent inverse frequencies
# Logit of ids outside the draft vocabulary: finite, and so is a row's sum (the loop refuses
# inf in raw logits), yet exp(OUTSIDE - max) underflows to exactly 0 in float32: q is 0 there.
OUTSIDE = -1e30


# -- the head -------------------------------------------------------------------------------------

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
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.dim, num_hidden_layers=1, vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters), attention_bias=False, mlp_bias=False,
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

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Attention of q (B, heads, T, D) over keys/values (B, kv_heads, S, D); ``allowed`` (B|1, 1|heads, T, S)."""
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                             enable_gqa=self.heads != self.kv_heads)  # (B, heads, T, D)
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

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of (B, T, H) token embeddings and hidden inputs; the embedding comes first."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        return self.self_attn.qkv(x, cos, sin)

    def finish(self, hidden: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               allowed: torch.Tensor) -> torch.Tensor:
        """The layer's pre-norm output (B, T, H); the residual is the un-normed hidden input."""
        h = hidden + self.self_attn.attend(q, keys, values, allowed)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """An EAGLE-3 head: ``fc`` fuses target features, one layer, ``norm`` and ``lm_head`` over the draft vocabulary.

    The pieces are public so that training code can unroll draft steps itself:
    ``fuse`` (target features -> hidden), ``rope``, ``layer.qkv``/``layer.finish``
    (with explicit keys and values), ``logits``; ``step`` runs one cached forward and
    ``unroll`` the training-time test. ``embed_tokens`` is None when the head uses the
    target's embedding (the usual case).
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

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: KVState,
             valid: torch.Tensor) -> torch.Tensor:
        """One forward over k new columns (B, k) appended to ``kv``; returns their pre-norm outputs (B, k, H).

        ``valid`` (B, k): columns that are not holes. A column sees the cache's valid
        entries and the valid new columns up to itself, and always itself (so a hole
        stays finite).
        """
        cos, sin = self.rope(hidden, positions)
        q, k, v = self.layer.qkv(embeds, hidden, cos, sin)
        old = kv.length
        mask = kv.extend_mask(valid).bool()  # (B, S)
        keys, values = kv.append(k, v)
        cols = torch.arange(mask.shape[1], device=mask.device)
        rows = old + torch.arange(k.shape[2], device=mask.device)
        allowed = (mask[:, None, :] & (cols[None, :] <= rows[:, None])) | (cols[None, :] == rows[:, None])
        return self.layer.finish(hidden, q, keys, values, allowed[:, None])  # allowed (B, 1, k, S)

    def unroll(self, fused: torch.Tensor, embeds: torch.Tensor, steps: int,
               valid: torch.Tensor | None = None) -> list[torch.Tensor]:
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
            q, key, value = self.layer.qkv(embeds[:, k: k + length], hidden, cos, sin)
            keys.append(key)
            values.append(value)
            allowed = torch.cat([causal | same] + [same] * k, dim=-1)  # (T, (k+1)T) or (B, T, (k+1)T)
            allowed = allowed[:, None] if allowed.dim() == 3 else allowed
            hidden = self.layer.finish(hidden, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), allowed)
            out.append(self.logits(hidden))
        return out


# -- directories ----------------------------------------------------------------------------------

def _read_config(path: Path) -> dict[str, Any] | None:
    file = path / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _weights_file(path: Path) -> Path | None:
    return next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)


def _load_tensors(file: Path, names_only: bool = False) -> dict[str, torch.Tensor] | set[str]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return set(f.keys()) if names_only else {name: f.get_tensor(name) for name in f.keys()}
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # an old (non-zip) torch.save file cannot be memory-mapped
        state = torch.load(file, map_location="cpu", weights_only=True)
    return set(state) if names_only else state


def head_kind(path: str | Path) -> str | None:
    """``"eagle3"`` for an EAGLE-3 head's directory, another speculators model type for other
    speculators heads, None for anything else (e.g. a plain causal LM).

    Recognised by contents: ``speculators_model_type``, ``draft_vocab_size``, a head
    architecture name, or, for a 1-layer config, the ``fc``/``d2t``/``midlayer`` tensors.
    """
    path = Path(str(path)).expanduser()
    conf = _read_config(path) if path.is_dir() else None
    if conf is None:
        return None
    if "speculators_model_type" in conf:
        return str(conf["speculators_model_type"])
    if "draft_vocab_size" in conf or set(conf.get("architectures") or ()) & set(HEAD_ARCHITECTURES):
        return "eagle3"
    file = _weights_file(path)
    if conf.get("num_hidden_layers") == 1 and file is not None:
        names = _load_tensors(file, names_only=True)
        if {"fc.weight", "d2t"} & names or any(n.startswith("midlayer.") for n in names):
            return "eagle3"
    return None


def is_eagle3_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory holding an EAGLE-3 head, in either layout."""
    return head_kind(path) == "eagle3"


_LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta", "rope_scaling",
               "rope_parameters", "vocab_size")


def _parse_config(conf: dict[str, Any], where: str) -> Eagle3Config:
    """The head's shape from either layout's config.json; refuses what the forward would get wrong."""
    if "speculators_model_type" in conf:
        if conf["speculators_model_type"] != "eagle3":
            raise HfspecError(f"{where}: speculators model type {conf['speculators_model_type']!r} is not "
                              "supported; hfspec runs EAGLE-3 heads (speculators_model_type \"eagle3\")")
        layer = conf.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise HfspecError(f"{where}: a speculators config needs a transformer_layer_config object")
        if "norm_before_residual" not in conf:
            raise HfspecError(f"{where}: norm_before_residual is not set; vLLM reads a missing value as true and "
                              "the speculators library as false. Add \"norm_before_residual\": false if the head "
                              "was trained without it (true is not supported)")
    else:
        layer = conf
    for flag in UNSUPPORTED_FLAGS:
        if conf.get(flag):
            raise HfspecError(f"{where}: {flag}: true is not supported; hfspec runs the original EAGLE-3 layer "
                              f"({', '.join(UNSUPPORTED_FLAGS)} all false)")
    if layer.get("model_type", "llama") != "llama":
        raise HfspecError(f"{where}: a {layer['model_type']!r} draft layer is not supported; hfspec runs "
                          "Llama-style EAGLE-3 layers")
    if layer.get("num_hidden_layers", 1) != 1:
        raise HfspecError(f"{where}: the head has {layer['num_hidden_layers']} decoder layers; hfspec runs "
                          "EAGLE-3 heads with one")
    if any(kind != "full_attention" for kind in layer.get("layer_types") or ()):
        # speculators' training CLI writes layer_types and runs "sliding_attention" layers with a window.
        raise HfspecError(f"{where}: layer_types {layer['layer_types']} asks for sliding-window attention, which "
                          "hfspec's EAGLE-3 layer does not run; it supports full_attention only")
    if any(layer.get(k) for k in ("attention_bias", "mlp_bias")):
        raise HfspecError(f"{where}: attention or MLP biases are not supported in an EAGLE-3 head")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size") if k not in layer]
    if missing:
        raise HfspecError(f"{where}: the head's layer config lacks {', '.join(missing)}")
    try:
        llama = LlamaConfig(**{k: layer[k] for k in _LLAMA_KEYS if k in layer and layer[k] is not None})
    except (TypeError, ValueError) as exc:
        raise HfspecError(f"{where}: invalid layer config: {str(exc).splitlines()[0]}") from None
    rope = dict(llama.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise HfspecError(f"{where}: RoPE type {rope.get('rope_type')!r} is not supported; "
                          f"supported: {', '.join(ROPE_TYPES)}")
    if llama.hidden_act not in ACT2FN:
        raise HfspecError(f"{where}: unknown hidden_act {llama.hidden_act!r}")
    ids = conf.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise HfspecError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer numbers or null")
        if any(a >= b for a, b in zip(ids, ids[1:])):
            # Engines gather features in layer order, whatever the list's order.
            raise HfspecError(f"{where}: eagle_aux_hidden_state_layer_ids must be strictly increasing, got {ids}")
    vocab = layer.get("vocab_size")
    if not isinstance(vocab, int):
        raise HfspecError(f"{where}: the head's config lacks vocab_size (the target's vocabulary size)")
    return Eagle3Config(
        hidden_size=llama.hidden_size, intermediate_size=llama.intermediate_size,
        num_attention_heads=llama.num_attention_heads, num_key_value_heads=llama.num_key_value_heads,
        vocab_size=vocab, draft_vocab_size=int(conf.get("draft_vocab_size") or vocab),
        target_hidden_size=conf.get("target_hidden_size"), head_dim=llama.head_dim,
        rms_norm_eps=llama.rms_norm_eps, hidden_act=llama.hidden_act, rope_parameters=rope,
        max_position_embeddings=llama.max_position_embeddings, layer_ids=tuple(ids) if ids else None,
    )


def _head_name(name: str) -> str:
    """Checkpoint tensor name -> the head's parameter name."""
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            return "layer." + name[len(prefix):]
    return name


def _listed(names: Any) -> str:
    names = sorted(names)
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def load_head(path: str | Path, *, dtype: torch.dtype | None = None,
              device: str | torch.device | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head from a directory in either layout (``model.safetensors`` or ``pytorch_model.bin``).

    ``dtype`` None keeps the stored floating dtype. Every tensor must match the config;
    anything the forward would ignore or misread is refused with an ``HfspecError``.
    """
    path = Path(str(path)).expanduser()
    where = f"EAGLE-3 head {str(path)!r}"
    conf = _read_config(path)
    if conf is None:
        raise HfspecError(f"{where}: no readable config.json")
    config = _parse_config(conf, where)
    file = _weights_file(path)
    if file is None:
        sharded = " (sharded checkpoints are not supported for heads; save it as one file)" \
            if any(path.glob("*.index.json")) else ""
        raise HfspecError(f"{where}: no {' or '.join(WEIGHT_FILES)}{sharded}")
    state = {_head_name(k): v for k, v in _load_tensors(file).items() if k not in IGNORED_TENSORS}
    if "target_hidden_size" in conf and "embed_tokens.weight" not in state and \
            conf["target_hidden_size"] not in (None, config.hidden_size):
        raise HfspecError(f"{where}: the config sets target_hidden_size, so the head carries its own embedding, "
                          "but the checkpoint has no embed_tokens.weight")
    head = Eagle3Head(config, own_embedding="embed_tokens.weight" in state)
    expected = head.state_dict()
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise HfspecError(f"{where}: the draft vocabulary ({config.draft_vocab_size}) is smaller than the "
                              f"target's ({config.vocab_size}) but the checkpoint has no d2t to map it")
        state["d2t"] = expected["d2t"]  # identity: target id = draft id
    unexpected, missing = set(state) - set(expected), set(expected) - set(state)
    if unexpected or missing:
        parts = ([f"tensors the forward would ignore: {_listed(unexpected)}"] if unexpected else []) + \
                ([f"missing tensors: {_listed(missing)}"] if missing else [])
        raise HfspecError(f"{where}: {'; '.join(parts)}")
    wrong = [f"{k} {tuple(v.shape)} (config: {tuple(expected[k].shape)})" for k, v in state.items()
             if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise HfspecError(f"{where}: tensor shapes do not match its config.json: {_listed(wrong)}")
    if state["d2t"].is_floating_point():
        raise HfspecError(f"{where}: d2t must hold integers (target id - draft id)")
    head.load_state_dict({k: v.to(expected[k].dtype) if k == "d2t" else v for k, v in state.items()})
    stored = state["fc.weight"].dtype
    return head.to(device=device, dtype=dtype or stored).eval()


def _layer_config(c: Eagle3Config) -> dict[str, Any]:
    """The 1-layer Llama config of a head, with RoPE written the way every reader understands."""
    rope = dict(c.rope_parameters)
    theta = rope.pop("rope_theta", 10000.0)
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.dim, "num_hidden_layers": 1,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": theta,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    return out


def save_head(head: Eagle3Head, path: str | Path, *, layout: str = "speculators", dtype: torch.dtype | None = None,
              target: PreTrainedModel | None = None, embedding: bool = False, verifier: str | None = None,
              speculative_tokens: int = 3) -> Path:
    """Write ``head`` to the directory ``path`` (``model.safetensors`` + ``config.json``) in ``layout``.

    ``speculators``: the layout vLLM serves with ``speculators_model_type: "eagle3"``;
    the verifier is ``verifier`` or ``target``'s name/path and architectures.
    ``eagle``: SafeAILab/EAGLE's (``midlayer.*``). ``dtype`` (e.g. bfloat16) casts the
    floating weights; ``d2t``/``t2d`` stay integer/bool. The target's embedding is
    not stored unless ``embedding`` (it needs ``target``); a head's own embedding always is.
    ``norm_before_residual`` is written false: this forward adds the un-normed hidden.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    c = head.config
    dtype = dtype or head.fc.weight.dtype
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    tensors: dict[str, torch.Tensor] = {}
    for name, value in head.state_dict().items():
        key = prefix + name[len("layer."):] if name.startswith("layer.") else name
        tensors[key] = value if name == "d2t" else value.to(dtype)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[head.target_ids().cpu()] = True
    tensors["t2d"] = t2d
    if embedding and head.embed_tokens is None:
        if target is None:
            raise ValueError("embedding=True stores the target's embedding: pass target=")
        weight = target.get_input_embeddings().weight
        if tuple(weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"the target's embedding is {tuple(weight.shape)}, the head expects "
                             f"({c.vocab_size}, {c.hidden_size})")
        tensors["embed_tokens.weight"] = weight.detach().to(dtype)
    from safetensors.torch import save_file

    path = Path(str(path)).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    layer = _layer_config(c)
    target_hidden = c.target_hidden_size if c.target_hidden_size not in (None, c.hidden_size) else None
    ids = list(c.layer_ids) if c.layer_ids else None
    if layout == "eagle":
        conf = {**layer, "draft_vocab_size": c.draft_vocab_size, "torch_dtype": dtype_name}
        if target_hidden is not None:
            conf["target_hidden_size"] = target_hidden
        if ids is not None:
            conf["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        architectures = list(getattr(target.config, "architectures", None) or []) if target is not None else []
        name = verifier if verifier is not None else (target.name_or_path or None) if target is not None else None
        conf = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": name, "architectures": architectures},
            },
            "transformer_layer_config": {**layer, "torch_dtype": dtype_name},
            "draft_vocab_size": c.draft_vocab_size, "norm_before_residual": False, "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "target_hidden_size": target_hidden,
            "eagle_aux_hidden_state_layer_ids": ids, "embed_requires_grad": False, "torch_dtype": dtype_name,
        }
    (path / "config.json").write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
    return path


# -- the drafter ----------------------------------------------------------------------------------

def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's features: the hidden states entering layers 2, N//2 and N-3, each once, in layer order."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


class Eagle3Drafter(Drafter):
    """Drafts with an EAGLE-3 head on ``target``'s hidden states (see the module docstring)."""

    kind = "eagle3"

    def __init__(self, head: Eagle3Head, target: PreTrainedModel):
        self.head = head.eval()
        self.target = target
        c = head.config
        text = target.config.get_text_config()
        blocks = decoder_layers(target)
        num_layers = len(blocks) if blocks is not None else int(text.num_hidden_layers)
        if c.layer_ids is None and num_layers < 3:
            raise HfspecError(f"the target has {num_layers} decoder layers; EAGLE-3's default features need 3 or "
                              "more (or a head with eagle_aux_hidden_state_layer_ids)")
        layers = c.layer_ids or default_layer_ids(num_layers)
        if not all(0 <= i < num_layers for i in layers):
            raise HfspecError(f"the head reads target layers {list(layers)} but the target has {num_layers} "
                              "decoder layers (ids count from 0, the input of each layer); pick the head trained "
                              "for this target")
        self.feature_layers = tuple(layers)
        width = len(layers) * int(text.hidden_size)
        if width != c.feature_width:
            raise HfspecError(
                f"the head's fc reads {c.feature_width} features but {len(layers)} target layers of width "
                f"{text.hidden_size} give {width} (layers {list(layers)}); pick the head trained for this target")
        embedding = head.embed_tokens.weight if head.embed_tokens is not None else \
            target.get_input_embeddings().weight
        if embedding.shape[1] != c.hidden_size:
            raise HfspecError(f"the head has hidden size {c.hidden_size} but uses the target's embedding of width "
                              f"{embedding.shape[1]}; such a head must carry its own embed_tokens.weight")
        self.embedding = embedding
        rows = model_vocab_size(target)
        ids = head.target_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= rows or ids.unique().numel() != ids.numel():
            raise HfspecError(f"the head's d2t maps draft ids outside the target's {rows} ids or two draft ids "
                              "to one target id; pick the head trained for this target")
        self.vocab_size = min(rows, embedding.shape[0])
        # Draft ids whose target id the run can score (a padded-embedding id is never one).
        kept = ids < self.vocab_size
        self.ids, self.kept = ids[kept], (None if bool(kept.all()) else kept)
        self.kv: KVState | None = None
        self.start_col: int | None = None  # first cache column of this step's own-output entries
        self.verified: torch.Tensor | None = None  # fused features of the last verification, until commit

    @classmethod
    def from_pretrained(cls, path: str | Path, target: PreTrainedModel, *, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None) -> Eagle3Drafter:
        """Load the head at ``path`` for ``target`` (dtype: the target's; device: its embedding's)."""
        device = device if device is not None else target.get_input_embeddings().weight.device
        return cls(load_head(path, dtype=dtype or target.dtype, device=device), target)

    @property
    def device(self) -> torch.device:
        return self.head.fc.weight.device

    def start(self, batch: int, device: torch.device) -> None:
        dev = self.device
        self.kv = KVState(batch, dev)
        self.fed = torch.zeros(batch, dtype=torch.long, device=dev)  # context positions in the cache, per row
        self.pending = torch.zeros(batch, dtype=torch.long, device=dev)  # committed positions waiting, per row
        self.features = torch.zeros(batch, 0, self.head.config.hidden_size, dtype=self.head.fc.weight.dtype,
                                    device=dev)  # (B, K, H) left-aligned: row b's first pending[b] columns
        self.start_col, self.verified = None, None

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Raw embedding rows (no model-specific scaling), as the head was trained with."""
        rows = F.embedding(tokens.to(self.embedding.device), self.embedding)
        return rows.to(device=self.device, dtype=self.head.fc.weight.dtype)

    def _append(self, new: torch.Tensor, count: torch.Tensor) -> None:
        """Add each row's first ``count[b]`` columns of ``new`` (B, k, H) after its pending features."""
        both = torch.cat([self.features, new], dim=1)
        total = self.pending + count
        cols = torch.arange(int(total.max()), device=self.device)[None]
        idx = torch.where(cols < self.pending[:, None], cols, self.features.shape[1] + cols - self.pending[:, None])
        idx = idx.clamp(max=both.shape[1] - 1)
        self.features = both.gather(1, idx[..., None].expand(-1, -1, both.shape[2]))
        self.pending = total

    def observe(self, ctx: Context, features: Features) -> None:
        fused = self.head.fuse(features.values.to(device=self.device, dtype=self.head.fc.weight.dtype))
        if features.verification:
            self.verified = fused  # its first num_accepted + 1 columns are committed at commit
            return
        valid = features.valid.to(self.device)
        order = torch.sort((~valid).long(), dim=1, stable=True).indices  # valid columns first, in order
        self._append(fused.gather(1, order[..., None].expand_as(fused)), valid.sum(dim=1))

    def _unfed(self, ctx: Context) -> tuple[torch.Tensor, ...]:
        """The pending context pairs, right-aligned in a (B, K) block: (fused, tokens, positions, valid)."""
        width = max(1, int(self.pending.max()))
        offset = torch.arange(width, device=self.device)[None] - (width - self.pending[:, None])
        valid = offset >= 0
        positions = (self.fed[:, None] + offset).clamp(min=0)
        tokens = ctx.tokens.gather(1, (positions + 1).to(ctx.tokens.device))  # position j pairs with token j + 1
        if self.features.shape[1] == 0:
            fused = self.features.new_zeros(offset.shape[0], width, self.features.shape[2])
        else:
            idx = offset.clamp(min=0, max=self.features.shape[1] - 1)
            fused = self.features.gather(1, idx[..., None].expand(-1, -1, self.features.shape[2]))
        return fused, tokens, positions, valid

    def _pick(self, ctx: Context, logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                          torch.Tensor]:
        """Draft i from draft-vocabulary logits (B, Vd): scattered to target ids, OUTSIDE elsewhere."""
        full = torch.full((logits.shape[0], self.vocab_size), OUTSIDE, dtype=torch.float32, device=self.device)
        full[:, self.ids] = logits.float() if self.kept is None else logits.float()[:, self.kept]
        return ctx.pick(full.to(ctx.tokens.device), i)

    @torch.inference_mode()
    def propose(self, ctx: Context, gamma: int, stop: Stop | None = None) -> Proposal:
        hidden, tokens, positions, valid = self._unfed(ctx)
        # A row's first draft needs one context pair (a one-token prompt has none yet).
        can_draft = self.pending > 0
        embeds = self._embed(tokens)
        drafts, qs = [], []
        for i in range(gamma):
            h = self.head.step(embeds, hidden, positions, self.kv, valid.long())[:, -1:]  # (B, 1, H)
            if i == 0:  # the context is fed: from here on, entries are built from the head's own outputs
                self.fed = (ctx.lengths.to(self.device) - 1).clamp(min=0)
                self.pending = torch.zeros_like(self.pending)
                self.features = self.features[:, :0]
                self.kv.snapshot()
                self.start_col = self.kv.length
            token, q, confidence = self._pick(ctx, self.head.logits(h[:, 0]), i)
            drafts.append(token)
            qs.append(q)
            if i + 1 < gamma and stop is not None and stop(i + 1, confidence):
                break
            # Draft i + 1 reads the head's pre-norm output and draft i, one position further.
            hidden, embeds = h, self._embed(token[:, None])
            positions = (ctx.lengths.to(self.device) - 1 + i)[:, None]
            valid = torch.ones_like(positions, dtype=torch.bool)
        tokens_out = torch.stack(drafts, dim=1)
        counts = None
        if not bool(can_draft.all()):
            counts = torch.where(can_draft, len(drafts), 0).to(tokens_out.device)
        return Proposal(tokens_out, torch.stack(qs, dim=1) if ctx.sample else None, counts)

    def commit(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        if self.start_col is not None:  # own-output entries go; accepted positions return from target features
            self.kv.rollback(torch.zeros_like(self.fed), self.start_col)
            self.start_col = None
        if self.verified is not None:
            self._append(self.verified, num_accepted.to(self.device) + 1)
            self.verified = None

    def select_rows(self, keep: torch.Tensor) -> None:
        keep = keep.to(self.device)
        self.kv.select_rows(keep)
        self.fed, self.pending, self.features = self.fed[keep], self.pending[keep], self.features[keep]
        width = int(self.pending.max()) if self.pending.numel() else 0
        self.features = self.features[:, :width]

    def check(self, ctx: Context) -> None:
        self.kv.check(self.fed, "EAGLE-3 head")
        expected = ctx.lengths.to(self.device) - 1 - self.fed
        assert torch.equal(self.pending, expected), \
            f"EAGLE-3 head: pending positions {self.pending.tolist()}, expected {expected.tolist()}"

    @torch.inference_mode()
    def step_seconds(self, context: list[int], device: torch.device, repeats: int = 5) -> float:
        """Median seconds of one cached head step (logits included) after ``context``."""
        dev = self.device
        ids = torch.tensor([list(context) or [0]], device=dev).clamp(max=self.vocab_size - 1)
        n = ids.shape[1]
        kv = KVState(1, dev)
        hidden = torch.zeros(1, n, self.head.config.hidden_size, dtype=self.head.fc.weight.dtype, device=dev)
        self.head.step(self._embed(ids), hidden, torch.arange(n, device=dev)[None], kv, torch.ones_like(ids))
        start, times = kv.length, []
        for i in range(repeats + 1):
            sync(dev)
            t0 = time.perf_counter()
            h = self.head.step(self._embed(ids[:, -1:]), hidden[:, :1], torch.tensor([[n]], device=dev), kv,
                               torch.ones(1, 1, dtype=torch.long, device=dev))
            self.head.logits(h)
            sync(dev)
            if i:  # the first call warms up allocators and kernels
                times.append(time.perf_counter() - t0)
            kv.rollback(torch.zeros(1, dtype=torch.long, device=dev), start)
        return statistics.median(times)

    def describe(self) -> dict[str, Any]:
        c = self.head.config
        return {"kind": self.kind, "feature_layers": list(self.feature_layers), "draft_vocab": c.draft_vocab_size,
                "parameters": sum(p.numel() for p in self.head.parameters())}
