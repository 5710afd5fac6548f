"""``hfspec distill --kind eagle3`` on a tiny Llama target: features, training, both layouts, resume, errors.

The target has 8 decoder layers (features from layers 2, 4 and 5) and a word-level
chat tokenizer, so the real prompt file and chat template stage its text.
"""

from __future__ import annotations

import json
import shutil

import pytest
import tiny
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfspec import SpeculativeGenerator
from hfspec.commands import cli
from hfspec.heads.checkpoint import load_head
from hfspec.models.adapter import hidden_features
from hfspec.training import eagle3_card, eagle3_data, eagle3_ttt, optim
from hfspec.training.eagle3 import Eagle3Report, parse_layer_ids, train_eagle3_head
from hfspec.training.eagle3_data import draft_vocabulary

SMALL = dict(
    draft_vocab=100,
    unroll=3,
    tokens=600,
    eval_tokens=150,
    seq_len=12,
    gen_batch=8,
    top_k=8,
    batch=8,
    steps=60,
    lr=1e-2,
    progress=False,
)
LAYERS = (2, 4, 5)  # default_layer_ids(8)


@pytest.fixture(scope="module")
def target8(tmp_path_factory):
    return tiny.chat_target(tmp_path_factory.mktemp("target8"), layers=8, sharpness=10.0)


