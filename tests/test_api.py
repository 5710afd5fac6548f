"""hfspec.generate: text in, new text out, one load per pair."""

from __future__ import annotations

import json
import logging

import pytest
import tiny
import torch
from transformers import GenerationConfig

import hfspec
from hfspec import Stats, api
from hfspec.cpu import fast
from hfspec.cpu import threads as cpu_threads
from hfspec.drafters import loading
from hfspec.errors import HfspecError
from hfspec.models import assets
from hfspec.models.presets import DEFAULT_MAX_NEW_TOKENS, load_preset
from hfspec.policy import HeuristicGamma

pytestmark = pytest.mark.usefixtures("fresh_api_cache")


@pytest.fixture
def pair(model_dir):
    return str(model_dir("llama", seed=0)), str(model_dir("llama", seed=1))


@pytest.fixture
def loads(monkeypatch):
    """Counts calls of load_pair."""
    calls = []
    real = loading.load_pair

    def counting(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_pair", counting)
    return calls


def test_the_public_names_load_on_first_use():
    for name in hfspec.__all__:
        assert getattr(hfspec, name) is not None and name in dir(hfspec), name
    from hfspec import SpeculativeGenerator, fast, generate

    assert generate is api.generate and SpeculativeGenerator is hfspec.generator.SpeculativeGenerator
    assert fast.__name__ == "hfspec.cpu.fast"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        hfspec.nothing  # noqa: B018


def test_hfspec_fast_is_the_cpu_kernels_module():
    import hfspec.cpu.fast
    import hfspec.fast
    from hfspec.fast import accelerate

    assert hfspec.fast is hfspec.cpu.fast and accelerate is hfspec.cpu.fast.accelerate


def target_greedy(path: str, ids: list[int], n: int) -> str:
    model, tok = tiny.load(path)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_string_prompt_returns_only_the_new_text(pair):
    target, draft = pair
    text = hfspec.generate("w10 w11 w12", target=target, draft=draft, max_new_tokens=12, gamma=3)
    assert isinstance(text, str) and text
    assert "w10 w11 w12" not in text
    assert text == target_greedy(target, [10, 11, 12], 12)


def test_list_of_prompts_of_different_lengths(pair):
    target, draft = pair
    prompts = ["w10 w11 w12 w13 w14", "w20", "w30 w31"]
    texts = hfspec.generate(prompts, target=target, draft=draft, max_new_tokens=8)
    assert isinstance(texts, list) and len(texts) == 3
    assert texts == [hfspec.generate(p, target=target, draft=draft, max_new_tokens=8) for p in prompts]


def test_chat_applies_the_template(pair):
    target, draft = pair
    text = hfspec.generate("w10 w11", target=target, draft=draft, max_new_tokens=8, chat=True, system="w40")
    ids = tiny.make_tokenizer(64)("<s> system : w40 </s> <s> user : w10 w11 </s> <s> assistant :")["input_ids"]
    assert text == target_greedy(target, ids, 8)
    assert text != hfspec.generate("w10 w11", target=target, draft=draft, max_new_tokens=8)


def test_chat_without_a_template_is_a_clear_error():
    tok = tiny.make_tokenizer(64)
    tok.chat_template = None
    with pytest.raises(HfspecError, match="no chat template; turn chat off"):
        api.encode(tok, ["w10"], chat=True)
    with pytest.raises(HfspecError, match="system message needs the chat template"):
        api.encode(tok, ["w10"], chat=False, system="w40")


def test_pair_is_loaded_once_and_reused(pair, loads):
    target, draft = pair
    first = hfspec.generate("w10", target=target, draft=draft, max_new_tokens=4)
    second = hfspec.generate(["w10", "w11"], target=target, draft=draft, max_new_tokens=4, gamma=2)
    assert len(loads) == 1 and second[0] == first
    hfspec.generate("w10", target=target, draft=draft, max_new_tokens=4, dtype="bfloat16")
    assert len(loads) == 2, "other loading options are another pair"


def test_return_stats(pair):
    target, draft = pair
    text, stats = hfspec.generate("w10 w11", target=target, draft=draft, max_new_tokens=9, return_stats=True)
    assert isinstance(stats, Stats) and stats.committed == 9 and len(text.split()) == 9
    assert 0 <= stats.acceptance_rate <= 1


def test_max_new_tokens_comes_from_the_call_then_generation_config_then_the_target(pair, monkeypatch):
    target, draft = pair
    kwargs = dict(target=target, draft=draft, gamma=2, return_stats=True)
    five = GenerationConfig(max_new_tokens=5)
    assert hfspec.generate("w10 w11", generation_config=five, **kwargs)[1].committed == 5
    assert hfspec.generate("w10 w11", max_new_tokens=3, generation_config=five, **kwargs)[1].committed == 3
    gen = api.load(api.resolve_preset(target, draft))
    monkeypatch.setattr(gen.target.generation_config, "max_new_tokens", 6)
    assert hfspec.generate("w10 w11", **kwargs)[1].committed == 6


def test_max_new_tokens_precedence_keyword_then_generation_config_then_the_target_then_the_default(pair, monkeypatch):
    target, draft = pair
    kwargs = dict(target=target, draft=draft, gamma=2, return_stats=True)
    gen = api.load(api.resolve_preset(target, draft))
    monkeypatch.setattr(gen.target.generation_config, "max_new_tokens", 6)
    five = GenerationConfig(max_new_tokens=5)
    assert hfspec.generate("w10 w11", generation_config=five, **kwargs)[1].committed == 5  # not the target's 6
    assert hfspec.generate("w10 w11", max_new_tokens=3, generation_config=five, **kwargs)[1].committed == 3
    ids = [[10, 11]]
    assert gen.generate(ids, gamma=2).stats.committed == 6
    assert gen.generate(ids, gamma=2, generation_config=five).stats.committed == 5
    assert gen.generate(ids, gamma=2, generation_config=five, max_new_tokens=3).stats.committed == 3
    monkeypatch.setattr(gen.target.generation_config, "max_new_tokens", None)
    monkeypatch.setattr(gen.target.generation_config, "eos_token_id", None)  # no early end
    assert hfspec.generate("w10 w11", **kwargs)[1].committed == DEFAULT_MAX_NEW_TOKENS


def test_seed_makes_sampling_reproducible_and_equal_to_the_generator(pair):
    target, draft = pair
    kwargs = dict(target=target, draft=draft, max_new_tokens=12, do_sample=True, temperature=1.0, gamma=3)
    a = hfspec.generate("w10 w11", seed=7, **kwargs)
    assert a == hfspec.generate("w10 w11", seed=7, **kwargs)
    assert a != hfspec.generate("w10 w11", seed=8, **kwargs)
    gen = api.load(api.resolve_preset(target, draft))
    out = gen.generate([10, 11], max_new_tokens=12, do_sample=True, temperature=1.0, gamma=3, seed=7)
    assert a == gen.tokenizer.decode(out.sequences[0, out.prompt_length :], skip_special_tokens=True)


def test_adaptive_gamma_is_still_lossless(pair):
    target, draft = pair
    fixed = hfspec.generate("w10 w11", target=target, draft=draft, max_new_tokens=16, gamma=2)
    assert fixed == hfspec.generate("w10 w11", target=target, draft=draft, max_new_tokens=16, gamma=HeuristicGamma())


def test_config_preset_supplies_defaults(pair, tmp_path):
    target, draft = pair
    path = tmp_path / "tiny.json"
    path.write_text(
        json.dumps({"name": "tiny", "target": target, "draft": draft, "gamma": 2, "chat": True, "dtype": "float32"})
    )
    text = hfspec.generate("w10", config=str(path), max_new_tokens=8)
    assert text == hfspec.generate("w10", target=target, draft=draft, max_new_tokens=8, chat=True)
    assert text != hfspec.generate("w10", config=str(path), max_new_tokens=8, chat=False)


def test_default_pair_is_the_offline_preset_with_chat(pair, model_dir, monkeypatch, loads, tmp_path):
    from eagle3_heads import random_head
    from transformers import AutoModelForCausalLM

    from hfspec.heads.checkpoint import save_head

    # The preset's draft is a draft model or an EAGLE-3 head: both are stood in for, by tiny ones.
    target, draft = str(model_dir("llama", seed=0, layers=5)), pair[1]
    target_model = AutoModelForCausalLM.from_pretrained(target)
    head = save_head(
        random_head(target_model, list(range(3, 40)), layer_ids=(1, 2, 4)), tmp_path / "head", target=target_model
    )
    monkeypatch.setattr(assets, "offline_target_path", lambda **kw: target)
    monkeypatch.setattr(assets, "shipped_draft_path", lambda: draft)
    monkeypatch.setattr(assets, "shipped_head_path", lambda: head)
    preset = load_preset("smollm2-offline")
    text = hfspec.generate("w10", max_new_tokens=8)
    assert loads[0][0] == ("offline", preset.draft) and loads[0][1]["dtype"] == "float32"
    assert preset.draft in ("shipped", "shipped-eagle3")
    api.clear_cache()
    assert text == hfspec.generate("w10", target=target, draft=draft, max_new_tokens=8, chat=True)


@pytest.mark.parametrize("name", ["smollm2-offline", "qwen2.5-coder-1.5b-offline"])
def test_the_offline_presets_run_float32_activations(name):
    # Their targets keep GGUF blocks on CPU, where hfspec's one-call decoder layers take float32 activations only: in
    # bfloat16 the Qwen pair ran module by module, its defaults 14.1 against 17.7 tok/s on a Zen 3.
    assert load_preset(name).load_kwargs()["dtype"] == "float32"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"config": "gpt2-xl", "target": "x"}, HfspecError, "either a config preset or target and draft"),
        ({"target": "x"}, HfspecError, "no draft given: pass both"),
        ({"draft": "x"}, HfspecError, "no target given"),
        ({"config": "nope"}, HfspecError, "no preset named 'nope'"),
    ],
)
def test_pair_selection_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        hfspec.generate("w10", **kwargs)


