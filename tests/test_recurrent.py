"""Recurrent and hybrid caches: exact rollback, greedy equivalence, one row at a time, refusals.

Tiny random models of each family (see tiny.recurrent_config). The rollback of a recurrent
state is checked against a fresh forward at the cache level, for both the adapter and the
generic path, then end to end: greedy output equals the target's own generate().
"""

from __future__ import annotations

import pytest
import tiny
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hfspec import HfspecError, SpeculativeGenerator
from hfspec.measure.costs import RollbackCost, rollback_cost
from hfspec.models.adapter import forward
from hfspec.models.kv_cache import KVState
from hfspec.models.recurrent import RecurrentState

V = 48
MAMBA1 = ("mamba", "falcon_mamba", "jamba")  # exact as drafts; refused as targets
TARGETS = tuple(a for a in tiny.RECURRENT if a not in MAMBA1)
GENERIC_ONLY = ("kimi_linear",)  # no adapter: always the generic path
# The full check (FULL_RUNS) for these; one prompt at γ = 4 for the others.
FULL = ("mamba", "jamba", "falcon_h1", "qwen3_next", "bamba")
# (prompt length, γ): prompts of 1, 6 and 13 tokens at γ = 4. In each test these three runs replay every kept length
# that γ = 1 on the same prompts did as well (γ = 1 with a recurrent target and draft: the Mamba-1 catch-up below).
FULL_RUNS = ((1, 4), (6, 4), (13, 4))
# 18 new tokens: every prompt runs past the Mamba-2 chunk (8), each test still replays every kept length it did with
# 24, and together they see every kept length that 40 did (draft keeps 0 to 3, target keeps 1 to 5).
NEW = 18
# The sliding-window prompt (20 tokens) is past the window (4) already: 12 new tokens keep every number of columns, at
# every γ, that 24 kept.
WINDOW_NEW = 12


