"""Tiny causal LMs and a matching tokenizer, built from configs with fixed seeds and saved to disk.

Every test model is loaded back by path, so the real loading path is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)

ARCHITECTURES = ("llama", "gpt2", "qwen2", "gpt_neox", "mistral")
# Models whose cache keeps a recurrent state (state-space and hybrid); see make_config.
RECURRENT = (
    "mamba",
    "falcon_mamba",
    "mamba2",
    "falcon_h1",
    "bamba",
    "granitemoehybrid",
    "jamba",
    "qwen3_next",
    "qwen3_5_text",
    "lfm2",
    "lfm3",
    "nemotron_h",
    "zamba2",
    "olmo_hybrid",
    "kimi_linear",
)


def word(i: int) -> str:
    return f"w{i}"


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: <pad> <s> </s> user assistant system : then w7 ... w{V-1}."""
    # Chat templates use role names and ':', so they take the ids after the specials.
    words = SPECIALS + ["user", "assistant", "system", ":"]
    words += [word(i) for i in range(len(words), vocab_size)]
    vocab = {tok: i for i, tok in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_config(
    arch: str, vocab_size: int, *, hidden: int = 32, layers: int = 2, eos: int | None = EOS, window: int = 4096, **extra
):
    common = dict(vocab_size=vocab_size, bos_token_id=BOS, eos_token_id=eos, pad_token_id=PAD, **extra)
    if arch in RECURRENT or arch in ("recurrent_gemma", "gemma2", "gemma3_text"):
        return recurrent_config(arch, hidden, layers, window, common)
    if arch == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=hidden, n_layer=layers, n_head=4, n_positions=window, **common)
    if arch == "gpt_neox":
        return AutoConfig.for_model(
            "gpt_neox",
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=2 * hidden,
            max_position_embeddings=window,
            **common,
        )
    return AutoConfig.for_model(
        arch,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        tie_word_embeddings=False,
        **common,
    )


def recurrent_config(arch: str, hidden: int, layers: int, window: int, common: dict):
    """Tiny state-space and hybrid configs: the first layer recurrent, the others attention where the
    architecture has both (with ``layers=2``: one of each). Gemma-2/3 (sliding windows) too."""
    mixed = ["linear_attention"] + ["full_attention"] * (layers - 1)
    attention = dict(
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window, tie_word_embeddings=False
    )
    ssm = dict(mamba_n_heads=8, mamba_d_state=8, mamba_chunk_size=8)  # Mamba-2 mixers of the hybrids
    state_space = dict(hidden_size=hidden, num_hidden_layers=layers, state_size=8, expand=2, conv_kernel=4)
    delta_net = dict(
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=mixed,
    )
    base = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, **attention)
    configs = {
        "mamba": dict(state_space),
        "falcon_mamba": dict(state_space),
        "mamba2": dict(state_space, num_heads=8, head_dim=hidden * 2 // 8, n_groups=1, chunk_size=8),
        "falcon_h1": dict(base, mamba_d_ssm=2 * hidden, head_dim=8, **ssm),
        "bamba": dict(base, attn_layer_indices=list(range(1, layers)), **ssm),
        "granitemoehybrid": dict(
            base, layer_types=mixed, num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=hidden, **ssm
        ),
        "jamba": dict(
            base,
            attn_layer_period=layers,
            attn_layer_offset=layers - 1,
            expert_layer_period=layers,
            expert_layer_offset=layers - 1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
        ),
        "qwen3_next": dict(
            base,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=hidden,
            **delta_net,
        ),
        "qwen3_5_text": dict(base, **delta_net),
        "lfm2": dict(base, layer_types=["conv"] + ["full_attention"] * (layers - 1), block_auto_adjust_ff_dim=False),
        # A sliding-window attention layer after the convolution (sliding_window from the caller, else 4).
        "lfm3": dict(base, head_dim=8, layer_types=["conv"] + ["sliding_attention"] * (layers - 1)),
        "olmo_hybrid": dict(
            base,
            layer_types=mixed,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        ),
        "kimi_linear": dict(
            base | dict(num_key_value_heads=4),
            moe_intermediate_size=hidden,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            v_head_dim=8,
            qk_nope_head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            linear_head_dim=8,
            linear_num_heads=4,
            layer_types=mixed,
        ),
        "nemotron_h": dict(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            head_dim=8,
            mamba_num_heads=8,
            mamba_head_dim=hidden * 2 // 8,
            ssm_state_size=8,
            n_groups=1,
            chunk_size=8,
            layers_block_type=["mamba"] + ["attention"] * (layers - 1),
            **attention,
        ),
        "zamba2": dict(
            hidden_size=hidden,
            num_hidden_layers=layers,
            n_mamba_heads=4,
            mamba_d_state=8,
            chunk_size=8,
            intermediate_size=2 * hidden,
            layers_block_type=["mamba"] + ["hybrid"] * (layers - 1),
            **attention,
        ),
        "recurrent_gemma": dict(
            base, lru_width=hidden, attention_window_size=8, block_types=["recurrent"] + ["attention"] * (layers - 1)
        ),
        # sliding_window comes with the caller's keywords; layer 0 slides, the others attend fully.
        "gemma2": dict(base, head_dim=8, layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1)),
        "gemma3_text": dict(base, head_dim=8, layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1)),
    }
    kwargs = configs[arch] | common
    if arch == "lfm3":
        kwargs.setdefault("sliding_window", 4)
    return AutoConfig.for_model(arch, **kwargs)


