"""One generator shared by threads, and calls cut short: each call gets the output it would get alone.

A generator runs one call at a time (README, "Threads"): calls from other threads wait for the running one, so
each gets what it would get alone, at a fixed γ greedy or seeded. A call that ends in an exception (an error in
a drafter, Ctrl-C) leaves nothing behind: the next call starts fresh caches and passes their invariants.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import eagle3_heads as eh
import pytest
import torch

import hfspec
from hfspec import api
from hfspec.drafters.eagle3 import Eagle3Drafter
from hfspec.errors import HfspecError
from hfspec.generator import SpeculativeGenerator

THREADS, CALLS = 4, 2


def calls(vocab: int) -> list[dict]:
    """THREADS × CALLS calls: prompts of different lengths, greedy and seeded sampling, at a fixed γ."""
    rng = torch.Generator().manual_seed(0)
    out = []
    for i in range(THREADS * CALLS):
        prompt = torch.randint(3, vocab, (1, 3 + i % 7), generator=rng)
        sampling = {"do_sample": True, "temperature": 0.9, "seed": i} if i % 2 else {}
        out.append({"input_ids": prompt, "max_new_tokens": 10 + i % 5, "gamma": 3, "tree": None, **sampling})
    return out


def run_in_threads(call, arguments: list) -> list:
    """``call(argument, thread)`` for each of ``arguments``, in THREADS threads released together."""
    start = threading.Barrier(THREADS)

    def worker(thread: int) -> list:
        start.wait()
        return [call(a, thread) for a in arguments[thread::THREADS]]

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(worker, range(THREADS)))
    out = [None] * len(arguments)
    for t, chunk in enumerate(results):
        out[t::THREADS] = chunk
    return out


@pytest.fixture(scope="module")
def alone(tiny_pair):
    """Each of ``calls`` run alone, one after another, on a generator of its own."""
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)
    return [gen.generate(**c).sequences for c in calls(target.config.vocab_size)]


def test_threads_sharing_one_generator_each_get_their_own_output(tiny_pair, alone):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)
    todo = calls(target.config.vocab_size)
    together = run_in_threads(lambda c, _: gen.generate(**c).sequences, todo)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert torch.equal(a, b), f"call {i} ({'sampled' if todo[i].get('do_sample') else 'greedy'}) differs"


def test_generators_on_the_same_models_run_at_once(tiny_pair, alone):
    target, draft, tok = tiny_pair("llama")
    gens = [SpeculativeGenerator(target, draft, tok) for _ in range(THREADS)]
    todo = calls(target.config.vocab_size)
    together = run_in_threads(lambda c, thread: gens[thread].generate(**c).sequences, todo)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_hfspec_generate_from_threads_loads_the_pair_once(model_dir, monkeypatch):
    target, draft = model_dir("llama", seed=0), model_dir("llama", seed=1)
    api.clear_cache()
    loads = []
    real = api.loading.load_pair
    monkeypatch.setattr(api.loading, "load_pair", lambda *a, **k: loads.append(a) or real(*a, **k))
    prompts = [f"p{i} " * (1 + i % 4) for i in range(THREADS * CALLS)]

    def call(i: int, thread: int = 0) -> str:
        sampling = {"do_sample": True, "seed": i} if i % 2 else {}
        return hfspec.generate(
            prompts[i],
            target=target,
            draft=draft,
            max_new_tokens=8,
            gamma=2,
            tree=None,
            device_map={"": "cpu"},
            **sampling,
        )

    together = run_in_threads(call, list(range(len(prompts))))
    assert len(loads) == 1, "a device_map dict is part of the key by value: one pair for every call"
    assert together == [call(i) for i in range(len(prompts))]
    api.clear_cache()


def test_the_pair_cache_is_bounded_and_keyed_by_value():
    key = api._key({"device_map": {"a": 0, "b": [1, 2]}, "dtype": torch.bfloat16})
    assert key == api._key({"dtype": torch.bfloat16, "device_map": {"b": [1, 2], "a": 0}})
    assert hash(key) == hash(api._key({"device_map": {"b": [1, 2], "a": 0}, "dtype": torch.bfloat16}))
    assert key != api._key({"device_map": {"a": 0, "b": [2, 1]}, "dtype": torch.bfloat16})
    thing = object()
    assert api._key({"x": thing}) == api._key({"x": thing}) != api._key({"x": object()})
    cache = api.PairCache(2)
    for name in "abc":
        cache.get(name, lambda name=name: name)
    assert cache.keys() == ["b", "c"], "the least recently used pair goes first"


def test_a_call_from_inside_a_call_is_refused(tiny_pair):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)

    class Streamer:
        def put(self, value):
            gen.generate(torch.tensor([[5, 6]]), max_new_tokens=2, gamma=2)

        def end(self):
            pass

    with pytest.raises(HfspecError, match="inside"):
        gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, gamma=2, streamer=Streamer())
    assert gen.generate(torch.tensor([[5, 6]]), max_new_tokens=3, gamma=2).sequences.shape[1] == 5


# -- interrupts -------------------------------------------------------------------------------------


class Interrupt(Exception):
    pass


def drafter_for(kind: str, target, draft):
    """The draft a generator is built with: a model, a model with lookup (hybrid), lookup alone, an EAGLE-3 head."""
    if kind == "eagle3":
        head = eh.random_head(target, list(range(3, 40)), seed=4, scale=5.0, layer_ids=FEATURES)
        return Eagle3Drafter(head, target)
    return {"model": draft, "hybrid": draft, "ngram": "ngram"}[kind]


# Four layers, no early end: an EAGLE-3 head reads three of them (the hidden states entering layers 1, 2 and 3).
LAYERS, FEATURES = 4, (1, 2, 3)
PROMPT = torch.tensor([[5, 9, 11, 4, 7, 5, 9, 11]])
# The cut comes at the first or second forward or proposal; the calls after it make 8 tokens, two steps or more.
CUT_NEW = 8


@pytest.fixture(scope="module")
def cut_pair(tiny_pair):
    """The pair the interrupted calls run, and the target's own greedy continuation of PROMPT."""
    target, draft, tok = tiny_pair("llama", layers=LAYERS, eos=None)
    reference = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=CUT_NEW)
    return target, draft, tok, reference


