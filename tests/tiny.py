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
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_config(arch: str, vocab_size: int, *, hidden: int = 32, layers: int = 2, eos: int | None = EOS,
                window: int = 4096, **extra):
    common = dict(vocab_size=vocab_size, bos_token_id=BOS, eos_token_id=eos, pad_token_id=PAD, **extra)
    if arch == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=hidden, n_layer=layers, n_head=4, n_positions=window, **common)
    if arch == "gpt_neox":
        return AutoConfig.for_model("gpt_neox", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                    intermediate_size=2 * hidden, max_position_embeddings=window, **common)
    return AutoConfig.for_model(arch, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window,
                                tie_word_embeddings=False, **common)


def build(directory: Path, arch: str = "llama", *, vocab_size: int = 64, seed: int = 0, tokenizer_size: int | None = None,
          sharpness: float = 1.0, perturb: float = 0.0, perturb_seed: int = 1, **config_kwargs) -> Path:
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
