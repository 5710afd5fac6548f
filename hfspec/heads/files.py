"""What a draft head's directory holds: its config.json, its one weights file, and which kind of head it is.

A head's directory looks like a model's (a ``config.json``, a weights file), and the
EAGLE layout even names a Llama architecture; loaded with ``AutoModelForCausalLM`` it
would run with random weights and no error. So the model loader asks ``head_kind``
first. Recognising a head needs only its files, so this module knows nothing of the
head's modules or of caches: it sits on the ground floor, below the model loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

__all__ = [
    "HEAD_ARCHITECTURES",
    "WEIGHT_FILES",
    "head_kind",
    "is_eagle3_dir",
    "load_tensors",
    "read_config",
    "weights_file",
]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Architecture names of EAGLE-3 heads in the wild (vLLM, SGLang, speculators).
HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DraftModel", "Eagle3Speculator")


def read_config(path: Path) -> dict[str, Any] | None:
    """``path/config.json`` as a dict, or None when there is none or it is not a JSON object."""
    file = path / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def weights_file(path: Path) -> Path | None:
    """The one weights file of a head's directory (safetensors first), or None."""
    return next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)


def load_tensors(file: Path, names_only: bool = False) -> dict[str, torch.Tensor] | set[str]:
    """The tensors of a safetensors or torch file on the CPU, or only their names (read without the data)."""
    if file.suffix == ".safetensors":
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
    conf = read_config(path) if path.is_dir() else None
    if conf is None:
        return None
    if "speculators_model_type" in conf:
        return str(conf["speculators_model_type"])
    if "draft_vocab_size" in conf or set(conf.get("architectures") or ()) & set(HEAD_ARCHITECTURES):
        return "eagle3"
    file = weights_file(path)
    if conf.get("num_hidden_layers") == 1 and file is not None:
        names = load_tensors(file, names_only=True)
        if {"fc.weight", "d2t"} & names or any(n.startswith("midlayer.") for n in names):
            return "eagle3"
    return None


def is_eagle3_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory holding an EAGLE-3 head, in either layout."""
    return head_kind(path) == "eagle3"
