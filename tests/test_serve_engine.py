"""The server's engine: continuous batching where every request's output is its own.

Requests join a running batch at step boundaries and leave it when they finish; a greedy answer equals the same
request served alone (a fresh engine with only it) and the target's own ``generate()``, a seeded sampled answer is
the same alone and in company, and a sampled row in company still follows the target's exact distribution; with
a draft model, an EAGLE-3 head, n-gram lookup (whose store of earlier outputs a seeded sampled row does not read)
and the hybrid of a model and lookup. The models run hfspec's kernels, which give a row the same bits whatever
rows share the forward.
"""

from __future__ import annotations

import asyncio
import threading

import eagle3_heads as eh
import numpy as np
import pytest
import stat_utils
import tiny
import torch
from stat_utils import ALPHA, chi_square_pvalue

from hfspec import SpeculativeGenerator
from hfspec.commands import cli
from hfspec.cpu import fast
from hfspec.decoding import sampling
from hfspec.drafters.eagle3 import Eagle3Drafter
from hfspec.drafters.ngram import NgramDrafter
from hfspec.errors import HfspecError
from hfspec.models import kv_cache
from hfspec.models.kv_buffer import BufferLayer
from hfspec.serve import batch as serve_batch
from hfspec.serve import command
from hfspec.serve.engine import BatchEngine
from hfspec.serve.engine import batch_rows as serve_batch_rows
from hfspec.serve.events import Delta, Done, QueueFull, Request
from hfspec.serve.sequential import SequentialEngine
from hfspec.serve.text import TextStream

V = 64


@pytest.fixture(scope="module")
def pair(model_dir, library):
    """A tiny Llama target and a draft like it (some drafts accepted, some not), both on hfspec's kernels."""
    common = dict(vocab_size=V, seed=0, sharpness=4.0)
    target, tok = tiny.load(model_dir("llama", **common))
    draft, _ = tiny.load(model_dir("llama", perturb=0.4, **common))
    fast.accelerate(target)
    fast.accelerate(draft)
    return target, draft, tok


@pytest.fixture
def gen(pair, scripted_auto):
    return scripted_auto(SpeculativeGenerator(*pair), "cheap")


@pytest.fixture
def ngram_gen(pair, scripted_auto):
    """The same target drafting by n-gram lookup, with a store of earlier outputs shared by every request."""
    return scripted_auto(SpeculativeGenerator(pair[0], "ngram", pair[2]), "cheap")


def serve(gen, requests, *, stagger: float = 0.0, **engine):
    """Run ``requests`` through one engine, the i-th submitted after i·stagger seconds: per request, its tokens,
    origins, text and final event."""

    async def main():
        eng = BatchEngine.from_generator(gen, model_name="tiny", **engine)
        eng.start()
        loop = asyncio.get_running_loop()

        async def one(request, delay):
            await asyncio.sleep(delay)
            tokens, origins, text = [], [], ""
            async for event in eng.submit(request, loop).events():
                if isinstance(event, Done):
                    return tokens, origins, text, event
                tokens += event.token_ids
                origins += event.origins
                text += event.text

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(r, i * stagger) for i, r in enumerate(requests))), 60)
        finally:
            eng.stop()

    return asyncio.run(main())


def target_greedy(target, prompt, new, eos):
    ids = torch.tensor([prompt])
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=eos
    )
    return out[0, len(prompt) :].tolist()


def mixed_requests() -> list[Request]:
    """16 requests of mixed lengths and settings: greedy under auto, γ = 0 and γ = 3, seeded sampled ones under auto
    and γ = 2 (temperature, top-p, top-k, min-p), unseeded sampled ones, and some that end at a stop token."""
    g = torch.Generator().manual_seed(3)
    settings = [
        dict(temperature=0.0),
        dict(temperature=0.0, gamma=0),
        dict(temperature=0.0, gamma=3),
        dict(temperature=0.8, seed=11),
        dict(temperature=0.7, top_p=0.9, seed=12, gamma=2),
        dict(temperature=1.0, top_k=8, min_p=0.05, seed=13),
        dict(temperature=0.9),
        dict(temperature=0.0, stop_token_ids=(20, 30, 40)),
    ]
    out = []
    for i in range(16):
        prompt = tuple(torch.randint(7, V, (1 + (i * 7) % 23,), generator=g).tolist())
        out.append(Request(f"r{i}", prompt, 6 + (i * 5) % 29, **settings[i % len(settings)]))
    return out


