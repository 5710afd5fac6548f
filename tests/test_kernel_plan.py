"""The kernel's block shapes: the same bits in every shape, and a plan chosen by timing, cached on disk."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch
from torch import nn

from hfspec.cpu import fast, kernels
from hfspec.cpu import plan as kernel_plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_shape_gives_the_same_bits_for_every_row_count(library, dtype):
    # A plan may pick any shape for any row count, so a shape must never change an output bit.
    assert len(library.shapes) >= 1 and all(mb >= 1 and nb >= 1 for mb, nb in library.shapes)
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(37, 71, generator=g).to(dtype), torch.randn(37, generator=g)
    x = torch.randn(50, 71, generator=g)
    for m in [*range(1, 18), 23, 24, 25, 33, 49, 50]:
        outs = [
            kernels.linear(library, x[:m], w, bias, (shape,))
            for shape in range(len(library.shapes))
            for bias in (None, b)
        ]
        for i, out in enumerate(outs):
            assert torch.equal(out, outs[i % 2]), f"{m} rows, shape {i // 2}"


def test_the_default_plan_covers_every_row_count_with_a_shape(library):
    plan = kernels.default_plan(library)
    assert len(plan) == kernels.PLAN_ROWS + 1 and all(0 <= s < len(library.shapes) for s in plan)


DEFAULT = (2, 0, 0, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 2, 2)  # 0..14 rows, the last entry serving 14 and up


def test_choose_takes_a_faster_shape_only_beyond_the_margin():
    best = {
        1: [1.0, 2.0, 2.0],  # the default already
        3: [0.90, 1.2, 1.0],  # 10% faster than the default's 1.0: taken
        5: [0.99, 1.1, 1.0],  # 1% faster: within the margin, the default stays
        9: [1.00, 1.5, 0.80],
    }  # the default (1) loses to shape 2
    plan = kernel_plan.choose(DEFAULT, best)
    assert plan[1] == 0 and plan[3] == 0 and plan[5] == 2 and plan[9] == 2
    # Between timed counts the count below decides; past the last timed count, and for prompts, the default.
    assert plan[2] == plan[1] and plan[4] == plan[3] and plan[6:9] == (2, 2, 2)
    assert plan[10:] == DEFAULT[10:] and len(plan) == len(DEFAULT)


def test_choose_with_nothing_timed_is_the_default():
    assert kernel_plan.choose(DEFAULT, {}) == DEFAULT


def test_time_shapes_times_every_shape_at_every_row_count(library):
    layers = [nn.Linear(40, 24), nn.Linear(24, 40, bias=False)]
    ticks = iter(range(10**6))
    best = kernel_plan.time_shapes(library, layers, rows=(1, 3), rounds=3, clock=lambda: next(ticks), progress=False)
    assert set(best) == {1, 3}  # each layer's call takes one tick: a pass, two
    assert all(len(times) == len(library.shapes) and all(t == 2 for t in times) for times in best.values())


def test_a_shape_far_slower_than_the_fastest_is_timed_in_one_round_only(library):
    # A kernel offering shapes for a few rows and for many spends most of its timing on the slow ones otherwise.
    now, calls = [0.0], Counter()

    class Layer(nn.Linear):
        kernel_kind = "fake"

        def kernel_call(self, x, w, bias, plan):
            calls[plan[0]] += 1
            now[0] += (1.0, 1.5, kernel_plan.SLOWER + 1.0)[plan[0]]

    best = kernel_plan.time_shapes(
        library,
        [Layer(8, 4)],
        rows=(1, 4),
        rounds=3,
        clock=lambda: now[0],
        progress=False,
        shapes=[(1, 1, 0), (2, 2, 0), (3, 3, 0)],
    )
    assert best == {1: [1.0, 1.5, kernel_plan.SLOWER + 1.0], 4: [1.0, 1.5, kernel_plan.SLOWER + 1.0]}
    assert calls == {0: 1 + 2 * 3, 1: 1 + 2 * 3, 2: 1 + 2 * 1}  # one warm-up; per row count 3 rounds, or 1


def test_a_round_stalled_by_another_process_does_not_count(library):
    # Another process taking a core stalls a two-thread call by a whole time slice; the fastest round is the truth.
    now, stalls = [0.0], iter([0.0, 0.0, 5.0] + [0.0] * 100)  # warm-up, round 1, round 2 stalled, ...

    class Layer(nn.Linear):
        kernel_kind = "fake"

        def kernel_call(self, x, w, bias, plan):
            now[0] += 1.0 + next(stalls)

    best = kernel_plan.time_shapes(
        library, [Layer(8, 4)], rows=(1,), rounds=3, clock=lambda: now[0], progress=False, shapes=[(1, 1, 0)]
    )
    assert best == {1: [1.0]}


def test_a_few_layers_per_distinct_shape_are_timed_for_all_of_them(monkeypatch):
    # A 1.5B model has 197 linears of 7 shapes; timing every one of them took minutes.
    monkeypatch.setattr(kernel_plan, "SAMPLE_ROWS", 16)
    layers = [nn.Linear(8, 12) for _ in range(10)] + [nn.Linear(12, 8, bias=False)] + [nn.Linear(8, 40)]
    picked = kernel_plan.sample(layers)
    assert len(picked) == kernel_plan.SAMPLE_LAYERS + 2
    # Weighted back, the sample stands for every layer and every weight row.
    assert sum(count * w.shape[0] for w, _, count in picked) == pytest.approx(10 * 12 + 8 + 40)
    head = [(w, b) for w, b, _ in picked if w.shape[1] == 8 and b is not None and b.numel() == 16]
    assert head and head[0][0].shape == (16, 8) and head[0][0].data_ptr() == layers[-1].weight.data_ptr()


def test_a_plan_is_timed_once_then_read_from_disk(library, tmp_path, monkeypatch):
    lib = dataclasses.replace(library, path=tmp_path / library.path.name)
    layers = [nn.Linear(64, 48), nn.Linear(48, 64)]
    monkeypatch.setattr(kernel_plan, "_PLANS", {})
    monkeypatch.setenv("HFSPEC_KERNEL_PLAN", "default")  # the suite's setting: nothing timed, nothing written
    monkeypatch.setattr(kernel_plan, "time_shapes", lambda *a, **k: pytest.fail("timed"))
    assert kernel_plan.plan_for(lib, layers) == kernels.default_plan(lib) and not list(tmp_path.iterdir())
    monkeypatch.undo()
    monkeypatch.delenv("HFSPEC_KERNEL_PLAN", raising=False)
    monkeypatch.setattr(kernel_plan, "_PLANS", {})
    if len(lib.shapes) < 2:
        assert kernel_plan.plan_for(lib, layers) == kernels.default_plan(lib)
        return
    plan = kernel_plan.plan_for(lib, layers, progress=False)
    path = kernel_plan.plan_path(lib, layers, torch.get_num_threads())
    record = json.loads(path.read_text())
    assert tuple(record["plan"]) == plan and len(plan) == kernels.PLAN_ROWS + 1
    assert set(map(int, record["ms"])) == set(kernel_plan.TUNED_ROWS)

    # A new process reads it back without timing anything.
    monkeypatch.setattr(kernel_plan, "_PLANS", {})
    monkeypatch.setattr(kernel_plan, "time_shapes", lambda *a, **k: pytest.fail("timed again"))
    assert kernel_plan.plan_for(lib, layers) == plan
    # Other shapes are another plan; a damaged file is timed again.
    assert kernel_plan.plan_path(lib, layers[:1], torch.get_num_threads()) != path
    path.write_text("{not json")
    monkeypatch.setattr(kernel_plan, "_PLANS", {})
    monkeypatch.setattr(
        kernel_plan,
        "time_shapes",
        lambda *a, **k: {m: [1.0, 0.5] + [1.0] * (len(lib.shapes) - 2) for m in kernel_plan.TUNED_ROWS},
    )
    assert kernel_plan.plan_for(lib, layers) == kernel_plan.choose(
        kernels.default_plan(lib), {m: [1.0, 0.5] + [1.0] * (len(lib.shapes) - 2) for m in kernel_plan.TUNED_ROWS}
    )


def test_accelerate_gives_every_layer_the_models_plan(library, tiny_pair):
    target, _, _ = tiny_pair("llama", target_seed=11)
    with fast.accelerated(target):
        plans = {id(m.plan) for m in target.modules() if type(m) is fast.FastLinear}
        assert len(plans) == 1 and next(m for m in target.modules() if type(m) is fast.FastLinear).plan
    assert not any("plan" in m.__dict__ for m in target.modules())
