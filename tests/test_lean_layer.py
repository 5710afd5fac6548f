"""A decoder layer in one kernel call (hfspec.cpu.layer) gives the bits of its switched modules, in every schedule.

Each model runs hfspec's schedules (tests/invariance.py: decoding steps, verification blocks, a prefill, a prefill
then blocks, a tree with a wrong sibling beside every node, a left-padded batch) on hfspec's buffered cache twice:
with its decoder layers in one kernel call and with them switched back to the module path (norms, attention, MLP and
projections each on their own kernel). Every logit must be the same bits, and within the one-call path every prefix
position's logits must be the decoding steps' bits. The models cover the linears the layer calls from C: float32
weights (Llama; Qwen2 with biases and a sliding window), GGUF blocks in float32 and in int8 arithmetic (K-quants,
repacked where the machine's kernel repacks them, and the 32-weight formats), and the draft kernel's codes.
"""

from __future__ import annotations

import gguf_files
import invariance
import pytest
import tiny
import torch
from test_int8_exactness import K_MIX, LEGACY_MIX
from transformers import AutoModelForCausalLM

from hfspec.cpu import draft_linear, fast, quant
from hfspec.cpu import layer as cpu_layer
from hfspec.models import gguf_native
from hfspec.models.kv_buffer import buffered_cache

VOCAB = 96
IDS, OTHER = [5, 17, 9, 40, 33, 8, 61, 12, 70, 3, 25, 90, 14, 6], [7, 44, 19, 2, 81, 56, 30, 11, 67, 23, 50] * 2


def float_model(arch: str, hidden: int = 40, inter: int = 100) -> torch.nn.Module:
    extra = dict(sliding_window=6, use_sliding_window=True, max_window_layers=0) if arch == "qwen2" else {}
    config = tiny.make_config(arch, VOCAB, hidden=hidden, layers=2, **extra)
    config.intermediate_size = inter
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    fast.accelerate(model)
    return model


def gguf_model(tmp_path, mix, arithmetic: str) -> torch.nn.Module:
    if quant.kernel() is None:
        pytest.skip(f"no quantized kernel: {quant.unavailable()}")
    path = gguf_files.write(tmp_path / "m", "qwen2", mix, vocab=VOCAB, seed=1)
    model = gguf_native.load(str(path.parent), path.name, "target", arithmetic=arithmetic)
    fast.accelerate(model)
    return model


MODELS = {
    "llama float32": lambda tmp: float_model("llama"),
    "qwen2 float32, biases, sliding window": lambda tmp: float_model("qwen2"),
    "gguf K-quants int8": lambda tmp: gguf_model(tmp, K_MIX, "int8"),
    "gguf 32-weight formats int8": lambda tmp: gguf_model(tmp, LEGACY_MIX, "int8"),
    "gguf K-quants float32": lambda tmp: gguf_model(tmp, K_MIX, "float32"),
}


def draft_model(tmp) -> torch.nn.Module:
    model = float_model("llama", hidden=64, inter=128)  # the draft kernel takes rows of whole 32-weight blocks
    if draft_linear.kernel() is None:
        pytest.skip(f"no draft kernel: {draft_linear.unavailable()}")
    draft_linear.quantize_for_drafting(model, 4)
    return model


MODELS["draft kernel codes"] = draft_model


@torch.inference_mode()
def logits(model, schedule) -> list[torch.Tensor]:
    cache = buffered_cache()
    return [
        model(input_ids=f.ids, attention_mask=f.mask, position_ids=f.positions, cache=cache, use_cache=True).logits
        for f in schedule()
    ]


@pytest.fixture
def calls(monkeypatch, library):
    """The one-call layer's kernel calls, counted."""
    count = []
    cpu_layer.bind(library)
    entry = cpu_layer._ENTRY

    def counted(*args):
        count.append(1)
        return entry(*args)

    monkeypatch.setattr(cpu_layer, "_ENTRY", counted)
    return count


@pytest.mark.parametrize("name", list(MODELS))
def test_one_call_layers_give_the_module_paths_bits_in_every_schedule(library, tmp_path, name, calls):
    model = MODELS[name](tmp_path)
    layers = model.config.num_hidden_layers
    assert fast.describe(model)["fused"]["layers"] == layers
    schedules = invariance.schedules(model, IDS, other=OTHER)
    lean = {key: logits(model, run) for key, run in schedules.items()}
    assert len(calls) >= layers * sum(len(feeds) - 1 for feeds in lean.values())  # all but each first forward
    assert cpu_layer.unuse(model) == layers
    before = len(calls)
    modules = {key: logits(model, run) for key, run in schedules.items()}
    assert len(calls) == before  # the module path
    for key in schedules:
        for got, want in zip(lean[key], modules[key], strict=True):
            assert torch.equal(got, want), f"{name}: {key}"
    reference = rows(schedules["decode"], lean["decode"])
    for key, run in schedules.items():
        for position, row in rows(run, lean[key]).items():
            assert torch.equal(row, reference[position]), f"{name}: {key}, position {position}"


def rows(schedule, outputs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    found = {}
    for feed, out in zip(schedule(), outputs, strict=True):
        for b, column, position in feed.rows:
            found[position] = out[b, column]
    return found


def test_a_hooked_part_a_gradient_or_a_foreign_cache_runs_the_module_path(library, calls):
    model = float_model("llama")
    ids = torch.tensor([IDS[:6]])
    with torch.no_grad():
        cache = buffered_cache()
        model(ids, cache=cache, use_cache=True)
        model(ids[:, :1], cache=cache, use_cache=True)
        assert len(calls) == 2  # the prefill wrote the cache, the step ran in one call per layer
        seen = []
        handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: seen.append(1))
        model(ids[:, :1], cache=cache, use_cache=True)
        handle.remove()
        assert seen == [1] and len(calls) == 3  # layer 0 in one call, the hooked layer 1 through its modules
        model(ids[:, :1], cache=transformers_cache(model), use_cache=True)
        assert len(calls) == 3
    with torch.enable_grad():
        model(ids[:, :1], cache=cache, use_cache=True)
    assert len(calls) == 3


def transformers_cache(model):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([IDS[:3]]), cache=cache, use_cache=True)
    return cache


def test_switched_layers_stay_their_classes_for_transformers_and_switch_back(library):
    model = float_model("qwen2")
    original = model.model.layers[0].hfspec_original
    assert isinstance(model.model.layers[0], original) and isinstance(model.model.layers[0], cpu_layer.LeanLayer)
    with torch.inference_mode():
        out = model(torch.tensor([IDS[:5]]), output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1  # transformers' hooks found the layers
    fast.restore(model)
    assert type(model.model.layers[0]) is original and "hfspec_plan" not in model.model.layers[0].__dict__


def test_a_switched_model_copies_and_pickles_and_its_copies_run_one_call_layers(library, calls):
    import copy
    import io

    model = float_model("qwen2")
    schedule = invariance.schedules(model, IDS, other=OTHER)["prefill 6, then blocks of 4"]
    want = logits(model, schedule)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        layer = other.model.layers[0]
        assert isinstance(layer, cpu_layer.LeanLayer) and layer.hfspec_original is model.model.layers[0].hfspec_original
        before = len(calls)
        got = logits(other, schedule)
        assert len(calls) > before and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
