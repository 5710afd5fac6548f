"""EAGLE-3 head checkpoints: reading and writing the two published layouts.

Two published layouts load here, recognised by their contents, not their names:
- SafeAILab/EAGLE: a 1-layer Llama ``config.json`` with ``draft_vocab_size``;
  tensors ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``.
- vllm-project/speculators: ``config.json`` with ``speculators_model_type: "eagle3"``,
  ``speculators_config`` and ``transformer_layer_config``; tensors ``layers.0.*``.

A checkpoint is read strictly: every option that would change the forward, every
tensor the forward would ignore and every shape that does not fit the config is
refused with an ``HfspecError``, because a head that loads but drafts wrong only shows
as a low acceptance rate (the output stays exact), which nobody would trace back to
the file. Written heads load in vLLM and SGLang as well as here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.initialization import no_init_weights

from hfspec.errors import HfspecError
from hfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from hfspec.heads.files import WEIGHT_FILES, load_tensors, read_config, weights_file

__all__ = ["LAYOUTS", "load_head", "save_head"]

LAYOUTS = ("speculators", "eagle")
# speculators options that change the forward; hfspec runs the original EAGLE-3 layer only.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
# Tensors some checkpoints carry that the forward does not use (t2d only serves training).
IGNORED_TENSORS = ("t2d", "verifier_lm_head.weight", "verifier_norm.weight")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # position-independent inverse frequencies
# Keys of a layer config that LlamaConfig reads; it validates them and fills in the rest.
_LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "vocab_size",
)


def _parse_config(conf: dict[str, Any], where: str) -> Eagle3Config:
    """The head's shape from either layout's config.json; refuses what the forward would get wrong."""
    if "speculators_model_type" in conf:
        if conf["speculators_model_type"] != "eagle3":
            raise HfspecError(
                f"{where}: speculators model type {conf['speculators_model_type']!r} is not "
                'supported; hfspec runs EAGLE-3 heads (speculators_model_type "eagle3")'
            )
        layer = conf.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise HfspecError(f"{where}: a speculators config needs a transformer_layer_config object")
        if "norm_before_residual" not in conf:
            raise HfspecError(
                f"{where}: norm_before_residual is not set; vLLM reads a missing value as true and "
                'the speculators library as false. Add "norm_before_residual": false if the head '
                "was trained without it (true is not supported)"
            )
    else:
        layer = conf
    for flag in UNSUPPORTED_FLAGS:
        if conf.get(flag):
            raise HfspecError(
                f"{where}: {flag}: true is not supported; hfspec runs the original EAGLE-3 layer "
                f"({', '.join(UNSUPPORTED_FLAGS)} all false)"
            )
    if layer.get("model_type", "llama") != "llama":
        raise HfspecError(
            f"{where}: a {layer['model_type']!r} draft layer is not supported; hfspec runs Llama-style EAGLE-3 layers"
        )
    if layer.get("num_hidden_layers", 1) != 1:
        raise HfspecError(
            f"{where}: the head has {layer['num_hidden_layers']} decoder layers; hfspec runs EAGLE-3 heads with one"
        )
    if any(kind != "full_attention" for kind in layer.get("layer_types") or ()):
        # speculators' training CLI writes layer_types and runs "sliding_attention" layers with a window.
        raise HfspecError(
            f"{where}: layer_types {layer['layer_types']} asks for sliding-window attention, which "
            "hfspec's EAGLE-3 layer does not run; it supports full_attention only"
        )
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
        raise HfspecError(
            f"{where}: RoPE type {rope.get('rope_type')!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
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
        hidden_size=llama.hidden_size,
        intermediate_size=llama.intermediate_size,
        num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads,
        vocab_size=vocab,
        draft_vocab_size=int(conf.get("draft_vocab_size") or vocab),
        target_hidden_size=conf.get("target_hidden_size"),
        head_dim=llama.head_dim,
        rms_norm_eps=llama.rms_norm_eps,
        hidden_act=llama.hidden_act,
        rope_parameters=rope,
        max_position_embeddings=llama.max_position_embeddings,
        layer_ids=tuple(ids) if ids else None,
    )


def _head_name(name: str) -> str:
    """Checkpoint tensor name -> the head's parameter name."""
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            return "layer." + name[len(prefix) :]
    return name