@pytest.mark.parametrize("where", ["drafter", "target"])
@pytest.mark.parametrize(
    "kind,tree,fault",
    [
        ("model", None, KeyboardInterrupt),
        ("model", None, Interrupt),
        ("model", 4, Interrupt),
        ("hybrid", None, Interrupt),
        ("ngram", None, Interrupt),
        ("eagle3", None, KeyboardInterrupt),
        ("eagle3", 4, Interrupt),
    ],
)
def test_a_call_cut_short_leaves_the_generator_exact(cut_pair, fault, where, kind, tree):
    target, draft, tok, reference = cut_pair
    gen = SpeculativeGenerator(target, drafter_for(kind, target, draft), tok, ngram=kind == "hybrid")
    prompt = PROMPT
    args = {"max_new_tokens": CUT_NEW, "gamma": 3, "tree": tree}
    sampled = gen.generate(prompt, do_sample=True, seed=3, **args).sequences
    for step in (1, 2):
        count = {"n": 0}

        def fail(*a, **k):
            count["n"] += 1
            if count["n"] == step:
                raise fault("cut short")

        handles = []
        if where == "target":
            handles.append(target.register_forward_pre_hook(fail))
        else:  # the drafter's proposal, after it has begun: its own caches hold drafts then
            name = "propose_tree" if tree else "propose"
            real = getattr(gen.drafter, name)
            setattr(gen.drafter, name, lambda *a, real=real: (real(*a), fail())[0])
        try:
            with pytest.raises(fault):
                gen.generate(prompt, do_sample=bool(step % 2), seed=5, **args)
        finally:
            for handle in handles:
                handle.remove()
            gen.drafter.__dict__.pop("propose_tree" if tree else "propose", None)
        # The next calls are exact, greedy and sampled, and their caches pass their invariants at every step.
        assert gen.check_invariants
        assert torch.equal(gen.generate(prompt, **args).sequences, reference)
        if kind not in ("hybrid", "ngram"):  # lookup learns from earlier outputs: its later draws may differ
            assert torch.equal(gen.generate(prompt, do_sample=True, seed=3, **args).sequences, sampled)
