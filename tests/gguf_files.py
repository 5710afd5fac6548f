"""Tiny GGUF files for the quantized-kernel tests, written with the gguf package's GGUFWriter.

A tiny Llama or Qwen2 (random weights, fixed seed) is written as llama.cpp lays a model out: GGUF tensor names,
Llama's q/k rows permuted as its converter permutes them, norms and biases in F32, and every linear weight and the
embedding in the block format asked for. The gguf package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; K-quant
blocks (which it only dequantizes) are random codes and scales, which is all a test of exactness needs. The file
carries no tokenizer: tests pass the tiny word-level one (saved beside it) as ``tokenizer=``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tiny
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from transformers import AutoModelForCausalLM

# Where each K-quant block holds its f16 scales (random codes elsewhere), and a scale that keeps values sane.
HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}
SCALE = {"Q4_K": 0.002, "Q5_K": 0.001, "Q6_K": 0.001, "Q2_K": 0.01, "Q3_K": 0.004}


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) uint8 of random ``fmt`` blocks with finite, small f16 scales."""
    qtype = GGMLQuantizationType[fmt]
    block, size = GGML_QUANT_SIZES[qtype]
    out = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in HALVES.get(fmt, (0, 2) if fmt in ("Q4_1", "Q5_1") else (0,)):
        halves = (np.abs(rng.standard_normal((rows, cols // block))) * SCALE.get(fmt, 0.01)).astype(np.float16)
        out[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(rows, -1, 2)
    return out.reshape(rows, -1)


def encode(weight: np.ndarray, fmt: str, rng: np.random.Generator) -> tuple[np.ndarray, GGMLQuantizationType]:
    """``weight`` (fp32) as ``fmt``: the gguf package's quantization where it has one, else random blocks."""
    qtype = GGMLQuantizationType[fmt]
    if fmt == "F32":
        return weight.astype(np.float32), qtype
    if fmt == "F16":
        return weight.astype(np.float16), qtype
    try:
        return quants.quantize(weight.astype(np.float32), qtype), qtype
    except NotImplementedError:
        return random_blocks(fmt, weight.shape[0], weight.shape[1], rng), qtype


def _permute(w: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (transformers undoes it when it loads a llama GGUF)."""
    if heads != kv_heads:
        heads = kv_heads
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(
    directory: Path,
    arch: str = "llama",
    fmt: str | dict[str, str] = "Q8_0",
    *,
    hidden: int = 256,
    layers: int = 2,
    vocab: int = 64,
    tied: bool = False,
    seed: int = 0,
    name: str = "model.gguf",
    sharpness: float = 1.0,
) -> Path:
    """Write ``directory/name`` (and the tiny tokenizer beside it); ``fmt`` is one format for every linear and the
    embedding, or a format per GGUF tensor kind (``"ffn_down"``, ``"token_embd"``, ..., ``"*"`` for the rest).
    ``sharpness`` scales an untied output layer, so that next-token distributions are far from uniform."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny.make_config(arch, vocab, hidden=hidden, layers=layers)
    config.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that a lost one shows
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn(p.shape) * 0.1)
    formats = {"*": fmt} if isinstance(fmt, str) else fmt
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(directory / name), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(tiny.BOS)
    writer.add_eos_token_id(tiny.EOS)
    writer.add_pad_token_id(tiny.PAD)

    def add(gguf_name: str, tensor: torch.Tensor, kind: str | None = None) -> None:
        values = tensor.detach().float().numpy()
        if kind is None:  # norms and biases
            writer.add_tensor(gguf_name, values.astype(np.float32))
            return
        data, qtype = encode(values, formats.get(kind, formats.get("*", "Q8_0")), rng)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"], "token_embd")
    add("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        add("output.weight", sd["lm_head.weight"] * sharpness, "output")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    for i in range(layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = (torch.from_numpy(_permute(t.numpy(), heads, h)) for t, h in ((q, heads), (k, kv)))
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", q, "attn_q")
        add(f"blk.{i}.attn_k.weight", k, "attn_k")
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], "attn_v")
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], "attn_output")
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], "ffn_gate")
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], "ffn_up")
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], "ffn_down")
        for proj in ("q", "k", "v"):
            if p + f"self_attn.{proj}_proj.bias" in sd:
                add(f"blk.{i}.attn_{proj}.bias", sd[p + f"self_attn.{proj}_proj.bias"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tiny.save_tokenizer(tiny.make_tokenizer(vocab), directory)
    return directory / name
