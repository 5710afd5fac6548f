"""gamma="auto"'s costs are measured once per machine, pair, dtype and thread count, kept on disk, and reused."""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch

from hfspec import SpeculativeGenerator, generator
from hfspec.measure import cost_cache, costs
from hfspec.measure.costs import Costs, capped

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 7]])


@pytest.fixture
def measures(monkeypatch):
    """How many times ``costs.measure`` ran."""
    calls = []
    real = costs.measure

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(costs, "measure", counted)
    return calls


def run(gen: SpeculativeGenerator, tree: str | None = None) -> torch.Tensor:
    return gen.generate(PROMPT, max_new_tokens=6, gamma="auto", tree=tree, eos_token_id=[]).sequences


def test_a_second_generator_for_the_same_pair_reuses_the_kept_costs(tiny_pair, measures, kept_costs, caplog):
    target, draft, tok = tiny_pair("llama")
    with caplog.at_level(logging.INFO, logger="hfspec.generator"):
        first = run(SpeculativeGenerator(target, draft, tok))
    assert len(measures) == 1
    notices = [r for r in caplog.records if "measuring this machine's costs" in r.getMessage()]
    assert len(notices) == 1 and notices[0].levelno == logging.INFO and str(kept_costs) in notices[0].getMessage()
    [kept] = kept_costs.glob("costs-*.json")
    record = json.loads(kept.read_text())
    assert record["key"]["machine"]["threads"] == torch.get_num_threads()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hfspec.generator"):
        second = run(SpeculativeGenerator(target, draft, tok))  # a new generator: nothing in memory
    assert len(measures) == 1, "the kept costs were measured again"
    assert not [r for r in caplog.records if "measuring" in r.getMessage()]
    assert torch.equal(first, second)


def test_the_call_writes_back_the_costs_its_steps_refined(tiny_pair, kept_costs):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)
    run(gen)
    [kept] = kept_costs.glob("costs-*.json")
    back = Costs.from_record(json.loads(kept.read_text())["costs"])
    costs = gen.tuning.costs
    assert costs.observed_verify, "no step refined the costs"
    assert back.verify == capped({k: min(s, costs.observed_verify.get((1, k), s)) for k, s in costs.verify.items()})
    assert back.draft == min(costs.draft, costs.observed_draft.get(1, costs.draft))


def test_the_fastest_time_seen_is_kept_so_that_a_loaded_measurement_heals():
    loaded = Costs({1: 0.5, 2: 0.6, 3: 0.7}, 0.05)
    loaded.record_verify(1, 3, 0.01)  # a quiet step after a measurement under load
    loaded.record_verify(1, 2, 5.0)  # a step that another process stalled
    loaded.record_draft(1, 0.001)
    kept = loaded.fastest()
    assert kept.verify[1] == 0.5 and kept.verify[3] == loaded.observed_verify[(1, 3)] < 0.6
    assert kept.verify[2] <= kept.verify[3]  # two tokens cost no more than three's quiet step: the stall is not kept
    assert kept.draft < 0.05 and not kept.observed_verify and not kept.observed_draft


# Kept on this machine (AMD EPYC, 2 threads) by a process that a neighbour slowed while it measured two and four
# tokens: as kept, v(1) = 30 priced every γ but 2 out for good, since only the γ a policy takes are timed again.
SLOWED = {1: 0.066, 2: 1.947, 3: 0.150, 4: 2.242, 5: 0.357, 6: 0.160}


def test_a_size_measured_dearer_than_what_it_could_run_as_is_priced_as_that():
    # Two sizes slowed: each is capped by the parts it could run as (2 = 1 + 1) or by a larger size (4 by 6).
    loaded = Costs.from_record(Costs(SLOWED, 0.02).to_record())
    assert loaded.verify == pytest.approx({1: 0.066, 2: 0.132, 3: 0.150, 4: 0.160, 5: 0.160, 6: 0.160})
    assert loaded.v(1) == pytest.approx(2.0) and loaded.fastest().verify == loaded.verify
    assert Costs(SLOWED, 0.02).v(1) > 29  # the control: the same times, not capped
    # Every size past two slowed (nothing larger to cap them): two forwards in a row bound them.
    tail = capped({1: 0.020, 2: 0.025, 3: 0.170, 4: 0.170, 5: 0.170})
    assert tail == pytest.approx({1: 0.020, 2: 0.025, 3: 0.045, 4: 0.050, 5: 0.070})
    quiet = {1: 0.020, 2: 0.025, 3: 0.031, 4: 0.036, 9: 0.070}  # as a quiet machine measures: nothing to cap
    assert capped(quiet) == quiet