@pytest.mark.parametrize("drafter", ["gen", "ngram_gen"])
def test_sixteen_staggered_requests_each_equal_alone(drafter, pair, monkeypatch, request):
    gen = request.getfixturevalue(drafter)
    joined = []  # rows already running, and steps already taken, when each request joined
    merge, step, steps = serve_batch.Batch.merge, serve_batch.Batch.step, [0]

    def counting(batch):
        steps[0] += 1
        return step(batch)

    monkeypatch.setattr(
        serve_batch.Batch, "merge", lambda batch, part: joined.append((batch.active, steps[0])) or merge(batch, part)
    )
    monkeypatch.setattr(serve_batch.Batch, "step", counting)
    # Columns that every row holds as holes are dropped as soon as rows leave (in service, once there are many):
    # each row's output must not change.
    trims = []
    drop_front = BufferLayer.drop_front
    monkeypatch.setattr(kv_cache, "_TRIM_AT_LEAST", 1)
    monkeypatch.setattr(BufferLayer, "drop_front", lambda layer, n: trims.append(n) or drop_front(layer, n))
    requests = mixed_requests()
    together = serve(gen, requests, stagger=0.004, max_batch=6, max_queue=16)
    monkeypatch.undo()
    assert trims, "no cache was trimmed"
    assert sum(1 for running, taken in joined if running and taken) >= 4, f"too few joined a running batch: {joined}"
    assert max(running for running, _ in joined) == 5, "the batch never filled up"
    assert all(done.finish_reason in ("stop", "length") for *_, done in together), "a request was lost or failed"
    for request, (tokens, origins, text, done) in zip(requests, together):
        assert len(tokens) == len(origins) == done.usage.completion_tokens <= request.max_new_tokens
        if request.temperature == 0 or request.seed is not None:
            (alone,) = serve(gen, [request])
            assert tokens == alone[0], f"{request.request_id} differs in company"
            assert text == alone[2]
        if request.temperature == 0:
            eos = [tiny.EOS, *request.stop_token_ids]
            assert tokens == target_greedy(pair[0], list(request.prompt_ids), request.max_new_tokens, eos)
    assert any(r.stop_token_ids for r in requests) and any(d.finish_reason == "stop" for *_, d in together)
    accepted = sum(d.usage.accepted for *_, d in together)
    assert 0 < accepted < sum(d.usage.drafted for *_, d in together), "drafts should be both accepted and rejected"


def test_a_long_prompt_with_a_short_budget_beside_a_short_prompt_drafting_far(gen, pair):
    # The step drafts as far as the widest row: the long prompt's row must have room for those drafts too.
    requests = [Request("far", (9,), 40, temperature=0.0, gamma=8), Request("long", (7,) * 90, 2, temperature=0.0)]
    for request, (tokens, *_) in zip(requests, serve(gen, requests)):
        assert tokens == target_greedy(pair[0], list(request.prompt_ids), request.max_new_tokens, [tiny.EOS])


def test_origins_agree_with_usage(gen):
    requests = [r for r in mixed_requests() if r.temperature == 0 or r.seed is not None][:6]
    for tokens, origins, _, done in serve(gen, requests):
        assert origins.count("accepted") == done.usage.accepted
        assert origins.count("resampled") + origins.count("bonus") <= done.usage.target_passes
        assert set(origins) <= {"accepted", "resampled", "bonus"}
        assert done.usage.accepted <= done.usage.drafted


