"""Cache rollback: exact contents, the invariant after every kind of step, long runs."""

from __future__ import annotations

import pytest
import tiny
import torch

from hfspec import SpeculativeGenerator
from hfspec.decoding.loop import Call
from hfspec.models.adapter import forward
from hfspec.models.kv_cache import KVState


@pytest.fixture(scope="module")
def pair(model_dir):
    target, tok = tiny.load(model_dir("llama", vocab_size=32, seed=0, sharpness=10.0, eos=None))
    close, _ = tiny.load(model_dir("llama", vocab_size=32, seed=0, sharpness=10.0, eos=None, perturb=0.3))
    unrelated, _ = tiny.load(model_dir("llama", vocab_size=32, seed=5, sharpness=10.0, eos=None))
    return target, {"same": target, "close": close, "unrelated": unrelated}, tok


def spy_steps(monkeypatch):
    """Record, after every step, (γ, accepted per row, target cache length, draft cache length, committed,
    committed tokens the draft has not been fed)."""
    log, verdicts = [], []
    verify, retire = Call.verify, Call.retire

    def spy_verify(self, proposal):
        verdicts.append(verify(self, proposal))
        return verdicts[-1]

    def spy_retire(self, finished, has_eos):  # the end of every step (and once before the first)
        retire(self, finished, has_eos)
        if verdicts and self.rows.active:
            drafter, lengths, verdict = self.drafter, self.rows.lengths, verdicts[-1]
            log.append(
                (
                    verdict.proposal.gamma,
                    verdict.accepted.tolist(),
                    self.kv.length,
                    drafter.kv.length,
                    lengths.tolist(),
                    (lengths - drafter.fed).tolist(),
                )
            )

    monkeypatch.setattr(Call, "verify", spy_verify)
    monkeypatch.setattr(Call, "retire", spy_retire)
    return log


@pytest.mark.parametrize("kind", ["same", "close", "unrelated"])
def test_single_row_caches_hold_exactly_the_committed_tokens(pair, kind, monkeypatch):
    target, drafts, tok = pair
    log = spy_steps(monkeypatch)
    SpeculativeGenerator(target, drafts[kind], tok).generate(
        [list(range(7, 17))], max_new_tokens=60, gamma=4, do_sample=True, seed=1
    )
    assert log
    accepted = set()
    for gamma, n, t_len, d_len, lengths, unfed in log:
        accepted.add(n[0] if n[0] in (0, gamma) else "mixed")
        assert t_len == lengths[0] - 1, "target cache must hold all committed tokens but the pending one"
        assert d_len == lengths[0] - unfed[0], "draft cache must hold exactly the committed tokens it was fed"
        assert unfed[0] == (2 if n[0] == gamma else 1), "only the pending token (and a last accepted draft) wait"
    expected = {"same": {4}, "close": {0, 4, "mixed"}, "unrelated": {0}}[kind]
    assert expected <= accepted, f"steps seen: {accepted}"


def test_invariant_check_catches_a_missing_rollback(pair, monkeypatch):
    target, drafts, tok = pair
    monkeypatch.setattr(KVState, "keep", lambda self, keep, start, ids=None, path=None: None)
    with pytest.raises(AssertionError, match="cache"):
        SpeculativeGenerator(target, drafts["unrelated"], tok).generate([[7, 8, 9]], max_new_tokens=10, gamma=3)


def test_rollback_leaves_a_cache_equal_to_a_fresh_forward(pair):
    target, _, _ = pair
    seq = torch.tensor([[7, 8, 9, 10, 11, 12, 13, 14]])
    kv = KVState(1, seq.device)
    ones = torch.ones_like(seq)
    pos = torch.arange(8)[None]
    forward(target, seq, kv.extend_mask(ones), pos, kv.cache)
    kv.keep(torch.tensor([3]), start=2)  # keep 2 + 3 = 5 positions
    assert kv.length == 5 and kv.cache.get_seq_length() == 5
    nxt = torch.tensor([[20]])
    got = forward(target, nxt, kv.extend_mask(torch.ones_like(nxt)), torch.tensor([[5]]), kv.cache)[:, -1]
    want = target(torch.cat([seq[:, :5], nxt], dim=1)).logits[:, -1].float()
    assert torch.allclose(got, want, atol=1e-5)


def test_rollback_with_ragged_rows_masks_holes(pair):
    target, _, _ = pair
    seqs = torch.tensor([[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
    kv = KVState(2, seqs.device)
    pos = torch.arange(5).expand(2, -1)
    forward(target, seqs, kv.extend_mask(torch.ones_like(seqs)), pos, kv.cache)
    kv.keep(torch.tensor([1, 3]), start=1)  # row 0 keeps 2 positions, row 1 keeps 4
    assert kv.length == 4
    assert kv.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    # Row 0's next token sits at position 2 and must see exactly [7, 8].
    nxt = torch.tensor([[20], [21]])
    got = forward(target, nxt, kv.extend_mask(torch.ones_like(nxt)), torch.tensor([[2], [4]]), kv.cache)[:, -1]
    want0 = target(torch.tensor([[7, 8, 20]])).logits[0, -1]
    want1 = target(torch.tensor([[12, 13, 14, 15, 21]])).logits[0, -1]
    assert torch.allclose(got[0], want0, atol=1e-5) and torch.allclose(got[1], want1, atol=1e-5)


# Hundreds of steps, the cache buffers grown several times over (kv_buffer.BLOCK = 64 positions, doubled).
LONG = 1024


def test_long_run_keeps_caches_at_the_committed_length(model_dir, monkeypatch):
    common = dict(vocab_size=32, seed=0, hidden=16, layers=1, eos=None, window=8192)
    target, tok = tiny.load(model_dir("llama", **common))
    draft, _ = tiny.load(model_dir("llama", perturb=0.5, **common))
    log = spy_steps(monkeypatch)
    out = SpeculativeGenerator(target, draft, tok).generate(
        [[7, 8]], max_new_tokens=LONG, gamma=4, do_sample=True, seed=0
    )
    assert out.sequences.shape[1] == 2 + LONG
    assert len(log) > 200
    assert all(t_len == lengths[0] - 1 for _, _, t_len, _, lengths, _ in log)
    # Memory is flat: the cache never holds more than the committed tokens, however many drafts were rejected.
    assert out.stats.drafted > out.stats.accepted
    # The last step, which finishes the row and is not logged, commits between 1 and γ + 1 tokens.
    assert 2 + LONG - 1 - 1 - 4 <= max(t_len for _, _, t_len, *_ in log) <= 2 + LONG - 1 - 1


def test_context_limit_stops_cleanly_with_a_reason(model_dir):
    target, tok = tiny.load(model_dir("gpt2", vocab_size=32, seed=0, eos=None, window=40))
    draft, _ = tiny.load(model_dir("gpt2", vocab_size=32, seed=1, eos=None, window=40))
    gen = SpeculativeGenerator(target, draft, tok)
    with pytest.raises(ValueError, match="context window of 40"):
        gen.generate([list(range(7, 17))], max_new_tokens=100)
    out = gen.generate([list(range(7, 17))], max_new_tokens=100, on_context_limit="stop")
    assert out.sequences.shape[1] == 40
    assert out.stats.rows[0].stop_reason == "context"
