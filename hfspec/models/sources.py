"""Where a model named by the user is: a local directory, a GGUF file in one, a hub repository, or a name hfspec knows.

Every place that takes a model by name (``--target``/``--draft``, ``SpeculativeGenerator.from_pretrained``,
``hfspec.generate``, ``hfspec.drafters.loading``, presets) resolves it with :func:`locate`, once, to a
:class:`ModelSource`: the directory or hub name transformers loads from and the GGUF file in it, if any. A path to a
GGUF file is its directory with that file as ``gguf_file`` (how llama.cpp users name a model, ``-m model.gguf``); so is
a local directory that holds a single ``.gguf`` and no other weights. A local file that is not a whole GGUF model (a
text file, an empty or a truncated file) is refused here, in one line naming it and the forms accepted.

Four names are special: ``"offline"`` as the target is SmolLM2-135M-Instruct, built without a model hub
(``hfspec.models.assets.offline_target_path``); ``"shipped"`` as the draft is the draft model committed with the package
for it and ``"shipped-eagle3"`` the EAGLE-3 head; ``"ngram"`` as the draft is model-free lookup, with no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hfspec.errors import HfspecError
from hfspec.models import assets, gguf_native

__all__ = ["FORMS", "NGRAM", "OFFLINE_TARGET", "SHIPPED_DRAFT", "SHIPPED_HEAD", "ModelSource", "locate", "lone_gguf"]

OFFLINE_TARGET = "offline"
SHIPPED_DRAFT = "shipped"
SHIPPED_HEAD = "shipped-eagle3"
NGRAM = "ngram"  # the draft name of model-free lookup
FORMS = "pass a model directory, a .gguf file or a hub name"  # what every error about a model's name ends with


@dataclass(frozen=True)
class ModelSource:
    """A model as transformers and hfspec load it: ``path`` (a local directory, a hub name, or ``"ngram"``) and the
    GGUF file in it (None: not a GGUF model)."""

    path: str
    gguf_file: str | None = None


def resolve_model(name: str | Path, role: str) -> str:
    """Turn the special names ``offline`` (target), ``shipped`` and ``shipped-eagle3`` (draft), and the names of
    models fetched from registry wheels (``assets.WHEEL_MODELS``, either role) into local paths."""
    name = str(name)
    if Path(name).expanduser().exists():
        return name
    if role == "target" and name == OFFLINE_TARGET:
        return str(assets.offline_target_path())
    if name in assets.WHEEL_MODELS:
        return str(assets.wheel_model_dir(name))
    if role == "draft" and name in (SHIPPED_DRAFT, SHIPPED_HEAD):
        what = "draft" if name == SHIPPED_DRAFT else "EAGLE-3 head"
        path = Path(assets.shipped_draft_path() if name == SHIPPED_DRAFT else assets.shipped_head_path())
        if not (path / "config.json").is_file():
            raise HfspecError(
                f"the shipped {what} is not part of this installation (expected it at {path}); "
                "pass a draft model with --draft PATH"
            )
        return str(path)
    return name


def locate(name: str | Path, role: str, gguf_file: str | None = None) -> ModelSource:
    """Where the ``role`` model ``name`` is (see the module docstring); ``gguf_file`` names a GGUF file in a
    directory or hub repository. An ``HfspecError`` for a local file that is not a whole GGUF model, a missing
    ``.gguf`` path, and a GGUF file named twice, differently."""
    if role == "draft" and str(name) == NGRAM:  # lookup, even beside a file or directory of that name
        return ModelSource(NGRAM, gguf_file)
    path = resolve_model(name, role)
    local = Path(path).expanduser()
    if local.is_file():
        problem = gguf_native.file_problem(local)
        if problem is not None:
            raise HfspecError(f"the {role} {str(name)!r} is {problem}; {FORMS}")
        local = local.absolute()  # not resolved: a linked file keeps its name (the hub cache links blobs)
        if gguf_file is not None and Path(gguf_file).name != local.name and Path(gguf_file) != local:
            raise HfspecError(
                f"the {role} is the GGUF file {str(name)!r}, and its gguf_file is {gguf_file!r}, another file; "
                "drop gguf_file (or --gguf-file), or name the directory that holds it as the model"
            )
        return ModelSource(str(local.parent), local.name)
    if path.lower().endswith(".gguf") and not local.exists():
        raise HfspecError(f"the {role} {str(name)!r} does not exist; {FORMS}")
    gguf_file = gguf_file or lone_gguf(path)
    found = gguf_native.local_file(path, gguf_file) if gguf_file else None
    problem = gguf_native.file_problem(found) if found else None
    if problem is not None:
        raise HfspecError(f"the {role} {str(name)!r}: its GGUF file {gguf_file!r} is {problem}; {FORMS}")
    return ModelSource(path, gguf_file)


_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")


def lone_gguf(path: str) -> str | None:
    """The GGUF file of a local directory that holds one and no other weights (a model fetched by name, a user's
    folder with a single GGUF, the offline target beside its config and tokenizer): it is the model, so it needs no
    ``gguf_file=``. None otherwise."""
    local = Path(path).expanduser()
    if not local.is_dir() or any(next(local.glob(pattern), None) for pattern in _WEIGHTS):
        return None
    found = sorted(local.glob("*.gguf"))
    return found[0].name if len(found) == 1 else None