@pytest.fixture(scope="module")
def load(model_dir):
    """``load(arch, seed=0, **kw)`` -> a tiny model without EOS (every run makes all NEW tokens), and its tokenizer."""
    loaded: dict[tuple, tuple] = {}

    def make(arch: str, seed: int = 0, **kwargs):
        key = (arch, seed, tuple(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = tiny.load(model_dir(arch, vocab_size=V, seed=seed, eos=None, **kwargs))
        return loaded[key]

    return make


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(tiny.BOS + 6, V, (1, n), generator=torch.Generator().manual_seed(seed + n))


def reference(model, ids: torch.Tensor, n: int = NEW, **kwargs) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kwargs)


# Three tokens allowed (the same processing on both sides): unrelated random models then agree
# often enough that steps keep every number of drafts, so replays of every length happen.
SUPPRESS = [t for t in range(V) if t not in (10, 11, 12)]
_GREEDY: dict[tuple, torch.Tensor] = {}  # (target, prompt length) -> its output: a target serves several tests


def greedy_reference(target, n: int) -> torch.Tensor:
    """The target's own greedy output for ``prompt(n)`` with SUPPRESS, generated once per target."""
    if (target, n) not in _GREEDY:
        _GREEDY[(target, n)] = reference(target, prompt(n), suppress_tokens=SUPPRESS)
    return _GREEDY[(target, n)]


def assert_greedy_equal(target, draft, tok, label: str, full: bool = True) -> None:
    gen = SpeculativeGenerator(target, draft, tok)
    accepted = drafted = 0
    for n, gamma in FULL_RUNS if full else ((6, 4),):
        got = gen.generate(prompt(n), max_new_tokens=NEW, gamma=gamma, eos_token_id=[], suppress_tokens=SUPPRESS)
        assert torch.equal(got.sequences, greedy_reference(target, n)), f"{label}, prompt of {n}, γ={gamma}"
        accepted, drafted = accepted + got.stats.accepted, drafted + got.stats.drafted
    if full:  # (one prompt may happen to agree always or never; the cache-level tests cover every keep)
        assert 0 < accepted < drafted, f"{label}: drafts all accepted or all rejected; replays not exercised"


# -- the reference itself ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", tiny.RECURRENT)
def test_target_generate_follows_the_full_forward(arch, load):
    # generate() is the reference: its cached greedy steps must match argmax of uncached forwards.
    model, _ = load(arch)
    ids = prompt(6)
    out = reference(model, ids, 8)
    for i in range(8):
        logits = model(out[:, : ids.shape[1] + i], use_cache=False).logits[:, -1]
        assert int(logits.argmax()) == int(out[0, ids.shape[1] + i]), f"{arch}: step {i}"


# -- rollback at the cache level ------------------------------------------------------------------


def rolled_back_logits(model, kv: KVState, past: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed ``past`` tokens, snapshot, feed 5 more, keep ``keep`` of them; then (logits of one more token,
    the same logits from an uncached forward over everything kept)."""
    seq = prompt(past + 6, seed=7)
    if past:
        forward(
            model,
            seq[:, :past],
            kv.extend_mask(torch.ones(1, past, dtype=torch.long)),
            torch.arange(past)[None],
            kv.cache,
        )
    kv.snapshot()
    block = seq[:, past : past + 5]
    # A draft feeds one token per forward after its snapshot, a verification all of them at once.
    step = 1 if kv.serial else 5
    for s in range(0, 5, step):
        forward(
            model,
            block[:, s : s + step],
            kv.extend_mask(torch.ones(1, step, dtype=torch.long)),
            torch.arange(past + s, past + s + step)[None],
            kv.cache,
        )
    kv.keep(torch.tensor([keep]), past, block)
    kv.check(torch.tensor([past + keep]), "model")
    nxt = seq[:, -1:]
    got = forward(
        model, nxt, kv.extend_mask(torch.ones(1, 1, dtype=torch.long)), torch.tensor([[past + keep]]), kv.cache
    )[:, -1]
    kept = torch.cat([seq[:, : past + keep], nxt], dim=1)
    want = model(kept, use_cache=False).logits[:, -1].float()
    return got, want


@pytest.mark.parametrize("mechanism", ["adapter", "generic"])
@pytest.mark.parametrize("arch", tiny.RECURRENT)
def test_rollback_leaves_the_state_of_a_fresh_forward(arch, mechanism, load):
    model, _ = load(arch)
    expected = "generic" if arch in GENERIC_ONLY else mechanism
    for past, keep in ((6, 0), (6, 2), (6, 5), (0, 3)):  # past 0: the snapshot of an empty cache
        kv = KVState(1, torch.device("cpu"), model, adapter=mechanism == "adapter")
        assert kv.recurrent.mechanism == expected
        got, want = rolled_back_logits(model, kv, past, keep)
        assert torch.allclose(got, want, atol=1e-4), f"{arch} {mechanism}: past {past}, keep {keep}"


@pytest.mark.parametrize("mechanism", ["adapter", "generic"])
def test_negative_control_a_restore_without_replay_is_detected(mechanism, load, monkeypatch):
    model, _ = load("falcon_h1")
    monkeypatch.setattr(RecurrentState, "_replay_mixers", lambda self, keep: None)
    monkeypatch.setattr(RecurrentState, "_replay_tokens", lambda self, ids, start, mask: None)
    kv = KVState(1, torch.device("cpu"), model, adapter=mechanism == "adapter")
    if mechanism == "generic":  # the attention layers were cropped to the snapshot: the invariant check fails
        with pytest.raises(AssertionError, match="cache holds 6 positions but its mask 8"):
            rolled_back_logits(model, kv, 6, 2)
        return
    got, want = rolled_back_logits(model, kv, 6, 2)  # the attention layers are right, the recurrent state not
    assert not torch.allclose(got, want, atol=1e-4)


def test_mixer_hooks_do_not_outlive_a_rollback(load):
    model, _ = load("qwen3_next")
    kv = KVState(1, torch.device("cpu"), model)
    rolled_back_logits(model, kv, 6, 2)
    assert all(not m._forward_pre_hooks for m in model.modules())


# -- greedy equivalence end to end ----------------------------------------------------------------


@pytest.mark.parametrize("arch", TARGETS)
def test_recurrent_target_equals_its_greedy_generate(arch, load):
    target, tok = load(arch)
    draft, _ = load("llama", seed=3)
    assert_greedy_equal(target, draft, tok, f"{arch} target, llama draft", full=arch in FULL)


@pytest.mark.parametrize("arch", tiny.RECURRENT)
def test_recurrent_draft_keeps_the_target_exact(arch, load):
    target, tok = load("llama", seed=3)
    draft, _ = load(arch)
    assert_greedy_equal(target, draft, tok, f"llama target, {arch} draft", full=arch in FULL)


@pytest.mark.parametrize(
    "target_arch, draft_arch",
    [
        ("falcon_h1", "mamba"),
        ("qwen3_next", "falcon_h1"),
        ("bamba", "jamba"),
    ],
)
def test_recurrent_target_with_recurrent_draft(target_arch, draft_arch, load):
    target, tok = load(target_arch)
    draft, _ = load(draft_arch, seed=1)
    assert_greedy_equal(target, draft, tok, f"{target_arch} target, {draft_arch} draft")


def test_draft_equal_to_target_accepts_everything(load):
    # Every step fully accepted: the draft catches up on two tokens at once, nothing is replayed.
    target, tok = load("falcon_h1")
    ids = prompt(6)
    out = SpeculativeGenerator(target, target, tok).generate(ids, max_new_tokens=20, gamma=4, eos_token_id=[])
    assert out.stats.acceptance_rate == 1.0
    assert torch.equal(out.sequences, reference(target, ids, 20))


def test_a_mamba1_draft_catches_up_one_token_at_a_time(load, monkeypatch):
    # Only two tokens allowed: the mamba draft often agrees with the target, and each fully accepted
    # step leaves it two tokens to catch up on, which its state can only take one at a time.
    target, tok = load("falcon_h1")
    draft, _ = load("mamba")
    suppress = [t for t in range(V) if t not in (10, 11)]
    widths = []
    original = KVState.extend_mask

    def extend_mask(self, valid):
        if self.serial:
            widths.append(valid.shape[1])
        return original(self, valid)

    monkeypatch.setattr(KVState, "extend_mask", extend_mask)
    ids = prompt(13)
    out = SpeculativeGenerator(target, draft, tok).generate(
        ids, max_new_tokens=NEW, gamma=1, eos_token_id=[], suppress_tokens=suppress
    )
    want = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, suppress_tokens=suppress
    )
    assert torch.equal(out.sequences, want)
    assert out.stats.accepted > 0, "no draft accepted: no catch-up of two tokens was exercised"
    assert widths[0] == 13 and set(widths[1:]) == {1}, "after the prompt, the mamba draft is fed one token at a time"


# -- batches run one row at a time ----------------------------------------------------------------


def test_ragged_batch_rows_equal_each_prompt_alone(model_dir):
    target, tok = tiny.load(model_dir("qwen3_next", vocab_size=16, seed=0))
    draft, _ = tiny.load(model_dir("mamba", vocab_size=16, seed=1))
    lengths = (1, 3, 17, 6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(7, 16, (n,), generator=g).tolist() for n in lengths]
    eos = reference(target, torch.tensor([prompts[2]]), 8)[0, -3].item()  # makes row 2 stop early
    want = [reference(target, torch.tensor([p]), 30)[0, len(p) :] for p in prompts]
    want = [w[: (w == eos).nonzero()[0, 0] + 1] if (w == eos).any() else w for w in want]
    assert any(len(w) < 30 for w in want), "no row stops early; the test would not cover it"
    out = SpeculativeGenerator(target, draft, tok).generate(prompts, max_new_tokens=30, gamma=3, eos_token_id=eos)
    width = max(lengths)
    assert out.prompt_length == width
    for b, (p, w) in enumerate(zip(prompts, want)):
        row = out.sequences[b]
        assert row[: width - len(p)].eq(tiny.PAD).all() and row[width - len(p) : width].tolist() == p
        new = row[width:]
        assert torch.equal(new[: len(w)], w) and new[len(w) :].eq(tiny.PAD).all()
        assert out.stats.rows[b].committed == len(w)
    assert out.stats.committed == sum(len(w) for w in want)
    assert len(out.stats.rows) == len(prompts)


def test_sampled_rows_share_one_generator(load):
    # Rows run one after another from the same generator: identical prompts still get different samples,
    # and the same seed gives the same batch.
    target, tok = load("falcon_h1")
    draft, _ = load("mamba", seed=1)
    gen = SpeculativeGenerator(target, draft, tok)
    a = gen.generate([[7, 8, 9]] * 4, max_new_tokens=12, gamma=3, do_sample=True, seed=3)
    b = gen.generate([[7, 8, 9]] * 4, max_new_tokens=12, gamma=3, do_sample=True, seed=3)
    assert torch.equal(a.sequences, b.sequences)
    assert len({tuple(r) for r in a.sequences.tolist()}) > 1


# -- sliding windows, prompts longer than the window ------------------------------------------------


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("mistral", {}),
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 0}),
        ("gemma2", {}),
        ("gemma3_text", {}),
        ("lfm3", {}),
    ],
)
def test_sliding_window_with_prompts_longer_than_the_window(arch, extra, load):
    target, tok = load(arch, sliding_window=4, **extra)
    assert target.config.sliding_window == 4
    draft, _ = load(arch, seed=1, sliding_window=4, **extra)
    gen = SpeculativeGenerator(target, draft, tok)
    ids = prompt(20)
    want = reference(target, ids, WINDOW_NEW)
    for gamma in (1, 4):
        got = gen.generate(ids, max_new_tokens=WINDOW_NEW, gamma=gamma)
        assert torch.equal(got.sequences, want), (arch, gamma)


# -- refusals, before any generation ----------------------------------------------------------------


@pytest.mark.parametrize("arch", MAMBA1)
def test_mamba1_target_is_refused_with_the_reason_and_what_works(arch, load):
    target, tok = load(arch)
    draft, _ = load("llama", seed=3)
    with pytest.raises(HfspecError, match=rf"target \({arch}\).*Mamba-1 scan.*target\.generate\(\)") as err:
        SpeculativeGenerator(target, draft, tok)
    assert "Mixer" in str(err.value) and "draft" in str(err.value)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_state_kept_inside_modules_is_refused(role, load):
    model, tok = load("recurrent_gemma")
    other, _ = load("llama", seed=3)
    pair = (model, other) if role == "target" else (other, model)
    with pytest.raises(HfspecError, match=rf"the {role} \(recurrent_gemma\).*inside its modules.*target\.generate\(\)"):
        SpeculativeGenerator(*pair, tok)


@pytest.mark.parametrize(
    "arch, sizes",
    [
        (
            "rwkv",
            dict(
                hidden_size=16, num_hidden_layers=2, attention_hidden_size=16, intermediate_size=32, context_length=64
            ),
        ),
        ("xlstm", dict(hidden_size=32, num_hidden_layers=2, num_heads=4)),
    ],
)
def test_state_outside_the_cache_is_refused(arch, sizes):
    target = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, vocab_size=V, **sizes))
    with pytest.raises(HfspecError, match=rf"target \({arch}\) keeps its recurrent state outside transformers' Cache"):
        SpeculativeGenerator(target, target)


@pytest.mark.parametrize("kind, message", [("indexed_attention", "DynamicIndexedLayer"), ("made_up", "'made_up'")])
def test_cache_layer_that_cannot_be_rolled_back_is_refused(kind, message):
    target = AutoModelForCausalLM.from_config(tiny.make_config("qwen3_next", V))
    target.config.layer_types = ["linear_attention", kind]
    with pytest.raises(HfspecError, match=rf"target \(qwen3_next\).*{message}.*target\.generate\(\)"):
        SpeculativeGenerator(target, target)


# -- what the rollback costs ------------------------------------------------------------------------


@pytest.mark.parametrize("arch, mechanism", [("falcon_h1", "adapter"), ("kimi_linear", "generic"), ("llama", "crop")])
def test_rollback_cost_reports_each_term(arch, mechanism, load):
    model, _ = load(arch)
    cost = rollback_cost(model, list(range(7, 30)), gamma=3, repeats=2)
    assert isinstance(cost, RollbackCost) and cost.mechanism == mechanism
    assert len(cost.replay) == 3 and cost.verify > 0 and cost.step_seconds > 0
    assert cost.expected(1.0) == cost.verify + cost.snapshot  # everything accepted: nothing replayed
    assert cost.expected(0.0) == pytest.approx(cost.verify + cost.snapshot + cost.replay[0])
    assert cost.worst == cost.verify + cost.snapshot + max(cost.replay)