def test_an_eagle3_head_in_company_greedy_equals_the_target_and_seeded_equals_alone(model_dir, library):
    target, tok = tiny.load(model_dir("llama", vocab_size=V, layers=8, hidden=32, seed=0, sharpness=8.0))
    head = eh.random_head(target, list(range(3, 43)), seed=3)
    fast.accelerate(target)
    fast.accelerate(head)
    gen = SpeculativeGenerator(target, Eagle3Drafter(head, target), tok)
    settings = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95)]
    requests = [
        Request(f"e{i}", tuple(range(7 + i, 9 + 2 * i)), 12 + i, gamma=3, seed=i, **settings[i % 2]) for i in range(6)
    ]
    for request, (tokens, *_) in zip(requests, serve(gen, requests, stagger=0.003)):
        if request.temperature == 0:
            assert tokens == target_greedy(target, list(request.prompt_ids), request.max_new_tokens, [tiny.EOS])
        else:
            assert tokens == serve(gen, [request])[0][0], f"{request.request_id} differs in company"


def test_a_hybrid_in_company_greedy_equals_the_target_and_seeded_equals_alone(pair, scripted_auto):
    gen = scripted_auto(SpeculativeGenerator(*pair, ngram=True), "cheap")
    settings = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95)]
    requests = [Request(f"y{i}", (7 + i, 9, 7 + i, 9) * 2, 16, gamma=3, seed=i, **settings[i % 2]) for i in range(6)]
    together = serve(gen, requests, stagger=0.003)
    for request, (tokens, *_) in zip(requests, together):
        if request.temperature == 0:
            assert tokens == target_greedy(pair[0], list(request.prompt_ids), request.max_new_tokens, [tiny.EOS])
        else:
            assert tokens == serve(gen, [request])[0][0], f"{request.request_id} differs in company"
    assert sum(done.usage.accepted for *_, done in together) > 0


def test_a_seeded_row_drafts_from_its_own_context_not_the_store(ngram_gen, monkeypatch):
    # The store holds what earlier requests answered; a seeded sampled row that read it would draft from it, and
    # its tokens would depend on what ran before it.
    requests = [Request(f"n{i}", (9 + i, 12, 9 + i, 12, 9 + i), 24, temperature=0.9, seed=i, gamma=3) for i in range(4)]
    ngram_gen.drafter.clear_history()
    first = [tokens for tokens, *_ in serve(ngram_gen, requests, stagger=0.003)]
    assert ngram_gen.drafter.history.size > 24, "their outputs should be in the store"
    assert [serve(ngram_gen, [r])[0][0] for r in requests] == first
    fork = NgramDrafter.fork  # the control: every row reads the store, and some row's tokens change
    monkeypatch.setattr(NgramDrafter, "fork", lambda self, own_context=False: fork(self, False))
    assert [serve(ngram_gen, [r])[0][0] for r in requests] != first


def test_the_serve_command_batches_lookup_and_the_hybrid(pair):
    for flags, draft, engine in (
        (["--draft", "ngram"], "ngram", BatchEngine),
        ([], pair[1], BatchEngine),
        (["--draft", "ngram", "--sequential"], "ngram", SequentialEngine),
    ):
        args = cli.build_parser("serve").parse_args(["serve", *flags])
        gen = SpeculativeGenerator(pair[0], draft, pair[2], ngram=draft != "ngram")
        assert type(command.make_engine(gen, "tiny", args)) is engine, flags