def build(
    directory: Path,
    arch: str = "llama",
    *,
    vocab_size: int = 64,
    seed: int = 0,
    tokenizer_size: int | None = None,
    sharpness: float = 1.0,
    perturb: float = 0.0,
    perturb_seed: int = 1,
    **config_kwargs,
) -> Path:
    """Build, save and return the path of a tiny model (and its tokenizer).

    ``sharpness`` scales the output layer so the next-token distributions are more
    peaked than a random init gives (closer to a trained model's).
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, vocab_size, **config_kwargs))
    if sharpness != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(sharpness)
    if perturb:
        g = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for w in model.parameters():
                w.add_(torch.randn(w.shape, generator=g) * w.std().nan_to_num(0.0) * perturb)
    model.generation_config.pad_token_id = PAD
    model.save_pretrained(directory)
    save_tokenizer(make_tokenizer(tokenizer_size or vocab_size), directory)
    return Path(directory)


def save_tokenizer(tok: PreTrainedTokenizerFast, directory: Path) -> None:
    """Save so that AutoTokenizer loads the same fast tokenizer whatever the model type."""
    tok.save_pretrained(directory)
    path = Path(directory) / "tokenizer_config.json"
    conf = json.loads(path.read_text())
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(conf, indent=2))


def load(path: Path):
    """Load a tiny model and its tokenizer by path, in float32, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # AutoTokenizer maps some model types (qwen2) to their own tokenizer class; load the saved one as is.
    return model, PreTrainedTokenizerFast.from_pretrained(path)


CHAT_SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
CHAT_WORDS = [
    "user",
    "assistant",
    "system",
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "what",
    "write",
    "explain",
    "how",
]
IM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_target(
    directory: Path, *, layers: int = 2, vocab_size: int = 160, seed: int = 0, sharpness: float = 40.0
) -> Path:
    """A Llama (hidden 32) with a word-level ChatML tokenizer that reads English prompts, saved by path.

    Its (tied) embeddings are scaled by ``sharpness`` so that its next-token
    distributions are peaked, as a trained model's are, and worth distilling.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = {tok: i for i, tok in enumerate(CHAT_SPECIALS + CHAT_WORDS)}
    for i in range(vocab_size - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = IM_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(sharpness)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def fail_after(fn, calls: int):
    """``fn`` that raises KeyboardInterrupt from its call ``calls + 1`` on: a run interrupted midway."""
    count = {"n": 0}

    def wrapped(*args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    return wrapped
