"""The target a draft is trained for: where it lives, how it loads, and what of its config a draft copies.

Both kinds of draft (a small draft model and an EAGLE-3 head) are trained against a
local target directory in float32, with the target's own tokenizer, and both take the
target's rotary base so that their positions mean what the target's mean.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hfspec.errors import HfspecError
from hfspec.models.assets import offline_target_float32

OFFLINE = "offline"  # the word that names SmolLM2-135M-Instruct from hfspec.models.assets


def resolve_target(target: str | Path, progress: bool) -> Path:
    """A local target directory; the word ``"offline"`` names SmolLM2-135M-Instruct from hfspec.models.assets."""
    if str(target) == OFFLINE:
        target = offline_target_float32(progress=progress)  # trained against in float32: its weights on disk
    path = Path(target)
    if not (path / "config.json").is_file():
        raise HfspecError(f"target must be a local model directory with a config.json (or 'offline'), got {target!s}")
    return path


def load_target(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, int]:
    """(target in float32 and eval mode, its tokenizer, the pad id); float32 because its log-probs are labels."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer, pad_id(tokenizer)


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's pad id, else its end-of-sequence id: many causal LMs ship without a pad token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def rope_theta(config) -> float:
    """The rotary base of a transformers config, wherever this transformers version keeps it (default 10000)."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))
