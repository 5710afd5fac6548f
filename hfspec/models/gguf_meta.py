"""What a GGUF file says about its model (config, tensor names, tokenizer), read once per file and kept.

transformers reads a GGUF's metadata with the ``gguf`` package's reader, which builds a numpy view for every
element of every array: the 151,936 tokens and 151,387 merges of a Qwen2.5 tokenizer take about 20 s to read on a
2-core CPU, and that again each time a config or a tokenizer is asked of the file. Here each is computed once per
file and kept under ``$HFSPEC_CACHE/gguf/`` where computing it took longer than :data:`WORTH_KEEPING` seconds
(tiny files are read faster than the cache), keyed by the file's real path, size and modification time and by
the transformers version that read it; a later load reads it back in milliseconds. Entries are written to a
temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from hfspec.models.paths import cache_dir

__all__ = ["WORTH_KEEPING", "config", "entry", "names", "read_once", "tokenizer"]

log = logging.getLogger(__name__)

WORTH_KEEPING = 1.0  # seconds: what took longer to read from the file is kept
_VERSION = 1  # of the entries' layout


def entry(path: str | Path) -> Path:
    """The cache directory for the GGUF file at ``path`` (not created): one per path, size, mtime and transformers
    version, so a file replaced in place is read afresh."""
    real = Path(path).resolve()
    stat = real.stat()
    key = f"{_VERSION}|{real}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return cache_dir() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:24]


@contextlib.contextmanager
def read_once(path: str | Path) -> Iterator[None]:
    """Within the block, transformers' reads of the GGUF file at ``path`` share one ``gguf.GGUFReader``: the
    config, the tokenizer and the weights that transformers reads one call at a time parse the file's metadata
    once (about 5 s for a 49,152-token vocabulary on a 2-core CPU, each time). Other files read as before. The
    tensor-name table it builds per module while naming the weights (``gguf.get_tensor_name_map``, a pure function
    of the architecture and the layer count) is built once too."""
    import gguf

    real = Path(path).resolve()
    original, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[Path, Any] = {}

    def reader(file: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or Path(file).resolve() != real:
            return original(file, *args, **kwargs)
        if real not in readers:
            readers[real] = original(file)
        return readers[real]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original, name_map


def _kept(
    path: str | Path,
    what: str,
    compute: Callable[[], Any],
    save: Callable[[Any, Path], None],
    load: Callable[[Path], Any],
) -> Any:
    """``load(dir)`` of the kept ``what`` of ``path``'s file, else ``compute()``, saved (``save(value, dir)``) if
    it took long."""
    kept = entry(path) / what
    if kept.exists():
        try:
            return load(kept)
        except (OSError, ValueError, KeyError) as exc:  # a damaged entry: read the file again
            log.debug("GGUF cache entry %s unreadable (%s); reading the file", kept, exc)
    start = time.perf_counter()
    value = compute()
    seconds = time.perf_counter() - start
    if seconds > WORTH_KEEPING:
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=kept.parent, prefix=f".{what}-") as tmp:
                staged = Path(tmp) / what
                staged.mkdir()
                save(value, staged)
                os.replace(staged, kept)
        except OSError as exc:  # a read-only or full cache: nothing kept, nothing lost
            log.debug("could not keep %s of %s (%s)", what, path, exc)
            return value
        log.info("read the %s of %s in %.1f s; kept in %s for later loads", what, Path(path).name, seconds, kept.parent)
    return value


def config(path: str | Path, compute: Callable[[], PretrainedConfig]) -> PretrainedConfig:
    """The transformers config of the GGUF file at ``path``: kept, or ``compute()`` (transformers reading it)."""
    return _kept(path, "config", compute, lambda c, d: c.save_pretrained(d), AutoConfig.from_pretrained)


def names(path: str | Path, compute: Callable[[], dict[str, str]]) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name for the file at ``path``: kept, or ``compute()``."""
    return _kept(
        path,
        "names",
        compute,
        lambda n, d: (d / "names.json").write_text(json.dumps(n)),
        lambda d: json.loads((d / "names.json").read_text()),
    )


def tokenizer(
    path: str | Path, compute: Callable[[], PreTrainedTokenizerBase], trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer converted from the GGUF file at ``path``: kept, or ``compute()`` (transformers converting it)."""
    return _kept(
        path,
        "tokenizer",
        compute,
        lambda t, d: t.save_pretrained(d),
        lambda d: AutoTokenizer.from_pretrained(d, trust_remote_code=trust_remote_code),
    )