@pytest.mark.parametrize("prompt", [[], [1, 2], None, ["w1", 2]])
def test_prompt_must_be_text(prompt):
    with pytest.raises(TypeError, match="string or a non-empty list of strings"):
        hfspec.generate(prompt)


def test_bad_settings_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="top_p must be in"):
        hfspec.generate("w10", target=target, draft=draft, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="gamma"):
        hfspec.generate("w10", target=target, draft=draft, gamma=0)


def test_threads_are_each_calls_and_the_kernel_plans_and_costs_follow_them(pair, library, caplog):
    if library.isa == "scalar":
        pytest.skip("no vectorised CPU kernel here, so hfspec loads models without it")
    before = torch.get_num_threads()
    gen = hfspec.SpeculativeGenerator.from_pretrained(*pair, threads=2)
    timed = [m for m in gen.target.modules() if type(m) is fast.FastLinear]
    assert timed and {m.plan_threads for m in timed} == {2}, "block shapes timed for the count the calls run on"
    assert torch.get_num_threads() == before and gen.describe()["threads"] == 2
    seen = []
    gen.target.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    ids = torch.tensor([[1, 10, 11, 12]])
    gen.generate(ids, max_new_tokens=4, gamma="auto", threads=1)
    assert set(seen) == {1} and {m.plan_threads for m in timed} == {1} and gen.tuning.costs is not None
    seen.clear()
    gen.generate(ids, max_new_tokens=4, gamma=2)  # the generator's own count again
    assert set(seen) == {2} and {m.plan_threads for m in timed} == {2}
    assert gen.tuning.costs is None, "costs measured on one thread are not two threads' costs"
    assert torch.get_num_threads() == before
    short = {"preset": api.resolve_preset(*pair), "gamma": 2, "generation_config": GenerationConfig(max_new_tokens=2)}
    assert api.complete(gen, ["w10"], **short).settings["threads"] == 2
    assert api.complete(gen, ["w10"], **short, threads=1).settings["threads"] == 1
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(HfspecError, match="threads must be an integer >= 1"):
            gen.generate(ids, max_new_tokens=2, threads=bad)
        with pytest.raises(HfspecError, match="threads must be an integer >= 1"):
            hfspec.generate("w10", target=pair[0], draft=pair[1], threads=bad)
    assert torch.get_num_threads() == before
    with caplog.at_level(logging.WARNING, logger="hfspec.cpu.threads"):
        assert cpu_threads.check(cpu_threads.available() + 1) == cpu_threads.available() + 1
    assert "threads beyond the CPUs only slow each other down" in caplog.text
