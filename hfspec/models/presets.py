"""Pair presets: a ready target/draft pair and the settings that suit it, one JSON file each.

Shipped presets live in ``hfspec/data/presets``; ``load_preset`` reads one by name or path and checks every key, type
and value, naming the allowed keys in its error.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfspec.errors import HfspecError
from hfspec.models.paths import DATA

__all__ = [
    "ALLOWED_KEYS",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_PRESET",
    "DTYPES",
    "PRESET_DIR",
    "Preset",
    "load_preset",
    "preset_names",
]

PRESET_DIR = DATA / "presets"
DEFAULT_PRESET = "smollm2-offline"  # the pair used when none is named
DEFAULT_MAX_NEW_TOKENS = 128
# The sampling settings a preset may set, by their GenerationConfig (and, but do_sample, SamplingParams) names.
SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")

# A dtype's spellings -> the name of its torch dtype (names, not torch objects: the command line reads this
# without importing torch).
DTYPES: dict[str, str] = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


@dataclass(frozen=True)
class Preset:
    """A ready target/draft pair and the settings that suit it (one JSON file)."""

    name: str
    target: str  # hub name, local path, or "offline"
    draft: str  # hub name, local path, "shipped", "shipped-eagle3", or "ngram" (model-free lookup)
    description: str = ""
    gamma: int | str = "auto"  # γ: drafts per verification step, or "auto" (chosen at every step)
    dtype: str = "auto"  # weights of both models: auto, float32, float16, bfloat16
    draft_dtype: str | None = None  # the draft's own dtype, if different
    chat: bool = False  # wrap prompts in the tokenizer's chat template
    system: str | None = None  # default system message when chat is on
    gguf_file: str | None = None  # a GGUF file inside the target's directory or repository
    draft_gguf_file: str | None = None  # a GGUF file inside the draft's directory or repository
    gguf_native: bool = True  # keep GGUF models' quantized blocks on CPU (False: dequantize as transformers does)
    revision: str | None = None  # the target's hub revision
    trust_remote_code: bool = False
    do_sample: bool | None = None  # sampling defaults; None keeps the target's generation_config
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    ngram: bool = False  # add n-gram lookup to the model draft (per row, whichever is expected to do better)
    fast_kernels: bool = True  # run both models on hfspec's CPU kernel where they sit on CPU (hfspec.fast)
    draft_bits: int | str | None = None  # the draft's integer arithmetic on CPU: 4, 8 or "off" (None: load_pair's 4)
    draft_vocab: int | None = None  # keep the draft's head to the N most frequent tokens (None: the whole vocabulary)
    arithmetic: str | None = None  # a GGUF target's on CPU: "int8" or "float32" (None: int8 where its kernel runs)
    source: str = ""  # the file it was read from (filled in by load_preset)

    def sampling(self) -> dict[str, Any]:
        """The sampling settings this preset sets, by their ``GenerationConfig`` names."""
        return {name: getattr(self, name) for name in SAMPLING if getattr(self, name) is not None}

    def load_kwargs(self) -> dict[str, Any]:
        """The ``load_pair`` keyword arguments this preset sets."""
        kwargs: dict[str, Any] = {"dtype": self.dtype, "trust_remote_code": self.trust_remote_code}
        if not self.fast_kernels:  # on is load_pair's default
            kwargs["fast_kernels"] = False
        if not self.gguf_native:
            kwargs["gguf_native"] = False
        if self.draft_bits is not None:
            kwargs["draft_bits"] = None if self.draft_bits == "off" else self.draft_bits
        for name in ("draft_dtype", "gguf_file", "draft_gguf_file", "revision", "draft_vocab", "arithmetic"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs


_REQUIRED = ("name", "target", "draft")
_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "target": (str,),
    "draft": (str,),
    "description": (str,),
    "gamma": (int, str),
    "dtype": (str,),
    "draft_dtype": (str,),
    "chat": (bool,),
    "system": (str,),
    "gguf_file": (str,),
    "revision": (str,),
    "trust_remote_code": (bool,),
    "do_sample": (bool,),
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "repetition_penalty": (int, float),
    "ngram": (bool,),
    "fast_kernels": (bool,),
    "draft_gguf_file": (str,),
    "gguf_native": (bool,),
    "draft_bits": (int, str),
    "draft_vocab": (int,),
    "arithmetic": (str,),
}
ALLOWED_KEYS = tuple(_TYPES)


def preset_names() -> list[str]:
    """Names of the presets shipped in ``hfspec/data/presets``."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def _preset_file(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if text.endswith(".json") or "/" in text or "\\" in text:
        raise HfspecError(f"preset file {text!r} does not exist; shipped presets: {', '.join(preset_names())}")
    shipped = PRESET_DIR / f"{text}.json"
    if not shipped.is_file():
        raise HfspecError(
            f"no preset named {text!r}; shipped presets: {', '.join(preset_names())} (or pass the path of a JSON file)"
        )
    return shipped


def load_preset(name_or_path: str | Path) -> Preset:
    """Read and validate a preset by shipped name (``qwen2.5-7b``) or by path."""
    path = _preset_file(name_or_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise HfspecError(f"preset {path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise HfspecError(f"preset {path}: the file must hold one JSON object, got {type(data).__name__}")
    allowed = ", ".join(ALLOWED_KEYS)
    unknown = sorted(set(data) - set(_TYPES))
    if unknown:
        raise HfspecError(f"preset {path}: unknown key(s) {', '.join(unknown)}; allowed keys: {allowed}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise HfspecError(f"preset {path}: missing required key(s) {', '.join(missing)}; allowed keys: {allowed}")
    for key, value in data.items():
        kinds = _TYPES[key]
        optional = key not in _REQUIRED and Preset.__dataclass_fields__[key].default is None
        if value is None and optional:
            continue
        if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
            want = " or ".join(k.__name__ for k in kinds)
            raise HfspecError(f"preset {path}: {key} must be {want}, got {value!r}")
    _check_values(path, data)
    return dataclasses.replace(Preset(**data), source=str(path))


def _check_values(path: Path, data: dict[str, Any]) -> None:
    def bad(key: str, rule: str) -> HfspecError:
        return HfspecError(f"preset {path}: {key} must be {rule}, got {data[key]!r}")

    gamma = data.get("gamma", "auto")
    if gamma != "auto" and (isinstance(gamma, str) or gamma < 1):
        raise bad("gamma", 'an integer >= 1 or "auto"')
    for key in ("dtype", "draft_dtype"):
        if data.get(key) is not None and data[key].lower() not in DTYPES:
            raise bad(key, "one of " + ", ".join(DTYPES))
    # Here, not at the top: the command line reads this module without importing torch.
    from hfspec.settings import SamplingParams

    try:  # the sampling settings' rules are SamplingParams'
        SamplingParams(**{name: data[name] for name in SAMPLING[1:] if data.get(name) is not None})
    except HfspecError as error:
        raise HfspecError(f"preset {path}: {error}") from None
    if data.get("draft_bits") is not None and data["draft_bits"] not in (4, 8, "off"):
        raise bad("draft_bits", '4, 8 or "off"')
    if data.get("arithmetic") is not None and data["arithmetic"] not in ("int8", "float32"):
        raise bad("arithmetic", '"int8" or "float32"')
    if data.get("draft_vocab") is not None and data["draft_vocab"] < 1:
        raise bad("draft_vocab", "an integer >= 1 (a number of tokens)")
    for key in ("name", "target", "draft"):
        if not data[key].strip():
            raise bad(key, "a non-empty string")