def _listed(names: Any) -> str:
    names = sorted(names)
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def load_head(
    path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> Eagle3Head:
    """Load an EAGLE-3 head from a directory in either layout (``model.safetensors`` or ``pytorch_model.bin``).

    ``dtype`` None keeps the stored floating dtype. Every tensor must match the config;
    anything the forward would ignore or misread is refused with an ``HfspecError``.
    """
    path = Path(str(path)).expanduser()
    where = f"EAGLE-3 head {str(path)!r}"
    conf = read_config(path)
    if conf is None:
        raise HfspecError(f"{where}: no readable config.json")
    config = _parse_config(conf, where)
    file = weights_file(path)
    if file is None:
        sharded = (
            " (sharded checkpoints are not supported for heads; save it as one file)"
            if any(path.glob("*.index.json"))
            else ""
        )
        raise HfspecError(f"{where}: no {' or '.join(WEIGHT_FILES)}{sharded}")
    state = {_head_name(k): v for k, v in load_tensors(file).items() if k not in IGNORED_TENSORS}
    if (
        "target_hidden_size" in conf
        and "embed_tokens.weight" not in state
        and conf["target_hidden_size"] not in (None, config.hidden_size)
    ):
        raise HfspecError(
            f"{where}: the config sets target_hidden_size, so the head carries its own embedding, "
            "but the checkpoint has no embed_tokens.weight"
        )
    with no_init_weights():  # every tensor comes from the checkpoint (checked below): random init is wasted time
        head = Eagle3Head(config, own_embedding="embed_tokens.weight" in state)
    expected = head.state_dict()
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise HfspecError(
                f"{where}: the draft vocabulary ({config.draft_vocab_size}) is smaller than the "
                f"target's ({config.vocab_size}) but the checkpoint has no d2t to map it"
            )
        state["d2t"] = expected["d2t"]  # identity: target id = draft id
    unexpected, missing = set(state) - set(expected), set(expected) - set(state)
    if unexpected or missing:
        parts = ([f"tensors the forward would ignore: {_listed(unexpected)}"] if unexpected else []) + (
            [f"missing tensors: {_listed(missing)}"] if missing else []
        )
        raise HfspecError(f"{where}: {'; '.join(parts)}")
    wrong = [
        f"{k} {tuple(v.shape)} (config: {tuple(expected[k].shape)})"
        for k, v in state.items()
        if tuple(v.shape) != tuple(expected[k].shape)
    ]
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
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.dim,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    return out


def save_head(
    head: Eagle3Head,
    path: str | Path,
    *,
    layout: str = "speculators",
    dtype: torch.dtype | None = None,
    target: PreTrainedModel | None = None,
    embedding: bool = False,
    verifier: str | None = None,
    speculative_tokens: int = 3,
) -> Path:
    """Write ``head`` to the directory ``path`` (``model.safetensors`` + ``config.json``) in ``layout``.

    ``speculators``: the layout vLLM serves with ``speculators_model_type: "eagle3"``;
    the verifier is ``verifier`` or ``target``'s name/path and architectures.
    ``eagle``: SafeAILab/EAGLE's (``midlayer.*``). ``dtype`` (e.g. bfloat16) casts the
    floating weights; ``d2t``/``t2d`` stay integer/bool. The target's embedding is
    not stored unless ``embedding`` (it needs ``target``); a head's own embedding always is.
    ``norm_before_residual`` is written false: this forward adds the un-normed hidden.
    """
    if layout not in LAYOUTS:
        raise HfspecError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    c = head.config
    dtype = dtype or head.fc.weight.dtype
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    tensors: dict[str, torch.Tensor] = {}
    for name, value in head.state_dict().items():
        key = prefix + name[len("layer.") :] if name.startswith("layer.") else name
        tensors[key] = value if name == "d2t" else value.to(dtype)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[head.target_ids().cpu()] = True
    tensors["t2d"] = t2d
    if embedding and head.embed_tokens is None:
        if target is None:
            raise HfspecError("embedding=True stores the target's embedding: pass target=")
        weight = target.get_input_embeddings().weight
        if tuple(weight.shape) != (c.vocab_size, c.hidden_size):
            raise HfspecError(
                f"the target's embedding is {tuple(weight.shape)}, the head expects ({c.vocab_size}, {c.hidden_size})"
            )
        tensors["embed_tokens.weight"] = weight.detach().to(dtype)
    path = Path(str(path)).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
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
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": int(speculative_tokens),
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": name, "architectures": architectures},
            },
            "transformer_layer_config": {**layer, "torch_dtype": dtype_name},
            "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "target_hidden_size": target_hidden,
            "eagle_aux_hidden_state_layer_ids": ids,
            "embed_requires_grad": False,
            "torch_dtype": dtype_name,
        }
    (path / "config.json").write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
    return path
