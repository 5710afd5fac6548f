"""Loading pairs by path, the tokenizer check, the usual loading mistakes, and presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModel, PreTrainedTokenizerFast

from hfspec import SpeculativeGenerator
from hfspec.drafters.loading import load_pair
from hfspec.errors import HfspecError
from hfspec.models import assets
from hfspec.models.presets import ALLOWED_KEYS, Preset, load_preset, preset_names
from hfspec.models.sources import resolve_model
from hfspec.models.weights import parse_dtype


def permuted_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The tiny tokenizer's tokens with the word ids reversed: same size, other ids."""
    words = list(tiny.make_tokenizer(vocab_size).get_vocab())
    words.sort(key=tiny.make_tokenizer(vocab_size).get_vocab().get)
    return word_tokenizer(words[:7] + words[7:][::-1])


def foreign_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The tiny tokenizer's specials and role words, but none of its other words (v7 ... instead of w7 ...)."""
    words = list(tiny.make_tokenizer(vocab_size).get_vocab())
    words.sort(key=tiny.make_tokenizer(vocab_size).get_vocab().get)
    return word_tokenizer(words[:7] + [f"v{i}" for i in range(7, vocab_size)])


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_from_pretrained_by_path_matches_target_greedy(model_dir, arch):
    target_dir, draft_dir = model_dir(arch, seed=0), model_dir(arch, seed=1)
    gen = SpeculativeGenerator.from_pretrained(str(target_dir), str(draft_dir), dtype="float32")
    assert gen.target.dtype == torch.float32 and gen.tokenizer is not None
    ids = torch.tensor([[1, 10, 11, 12]])
    out = gen.generate(ids, max_new_tokens=10, gamma=3)
    reference = gen.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert torch.equal(out.sequences, reference)


def test_dtypes_apply_to_both_unless_the_draft_has_its_own(model_dir):
    target, draft, _ = load_pair(
        model_dir("llama", seed=0), model_dir("llama", seed=1), dtype="bf16", draft_dtype="float32"
    )
    assert target.dtype == torch.bfloat16 and draft.dtype == torch.float32
    target, draft, _ = load_pair(model_dir("llama", seed=0), model_dir("llama", seed=1), dtype=torch.float16)
    assert target.dtype == draft.dtype == torch.float16


def test_parse_dtype():
    assert parse_dtype("auto") == "auto" and parse_dtype(None) == "auto"
    assert parse_dtype("BF16") is torch.bfloat16 and parse_dtype("half") is torch.float16
    with pytest.raises(HfspecError, match="unknown dtype 'float8'.*bfloat16"):
        parse_dtype("float8")


def test_given_tokenizer_is_used(model_dir):
    tok = tiny.make_tokenizer(64)
    _, _, loaded = load_pair(model_dir("llama", seed=0), model_dir("llama", seed=1), tokenizer=tok)
    assert loaded is tok


def test_draft_sharing_almost_no_tokens_is_refused_naming_both(model_dir, tmp_path):
    draft_dir = tiny.build(tmp_path / "draft", "llama", seed=1)
    tiny.save_tokenizer(foreign_tokenizer(64), draft_dir)
    target_dir = model_dir("llama", seed=0)
    with pytest.raises(HfspecError) as err:
        load_pair(target_dir, draft_dir)
    message = str(err.value)
    assert str(target_dir) in message and str(draft_dir) in message
    assert "different tokenizers" in message and "trained with the target's tokenizer" in message


def test_draft_with_other_token_ids_drafts_across_tokenizers(model_dir, tmp_path):
    # The same tokens under other ids: a different tokenizer, drafted through the tokens both share.
    draft_dir = tiny.build(tmp_path / "draft", "llama", seed=1)
    tiny.save_tokenizer(permuted_tokenizer(64), draft_dir)
    gen = SpeculativeGenerator.from_pretrained(str(model_dir("llama", seed=0)), str(draft_dir), dtype="float32")
    assert gen.drafter.kind == "cross-tokenizer" and gen.drafter.describe()["shared_tokens"] == 64
    ids = torch.tensor([[1, 10, 11, 12]])
    reference = gen.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert torch.equal(gen.generate(ids, max_new_tokens=10, gamma=3).sequences, reference)


