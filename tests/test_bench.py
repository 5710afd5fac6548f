"""hfspec bench: its arithmetic, its report's shape, and one end-to-end run on a tiny pair (no timing checks)."""

from __future__ import annotations

import json
import os

import pytest
import tiny
import torch

from hfspec import bench
from hfspec.bench import Bench, Contender, Mode, Run, Settings, report
from hfspec.bench import command as bench_command
from hfspec.cpu import draft_linear, fast
from hfspec.decoding.stats import RowStats, Stats
from hfspec.drafters.factory import make_drafter
from hfspec.drafters.hybrid import HybridDrafter, with_ngram
from hfspec.drafters.loading import load_pair
from hfspec.drafters.ngram import NgramDrafter
from hfspec.errors import HfspecError
from hfspec.policy import alpha_from_tokens_per_pass

GREEDY = Mode("greedy", False)
SAMPLE = Mode("sample", True, 0.7, 0.95, 0)
CONTENDER_KEYS = {
    "kind",
    "schedule",
    "gamma",
    "drafter",
    "tokens_per_second",
    "speedup_vs_plain",
    "speedup_vs_hfspec_g0",
    "speedup_vs_assisted",
    "speedup_vs_assisted_default",
    "acceptance_rate",
    "alpha",
    "mean_accepted_length",
    "mean_gamma",
    "acceptance_by_position",
    "gamma_histogram",
    "prediction_gamma",
    "predicted_speedup",
    "predicted_speedup_v",
    "efficiency",
    "new_tokens",
    "seconds",
    "tree_steps",
    "tree_nodes",
}


def test_alpha_fit_recovers_the_per_token_rate_and_accepted_share_does_not():
    # Passes of γ drafts, each accepted independently with probability α until the first rejection.
    gen = torch.Generator().manual_seed(0)
    for alpha, gamma in [(0.3, 2), (0.6, 4), (0.9, 6)]:
        passes = 20_000
        u = torch.rand(passes, gamma, generator=gen) < alpha
        accepted = torch.cumprod(u.int(), dim=1).sum(dim=1).float()
        fitted = alpha_from_tokens_per_pass(float(accepted.mean()) + 1, gamma)
        assert fitted == pytest.approx(alpha, abs=0.015)
        share = float(accepted.sum()) / (passes * gamma)
        assert share < alpha - 0.05, "the accepted share is a biased estimate of α"
    assert alpha_from_tokens_per_pass(1.0, 3) == pytest.approx(0.0, abs=1e-9)
    assert alpha_from_tokens_per_pass(4.0, 3) == pytest.approx(1.0, abs=1e-9)
    assert alpha_from_tokens_per_pass(9.0, 3) == pytest.approx(1.0, abs=1e-9)  # clipped
    with pytest.raises(ValueError, match="gamma"):
        alpha_from_tokens_per_pass(1.5, 0)


def test_predicted_speedup_matches_hand_values():
    # α=0.8, γ=4, c=0.1: (1 - 0.8^5) / (0.2 * (0.4 + 1)) = 0.67232 / 0.28
    pred, pred_v, g = bench.prediction(0.8, 4, 0.1, {4: 1.5})
    assert g == 4
    assert pred == pytest.approx(2.401142857, rel=1e-9)
    assert pred_v == pytest.approx(0.67232 / 0.38, rel=1e-9)
    # α=0: only the bonus token, at the price of γ draft steps and one verification.
    assert bench.prediction(0.0, 1, 0.5, {})[0] == pytest.approx(1 / 1.5)
    # α=1: every draft accepted, γ+1 tokens per step.
    assert bench.prediction(1.0, 3, 0.2, {3: 1.2})[1] == pytest.approx(4 / 1.8)
    # An adaptive run's mean γ is rounded, and a missing v(γ) borrows the nearest measured one.
    assert bench.prediction(0.5, 2.4, 0.1, {1: 1.1, 3: 1.3})[2] == 2
    assert bench.prediction(None, 4, 0.1, {}) == (None, None, None)


