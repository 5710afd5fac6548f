"""GGUF models loaded with their blocks kept decode exactly as the same files dequantized to float32.

The reference is what a user gets without hfspec's GGUF loading: ``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=..., dtype=torch.float32)`` on hfspec's fp32 kernel (``gguf_native=False``). The files are tiny Llamas
and Qwen2s the tests write (``gguf_files``), in every format the kernel reads, mixed as llama.cpp mixes them.
The real Qwen2.5-Coder pair is checked the same way by ``scripts/gguf_pair_bench.py --parts exact`` (transformers'
float32 load of the 1.5B alone takes minutes, too long for the suite).
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf_files
import pytest
import torch
from transformers import AutoModelForCausalLM

from hfspec import SpeculativeGenerator
from hfspec.cpu import fast, quant
from hfspec.drafters.loading import load_pair
from hfspec.errors import HfspecError
from hfspec.models import gguf_native
from hfspec.models.sources import ModelSource, locate

MIXES = {
    "llama-q8_0": ("llama", "Q8_0", False),
    "llama-k-mix-tied": ("llama", {"*": "Q4_K", "ffn_down": "Q6_K", "attn_v": "Q5_K", "token_embd": "Q4_1"}, True),
    "qwen2-k-mix": ("qwen2", {"*": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q4_K"}, False),
    "qwen2-legacy-mix": (
        "qwen2",
        {"*": "Q5_0", "attn_q": "Q4_0", "attn_k": "Q5_1", "output": "Q8_0", "token_embd": "Q5_0"},
        False,
    ),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, library):
    if quant.kernel() is None:
        pytest.skip(f"no quantized kernel: {quant.unavailable()}")
    root = tmp_path_factory.mktemp("gguf")
    return {name: gguf_files.write(root / name, arch, fmt, tied=tied) for name, (arch, fmt, tied) in MIXES.items()}


def dequantized(path: Path):
    """The reference: transformers' own float32 load of the file, on hfspec's fp32 kernel."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    report = fast.accelerate(model)
    assert report.layers and report.reason is None
    return model


def native(path: Path):
    model = gguf_native.load(str(path.parent), path.name, "target")
    assert model is not None
    fast.accelerate(model)
    return model


@pytest.mark.parametrize("name", MIXES)
def test_a_native_model_computes_the_dequantized_models_logits_bit_for_bit(files, name):
    path = files[name]
    want, got = dequantized(path), native(path)
    assert not [m for m in got.modules() if type(m) in (torch.nn.Linear, fast.FastLinear)]
    ids = torch.randint(3, 64, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
        # a decoding step and a verification of 4 rows against a cache, as hfspec feeds them
        a, b = got(ids[:, :9], use_cache=True), want(ids[:, :9], use_cache=True)
        for k in (1, 4):
            new = ids[:, 9 : 9 + k]
            assert torch.equal(got(new, cache=a.past_key_values).logits, want(new, cache=b.past_key_values).logits)
    prompt = ids[:1, :6]
    assert torch.equal(
        got.generate(prompt, max_new_tokens=24, do_sample=False),
        want.generate(prompt, max_new_tokens=24, do_sample=False),
    )


def test_a_tied_head_reads_the_embeddings_blocks(files):
    model = native(files["llama-k-mix-tied"])
    assert isinstance(model.get_input_embeddings(), quant.QuantEmbedding)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    described = fast.describe(model)
    assert described["on"] and described["quantized"]["formats"]["Q4_1 embedding"] == 1


def test_load_pair_keeps_both_models_blocks_and_speculation_is_exact(files):
    target_file, draft_file = files["qwen2-k-mix"], files["qwen2-legacy-mix"]
    want = dequantized(target_file)
    ids = torch.tensor([[1, 9, 17, 33, 4]])
    for bits in (None, 4):  # the draft's blocks as stored, or converted to integer arithmetic (the default)
        target, draft, tok = load_pair(
            str(target_file.parent),
            str(draft_file.parent),
            gguf_file=target_file.name,
            draft_gguf_file=draft_file.name,
            tokenizer=str(target_file.parent),
            draft_bits=bits,
        )
        assert quant.quantized_layers(target) and (bits or quant.quantized_layers(draft))
        gen = SpeculativeGenerator(target, draft, tok)
        described = gen.describe()["fast_kernels"]["draft"]
        assert described["quantized"]["formats"]["Q5_0"] > 0 if bits is None else described["integer"]["layers"]
        for gamma in (1, 3, "auto"):
            out = gen.generate(ids, max_new_tokens=20, gamma=gamma, eos_token_id=[])
            assert torch.equal(out.sequences, want.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))


def test_gguf_native_false_and_no_fast_kernels_dequantize_as_transformers_does(files):
    path = files["llama-q8_0"]
    for kwargs in ({"gguf_native": False}, {"fast_kernels": False}):
        target, _, _ = load_pair(
            str(path.parent), "ngram", gguf_file=path.name, tokenizer=str(path.parent), dtype="float32", **kwargs
        )
        assert not quant.quantized_layers(target) and target.dtype == torch.float32


