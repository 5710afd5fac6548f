"""train_draft_model() on a tiny random Llama target: it trains, saves, reports and resumes."""

from __future__ import annotations

import argparse
import json

import pytest
import tiny
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hfspec.training import command, draft_objective, optim, staging
from hfspec.training import report as report_mod
from hfspec.training.draft_model import DraftModelReport, train_draft_model
from hfspec.training.report import speedup_at_best_gamma


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A 2-layer Llama (vocab 160, hidden 32) with a word-level chat tokenizer, saved by path."""
    return tiny.chat_target(tmp_path_factory.mktemp("tiny-target"), layers=2)


SMALL = dict(
    hidden=16,
    layers=1,
    heads=2,
    tokens=600,
    eval_tokens=150,
    seq_len=12,
    gen_batch=8,
    top_k=8,
    batch=8,
    steps=40,
    lr=1e-2,
    progress=False,
)


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    """A draft trained with SMALL once: (its directory, its report); the tests only read it."""
    out = tmp_path_factory.mktemp("trained") / "draft"
    return out, train_draft_model(tiny_target, out, **SMALL)


def test_distill_trains_saves_and_reports(trained):
    out, report = trained

    assert isinstance(report, DraftModelReport)
    losses = torch.load(out / "train" / "checkpoint.pt", weights_only=False)["losses"]
    assert len(losses) == SMALL["steps"]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, "training loss did not go down"

    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert isinstance(draft, LlamaForCausalLM)
    assert draft.config.vocab_size == 160 and draft.config.hidden_size == 16
    assert draft.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and len(tokenizer) == 160

    assert 0.0 <= report.alpha <= 1.0 and 0.0 <= report.greedy_agreement <= 1.0
    assert report.cost_ratio > 0 and report.draft_step_ms > 0 and report.target_step_ms > 0
    assert report.speedup_sampled > 0 and 1 <= report.gamma_sampled <= 8
    assert report.speedup_greedy > 0 and 1 <= report.gamma_greedy <= 8
    assert report.train_tokens >= SMALL["tokens"] and report.eval_tokens >= SMALL["eval_tokens"]
    assert json.loads((out / "distill_report.json").read_text()) == report.to_dict()


def test_distill_beats_untrained_draft(tiny_target, trained, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "data").symlink_to(trained[0] / "data")  # the same data, so the alphas compare
    untrained = train_draft_model(tiny_target, tmp_path / "a", **{**SMALL, "steps": 1, "lr": 1e-6})
    assert trained[1].alpha > untrained.alpha + 0.05


def test_resume_continues_data_and_training(tiny_target, tmp_path, monkeypatch):
    out = tmp_path / "draft"
    real_loss = draft_objective.distill_loss
    monkeypatch.setattr(draft_objective, "distill_loss", tiny.fail_after(real_loss, 25))
    with pytest.raises(KeyboardInterrupt):
        train_draft_model(tiny_target, out, **SMALL)
    first = torch.load(out / "train" / "checkpoint.pt", weights_only=False)
    assert 0 < first["step"] < SMALL["steps"]
    shards = sorted(p.name for p in (out / "data").glob("*.pt"))

    # Rerunning must neither regenerate data nor restart training.
    monkeypatch.setattr(draft_objective, "distill_loss", real_loss)
    monkeypatch.setattr(staging, "_generate_shard", lambda *a, **k: pytest.fail("data was regenerated"))
    steps_before = []
    real_train_step = optim.learning_rate
    monkeypatch.setattr(optim, "learning_rate", lambda step, s: steps_before.append(step) or real_train_step(step, s))
    report = train_draft_model(tiny_target, out, **SMALL)

    assert steps_before[0] == first["step"]
    assert report.steps == SMALL["steps"]
    assert sorted(p.name for p in (out / "data").glob("*.pt")) == shards
    final = torch.load(out / "train" / "checkpoint.pt", weights_only=False)
    assert final["losses"][: first["step"]] == first["losses"]


def test_resume_refuses_a_different_architecture(tiny_target, tmp_path):
    out = tmp_path / "draft"
    train_draft_model(tiny_target, out, **{**SMALL, "steps": 2})
    with pytest.raises(ValueError, match="different hidden"):
        train_draft_model(tiny_target, out, **{**SMALL, "steps": 2, "hidden": 8})


def test_init_from_starts_where_an_earlier_draft_ended(tiny_target, trained, tmp_path):
    a, first = trained
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "data").symlink_to(a / "data")  # same data, so the losses compare
    more = train_draft_model(tiny_target, tmp_path / "b", **{**SMALL, "steps": 10}, init_from=a)
    fresh_losses = torch.load(a / "train" / "checkpoint.pt", weights_only=False)["losses"]
    warm_losses = torch.load(tmp_path / "b" / "train" / "checkpoint.pt", weights_only=False)["losses"]
    # The warm start begins near the end of the first run, far below a fresh start.
    assert warm_losses[0] < 0.8 * fresh_losses[0]
    assert abs(warm_losses[0] - sum(fresh_losses[-5:]) / 5) < 0.3 * fresh_losses[0]
    assert more.alpha > first.alpha - 0.1
    assert json.loads((tmp_path / "b" / "train" / "settings.json").read_text())["init_from"] == str(a.resolve())


def test_init_from_refuses_a_different_architecture(tiny_target, trained, tmp_path):
    with pytest.raises(ValueError, match="hidden_size 16 vs 8"):
        train_draft_model(tiny_target, tmp_path / "b", **{**SMALL, "steps": 2, "hidden": 8}, init_from=trained[0])
    with pytest.raises(ValueError, match="config.json"):
        train_draft_model(tiny_target, tmp_path / "c", **SMALL, init_from=tmp_path / "missing")


def test_staged_acceptance_matches_the_target_forward_when_top_k_is_the_vocabulary(tiny_target, tmp_path):
    out = tmp_path / "draft"
    train_draft_model(tiny_target, out, **{**SMALL, "top_k": 160, "steps": 10})
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    samples = staging.load_samples(out / "data", "eval")
    pad = AutoTokenizer.from_pretrained(tiny_target).pad_token_id
    alpha, agreement, _ = draft_objective.acceptance(target, draft, samples, pad, 8)
    staged_alpha, staged_agreement = draft_objective.staged_acceptance(draft, samples, pad, 8)
    assert staged_alpha == pytest.approx(alpha, abs=2e-3)  # top-k log-probs are stored in float16
    assert staged_agreement == pytest.approx(agreement, abs=0.02)


def test_the_draft_kept_is_the_best_held_out_check(tiny_target, trained, tmp_path, monkeypatch):
    scores = iter([0.2, 0.5, 0.3, 0.1])  # checks at steps 10, 20, 30, 40: the second is best

    def scripted(draft, samples, pad, batch):
        return next(scores), 0.0

    monkeypatch.setattr(draft_objective, "staged_acceptance", scripted)
    out = tmp_path / "draft"
    out.mkdir()
    (out / "data").symlink_to(trained[0] / "data")  # the data SMALL stages, staged once
    report = train_draft_model(tiny_target, out, **{**SMALL, "eval_every": 10})
    assert report.best_step == 20
    assert [c[:2] for c in report.heldout] == [(10, 0.2), (20, 0.5), (30, 0.3), (40, 0.1)]
    best = torch.load(out / "train" / "checkpoint.pt", weights_only=False)["best"]
    assert best[0] == 20
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, weight in best[2].items():
        assert torch.equal(saved[name], weight.to(torch.float16).float()), name
    last = torch.load(out / "train" / "checkpoint.pt", weights_only=False)["model"]
    assert not torch.equal(last["model.norm.weight"], best[2]["model.norm.weight"])


def test_bad_arguments_are_rejected(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="divisible"):
        train_draft_model(tiny_target, tmp_path, hidden=30, heads=4, progress=False)
    with pytest.raises(ValueError, match="positive"):
        train_draft_model(tiny_target, tmp_path, steps=0, progress=False)
    with pytest.raises(ValueError, match="config.json"):
        train_draft_model(tmp_path / "missing", tmp_path / "out", progress=False)


def test_speedup_at_best_gamma_matches_leviathan():
    # alpha = 0 accepts nothing: best is gamma = 1, speedup 1 / (c + 1).
    assert speedup_at_best_gamma(0.0, 0.1) == pytest.approx((1 / 1.1, 1))
    # alpha = 1 with free drafts: every draft accepted, the longest gamma wins.
    assert speedup_at_best_gamma(1.0, 0.0) == pytest.approx((9.0, 8))
    speedup, gamma = speedup_at_best_gamma(0.8, 0.05)
    expected = max((1 - 0.8 ** (g + 1)) / ((1 - 0.8) * (g * 0.05 + 1)) for g in range(1, 9))
    assert speedup == pytest.approx(expected) and 1 <= gamma <= 8
    with pytest.raises(ValueError):
        speedup_at_best_gamma(1.5, 0.1)


def test_cli_parser_registers_distill():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    command.add_parser(sub)
    args = parser.parse_args(["distill", "--target", "offline", "--out", "x", "--hidden", "64", "--no-resume"])
    assert args.func is command.run
    assert args.target == "offline" and args.hidden == 64 and args.resume is False


def test_candidate_logits_keep_targets_and_estimate_the_normaliser():
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 5000, 8
    weight = 0.3 * torch.randn(vocab, hidden, generator=gen)
    h = torch.randn(6, hidden, generator=gen)
    top_ids = torch.randint(vocab, (6, 4), generator=gen)
    token = top_ids[:, 0]
    logits, top_idx, token_idx = draft_objective.candidate_logits(h, weight, top_ids, token, 1000, gen)
    assert logits.shape[0] == 6 and logits.shape[1] < vocab
    full = h @ weight.T
    # Re-indexed ids point at the same logits as in the full vocabulary.
    assert torch.allclose(logits.gather(-1, top_idx), full.gather(-1, top_ids))
    assert torch.allclose(logits.gather(-1, token_idx[:, None]), full.gather(-1, token[:, None]))
    # The corrected normaliser is close to the full one.
    assert torch.allclose(logits.logsumexp(-1), full.logsumexp(-1), atol=0.1)
    # Zero negatives means the full vocabulary.
    logits, top_idx, _ = draft_objective.candidate_logits(h, weight, top_ids, token, 0, gen)
    assert logits.shape == (6, vocab) and torch.equal(top_idx, top_ids)


def test_claim_skips_live_locks_and_takes_over_stale_ones(tmp_path):
    import os

    live = tmp_path / ".train-00000.lock"
    live.write_text(str(os.getpid()))
    assert not staging.claim_lock(live)
    stale = tmp_path / ".train-00001.lock"
    stale.write_text("999999999")
    assert staging.claim_lock(stale)
    assert stale.read_text() == str(os.getpid())
    fresh = tmp_path / ".train-00002.lock"
    assert staging.claim_lock(fresh) and not staging.claim_lock(fresh)


def test_data_only_stages_shards_and_stops(tiny_target, tmp_path):
    out = tmp_path / "draft"
    assert train_draft_model(tiny_target, out, data_only=True, **SMALL) is None
    assert list((out / "data").glob("train-*.pt")) and list((out / "data").glob("eval-*.pt"))
    assert not (out / "train" / "checkpoint.pt").exists()
    assert not list((out / "data").glob(".*.lock"))


def test_decode_step_seconds_times_each_model(tiny_target):
    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    small = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=160,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    times = report_mod.decode_step_seconds(target, small, steps=4, warmup=1)
    assert len(times) == 2 and all(t > 0 for t in times)


def test_decode_step_seconds_waits_for_each_models_device(tiny_target, monkeypatch):
    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    devices = []
    real = report_mod.timed
    monkeypatch.setattr(report_mod, "timed", lambda fn, device=None: devices.append(device) or real(fn, device))
    report_mod.decode_step_seconds(target, steps=3, warmup=2)
    assert devices == [target.device] * 5


def test_staging_counts_every_shard_and_fills_gaps(tiny_target, tmp_path, monkeypatch):
    out = tmp_path / "draft"
    train_draft_model(tiny_target, out, data_only=True, **SMALL)
    data = out / "data"
    shards = sorted(data.glob("train-*.pt"))
    sizes = {p.name: torch.load(p)["tokens"] for p in shards}
    # A shard lost by a dead process leaves a gap: only that shard is generated again.
    shards[1].unlink()
    (data / f".{shards[1].stem}.lock").write_text("999999999")
    made = []
    real = staging._generate_shard
    monkeypatch.setattr(staging, "_generate_shard", lambda *a, **k: made.append(1) or real(*a, **k))
    train_draft_model(tiny_target, out, data_only=True, **{**SMALL, "tokens": sum(sizes.values())})
    assert len(made) == 1 and shards[1].is_file()
    assert torch.load(shards[1])["tokens"] == sizes[shards[1].name]