def test_draft_without_a_tokenizer_uses_the_targets(model_dir, tmp_path):
    target, _ = tiny.load(model_dir("llama", seed=1))
    target.save_pretrained(tmp_path / "bare")
    _, draft, tok = load_pair(model_dir("llama", seed=0), tmp_path / "bare")
    assert len(tok) == 64 and draft.config.vocab_size == 64


def test_missing_path(model_dir, tmp_path):
    with pytest.raises(HfspecError, match="draft path .*nowhere.* does not exist"):
        load_pair(model_dir("llama"), tmp_path / "nowhere")


def test_directory_without_a_model(model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(HfspecError, match="target directory .*empty.* holds no model"):
        load_pair(tmp_path / "empty", model_dir("llama"))


def test_non_causal_model_is_refused(model_dir, tmp_path):
    config = AutoConfig.for_model("t5", vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    AutoModel.from_config(config).save_pretrained(tmp_path / "t5")
    with pytest.raises(HfspecError, match="not a causal language model"):
        load_pair(tmp_path / "t5", model_dir("llama"))


def test_bad_device_is_refused_before_loading(model_dir):
    with pytest.raises(HfspecError, match="invalid target device 'gpu0'"):
        load_pair(model_dir("llama"), model_dir("llama"), device="gpu0")
    with pytest.raises(HfspecError, match="device or device_map, not both"):
        load_pair(model_dir("llama"), model_dir("llama"), device="cpu", device_map="auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(model_dir):
    with pytest.raises(HfspecError, match="torch sees no CUDA GPU; use --device cpu"):
        load_pair(model_dir("llama"), model_dir("llama"), device="cuda")


def test_special_names_resolve_through_assets(monkeypatch, tmp_path, model_dir):
    monkeypatch.setattr(assets, "offline_target_path", lambda **kw: model_dir("llama", seed=0))
    monkeypatch.setattr(assets, "shipped_draft_path", lambda: tmp_path / "no-draft")
    assert resolve_model("offline", "target") == str(model_dir("llama", seed=0))
    assert resolve_model("gpt2", "target") == "gpt2"
    with pytest.raises(HfspecError, match="shipped draft is not part of this installation.*--draft PATH"):
        resolve_model("shipped", "draft")
    monkeypatch.setattr(assets, "shipped_draft_path", lambda: model_dir("llama", seed=1))
    assert resolve_model("shipped", "draft") == str(model_dir("llama", seed=1))
    monkeypatch.setattr(assets, "shipped_head_path", lambda: tmp_path / "no-head")
    with pytest.raises(HfspecError, match="shipped EAGLE-3 head is not part of this installation"):
        resolve_model("shipped-eagle3", "draft")
    monkeypatch.setattr(assets, "shipped_head_path", lambda: model_dir("llama", seed=2))
    assert resolve_model("shipped-eagle3", "draft") == str(model_dir("llama", seed=2))
    assert resolve_model("shipped-eagle3", "target") == "shipped-eagle3"


def test_the_constructor_takes_the_shipped_names(monkeypatch, tiny_pair, model_dir):
    from hfspec import SpeculativeGenerator

    target, _, tok = tiny_pair("llama")
    monkeypatch.setattr(assets, "shipped_draft_path", lambda: model_dir("llama", seed=1))
    assert SpeculativeGenerator(target, "shipped", tok).drafter.kind == "model"


# -- presets --------------------------------------------------------------------------------------


def test_every_shipped_preset_is_valid():
    names = preset_names()
    assert {"smollm2-offline", "smollm2-1.7b", "qwen2.5-7b", "llama-3.1-8b", "gpt2-xl", "pythia-6.9b"} <= set(names)
    for name in names:
        preset = load_preset(name)
        assert preset.name == name, f"{name}.json names itself {preset.name!r}"
        assert preset.gamma == "auto" and preset.description, "every shipped preset lets hfspec choose γ"
        assert parse_dtype(preset.dtype) != "auto", f"{name}: pin a dtype"


def test_checkout_configs_link_points_at_the_shipped_presets():
    root = Path(__file__).resolve().parent.parent
    assert (root / "configs").resolve() == (root / "hfspec" / "data" / "presets").resolve()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_preset_by_path_with_sampling_defaults(tmp_path):
    path = write(
        tmp_path / "p.json",
        json.dumps(
            {"name": "p", "target": "t", "draft": "d", "gamma": 3, "do_sample": True, "temperature": 0.7, "top_p": 0.9}
        ),
    )
    preset = load_preset(path)
    assert isinstance(preset, Preset) and preset.gamma == 3 and preset.temperature == 0.7
    assert preset.source == str(path) and preset.load_kwargs() == {"dtype": "auto", "trust_remote_code": False}
    with pytest.raises(Exception):
        preset.gamma = 5  # frozen


@pytest.mark.parametrize("bits, want", [(4, {"draft_bits": 4}), (8, {"draft_bits": 8}), ("off", {"draft_bits": None})])
def test_preset_sets_the_drafts_arithmetic_and_vocabulary(tmp_path, bits, want):
    path = write(
        tmp_path / "p.json",
        json.dumps({"name": "p", "target": "t", "draft": "d", "draft_bits": bits, "draft_vocab": 32768}),
    )
    assert load_preset(path).load_kwargs() == {
        "dtype": "auto",
        "trust_remote_code": False,
        "draft_vocab": 32768,
        **want,
    }


def test_preset_sets_the_targets_arithmetic(tmp_path):
    path = write(tmp_path / "p.json", json.dumps({"name": "p", "target": "t", "draft": "d", "arithmetic": "int8"}))
    assert load_preset(path).load_kwargs()["arithmetic"] == "int8"


def test_load_pair_refuses_an_unknown_arithmetic():
    with pytest.raises(HfspecError, match="arithmetic must be 'int8'"):
        load_pair("t", "d", arithmetic="int4")


def test_preset_unknown_key_is_named_with_the_allowed_ones(tmp_path):
    path = write(tmp_path / "p.json", '{"name": "p", "target": "t", "draft": "d", "gama": 3}')
    with pytest.raises(HfspecError) as err:
        load_preset(path)
    assert "unknown key(s) gama" in str(err.value) and str(path) in str(err.value)
    assert all(key in str(err.value) for key in ALLOWED_KEYS)


def test_preset_missing_field_is_named(tmp_path):
    path = write(tmp_path / "p.json", '{"name": "p", "target": "t"}')
    with pytest.raises(HfspecError, match=r"missing required key\(s\) draft; allowed keys: name, target"):
        load_preset(path)


def test_preset_bad_json_names_file_and_line(tmp_path):
    path = write(tmp_path / "p.json", '{\n  "name": "p",\n  "target": "t"\n  "draft": "d"\n}\n')
    with pytest.raises(HfspecError, match=r"p\.json: invalid JSON at line 4, column 3"):
        load_preset(path)


@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("gamma", 0, ">= 1"),
        ("gamma", "4", "int"),
        ("chat", "yes", "bool"),
        ("gamma", True, "int"),
        ("dtype", "fp8", "one of auto"),
        ("top_p", 1.5, r"in \(0, 1\]"),
        ("temperature", -1, ">= 0"),
        ("target", " ", "non-empty"),
        ("draft_bits", 3, '4, 8 or "off"'),
        ("draft_bits", "on", '4, 8 or "off"'),
        ("draft_vocab", 0, ">= 1"),
        ("draft_vocab", 1.5, "int"),
        ("arithmetic", "int4", '"int8" or "float32"'),
    ],
)
def test_preset_bad_values(tmp_path, key, value, rule):
    data = {"name": "p", "target": "t", "draft": "d", key: value}
    with pytest.raises(HfspecError, match=f"p.json: {key} must be .*{rule}"):
        load_preset(write(tmp_path / "p.json", json.dumps(data)))


def test_unknown_preset_name_lists_the_shipped_ones(tmp_path):
    with pytest.raises(HfspecError, match="no preset named 'nope'; shipped presets: .*smollm2-offline"):
        load_preset("nope")
    with pytest.raises(HfspecError, match="preset file .*missing.json.* does not exist"):
        load_preset(tmp_path / "missing.json")
