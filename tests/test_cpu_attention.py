"""Grouped-query attention read in place for masked queries on CPU: the same bits as transformers' sdpa."""
from __future__ import annotations

import pytest
import tiny
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

from hfspec.cpu import attention as cpu_attention, fast
from hfspec.models import cache_kwarg


@pytest.fixture
def gqa_calls(monkeypatch):
    """One entry per attention call: True where masked queries read grouped key/value heads in place."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(bool(kwargs.get("enable_gqa")) and kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


def logits_both_ways(model, prefix, new, mask=None, prefix_mask=None):
    """Logits of ``new`` after ``prefix`` in the cache, with transformers' sdpa and with hfspec's."""
    out = []
    for switch in (cpu_attention.unuse, cpu_attention.use):
        switch(model)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            key = cache_kwarg(type(model))  # the forward's own name for the cache
            model(prefix, attention_mask=prefix_mask, **{key: cache})
            out.append(model(new, attention_mask=mask, **{key: cache}).logits)
    cpu_attention.unuse(model)
    return out


def test_a_chain_and_a_ragged_batch_get_the_same_bits(tiny_pair, gqa_calls):
    target, _, _ = tiny_pair("llama", target_seed=21)
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    prefix, new = torch.randint(3, 60, (2, 9), generator=g), torch.randint(3, 60, (2, 4), generator=g)
    plain, ours = logits_both_ways(target, prefix[:1], new[:1])
    assert torch.equal(plain, ours)
    # Left padding in the first row: the mask hides it in every layer.
    pad = torch.ones(2, 13, dtype=torch.long)
    pad[0, :3] = 0
    plain, ours = logits_both_ways(target, prefix, new, mask=pad, prefix_mask=pad[:, :9])
    assert torch.equal(plain, ours)
    layers = target.config.num_hidden_layers
    # In every layer: the chain's 4 tokens, the padded prefix and the batch's 4 tokens (all masked).
    assert gqa_calls.count(True) == 3 * layers


def test_a_tree_mask_gets_the_same_bits(tiny_pair, gqa_calls):
    target, _, _ = tiny_pair("llama", target_seed=22)
    g = torch.Generator().manual_seed(1)
    prefix, new = torch.randint(3, 60, (1, 6), generator=g), torch.randint(3, 60, (1, 5), generator=g)
    # Root, two children of the root, a child of each: every node sees the prefix, itself and its ancestors.
    parents = [-1, 0, 0, 1, 2]
    visible = torch.zeros(5, 11, dtype=torch.bool)
    visible[:, :6] = True
    for i, p in enumerate(parents):
        visible[i, 6 + i] = True
        while p >= 0:
            visible[i, 6 + p] = True
            p = parents[p]
    mask = visible[None, None]
    positions = torch.tensor([[6, 7, 7, 8, 8]])
    out = []
    for switch in (cpu_attention.unuse, cpu_attention.use):
        switch(target)
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            key = cache_kwarg(type(target))
            target(prefix, **{key: cache})
            out.append(target(new, attention_mask=mask, position_ids=positions, **{key: cache}).logits)
    cpu_attention.unuse(target)
    assert torch.equal(out[0], out[1]) and gqa_calls.count(True) == target.config.num_hidden_layers


def test_one_query_and_full_heads_keep_transformers_path(tiny_pair, gqa_calls):
    llama, _, _ = tiny_pair("llama", target_seed=23)
    plain, ours = logits_both_ways(llama, torch.tensor([[5, 6, 7]]), torch.tensor([[8]]))
    assert torch.equal(plain, ours)
    gpt2, _, _ = tiny_pair("gpt2", target_seed=23)  # one key/value head per query head: nothing to copy
    plain, ours = logits_both_ways(gpt2, torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9, 10]]))
    assert torch.equal(plain, ours)
    assert True not in gqa_calls


def test_only_sdpa_models_switch_and_accelerate_restore_and_suspend_follow(model_dir, library):
    eager = AutoModelForCausalLM.from_pretrained(model_dir("llama", seed=24), attn_implementation="eager")
    assert cpu_attention.use(eager) is False and eager.config._attn_implementation == "eager"
    model, _ = tiny.load(model_dir("llama", seed=24))
    assert model.config._attn_implementation == "sdpa"
    report = fast.accelerate(model)
    assert report.attention and model.config._attn_implementation == cpu_attention.IMPLEMENTATION
    with fast.suspended(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == cpu_attention.IMPLEMENTATION
    fast.restore(model)
    assert model.config._attn_implementation == "sdpa" and cpu_attention.unuse(model) is False