def test_ratios_spread_and_mismatches():
    assert bench.median_ratio([2.0, 9.0, 3.0], [1.0, 3.0, 1.0]) == 3.0
    assert bench.median_ratio([1.0], [0.0]) is None
    s = bench.spread([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s["median"], s["p25"], s["p75"], s["min"], s["max"]) == (3.0, 2.0, 4.0, 1.0, 5.0)
    assert bench.mismatches([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == []
    assert bench.mismatches([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5, 6]]) == [
        {"prompt": 0, "position": 1, "reference_length": 3, "length": 3},
        {"prompt": 1, "position": 2, "reference_length": 2, "length": 3},
    ]
    assert bench.trim([5, 6, 2, 7, 2], {2}) == [5, 6, 2]
    assert bench.trim([5, 6, 7, 2], {2}, length=2) == [5, 6]


def _stats(drafted: int, accepted: int, passes: int, committed: int) -> Stats:
    row = RowStats(committed, accepted, passes, drafted, "length")
    # Only the first two draft positions are filled in: 5 of 5, then 2 of 4 accepted.
    return Stats(
        passes, drafted, drafted, accepted, committed, (5, 2), (5, 4), (0, 0, 0, 0, passes), 0.0, 0.0, 1.0, (row,)
    )


def test_summary_arithmetic():
    plain = [Run([[1] * 10], 1.0, 11, 0), Run([[1] * 10], 2.0, 11, 0)]  # 10 and 5 tok/s
    assisted = [Run([[1] * 10], 0.5, 4, 12), Run([[1] * 10], 1.0, 4, 12)]  # 20 and 10 tok/s
    # 20 drafted (γ=4, 5 passes), 15 accepted: α = 0.75, 4 tokens per pass.
    spec = [Run([[1] * 20], 0.5, 6, 21, _stats(20, 15, 5, 20)), Run([[1] * 20], 1.0, 6, 21, _stats(20, 15, 5, 20))]
    c, v = 0.1, {4: 1.5}
    row = bench.summarize(
        Contender("hfspec", "hfspec", 4, "fixed"), spec, plain, assisted, c, v, greedy=False, assisted_default=plain
    )
    assert row["speedup_vs_plain"] == pytest.approx(4.0)
    assert row["speedup_vs_assisted"] == pytest.approx(2.0)
    assert row["speedup_vs_assisted_default"] == pytest.approx(4.0)
    assert row["gamma_histogram"] == [0, 0, 0, 0, 10] and row["mean_gamma"] == pytest.approx(4.0)
    assert row["acceptance_rate"] == pytest.approx(0.75)
    assert row["mean_accepted_length"] == pytest.approx(4.0)
    assert row["acceptance_by_position"] == [1.0, 0.5]
    # α is fitted to 4 tokens per pass at γ = 4, so the prediction is tokens per pass ÷ (γc + v).
    alpha = row["alpha"]
    assert sum(alpha**i for i in range(5)) == pytest.approx(4.0)
    pred_v = 4.0 / (4 * 0.1 + 1.5)
    assert row["predicted_speedup_v"] == pytest.approx(pred_v)
    assert row["efficiency"] == pytest.approx(4.0 / pred_v)
    assert "greedy_mismatches" not in row

    # transformers' counts come from forward calls: 4 rounds commit 10 tokens, so 6 of 12 drafts were accepted.
    row = bench.summarize(
        Contender("assisted", "assisted", 3, "constant"), assisted, plain, assisted, c, v, greedy=True
    )
    assert row["acceptance_rate"] == pytest.approx(0.5)
    assert row["mean_accepted_length"] == pytest.approx(2.5)
    assert sum(row["alpha"] ** i for i in range(4)) == pytest.approx(2.5)
    assert row["speedup_vs_assisted"] == pytest.approx(1.0)
    assert row["greedy_mismatches"] == []


def test_assistant_settings_are_constant_and_restored(tiny_pair):
    _, draft, _ = tiny_pair("llama")
    before = draft.generation_config.to_dict()
    with bench.assistant_settings(draft, 3):
        conf = draft.generation_config
        assert (conf.num_assistant_tokens, conf.num_assistant_tokens_schedule) == (3, "constant")
        assert conf.assistant_confidence_threshold == 0
    assert draft.generation_config.to_dict() == before


def test_prompts_from_jsonl_and_text(tmp_path):
    shipped = bench.load_prompts()
    assert len(shipped) >= 20 and all(p["prompt"] and p["kind"] != "-" for p in shipped)
    assert len({p["id"] for p in shipped}) == len(shipped)
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond\\nline two\n")
    assert [p["prompt"] for p in bench.load_prompts(text)] == ["first prompt", "second\nline two"]


def _tiny_settings(**kw) -> Settings:
    base = dict(
        gamma=2,
        gammas=(1, 2),
        trees=(),
        modes=(GREEDY,),
        warmup=0,
        batch_size=2,
        batch_repeats=1,
        cost_repeats=2,
        progress=False,
    )
    return Settings(**{**base, **kw})


class _Wrong(Bench):
    """Changes the last token of two contenders' outputs (one of the tree sweep), as a broken implementation would."""

    def _generate(self, contender, rows, mode, seed):
        tokens, stats = super()._generate(contender, rows, mode, seed)
        if contender.name in ("hfspec-heuristic", "hfspec-t4"):
            tokens = [t[:-1] + [(t[-1] + 1) % 60 + 3] for t in tokens]
        return tokens, stats


def test_greedy_check_flags_a_wrong_contender(tiny_pair):
    target, draft, tok = tiny_pair("llama", sharpness=4.0)
    prompts = [{"id": "a", "kind": "-", "prompt": "w10 w11 w12"}, {"id": "b", "kind": "-", "prompt": "w20 w21"}]
    result = bench.run_bench(
        _Wrong(target, draft, tok, max_new_tokens=6, gamma=2), prompts, _tiny_settings(batch_size=0, trees=(4, 6))
    )
    rows = result["modes"]["greedy"]["contenders"]
    assert len(rows["hfspec-heuristic"]["greedy_mismatches"]) == 2
    trees = result["modes"]["greedy"]["tree_mismatches"]
    assert len(trees["hfspec-t4"]) == 2 and trees["hfspec-t6"] == []
    assert "tree sweep greedy mismatches: {'hfspec-t4': 2}" in bench.format_table(result)
    for name in ("plain", "hfspec-g0", "assisted", "assisted-default", "hfspec-auto", "hfspec", "hfspec-cost"):
        assert rows[name]["greedy_mismatches"] == [], name
    assert "mismatch" in bench.format_table(result)


def test_skipped_contenders_do_not_run(tiny_pair):
    target, draft, tok = tiny_pair("llama", sharpness=4.0)
    prompts = [{"id": "a", "kind": "-", "prompt": "w10 w11 w12"}]
    settings = _tiny_settings(batch_size=0, skip=("hfspec", "hfspec-heuristic", "hfspec-cost", "plain"))
    result = bench.run_bench(Bench(target, draft, tok, max_new_tokens=4, gamma=2), prompts, settings)
    mode = result["modes"]["greedy"]
    assert set(mode["contenders"]) == {"plain", "hfspec-g0", "assisted", "assisted-default", "hfspec-auto"}
    assert [s["gamma"] for s in mode["sweep"]] == [1]


def test_bench_end_to_end_writes_json_and_png(model_dir, tmp_path, capsys):
    target = model_dir("llama", seed=0, sharpness=4.0)
    draft = model_dir("llama", seed=0, sharpness=4.0, hidden=16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "a", "kind": "chat", "prompt": "w10 w11 w12"}\n{"id": "b", "kind": "list", "prompt": "w20 w21"}\n'
    )
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    status = bench.main(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--prompts-file",
            str(prompts),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--gamma",
            "2",
            "--gammas",
            "1,2",
            "--warmup",
            "1",
            "--batch-size",
            "2",
            "--batch-repeats",
            "1",
            "--cost-repeats",
            "2",
            "--threads",
            "1",
            "--no-progress",
            "--drafters",
            "useless",
            "--trees",
            "4,8",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert status == 0
    table = capsys.readouterr().out
    assert "hfspec-heuristic" in table and "machine:" in table and "steps by γ" in table and "tree sweep" in table
    result = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(result) >= {"environment", "costs", "auto_costs", "modes", "prompts"}
    assert result["environment"]["cpu"] and result["environment"]["threads"] == 1
    assert result["costs"]["c"] > 0 and set(result["costs"]["v"]) == {"1", "2"}
    assert set(result["auto_costs"]) == {"draft", "useless"}
    assert all(a["measured_target_ms"]["1"] > 0 for a in result["auto_costs"].values())
    assert set(result["modes"]) == {"greedy", "sample"}
    expected = {
        "plain",
        "plain-kernel",
        "hfspec-g0",
        "assisted",
        "assisted-default",
        "hfspec-auto",
        "hfspec",
        "hfspec-heuristic",
        "hfspec-cost",
        "auto:useless",
        "assisted-default:useless",
    }
    if os.environ.get("HFSPEC_KERNELS", "1") == "0":
        expected.discard("plain-kernel")  # it runs only where the kernels do
    for mode in result["modes"].values():
        assert set(mode["contenders"]) == expected
        assert sum(mode["contenders"]["hfspec-auto"]["gamma_histogram"]) > 0
        trees = mode["contenders"]["hfspec-auto"]["tree_steps"]  # auto may draft trees (tree="auto")
        assert trees is not None and 0 <= trees <= sum(mode["contenders"]["hfspec-auto"]["gamma_histogram"])
        assert mode["contenders"]["plain"]["tree_steps"] is None
        for row in mode["contenders"].values():
            assert set(row) - {"greedy_mismatches", "greedy_mismatches_vs_kernel"} == CONTENDER_KEYS
            assert row["new_tokens"] > 0
        assert [s["gamma"] for s in mode["sweep"]] == [1, 2]
        assert [t["nodes"] for t in mode["tree_sweep"]] == [4, 8]
        for t in mode["tree_sweep"]:  # a tree step commits at least the target's own token, at most depth + 1
            assert 1.0 <= t["tokens_per_pass"] <= 1 + 4 and t["speedup_vs_plain"] > 0 and t["nodes_per_pass"] > 0
            assert sum(t["depth_histogram"]) > 0 and all(0.0 <= a <= 1.0 for a in t["acceptance_by_depth"])
        assert len(mode["per_prompt"]) == 2
        batch = mode["batch"]
        assert set(batch["tokens_per_second"]) == {"plain_batched", "hfspec_batched", "hfspec_serial"}
        assert batch["batched_vs_serial"] > 0
    greedy = result["modes"]["greedy"]
    # Same target on both sides of every comparison: greedy outputs must agree token for token.
    assert all(row["greedy_mismatches"] == [] for row in greedy["contenders"].values())
    assert greedy["batch"]["greedy_mismatches"] == []
    assert greedy["tree_mismatches"] == {"hfspec-t4": [], "hfspec-t8": []}
    assert greedy["contenders"]["hfspec"]["acceptance_rate"] is not None


def test_bench_reports_the_rollback_cost_of_a_recurrent_target(model_dir, tmp_path):
    target, tok = tiny.load(model_dir("falcon_h1", vocab_size=64, seed=0))
    draft, _ = tiny.load(model_dir("llama", vocab_size=64, seed=1))
    prompts = [{"id": "a", "kind": "-", "prompt": "w10 w11 w12"}]
    result = bench.run_bench(
        Bench(target, draft, tok, max_new_tokens=6, gamma=2),
        prompts,
        _tiny_settings(batch_size=0, gammas=(2,), trees=(4,)),
    )
    assert result["modes"]["greedy"]["tree_sweep"] == []  # one recurrent state cannot read a tree: no tree sweep
    row = result["rollback"]["2"]
    assert row["mechanism"] == "adapter" and row["v"] > 0 and len(row["replay"]) == 2
    assert row["modes"]["greedy"]["v_with_rollback"] >= row["v"]
    assert "what the rollback costs" in bench.format_table(result)
    greedy = result["modes"]["greedy"]["contenders"]
    assert all(greedy[c]["greedy_mismatches"] == [] for c in greedy if c.startswith("hfspec"))


def test_bench_subcommand_is_registered():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bench.add_parser(sub)
    assert parser.parse_args(["bench", "--trees", "none"]).trees == ()
    assert parser.parse_args(["bench"]).trees == (8, 16, 32)
    args = parser.parse_args(["bench", "--gammas", "1,3", "--json"])
    assert args.func is bench.run and args.gammas == (1, 3) and args.json == "-"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--gammas", "0,2"])


def test_skipping_hfspec_auto_on_a_recurrent_target_reports_the_rollback(model_dir):
    target, tok = tiny.load(model_dir("falcon_h1", vocab_size=64, seed=0))
    draft, _ = tiny.load(model_dir("llama", vocab_size=64, seed=1))
    prompts = [{"id": "a", "kind": "-", "prompt": "w10 w11 w12"}]
    result = bench.run_bench(
        Bench(target, draft, tok, max_new_tokens=4, gamma=2),
        prompts,
        _tiny_settings(batch_size=0, gammas=(2,), skip=("hfspec-auto",)),
    )
    assert "hfspec-auto" not in result["modes"]["greedy"]["contenders"]
    # The rollback rows use the fixed-γ contender's α when hfspec-auto did not run.
    alpha = result["modes"]["greedy"]["contenders"]["hfspec"]["alpha"]
    assert result["rollback"]["2"]["modes"]["greedy"]["alpha"] == alpha


def test_plot_without_an_assisted_contender(tiny_pair, tmp_path):
    target, draft, tok = tiny_pair("llama", sharpness=4.0)
    prompts = [{"id": "a", "kind": "-", "prompt": "w10 w11 w12"}]
    result = bench.run_bench(
        Bench(target, draft, tok, max_new_tokens=4, gamma=2),
        prompts,
        _tiny_settings(batch_size=0, skip=("assisted", "assisted-default")),
    )
    assert "assisted" not in result["modes"]["greedy"]["contenders"]
    png = tmp_path / "no-assisted.png"
    bench.plot(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drafters_are_built_once_each_from_the_main_draft(tiny_pair):
    target, draft, _ = tiny_pair("llama", sharpness=4.0)
    built = bench.load_drafters(["useless", "hybrid", "ngram"], target, draft, seed=3)
    useless = built["useless"]
    assert type(useless) is type(draft) and useless.config.to_dict() == draft.config.to_dict()
    assert not torch.equal(useless.get_output_embeddings().weight, draft.get_output_embeddings().weight)
    assert isinstance(built["hybrid"], HybridDrafter) and built["hybrid"].model is draft
    assert isinstance(built["ngram"], NgramDrafter)
    with pytest.raises(HfspecError, match="needs a draft model"):
        bench.useless_copy(built["ngram"], 0)


class _Spy(Bench):
    """Notes, at every hfspec call, the outputs in the drafter's lookup store and then the call's own outputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str, tuple[int, ...], list[tuple[int, ...]], tuple[int, ...]]] = []

    def _generate(self, contender, rows, mode, seed):
        drafter = self.specs[contender.drafter].drafter
        lookup = drafter.ngram if isinstance(drafter, HybridDrafter) else drafter
        held = [tuple(o) for o in lookup.history.outputs] if isinstance(lookup, NgramDrafter) else []
        tokens, stats = super()._generate(contender, rows, mode, seed)
        if contender.kind == "hfspec" and isinstance(lookup, NgramDrafter):
            for row, out in zip(rows, tokens):
                self.calls.append((contender.drafter, mode.name, tuple(row), held, tuple(out)))
        return tokens, stats


def test_no_measured_prompt_finds_its_own_output_in_a_lookup_store(tiny_pair):
    target, draft, tok = tiny_pair("llama", sharpness=4.0)
    drafters = {"ngram": NgramDrafter(), "hybrid": with_ngram(make_drafter(draft))}
    prompts = [
        {"id": str(i), "kind": "-", "prompt": p} for i, p in enumerate(["w10 w11 w12", "w20 w21", "w30 w31 w32 w33"])
    ]
    spy = _Spy(target, draft, tok, max_new_tokens=8, gamma=2, drafters=drafters)
    others = ("assisted", "assisted-default", "prompt-lookup", "hfspec", "hfspec-heuristic", "hfspec-cost")
    bench.run_bench(
        spy, prompts, _tiny_settings(gammas=(2,), batch_size=0, warmup=2, modes=(GREEDY, SAMPLE), skip=others)
    )
    answers: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for _, _, prompt, _, out in spy.calls:  # every output of a prompt, in any mode, warm-up included
        answers.setdefault(prompt, set()).add(out)
    assert {d for d, *_ in spy.calls} == {"ngram", "hybrid"}
    greedy = {prompt: out for d, m, prompt, _, out in spy.calls if d == "ngram" and m == "greedy"}
    assert len(set(greedy.values())) == len(prompts), "the prompts must have distinct answers for this test"
    for drafter, mode, prompt, held, _ in spy.calls:
        leaked = answers[prompt].intersection(held)
        assert not leaked, f"{drafter} ({mode}) started a prompt with its own output in the store"
    # The stores are not simply empty: later prompts draft from other prompts' outputs.
    assert any(held for *_, held, _ in spy.calls)
    # Exactly: the outputs of the drafter's earlier calls in this mode (warm-up included), oldest first, of the
    # other prompts (the store drops outputs too short to hold an n-gram with a continuation).
    for k, (drafter, mode, prompt, held, _) in enumerate(spy.calls):
        expected = [
            out
            for d, m, p, _, out in spy.calls[:k]
            if (d, m) == (drafter, mode) and p != prompt and len(out) > NgramDrafter().min_match
        ]
        assert held == expected, (k, drafter, mode)


# -- the CPU kernel: where the time goes -------------------------------------------------------------


class _KernelSpy(Bench):
    """Notes, at every call, whether the target and the draft run hfspec's CPU kernel."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[str, set[tuple[bool, bool]]] = {}

    def _generate(self, contender, rows, mode, seed):
        state = (fast.is_accelerated(self.target), fast.is_accelerated(self.plain_draft))
        self.seen.setdefault(contender.name if contender.kernels else contender.kind, set()).add(state)
        return super()._generate(contender, rows, mode, seed)


@pytest.fixture
def vector_kernel(library):
    if library.isa == "scalar":
        pytest.skip("no vectorised CPU kernel here, so hfspec loads models without it")
    return library


@pytest.mark.usefixtures("vector_kernel")
def test_transformers_contenders_run_eager_and_hfspec_runs_the_kernel(model_dir):
    target, draft, tok = load_pair(
        model_dir("llama", seed=0, sharpness=4.0),
        model_dir("llama", seed=1, sharpness=4.0),
        dtype="float32",
        draft_bits=None,
    )
    # As `hfspec bench` runs them: hfspec's contenders draft with a copy in integer arithmetic, transformers' with
    # the draft as loaded (on torch's linears).
    twin = bench_command.integer_draft(draft, True)
    spy = _KernelSpy(target, twin, tok, max_new_tokens=6, gamma=2, assistant=draft)
    assert draft_linear.kernel() is None or draft_linear.describe(twin)["layers"]
    prompts = [{"id": "a", "kind": "-", "prompt": "w10 w11 w12"}, {"id": "b", "kind": "-", "prompt": "w20 w21"}]
    result = bench.run_bench(spy, prompts, _tiny_settings(batch_size=2))
    assert spy.seen["plain"] == spy.seen["assisted"] == {(False, False)}
    assert spy.seen["hfspec"] == spy.seen["plain-kernel"] == {(True, True)}
    assert fast.is_accelerated(target) and fast.is_accelerated(draft)  # put back after every eager run
    greedy = result["modes"]["greedy"]
    g0 = greedy["contenders"]["hfspec-g0"]
    assert g0["gamma"] == 0 and g0["mean_gamma"] == 0 and g0["speedup_vs_hfspec_g0"] == pytest.approx(1.0)
    assert g0["alpha"] is None and g0["predicted_speedup"] is None
    for row in greedy["contenders"].values():  # against both references: plain and plain-kernel
        assert row["speedup_vs_hfspec_g0"] > 0 and row["greedy_mismatches"] == row["greedy_mismatches_vs_kernel"] == []
    assert greedy["sweep_mismatches_vs_kernel"] and "against plain-kernel: none" in bench.format_table(result)
    assert all(s["speedup_vs_hfspec_g0"] > 0 for s in greedy["sweep"])


def test_costs_are_measured_with_the_kernel_and_eager(model_dir, tmp_path, capsys, vector_kernel):
    library = vector_kernel
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "w10 w11 w12"}\n')
    argv = [
        "--target",
        str(model_dir("llama", seed=0, sharpness=4.0)),
        "--draft",
        str(model_dir("llama", seed=1, sharpness=4.0)),
        "--prompts-file",
        str(prompts),
        "--max-new-tokens",
        "4",
        "--gamma",
        "2",
        "--gammas",
        "1,2",
        "--warmup",
        "0",
        "--batch-size",
        "0",
        "--cost-repeats",
        "2",
        "--modes",
        "greedy",
        "--threads",
        "1",
        "--no-progress",
    ]
    results = []
    for extra in ([], ["--no-fast-kernels"]):
        out = tmp_path / f"bench{len(results)}.json"
        assert bench.main(argv + extra + ["--json", str(out)]) == 0
        results.append((json.loads(out.read_text()), capsys.readouterr().out))
    (on, table_on), (off, table_off) = results
    costs = on["costs"]
    assert set(costs["eager"]) == {"c", "v", "target_step_ms", "draft_step_ms", "target_ms"}
    assert set(costs["eager"]["v"]) == set(costs["v"]) == {"1", "2"} and costs["eager"]["target_step_ms"] > 0
    assert costs["step_speedup"] == pytest.approx(costs["eager"]["target_step_ms"] / costs["target_step_ms"])
    for described in (costs["fast_kernels"], on["environment"]["fast_kernels"]):
        assert described["target"]["on"] and described["draft"]["on"]
        assert described["target"]["isa"] == library.isa and described["target"]["bytes_added"] == 0
    assert "eager: torch's linears" in table_on and f"fast kernels: target {library.isa}" in table_on
    assert "×γ0" in table_on
    assert off["costs"]["eager"] is None and off["costs"]["step_speedup"] is None
    assert not off["costs"]["fast_kernels"]["target"]["on"] and "eager" not in table_off


def test_speedup_against_gamma_zero_is_a_paired_median():
    g0 = [Run([[1] * 10], 1.0, 11, 0), Run([[1] * 10], 0.5, 11, 0)]  # 10 and 20 tok/s
    spec = [Run([[1] * 20], 0.5, 6, 21, _stats(20, 15, 5, 20)), Run([[1] * 20], 0.5, 6, 21, _stats(20, 15, 5, 20))]
    row = bench.summarize(
        Contender("hfspec", "hfspec", 4, "fixed"), spec, g0, None, 0.1, {4: 1.5}, greedy=False, gamma0=g0
    )
    assert row["speedup_vs_hfspec_g0"] == pytest.approx(3.0)  # ratios 4 and 2
    assert (
        bench.summarize(Contender("hfspec", "hfspec", 4, "fixed"), spec, g0, None, 0.1, {4: 1.5}, greedy=False)[
            "speedup_vs_hfspec_g0"
        ]
        is None
    )


def test_the_table_says_how_many_steps_drafted_trees():
    assert report._trees({"tree_steps": 3, "tree_nodes": 24}) == " | trees: 3 steps, 8.0 nodes each"
    assert report._trees({"tree_steps": 0, "tree_nodes": 0}) == report._trees({"tree_steps": None}) == ""


@pytest.mark.parametrize("gamma, want", [("auto", None), (3, 3)])
def test_a_presets_gamma_fixes_the_fixed_contenders_only_when_it_is_a_number(tmp_path, gamma, want):
    # A preset's gamma="auto" is what hfspec-auto runs anyway; the fixed-γ contenders then take the default.
    import argparse

    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "p", "target": "t", "draft": "d", "gamma": gamma}))
    args = argparse.Namespace(config=str(path), dtype=None, gamma=None)
    bench_command.apply_preset(args)
    assert args.gamma == want and (args.target, args.draft) == ("t", "d")
