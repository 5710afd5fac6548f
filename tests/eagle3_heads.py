"""Tiny EAGLE-3 heads for tests: random ones, briefly trained ones, and heads written by hand in each layout.

Training is the training-time test of EAGLE-3 (arXiv 2503.01840) at toy scale: the
target's own sampled text, its hidden states as features, cross-entropy to the
target's next-token distribution restricted to the draft vocabulary, a few unrolled
steps, a few hundred Adam steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from hfspec.heads.eagle3 import Eagle3Config, Eagle3Head, default_layer_ids


def config_for(
    target, draft_ids: list[int], layer_ids: tuple[int, ...] | None = None, rope_theta: float = 10000.0
) -> Eagle3Config:
    """A head as wide as ``target`` whose draft vocabulary is ``draft_ids`` (sorted target ids)."""
    c = target.config
    return Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=2 * c.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=target.get_output_embeddings().weight.shape[0],
        draft_vocab_size=len(draft_ids),
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        layer_ids=layer_ids,
    )


def random_head(
    target, draft_ids: list[int], seed: int = 0, layer_ids: tuple[int, ...] | None = None, scale: float = 1.0
) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(config_for(target, draft_ids, layer_ids))
    with torch.no_grad():
        head.d2t.copy_(torch.tensor(draft_ids) - torch.arange(len(draft_ids)))
        head.lm_head.weight.mul_(scale)
    return head.eval()


@torch.no_grad()
def sample_text(target, rows: int, length: int, seed: int, first: int = 3) -> torch.Tensor:
    """(rows, length) token ids sampled from ``target`` itself after a random first token."""
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(first, vocab, (rows, 1), generator=g)
    for _ in range(length - 1):
        probs = torch.softmax(target(ids).logits[:, -1].float(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return ids


def frequent_ids(text: torch.Tensor, count: int) -> list[int]:
    """EAGLE-3's draft vocabulary: the ``count`` most frequent ids of the training text, sorted by id."""
    freq = torch.bincount(text.flatten())
    return sorted(freq.topk(count).indices.tolist())


def train_head(
    target,
    draft_size: int,
    *,
    steps: int = 200,
    unroll: int = 3,
    rows: int = 48,
    length: int = 24,
    seed: int = 0,
    lr: float = 1e-2,
    layer_ids: tuple[int, ...] | None = None,
) -> Eagle3Head:
    """A head trained briefly on the target's own text with the training-time test."""
    text = sample_text(target, rows, length, seed)
    draft_ids = frequent_ids(text, draft_size)
    head = random_head(target, draft_ids, seed=seed, layer_ids=layer_ids)
    layers = layer_ids or default_layer_ids(target.config.num_hidden_layers)
    with torch.no_grad():
        out = target(text, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)  # (R, L, F)
        # The draft's target at position j: p(token j+1), restricted to the draft vocabulary and renormalised.
        p = torch.softmax(out.logits.float()[..., draft_ids], dim=-1)  # (R, L, Vd)
        embeds = F.embedding(text, target.get_input_embeddings().weight)
    span = length - unroll - 1  # context columns j = 0..span-1 have a target for every step
    head.train()
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, rows, (16,), generator=g)
        logits = head.unroll(head.fuse(features[batch, :span]), embeds[batch, 1 : span + unroll], unroll)
        # Step k at column j predicts the token at j + k + 2: the target's p at position j + k + 1.
        loss = sum(
            (0.8**k) * -(p[batch, k + 1 : k + 1 + span] * F.log_softmax(lk.float(), -1)).sum(-1).mean()
            for k, lk in enumerate(logits)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def write_by_hand(
    head: Eagle3Head,
    directory: Path,
    *,
    layout: str,
    container: str,
    architecture: str,
    embedding: torch.Tensor | None = None,
    extra: dict | None = None,
    extra_tensors: dict | None = None,
) -> Path:
    """Write ``head``'s weights as plain tensors and a json, the way each published layout names them."""
    c = head.config
    prefix = "midlayer." if layout == "eagle" else "layers.0."
    tensors = {}
    for name, value in head.state_dict().items():
        tensors[prefix + name[len("layer.") :] if name.startswith("layer.") else name] = value.detach().clone()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[head.target_ids()] = True
    tensors["t2d"] = t2d
    if embedding is not None:
        tensors["embed_tokens.weight"] = embedding.detach().clone()
    tensors.update(extra_tensors or {})
    layer = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rope_theta": c.rope_parameters["rope_theta"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if layout == "eagle":  # SafeAILab/EAGLE: eagle/traineagle3/config.json plus the head's sizes
        conf = {**layer, "draft_vocab_size": c.draft_vocab_size}
    else:  # vllm-project/speculators: Eagle3SpeculatorConfig as it serialises
        conf = {
            "architectures": [architecture],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": None,
        }
    if c.layer_ids is not None:
        conf["eagle_aux_hidden_state_layer_ids"] = list(c.layer_ids)
    conf.update(extra or {})
    directory.mkdir(parents=True, exist_ok=True)
    if container == "bin":
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(conf, indent=2))
    return directory