def test_formats_without_a_kernel_are_dequantized_saying_so(tmp_path, library, caplog):
    if quant.kernel() is None:
        pytest.skip(f"no quantized kernel: {quant.unavailable()}")
    path = gguf_files.write(tmp_path, "qwen2", {"*": "Q3_K", "attn_q": "Q8_0"})
    with caplog.at_level(logging.INFO, logger="hfspec.models.gguf_native"):
        got = native(path)
    assert "no quantized kernel for 14 Q3_K" in caplog.text
    assert len(quant.quantized_layers(got)) == 2
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, dequantized(path)(ids).logits)


def test_without_the_kernel_a_gguf_loads_dequantized(files, monkeypatch, caplog):
    path = files["llama-q8_0"]
    monkeypatch.setenv("HFSPEC_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="hfspec.models.gguf_native"):
        assert gguf_native.load(str(path.parent), path.name, "target") is None
    assert "HFSPEC_KERNELS=0" in caplog.text and "dequantized" in caplog.text


def test_the_cli_and_presets_load_gguf_pairs(files, capsys, tmp_path):
    import json

    from hfspec import api
    from hfspec.commands import cli
    from hfspec.models.presets import load_preset

    target, draft = files["llama-q8_0"], files["llama-k-mix-tied"]
    argv = [
        "generate",
        "w10 w11",
        "--target",
        str(target.parent),
        "--draft",
        str(draft.parent),
        "--gguf-file",
        target.name,
        "--draft-gguf-file",
        draft.name,
        "--max-new-tokens",
        "8",
        "--json",
        "--stats",
    ]
    api.clear_cache()
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    native = json.loads(out)
    described = native["settings"]["fast_kernels"]
    assert described["target"]["quantized"]["formats"] == {"Q8_0": 15, "Q8_0 embedding": 1}
    assert "GGUF blocks kept" in err
    assert cli.main([*argv, "--no-gguf-native"]) == 0
    dense = json.loads(capsys.readouterr()[0])
    assert "quantized" not in dense["settings"]["fast_kernels"]["target"]
    assert dense["tokens"] == native["tokens"]  # the dequantized float32 pair, on the fp32 kernel
    api.clear_cache()
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "name": "p",
                "target": str(target.parent),
                "draft": str(draft.parent),
                "gguf_file": target.name,
                "draft_gguf_file": draft.name,
                "gguf_native": False,
            }
        )
    )
    assert load_preset(path).load_kwargs() == {
        "dtype": "auto",
        "trust_remote_code": False,
        "gguf_native": False,
        "gguf_file": target.name,
        "draft_gguf_file": draft.name,
    }


def test_a_gguf_file_is_a_model_as_its_directory_is(files, capsys, tmp_path):
    """The file itself names the model (llama.cpp's -m): the same models, blocks kept, and the same output as the
    directory that holds it, from the generator, the command line and a preset."""
    import json

    from hfspec import api
    from hfspec.commands import cli

    target, draft = files["qwen2-k-mix"], files["qwen2-legacy-mix"]
    ids = torch.tensor([[1, 9, 17, 33, 4]])
    by_file = SpeculativeGenerator.from_pretrained(str(target), str(draft))
    by_dir = SpeculativeGenerator.from_pretrained(str(target.parent), str(draft.parent))
    assert by_file.describe()["fast_kernels"] == by_dir.describe()["fast_kernels"]
    assert by_file.describe()["fast_kernels"]["target"]["quantized"]["formats"] == {
        "Q4_K": 12,
        "Q6_K": 3,
        "Q4_K embedding": 1,
    }
    assert torch.equal(
        by_file.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences,
        by_dir.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences,
    )
    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"name": "p", "target": str(target), "draft": str(draft)}))
    runs = []
    for models in (
        ["--target", str(target), "--draft", str(draft)],
        ["--target", str(target.parent), "--draft", str(draft.parent)],
        ["--config", str(preset)],
    ):
        api.clear_cache()
        assert cli.main(["generate", "w10 w11", *models, "--max-new-tokens", "8", "--json"]) == 0
        runs.append(json.loads(capsys.readouterr()[0]))
    assert all(run["tokens"] == runs[0]["tokens"] for run in runs)
    assert runs[0]["settings"]["fast_kernels"]["target"]["quantized"]["formats"]["Q6_K"] == 3


def test_a_gguf_file_and_another_gguf_file_name_are_refused(files):
    target = files["llama-q8_0"]
    with pytest.raises(HfspecError, match=r"GGUF file '.*model.gguf', and its gguf_file is 'other.gguf'"):
        load_pair(str(target), "ngram", gguf_file="other.gguf")
    assert locate(str(target), "target", target.name) == ModelSource(str(target.parent.absolute()), target.name)
    assert locate(str(target.parent), "target") == ModelSource(str(target.parent), target.name)  # its lone GGUF
    assert locate("ngram", "draft") == ModelSource("ngram")


def test_the_header_check_finds_what_cuts_a_file_short(files, tmp_path):
    path = files["llama-q8_0"]
    assert gguf_native.file_problem(path) is None
    data = path.read_bytes()
    for size, says in ((0, "an empty file"), (20, "header does not fit"), (len(data) - 1, "tensor data ends at byte")):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        assert says in gguf_native.file_problem(cut)
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + data[8:])
    assert "GGUF v1; hfspec reads v2 and v3" in gguf_native.file_problem(tmp_path / "v1.gguf")