@pytest.fixture(scope="module")
def trained(target8, tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    return out, train_eagle3_head(target8, out, **SMALL)


def load_target(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


# -- staging ------------------------------------------------------------------------------------


def test_features_are_the_target_hidden_states_of_each_staged_sample(target8, trained):
    out, _ = trained
    target, _ = load_target(target8)
    for split in ("train", "eval"):
        shards = sorted((out / "data").glob(f"{split}-*.pt"))
        assert shards and [p.name for p in shards] == sorted(p.name for p in (out / "features").glob(f"{split}-*"))
    feats = torch.load(out / "features" / shards[0].name)
    samples = torch.load(shards[0])["samples"]
    assert feats["layer_ids"] == list(LAYERS) and feats["values"].dtype == torch.bfloat16
    for i in (0, len(samples) - 1):
        ids = torch.cat([samples[i]["prompt"], samples[i]["gen"]]).long()[None]
        with torch.no_grad():
            hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
        want = torch.cat([hidden[j] for j in LAYERS], dim=-1)[0, : ids.shape[1] - 2]  # positions 0..L-3
        got = feats["values"][feats["offsets"][i] : feats["offsets"][i + 1]].float()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0.02 * float(want.abs().max()), rtol=0.02)


def test_hidden_features_skip_nothing_they_return(target8):
    target, _ = load_target(target8)
    ids = torch.randint(3, 160, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        hidden = target(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for layers in (LAYERS, (0, 7)):
        want = torch.cat([hidden[j] for j in layers], dim=-1)
        torch.testing.assert_close(hidden_features(target, ids, mask, layers), want)


def test_draft_vocabulary_is_the_most_frequent_generated_tokens_sorted():
    samples = [
        {"prompt": torch.tensor([9, 9, 9, 9]), "gen": torch.tensor([5, 3, 5, 7])},
        {"prompt": torch.tensor([9]), "gen": torch.tensor([7, 5, 1])},
    ]
    assert draft_vocabulary(samples, 2, 10).tolist() == [5, 7]  # 9 only occurs in prompts
    assert draft_vocabulary(samples, 4, 10).tolist() == [1, 3, 5, 7]  # ties: the lower id first
    assert draft_vocabulary(samples, 5, 10).tolist() == [0, 1, 3, 5, 7]  # then unseen ids, lowest first


# -- training -----------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 4])
def test_fast_unroll_equals_the_heads_training_time_test(target8, trained, steps):
    out, _ = trained
    target, _ = load_target(target8)
    split = eagle3_data.StagedSplit(out / "data", out / "features", "train", LAYERS)
    vocab = torch.arange(3, 103)
    t2d = torch.full((160,), -1)
    t2d[vocab] = torch.arange(100)
    head = eagle3_ttt.build_head(target, vocab, LAYERS, seed=0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    batch = eagle3_data.make_batch(split, [0, 3, 7], t2d, steps)
    width = batch.valid.shape[1]
    fused = head.fuse(batch.features)
    embeds = eagle3_data.embed_tokens(batch, target.get_input_embeddings().weight.detach(), width, steps)
    fast = eagle3_ttt.unrolled(head, fused, embeds, batch.valid, batch.active, steps)
    reference = head.unroll(fused, embeds, steps, batch.valid)  # per step (B, T, Vd)
    rows, cols = batch.active.nonzero(as_tuple=True)
    for k in range(steps):
        torch.testing.assert_close(head.logits(fast[k]), reference[k][rows, cols], atol=1e-4, rtol=1e-4)
    # Labels: step k at column j predicts the token at j + k + 2; every generated token it can reach is one.
    sample, offset = split.samples[3], len(split.samples[0]["gen"])  # row 1 of the batch
    prompt, gen = len(sample["prompt"]), len(sample["gen"])
    for k, labels in enumerate(batch.labels):
        mine = rows[labels.index] == 1
        t = labels.gen_pos[mine] - offset
        assert t.tolist() == list(range(max(0, k + 2 - prompt), gen))
        j = cols[labels.index][mine]
        assert torch.equal(j, t + prompt - k - 2)
        assert torch.equal(batch.tokens[1, j + k + 2], sample["gen"][t].long())


def staged(trained, out):
    """``out`` holding the trained head's staged text and features (and nothing of its training)."""
    for part in ("data", "features"):
        shutil.copytree(trained[0] / part, out / part)
    return out


def test_trained_head_beats_an_untrained_one(target8, trained, tmp_path):
    _, report = trained
    # The same staged text and features: the heads' measures compare.
    untrained = train_eagle3_head(target8, staged(trained, tmp_path / "untrained"), **{**SMALL, "steps": 1, "lr": 1e-9})
    assert report.alpha > untrained.alpha + 0.2
    # The untrained head starts by passing the target's highest feature through, so it already agrees
    # often at greedy; training must still close much of the remaining gap.
    assert report.greedy_agreement > untrained.greedy_agreement + 0.5 * (1 - untrained.greedy_agreement)
    assert report.accepted_length > untrained.accepted_length
    losses = torch.load(tmp_path / "untrained" / "train" / "checkpoint.pt", weights_only=False)["losses"]
    assert len(losses) == 1


def test_report_and_written_head(target8, trained):
    out, report = trained
    assert isinstance(report, Eagle3Report)
    assert json.loads((out / "distill_report.json").read_text()) == report.to_dict()
    assert report.layer_ids == LAYERS and report.draft_vocab == 100 and report.unroll == 3
    assert len(report.alpha_by_depth) == len(report.agreement_by_depth) == 3
    assert all(0 <= a <= 1 for a in report.alpha_by_depth + report.agreement_by_depth)
    assert 0 < report.vocab_coverage <= 1 and 0 < report.argmax_coverage <= 1
    assert report.cost_ratio > 0 and report.steps == SMALL["steps"] and report.train_tokens >= SMALL["tokens"]
    assert report.head_bytes == (out / "model.safetensors").stat().st_size
    assert [c[0] for c in report.heldout] == list(range(6, 61, 6))
    conf = json.loads((out / "config.json").read_text())
    assert conf["speculators_model_type"] == "eagle3" and conf["draft_vocab_size"] == 100
    assert conf["speculators_config"]["verifier"]["name_or_path"] == str(target8)
    assert conf["eagle_aux_hidden_state_layer_ids"] is None  # the default layers: engines pick them themselves
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        d2t = f.get_tensor("d2t")
    assert "embed_tokens.weight" not in names and any(n.startswith("layers.0.") for n in names)
    vocab = torch.load(out / "train" / "vocab.pt")
    assert torch.equal(torch.arange(100) + d2t, vocab)
    head = load_head(out)
    assert head.config.draft_vocab_size == 100 and head.config.layer_ids is None


def test_model_card_says_how_the_head_was_made_and_what_it_measures(trained):
    out, report = trained
    card = eagle3_card.model_card(out, title="Tiny head", note="Trained for a tiny target.")
    assert card.startswith("# Tiny head\n") and "Trained for a tiny target." in card
    for value in (
        f"{report.train_tokens:,} tokens",
        f"{report.steps:,} steps",
        f"{report.alpha_by_depth[2]:.3f}",
        f"{report.cost_ratio:.3f}",
        "3 unrolled draft steps",
        "100 most frequent generated tokens",
    ):
        assert value in card, value


def test_head_drives_exact_greedy_decoding_in_both_layouts(target8, trained, tmp_path, monkeypatch):
    out = tmp_path / "head"
    shutil.copytree(trained[0], out)
    target, tok = load_target(target8)
    # Writing the other layout reuses the finished training: nothing is retrained or staged again.
    monkeypatch.setattr(eagle3_data, "_shard_features", lambda *a, **k: pytest.fail("features were staged again"))
    monkeypatch.setattr(eagle3_ttt, "loss", lambda *a, **k: pytest.fail("the head was trained again"))
    eagle = train_eagle3_head(target8, out, **SMALL, format="eagle")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["draft_vocab_size"] == 100
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert any(n.startswith("midlayer.") for n in f.keys())
    assert eagle.format == "eagle"
    gen = SpeculativeGenerator(target, str(out), tok)
    accepted = 0
    for prompt in ([3, 4, 0, 7, 2, 3, 5], [3, 11, 12, 13, 2, 3, 5, 20]):
        ids = torch.tensor([prompt])
        want = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        result = gen.generate([prompt], max_new_tokens=16, gamma=3, eos_token_id=[])
        assert result.sequences[0, result.prompt_length : result.prompt_length + 16].tolist() == want
        accepted += result.stats.accepted
    assert accepted > 0


def test_resume_continues_training_without_restaging(target8, trained, tmp_path, monkeypatch):
    out = staged(trained, tmp_path / "head")
    real_loss = eagle3_ttt.loss
    monkeypatch.setattr(eagle3_ttt, "loss", tiny.fail_after(real_loss, 25))
    with pytest.raises(KeyboardInterrupt):
        train_eagle3_head(target8, out, **SMALL)
    first = torch.load(out / "train" / "checkpoint.pt", weights_only=False)
    assert first["step"] == 24  # the last check before the interruption

    monkeypatch.setattr(eagle3_ttt, "loss", real_loss)
    monkeypatch.setattr(eagle3_data, "_shard_features", lambda *a, **k: pytest.fail("features were staged again"))
    starts = []
    real_lr = optim.learning_rate
    monkeypatch.setattr(optim, "learning_rate", lambda step, s: starts.append(step) or real_lr(step, s))
    report = train_eagle3_head(target8, out, **SMALL)
    assert starts[0] == 24 and report.steps == SMALL["steps"]
    final = torch.load(out / "train" / "checkpoint.pt", weights_only=False)
    assert final["losses"][:24] == first["losses"]
    with pytest.raises(ValueError, match="different unroll"):
        train_eagle3_head(target8, out, **{**SMALL, "unroll": 2})


def test_features_are_staged_once_and_shared(target8, tmp_path, monkeypatch):
    out = tmp_path / "head"
    assert train_eagle3_head(target8, out, **SMALL, data_only=True) is None
    assert list((out / "features").glob("train-*.pt")) and not (out / "train" / "checkpoint.pt").exists()
    assert not list((out / "features").glob(".*"))
    lost = sorted((out / "features").glob("train-*.pt"))[1]
    lost.unlink()
    made = []
    real = eagle3_data._shard_features
    monkeypatch.setattr(eagle3_data, "_shard_features", lambda *a, **k: made.append(1) or real(*a, **k))
    train_eagle3_head(target8, out, **SMALL, data_only=True)
    assert len(made) == 1 and lost.is_file()
    with pytest.raises(ValueError, match="features of target layers"):
        train_eagle3_head(target8, out, **SMALL, data_only=True, layer_ids=(1, 3))


# -- bad input ----------------------------------------------------------------------------------


def test_bad_arguments_are_rejected(target8, tmp_path):
    with pytest.raises(ValueError, match="must not exceed the target vocabulary"):
        train_eagle3_head(target8, tmp_path / "a", **{**SMALL, "draft_vocab": 161})
    with pytest.raises(ValueError, match="format must be one of"):
        train_eagle3_head(target8, tmp_path / "a", **SMALL, format="gguf")
    with pytest.raises(ValueError, match="strictly increasing"):
        train_eagle3_head(target8, tmp_path / "a", **SMALL, layer_ids=(2, 8))
    with pytest.raises(ValueError, match="positive"):
        train_eagle3_head(target8, tmp_path / "a", **{**SMALL, "unroll": 0})
    two_layers = tiny.chat_target(tmp_path / "two", layers=2)
    with pytest.raises(ValueError, match="3 or more"):
        train_eagle3_head(two_layers, tmp_path / "b", **SMALL)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_layer_ids("2,x")
    assert parse_layer_ids("2, 15,27") == (2, 15, 27)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kind", "eagle3", "--hidden", "64"], "--hidden only apply to --kind model"),
        (["--kind", "eagle3", "--negatives", "0", "--init-from", "x"], "--negatives, --init-from only apply"),
        (["--draft-vocab", "64"], "--draft-vocab only apply to --kind eagle3"),
        (["--kind", "eagle3", "--format", "gguf"], "invalid choice: 'gguf'"),
        (["--kind", "eagle3", "--layer-ids", "5,2"], "strictly increasing"),
        (["--kind", "eagle3", "--draft-vocab", "100000"], "must not exceed the target vocabulary"),
    ],
)
def test_cli_refuses_flags_that_do_not_apply(target8, tmp_path, capsys, argv, message):
    capsys.readouterr()
    code = cli.main(["distill", "--target", str(target8), "--out", str(tmp_path / "x"), "--quiet", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("hfspec: error: ") and message in err[0], err