def test_a_cancelled_request_leaves_within_one_step(gen, monkeypatch):
    seen = []  # per step: whether the cancelled request's row was still in the batch after it was cancelled
    step = serve_batch.Batch.step

    def spying(batch):
        if handles:
            seen.append(handles[0].cancelled and any(s.slot == 0 for s in batch.states))
        return step(batch)

    monkeypatch.setattr(serve_batch.Batch, "step", spying)
    handles = []

    async def main():
        eng = BatchEngine(gen, model_name="tiny", max_batch=2)
        eng.start()
        loop = asyncio.get_running_loop()
        handles.append(eng.submit(Request("long", (7, 8, 9), 400, temperature=0.0, gamma=1), loop))
        other = eng.submit(Request("other", (9, 8), 400, temperature=0.0, gamma=1), loop)
        first = await handles[0].queue.get()
        assert isinstance(first, Delta)
        handles[0].cancel()
        async for event in handles[0].events():
            if isinstance(event, Done):
                break
        assert event.finish_reason == "cancelled"
        running = eng.running
        eng.stop()
        last = None
        async for last in other.events():
            pass
        return running, last

    running, last = asyncio.run(main())
    assert running == 1 and sum(seen) <= 1, f"the cancelled row stayed {sum(seen)} steps"
    assert last.finish_reason == "cancelled"  # stop() ends the rows in flight


def test_queue_full_past_the_bound(gen):
    async def main():
        eng = BatchEngine(gen, model_name="tiny", max_batch=1, max_queue=2)
        loop = asyncio.get_running_loop()
        handles = [eng.submit(Request(f"q{i}", (7, 8), 3, temperature=0.0), loop) for i in range(3)]
        with pytest.raises(QueueFull):
            eng.submit(Request("over", (7, 8), 3, temperature=0.0), loop)
        assert eng.waiting == 3
        eng.start()
        finals = []
        for h in handles:
            async for event in h.events():
                pass
            finals.append(event)
        eng.stop()
        return finals

    assert [f.finish_reason for f in asyncio.run(main())] == ["length"] * 3


def test_bad_settings_are_refused_at_submit(gen):
    eng = BatchEngine(gen, model_name="tiny")
    loop = asyncio.new_event_loop()
    try:
        for bad in (
            dict(temperature=-1.0),
            dict(top_p=0.0),
            dict(top_k=-2),
            dict(gamma="fast"),
            dict(max_new_tokens=0),
        ):
            fields = dict(request_id="bad", prompt_ids=(7, 8), max_new_tokens=4) | bad
            with pytest.raises(HfspecError):
                eng.submit(Request(**fields), loop)
        with pytest.raises(HfspecError, match="prompt"):
            eng.submit(Request("empty", (), 4), loop)
    finally:
        loop.close()


def test_stop_strings_cut_the_text_even_across_steps(gen):
    base = Request("s", (7, 9, 11, 13), 24, temperature=0.0, gamma=3)
    tokens, _, text, _ = serve(gen, [base])[0]
    words = text.split(" ")
    assert len(words) >= 8

    # Deltas end where steps end: find a step boundary and a stop string that spans it.
    async def steps():
        eng = BatchEngine(gen, model_name="tiny")
        eng.start()
        sizes = [
            len(e.token_ids)
            async for e in eng.submit(base, asyncio.get_running_loop()).events()
            if isinstance(e, Delta)
        ]
        eng.stop()
        return sizes

    sizes = asyncio.run(steps())
    boundary = next(i for i in np.cumsum(sizes) if 2 <= i < len(words) - 2)
    spanning = words[boundary - 1][-1:] + " " + words[boundary][:2]  # the end of one step's last word, the next's start
    within = " ".join(words[3:5])
    for stop, cut in ((spanning, text.index(spanning)), (within, text.index(within))):
        kept, _, got, done = serve(
            gen, [Request("s", base.prompt_ids, 24, temperature=0.0, gamma=3, stop=(stop, "zzz"))]
        )[0]
        assert done.finish_reason == "stop" and got == text[:cut], (stop, got)
        assert kept == tokens[: len(kept)] and stop in gen.tokenizer.decode(kept)
        assert stop not in gen.tokenizer.decode(kept[:-1])  # the fewest tokens that reach the stop string


