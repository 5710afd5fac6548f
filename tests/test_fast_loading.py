"""hfspec's CPU kernel is on for the models hfspec loads, off for the models a caller passes, and reported."""

from __future__ import annotations

import json

import eagle3_heads
import pytest
import tiny
import torch
from torch import nn

from hfspec import SpeculativeGenerator, api
from hfspec.cpu import draft_linear, fast
from hfspec.drafters.factory import draft_module
from hfspec.drafters.loading import load_pair
from hfspec.errors import HfspecError
from hfspec.heads.checkpoint import save_head
from hfspec.models.presets import load_preset

PROMPTS = [[1, 10, 11, 12], [1, 30], [1, 20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module", autouse=True)
def library(library):
    """The session's kernel (skipped where it cannot be built or is off), with vector instructions."""
    if library.isa == "scalar":
        pytest.skip("the kernel has no vector instructions here, so hfspec loads models without it")
    return library


def linear_count(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_pair_accelerates_both_models_by_default(model_dir, dtype):
    target, draft, _ = load_pair(model_dir("llama", seed=0), model_dir("llama", seed=1), dtype=dtype)
    # The draft's linears run in integer arithmetic where that kernel is on (hfspec.cpu.draft_linear).
    assert draft_linear.kernel() is None or draft_linear.describe(draft)["layers"] == linear_count(
        tiny.load(model_dir("llama", seed=1))[0]
    )
    _, kept, _ = load_pair(model_dir("llama", seed=0), model_dir("llama", seed=1), dtype=dtype, draft_bits=None)
    for model in (target, kept):
        assert fast.is_accelerated(model)
        assert all(type(m) is fast.FastLinear for m in model.modules() if isinstance(m, nn.Linear))


def test_fast_kernels_false_loads_plain_models(model_dir):
    target, draft, _ = load_pair(
        model_dir("llama", seed=0), model_dir("llama", seed=1), dtype="float32", fast_kernels=False
    )
    assert not fast.is_accelerated(target) and not fast.is_accelerated(draft)
    assert fast.describe(target)["on"] is False and "not accelerated" in fast.describe(target)["reason"]
    with pytest.raises(HfspecError, match="fast_kernels must be True or False"):
        load_pair(model_dir("llama", seed=0), model_dir("llama", seed=1), fast_kernels="no")


def test_float16_stays_with_torch_and_says_why(model_dir):
    target, draft, _ = load_pair(model_dir("llama", seed=0), model_dir("llama", seed=1), dtype="float16")
    assert not fast.is_accelerated(target) and not fast.is_accelerated(draft)
    assert fast.describe(target)["reason"].startswith("off: float16 weights")


def test_a_model_off_the_cpu_is_reported_as_such(model_dir):
    target, _ = tiny.load(model_dir("llama", seed=0))
    off = target.to("meta")
    assert fast.accelerate_loaded(off).layers == ()
    assert (
        fast.describe(off) == {"on": False, "isa": None, "layers": 0, "bytes_added": 0, "reason": fast.NOT_CPU}
        and fast.NOT_CPU == "off: not a CPU model"
    )


def test_the_constructor_leaves_the_callers_models_alone(model_dir):
    target, tok = tiny.load(model_dir("llama", seed=0))
    draft, _ = tiny.load(model_dir("llama", seed=1))
    for gen in (
        SpeculativeGenerator(target, draft, tok),
        SpeculativeGenerator(target, str(model_dir("llama", seed=1)), tok),
    ):
        gen.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, gamma=2)
        assert not fast.is_accelerated(gen.target) and not fast.is_accelerated(gen.draft)
        described = gen.describe()["fast_kernels"]
        assert described["target"]["on"] is False and described["draft"]["on"] is False
    fast.accelerate(target)  # the explicit opt-in
    assert SpeculativeGenerator(target, draft, tok).describe()["fast_kernels"]["target"]["on"] is True
    fast.restore(target)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_greedy_equals_the_loaded_targets_own_generate(model_dir, arch):
    gen = SpeculativeGenerator.from_pretrained(
        str(model_dir(arch, seed=0)), str(model_dir(arch, seed=1)), dtype="float32"
    )
    assert fast.is_accelerated(gen.target) and gen.describe()["fast_kernels"]["draft"]["on"]
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        reference = gen.target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
        )  # the same kernels: the loaded model's own generate()
        for gamma in (1, 3, "auto"):
            assert torch.equal(gen.generate(ids, max_new_tokens=16, gamma=gamma).sequences, reference), (prompt, gamma)


def test_describe_reports_isa_layers_and_no_memory_added(model_dir, library):
    gen = SpeculativeGenerator.from_pretrained(
        str(model_dir("llama", seed=0)), str(model_dir("llama", seed=1)), dtype="float32"
    )
    described, layers = gen.describe(), gen.target.config.num_hidden_layers
    assert described["drafter"]["kind"] == gen.drafter.kind
    assert described["fast_kernels"]["target"] == {
        "on": True,
        "isa": library.isa,
        "bytes_added": 0,
        "reason": None,
        "layers": linear_count(gen.target),
        "fused": {"norms": 2 * layers + 1, "rotary": layers, "mlp": layers, "layers": layers},  # in hfspec.cpu
    }
    draft = described["fast_kernels"]["draft"]  # in integer arithmetic (hfspec.cpu.draft_linear) where it can be
    integer = draft_linear.describe(gen.draft)
    assert draft["on"] and draft["layers"] == linear_count(tiny.load(model_dir("llama", seed=1))[0])
    assert draft.get("integer", {"layers": 0}) == integer and (integer["layers"] or draft["isa"] == library.isa)
    lookup = SpeculativeGenerator.from_pretrained(str(model_dir("llama", seed=0)), "ngram", dtype="float32")
    assert lookup.describe()["fast_kernels"]["target"]["on"] is True
    assert lookup.describe()["fast_kernels"]["draft"]["reason"] == "off: no draft model"


def test_an_eagle3_heads_linears_run_the_kernel(model_dir, tmp_path):
    target_dir = model_dir("llama", seed=0, layers=8)  # as the EAGLE-3 tests: three feature layers to read
    target, _ = tiny.load(target_dir)
    head_dir = save_head(eagle3_heads.random_head(target, list(range(40))), tmp_path / "head", target=target)
    target, drafter, _ = load_pair(target_dir, head_dir, dtype="float32")
    head = draft_module(drafter)
    assert head is drafter.head and fast.describe(head)["layers"] == linear_count(head) > 0
    gen = SpeculativeGenerator(target, drafter, None)
    ids = torch.tensor([PROMPTS[2]])
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(gen.generate(ids, max_new_tokens=12, gamma=3).sequences, reference)


def test_suspended_runs_torch_and_puts_the_kernel_back(model_dir):
    target, draft, _ = load_pair(
        model_dir("llama", seed=0), model_dir("llama", seed=1), dtype="float32", draft_bits=None
    )
    layers = fast.describe(target)["layers"]
    with fast.suspended(target, draft, None):
        assert not fast.is_accelerated(target) and not fast.is_accelerated(draft)
    assert fast.describe(target)["layers"] == layers and fast.is_accelerated(draft)


@pytest.mark.usefixtures("fresh_api_cache")
def test_the_api_keys_its_pairs_on_fast_kernels(model_dir):
    pair = {"target": str(model_dir("llama", seed=0)), "draft": str(model_dir("llama", seed=1)), "max_new_tokens": 5}
    text = api.generate("w10 w11", **pair)
    assert api.generate("w10 w11", fast_kernels=True, **pair) == text and len(api._PAIRS) == 1
    assert api.generate("w10 w11", fast_kernels=False, **pair) == text and len(api._PAIRS) == 2
    gens = list(api._PAIRS.values())
    assert [fast.is_accelerated(g.target) for g in gens] == [True, False]


def test_a_preset_turns_the_kernel_off(model_dir, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "name": "p",
                "target": str(model_dir("llama", seed=0)),
                "draft": str(model_dir("llama", seed=1)),
                "fast_kernels": False,
            }
        )
    )
    preset = load_preset(path)
    assert preset.fast_kernels is False and preset.load_kwargs()["fast_kernels"] is False
    assert not fast.is_accelerated(load_pair(preset.target, preset.draft, **preset.load_kwargs())[0])
    path.write_text(json.dumps({"name": "p", "target": "t", "draft": "d", "fast_kernels": "off"}))
    with pytest.raises(HfspecError, match="fast_kernels must be bool"):
        load_preset(path)


@pytest.mark.parametrize("setting", [("HFSPEC_KERNELS", "0"), ("HFSPEC_CXX", "/nonexistent/g++")])
def test_without_the_kernel_load_pair_keeps_torch_and_says_why(model_dir, monkeypatch, setting):
    monkeypatch.setenv(*setting)
    target, draft, tok = load_pair(model_dir("llama", seed=0), model_dir("llama", seed=1), dtype="float32")
    assert not fast.is_accelerated(target) and not fast.is_accelerated(draft)
    reason = SpeculativeGenerator(target, draft, tok).describe()["fast_kernels"]["target"]["reason"]
    assert ("HFSPEC_KERNELS=0" in reason) if setting[0] == "HFSPEC_KERNELS" else ("no C++ compiler" in reason), reason
