"""A GGUF's config, tensor names and tokenizer are read once per file and kept where reading them took long."""

from __future__ import annotations

import os

import gguf_files
import pytest

from hfspec.models import gguf_meta, gguf_native


@pytest.fixture
def gguf(tmp_path, monkeypatch, library):
    monkeypatch.setattr(gguf_meta, "cache_dir", lambda: tmp_path / "cache")  # the kernels stay where they are built
    monkeypatch.setattr(gguf_meta, "WORTH_KEEPING", 0.0)  # keep everything, however fast
    return gguf_files.write(tmp_path / "model", "qwen2", "Q8_0")


def test_what_took_long_is_kept_and_read_back(gguf, monkeypatch):
    first = gguf_native.load(str(gguf.parent), gguf.name, "target")
    assert first is not None
    kept = gguf_meta.entry(gguf)
    assert (kept / "config" / "config.json").is_file() and (kept / "names" / "names.json").is_file()

    class Unread:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError("read the file again")

    monkeypatch.setattr(gguf_native, "AutoConfig", Unread)
    monkeypatch.setattr("transformers.modeling_gguf_pytorch_utils.get_gguf_hf_weights_map", Unread.from_pretrained)
    second = gguf_native.load(str(gguf.parent), gguf.name, "target")
    assert second.config.to_dict() | {"_name_or_path": ""} == first.config.to_dict() | {"_name_or_path": ""}
    assert [n for n, _ in second.named_parameters()] == [n for n, _ in first.named_parameters()]


def test_a_file_changed_in_place_is_read_afresh(gguf):
    before = gguf_meta.entry(gguf)
    os.utime(gguf, ns=(0, 10**9))
    assert gguf_meta.entry(gguf) != before


def test_a_damaged_entry_is_read_from_the_file(gguf):
    calls = []
    value = gguf_meta.names(gguf, lambda: calls.append(1) or {"a": "b"})
    (gguf_meta.entry(gguf) / "names" / "names.json").write_text("{not json")
    assert gguf_meta.names(gguf, lambda: calls.append(1) or {"a": "b"}) == value and len(calls) == 2


def test_what_is_quick_to_read_is_not_kept(gguf, monkeypatch):
    monkeypatch.setattr(gguf_meta, "WORTH_KEEPING", 60.0)
    gguf_meta.names(gguf, lambda: {"a": "b"})
    assert not gguf_meta.entry(gguf).exists()


def test_reads_inside_read_once_parse_the_file_once_and_give_what_separate_reads_give(gguf, monkeypatch):
    import gguf as gguf_package
    from transformers import AutoConfig, AutoModelForCausalLM

    parsed = []
    original = gguf_package.GGUFReader

    class Counted(original):
        def __init__(self, *args, **kwargs):
            parsed.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_package, "GGUFReader", Counted)

    def read():
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return config.to_dict(), model.state_dict()

    apart = read()
    separate = len(parsed)
    parsed.clear()
    with gguf_meta.read_once(gguf):
        together = read()
    assert separate >= 3 and len(parsed) == 1
    assert gguf_package.GGUFReader is Counted  # put back
    assert together[0] == apart[0]
    assert together[1].keys() == apart[1].keys()
    assert all(t.equal(apart[1][k]) for k, t in together[1].items())