class _Bytes:
    """A tokenizer whose ids are bytes: a multi-byte character arrives in pieces."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_never_splits_a_character():
    stream = TextStream(_Bytes())
    pieces = [stream.add(tuple(chunk))[1] for chunk in ([104, 0xC3], [0xA9, 0xE2, 0x82], [0xAC, 33])]
    assert pieces == ["h", "é", "€!"]
    stream = TextStream(_Bytes(), stop=("é€",))
    assert stream.add((104, 0xC3))[1:] == ("", False)  # held: it may begin the stop string
    assert stream.add((0xA9, 0xE2, 0x82, 0xAC, 33)) == (4, "h", True)


# -- the distribution in company ----------------------------------------------------------------

# 600 requests: over 5 seeds the wrong residual's p-value is 1e-14 to 1e-24 with the draft model, 1e-16 to 1e-30 with
# lookup (the tests ask for p < ALPHA = 1e-8); the exact sampler's 0.08 to 1.
NEW, SAMPLES = 2, 600
# Per drafter, the prompt: one token for the draft model (nothing to prefill, so thousands of requests join in
# seconds); for n-gram lookup a repeat it drafts from (its drafts' q is one-hot: a path of its own at verification).
PROMPTS = {"model": (7,), "ngram": (3, 7, 3, 7, 3)}
SETTINGS = {"temperature": 0.8, "top_k": 6}


@pytest.fixture(scope="module")
def small_pair(model_dir, library):
    common = dict(vocab_size=9, seed=10, sharpness=30.0, eos=None, hidden=16, layers=1)
    target, tok = tiny.load(model_dir("llama", **common))
    draft, _ = tiny.load(model_dir("llama", perturb=0.5, **common))
    fast.accelerate(target)
    fast.accelerate(draft)
    return target, draft, tok


def sampled_in_company(small_pair, drafter: str, seed: int) -> tuple[np.ndarray, float]:
    """Counts of the first tokens of SAMPLES seeded requests for the drafter's prompt, each sampled beside greedy
    and other sampled rows (other prompts and settings); and the share of drafts accepted."""
    requests, g, prompt = [], np.random.default_rng(seed), PROMPTS[drafter]
    for i in range(SAMPLES):
        requests.append(Request(f"x{i}", prompt, NEW, seed=int(g.integers(1 << 62)), gamma=2, **SETTINGS))
        if i % 8 == 0:
            requests.append(Request(f"g{i}", (8,), 5, temperature=0.0, gamma=3))
            requests.append(Request(f"h{i}", (7,), 4, temperature=1.3, top_p=0.7, gamma=1))
    target, draft, tok = small_pair
    gen = SpeculativeGenerator(target, draft if drafter == "model" else "ngram", tok)
    out = serve(gen, requests, max_batch=48, max_queue=len(requests))
    counts = np.zeros([9] * NEW)
    drafted = accepted = 0
    for request, (tokens, _, _, done) in zip(requests, out):
        if request.request_id.startswith("x"):
            counts[tuple(tokens)] += 1
            drafted, accepted = drafted + done.usage.drafted, accepted + done.usage.accepted
    return counts, accepted / drafted


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_sampled_row_in_company_follows_the_target_exactly(small_pair, drafter):
    counts, rate = sampled_in_company(small_pair, drafter, seed=1)
    assert 0.2 < rate < 0.9, f"the draft should disagree with the target sometimes (accepted {rate:.2f})"
    exact = stat_utils.exact_joint(small_pair[0], list(PROMPTS[drafter]), SETTINGS, 9, NEW)
    pv = chi_square_pvalue(counts, exact)
    assert pv > ALPHA, f"samples in company differ from the target (p-value {pv:.3g})"


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_negative_control_a_wrong_residual_is_detected_in_company(small_pair, drafter, monkeypatch):
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    counts, _ = sampled_in_company(small_pair, drafter, seed=2)
    exact = stat_utils.exact_joint(small_pair[0], list(PROMPTS[drafter]), SETTINGS, 9, NEW)
    assert chi_square_pvalue(counts, exact) < ALPHA


def test_a_failed_step_ends_its_rows_with_an_error_and_the_engine_serves_on(gen, monkeypatch):
    step, calls = serve_batch.Batch.step, [0]

    def failing_once(batch):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("broken step")
        return step(batch)

    monkeypatch.setattr(serve_batch.Batch, "step", failing_once)

    async def main():
        eng = BatchEngine(gen, model_name="tiny")
        eng.start()
        loop = asyncio.get_running_loop()
        try:
            finals = []
            for request in (
                Request("a", (7, 8), 20, temperature=0.0, gamma=1),
                Request("b", (7, 8), 5, temperature=0.0),
            ):
                tokens = []
                async for event in eng.submit(request, loop).events():
                    tokens += [] if isinstance(event, Done) else event.token_ids
                finals.append((tokens, event))
            return finals
        finally:
            eng.stop()

    (_, failed), (tokens, done) = asyncio.run(main())
    assert failed.finish_reason == "error" and "broken step" in failed.error
    # greedy, so whether it ends at EOS does not hang on a draw; either way the row after the failure is served
    assert (done.finish_reason, len(tokens) == 5) in {("length", True), ("stop", False)} and tokens


def test_the_loop_runs_in_the_callers_thread_until_stopped(gen):
    # hfspec serve runs the loop on the main thread (OpenMP's regions start cheaply only there), clients beside it.
    engine = BatchEngine.from_generator(gen, model_name="tiny")
    engine.run_here = True
    engine.start()  # as the app's lifespan calls it: nothing starts
    assert not engine.ready  # /health answers 503 until the loop has measured its costs
    request = mixed_requests()[0]
    answers = []

    def client():
        async def one():
            async for event in engine.submit(request, asyncio.get_running_loop()).events():
                if isinstance(event, Done):
                    assert engine.ready
                    return event

        try:
            answers.append(asyncio.run(one()))
        finally:
            engine.stop()

    thread = threading.Thread(target=client)
    thread.start()
    engine.run()  # returns once the client's stop() ends the loop
    thread.join(10)
    assert answers and answers[0].finish_reason in ("stop", "length")


def test_a_stop_from_another_thread_leaves_the_loops_rows_to_the_loop(gen, monkeypatch, caplog):
    # hfspec serve's signal handler stops the engine from a thread of its own while the loop, on the main thread, is
    # inside a step: the loop alone ends the rows, each with one final event, and no step fails.
    engine = BatchEngine.from_generator(gen, model_name="tiny")
    engine.run_here = True
    step, stopper = serve_batch.Batch.step, []

    def step_while_stopped(batch):
        if not stopper:
            stopper.append(threading.Thread(target=engine.stop))
            stopper[0].start()
            stopper[0].join(0.3)  # the stop runs, or waits for the loop, meanwhile
        return step(batch)

    monkeypatch.setattr(serve_batch.Batch, "step", step_while_stopped)
    events = []

    def client():
        async def one():
            handle = engine.submit(Request("a", (5, 6, 7), 40, temperature=0.0), asyncio.get_running_loop())
            async for event in handle.events():
                events.append(event)
            await asyncio.sleep(0.3)  # a second final event would arrive meanwhile
            while not handle.queue.empty():
                events.append(handle.queue.get_nowait())

        asyncio.run(one())

    thread = threading.Thread(target=client)
    thread.start()
    engine.run()
    thread.join(10)
    stopper[0].join(10)
    finals = [e for e in events if isinstance(e, Done)]
    assert [e.finish_reason for e in finals] == ["cancelled"] and events[-1] is finals[0]
    assert not stopper[0].is_alive() and "step failed" not in caplog.text


def test_the_engine_times_the_rows_a_full_batch_verifies(gen):
    assert serve_batch_rows(8, 8) == [16, 32, 64]  # a batch of one token is within the chain's sizes
    assert serve_batch_rows(16, 3) == [16, 32, 64]
    assert serve_batch_rows(4, 2) == [4, 12]
    assert serve_batch_rows(1, 8) == []
    engine = BatchEngine.from_generator(gen, model_name="tiny", max_batch=4)
    engine._batch()
    costs = gen.tuning.costs
    assert set(serve_batch_rows(4, costs.max_gamma)) <= set(costs.verify)