def test_a_size_slowed_while_it_is_measured_is_capped_by_a_larger_one(tiny_pair, monkeypatch):
    # forward_seconds times sizes 1..3 round-robin after two warm-ups (1 and 3); here every forward over 2 tokens
    # takes 1 s, one over 1 token 0.125 s and one over 3 tokens 0.25 s.
    target, _, _ = tiny_pair("llama")
    order = [1, 3, *[1, 2, 3] * 3]
    calls = iter(order)

    def scripted(fn, device):
        k = next(calls)
        return fn(), {1: 0.125, 2: 1.0, 3: 0.25}[k]

    monkeypatch.setattr(costs, "timed", scripted)
    assert costs.forward_seconds(target, [1, 5, 9], [1, 2, 3], 3, torch.device("cpu")) == {1: 0.125, 2: 0.25, 3: 0.25}
    assert next(calls, None) is None, "not the forwards the timings were scripted for"


def test_another_thread_count_dtype_or_pair_misses_the_cache(tiny_pair, measures):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)
    run(gen)
    assert cost_cache.kept(gen.costs_key()).costs is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cost_cache.kept(SpeculativeGenerator(target, draft, tok).costs_key()).costs is None
    finally:
        torch.set_num_threads(threads)
    other_draft = tiny_pair("llama", draft_seed=2)[1]
    assert cost_cache.kept(SpeculativeGenerator(target, other_draft, tok).costs_key()).costs is None
    half = copy.deepcopy(target).to(torch.bfloat16)
    assert cost_cache.path(SpeculativeGenerator(half, draft, tok).costs_key()) != cost_cache.path(gen.costs_key())
    assert len(measures) == 1


@pytest.mark.parametrize("content", ["{not json", '{"key": 1}', "[]", ""])
def test_a_corrupt_file_is_ignored_and_measured_again(tiny_pair, measures, caplog, content):
    target, draft, tok = tiny_pair("llama")
    gen = SpeculativeGenerator(target, draft, tok)
    where = cost_cache.path(gen.costs_key())
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(content)
    with caplog.at_level(logging.DEBUG, logger="hfspec"):
        run(gen)
    assert len(measures) == 1
    assert any("ignoring" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    assert cost_cache.kept(gen.costs_key()).costs is not None  # written over with a whole record


def test_a_record_with_a_bad_time_is_refused():
    good = Costs({1: 0.01, 2: 0.012}, 0.002, observed_verify={(1, 2): 0.013}).to_record()
    assert Costs.from_record(good).observed_verify == {(1, 2): 0.013}
    for bad in ({**good, "draft": -1.0}, {**good, "verify": [[2, 0.01]]}, {**good, "verify": [[1, "x"]]}):
        with pytest.raises(ValueError):
            Costs.from_record(bad)


def test_the_tree_probe_is_kept_beside_the_costs(tiny_pair, monkeypatch):
    target, draft, tok = tiny_pair("llama")
    probes = []
    monkeypatch.setattr(generator, "reads_trees", lambda model: probes.append(1) or True)
    first = SpeculativeGenerator(target, draft, tok)
    run(first, tree="auto")
    assert probes == [1] and cost_cache.kept(first.costs_key()).reads_trees is True
    run(SpeculativeGenerator(target, draft, tok), tree="auto")
    assert probes == [1]


def test_a_module_without_a_dtype_has_a_key():
    head = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert cost_cache._dtype(head) == "torch.float32" and cost_cache._dtype(None) is None
    assert cost_cache.identity(head) != cost_cache.identity(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_an_eagle3_head_keeps_its_costs(model_dir, measures):
    import eagle3_heads
    import tiny

    from hfspec.drafters.eagle3 import Eagle3Drafter

    target, tok = tiny.load(model_dir("llama", vocab_size=64, layers=8, hidden=32, seed=0, sharpness=8.0))
    head = eagle3_heads.random_head(target, list(range(3, 43)), seed=3)
    run(SpeculativeGenerator(target, Eagle3Drafter(head, target), tok))
    run(SpeculativeGenerator(target, Eagle3Drafter(head, target), tok))
    assert len(measures) == 1


def test_a_new_generator_starts_from_the_acceptance_seen_before(tiny_pair, scripted_auto):
    target, draft, tok = tiny_pair("llama")
    first = scripted_auto(SpeculativeGenerator(target, draft, tok), "cheap")  # costs where drafting pays
    run(first)
    seen = first.tuning.evidence()
    assert seen.trials > 2.0, "the first call learnt nothing"
    second = SpeculativeGenerator(target, draft, tok)
    second.measure_costs(PROMPT[0].tolist())
    second.tuning.setting = first.tuning.setting
    assert (second.tuning.evidence().accepted, second.tuning.evidence().trials) == (seen.accepted, seen.trials)


def test_records_are_replaced_whole_and_a_read_only_cache_is_no_error(tmp_path):
    from hfspec.cpu import records

    where = tmp_path / "c" / "r.json"
    assert records.keep(where, {"a": 1}) and records.read(where) == {"a": 1}
    assert records.keep(where, {"a": 2}) and records.read(where) == {"a": 2}
    assert [p.name for p in where.parent.iterdir()] == ["r.json"]  # no temporary file left beside it
    where.parent.chmod(0o555)
    try:
        assert not records.keep(where, {"a": 3}) or os.geteuid() == 0  # root writes anywhere
    finally:
        where.parent.chmod(0o755)
    assert records.read(where)["a"] in (2, 3)
