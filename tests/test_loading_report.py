"""Targets and drafts are refused when transformers would initialise any of their weights at random.

Every checkpoint here is a tiny model saved by hand: a classifier (no language-model
head), a causal LM whose untied lm_head was cut out of its safetensors, a model with a
tied lm_head (accepted: the head is the loaded embedding), and GGUF files. Last, EAGLE-3
heads whose layer config carries the attention fields speculators writes: a
sliding-window layer is refused rather than run with full attention.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import tiny
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import hfspec
from hfspec import SpeculativeGenerator
from hfspec.commands import cli
from hfspec.drafters.loading import load_pair
from hfspec.errors import HfspecError
from hfspec.heads.checkpoint import load_head, save_head
from hfspec.heads.eagle3 import Eagle3Config, Eagle3Head

pytestmark = pytest.mark.usefixtures("fresh_api_cache")

PROMPT = "w10 w11 w12"


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    """A BertForSequenceClassification checkpoint (with the tiny tokenizer): no LM head at all."""
    directory = tmp_path_factory.mktemp("bert-classifier")
    config = AutoConfig.for_model(
        "bert",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        pad_token_id=tiny.PAD,
    )
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    tiny.save_tokenizer(tiny.make_tokenizer(64), directory)
    return directory


@pytest.fixture(scope="module")
def headless(tmp_path_factory) -> Path:
    """A tiny Llama with an untied lm_head, saved, then with lm_head.weight removed from its safetensors."""
    directory = tiny.build(tmp_path_factory.mktemp("headless"), "llama", seed=2)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    assert "lm_head.weight" in tensors
    del tensors["lm_head.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    """A tiny Llama whose lm_head is tied to its embedding, so its checkpoint holds no lm_head.weight."""
    directory = tmp_path_factory.mktemp("tied")
    config = tiny.make_config("llama", 64)
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tiny.save_tokenizer(tiny.make_tokenizer(64), directory)
    assert "lm_head.weight" not in load_file(directory / "model.safetensors")
    return directory


def refusal(excinfo: pytest.ExceptionInfo, role: str, path: Path) -> str:
    message = str(excinfo.value)
    assert f"the {role} {str(path)!r}" in message and "initialise at random" in message
    return message


def test_classifier_is_refused_as_target_naming_its_class_and_missing_weights(classifier, model_dir):
    with pytest.raises(HfspecError) as err:
        hfspec.generate(PROMPT, target=str(classifier), draft=str(model_dir("llama", seed=1)), max_new_tokens=4)
    message = refusal(err, "target", classifier)
    assert "lacks 6 weight(s)" in message and "cls.predictions.transform.dense.weight" in message
    assert "no language-model head: it was saved as BertForSequenceClassification" in message
    assert "pass a causal LM" in message


def test_classifier_is_refused_as_draft(classifier, model_dir):
    with pytest.raises(HfspecError) as err:
        SpeculativeGenerator.from_pretrained(str(model_dir("llama", seed=0)), str(classifier))
    assert "BertForSequenceClassification" in refusal(err, "draft", classifier)


def test_untied_lm_head_cut_from_the_checkpoint_is_refused(headless, model_dir):
    with pytest.raises(HfspecError) as err:
        SpeculativeGenerator.from_pretrained(str(headless), str(model_dir("llama", seed=1)))
    message = refusal(err, "target", headless)
    assert "(lm_head.weight)" in message and "incomplete" in message
    with pytest.raises(HfspecError) as err:
        hfspec.generate(PROMPT, target=str(model_dir("llama", seed=0)), draft=str(headless), max_new_tokens=4)
    assert "lm_head.weight" in refusal(err, "draft", headless)


def test_cli_refuses_in_one_line(capsys, classifier, headless, model_dir):
    llama = str(model_dir("llama", seed=0))
    for target, draft, bad in (
        (str(classifier), llama, "BertForSequenceClassification"),
        (llama, str(headless), "lm_head.weight"),
    ):
        capsys.readouterr()
        code = cli.main(["generate", PROMPT, "--target", target, "--draft", draft, "--max-new-tokens", "4"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
        assert err.startswith("hfspec: error: ") and bad in err and "initialise at random" in err


def test_tied_lm_head_is_accepted_and_exact(tied, model_dir):
    gen = SpeculativeGenerator.from_pretrained(str(tied), str(model_dir("llama", seed=1)), dtype="float32")
    head, embedding = gen.target.get_output_embeddings().weight, gen.target.get_input_embeddings().weight
    assert head.data_ptr() == embedding.data_ptr()  # the head is the loaded embedding, not a random init
    ids = torch.tensor([[1, 10, 11, 12]])
    reference = tiny.load(tied)[0].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(gen.generate(ids, max_new_tokens=8, gamma=3).sequences, reference)


def test_ordinary_pair_is_accepted_everywhere(capsys, model_dir):
    target, draft = str(model_dir("llama", seed=0)), str(model_dir("llama", seed=1))
    text = hfspec.generate(PROMPT, target=target, draft=draft, max_new_tokens=6)
    assert isinstance(text, str) and text
    capsys.readouterr()
    assert cli.main(["generate", PROMPT, "--target", target, "--draft", draft, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == text + "\n"


# -- GGUF -----------------------------------------------------------------------------------------


def write_gguf(path: Path, *, skip: str | None = None, vocab: int = 64, hidden: int = 32, layers: int = 2) -> Path:
    """A tiny llama GGUF (float32, no output.weight, so its lm_head is tied); ``skip`` leaves one tensor out."""
    heads, kv_heads, inter = 4, 2, 64
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    kv = kv_heads * hidden // heads
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (inter, hidden),
            f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
        }
    for name, shape in shapes.items():
        if name != skip:
            writer.add_tensor(name, (rng.standard_normal(shape) * 0.5).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_target_still_loads(tmp_path, model_dir):
    write_gguf(tmp_path / "tiny.gguf")
    target, draft, _ = load_pair(
        tmp_path, model_dir("llama", seed=1), gguf_file="tiny.gguf", tokenizer=tiny.make_tokenizer(64)
    )
    assert target.get_output_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[1, 10, 11, 12]])
    gen = SpeculativeGenerator(target, draft, tiny.make_tokenizer(64))
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(gen.generate(ids, max_new_tokens=8, gamma=3).sequences, reference)


def test_gguf_missing_a_tensor_is_refused(tmp_path, model_dir):
    write_gguf(tmp_path / "tiny.gguf", skip="blk.1.ffn_down.weight")
    with pytest.raises(HfspecError) as err:
        load_pair(tmp_path, model_dir("llama", seed=1), gguf_file="tiny.gguf", tokenizer=tiny.make_tokenizer(64))
    assert "model.layers.1.mlp.down_proj.weight" in refusal(err, "target", tmp_path)


# -- EAGLE-3 heads as speculators' training CLI writes them ----------------------------------------


def speculators_layer_head(tmp_path: Path, layer_types: list[str], window: int | None) -> Path:
    """A head saved by hfspec whose layer config then gets the attention fields speculators writes."""
    torch.manual_seed(0)
    head = Eagle3Head(
        Eagle3Config(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            draft_vocab_size=64,
        )
    )
    path = save_head(head, tmp_path / "head", dtype=torch.float32)
    conf = json.loads((path / "config.json").read_text())
    conf["transformer_layer_config"] |= {
        "layer_types": layer_types,
        "sliding_window": window,
        "use_sliding_window": window is not None,
    }
    (path / "config.json").write_text(json.dumps(conf))
    return path


def test_head_with_full_attention_layer_types_loads(tmp_path):
    head = load_head(speculators_layer_head(tmp_path, ["full_attention"], None))
    assert head.config.hidden_size == 32 and head.config.draft_vocab_size == 64


def test_head_with_a_sliding_window_layer_is_refused(tmp_path):
    path = speculators_layer_head(tmp_path, ["sliding_attention"], 4)
    with pytest.raises(HfspecError, match=r"layer_types \['sliding_attention'\] asks for sliding-window attention"):
        load_head(path)
