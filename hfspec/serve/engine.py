"""The engine behind ``hfspec serve``: one thread owns the models and runs continuous batching.

Requests wait in a bounded queue; at each step boundary the thread takes as many as the batch has room for,
prefills each alone and merges it into the running batch (``hfspec.serve.batch``), runs one speculative step for
every row, and hands each row's committed tokens, with their text and how each was decided, to the asyncio loop
that submitted it. A row leaves the batch the step it finishes (EOS or a stop token id, a stop string, its budget)
or is cancelled. Exactness, per row, whatever else runs: see ``hfspec.serve.batch``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections import deque
from dataclasses import dataclass

import torch

from hfspec.cpu import threads as cpu_threads
from hfspec.decoding import config as cfg
from hfspec.decoding.scoring import Scoring
from hfspec.drafters import merges_rows
from hfspec.errors import HfspecError
from hfspec.generator import SpeculativeGenerator
from hfspec.models.adapter import window_in_columns
from hfspec.models.kv_cache import KVState
from hfspec.policy import AutoGamma
from hfspec.serve.batch import Batch, Committed, RowState
from hfspec.serve.events import Delta, Done, Event, FinishReason, Handle, QueueFull, Request, Usage
from hfspec.serve.text import TextStream
from hfspec.settings import SamplingParams

log = logging.getLogger(__name__)

SEEDED_GAMMA = 4  # a seeded sampled row's γ under "auto": fixed, so that its draws never depend on the batch


@dataclass
class _Live:
    """A request in the batch: where its events go, its text, and its counts."""

    handle: Handle
    loop: asyncio.AbstractEventLoop
    params: SamplingParams
    text: TextStream
    completion: int = 0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0

    def usage(self) -> Usage:
        prompt = len(self.handle.request.prompt_ids)
        return Usage(prompt, self.completion, self.drafted, self.accepted, self.passes)


def request_params(request: Request) -> SamplingParams:
    """A request's settings, validated (``HfspecError`` names a bad one). Its ``stop_token_ids`` are those besides
    the model's EOS ids, which the engines add. A request runs for one token at least: a step commits one."""
    if request.max_new_tokens == 0:
        raise HfspecError("max_new_tokens must be >= 1 for a request (a step commits one token at least)")
    return SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        max_new_tokens=request.max_new_tokens,
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
    )


def batch_rows(max_batch: int, max_gamma: int, largest: int = 64) -> list[int]:
    """Token rows whose forward a server times at start, beyond one row's chain: a full batch of one token, and
    powers of two up to the batch's verification of γ+1 (at most ``largest``: a forward over many more rows costs
    seconds on a large target, and past the largest the price goes on along the last slope)."""
    top = min(largest, max_batch * (max_gamma + 1))
    sizes = {max_batch} | {1 << i for i in range(4, 8) if (1 << i) <= top} | {top}
    return sorted(k for k in sizes if k > max_gamma + 1)


class BatchEngine:
    """Continuous batching over a ``SpeculativeGenerator`` (the ``hfspec.serve.events.Engine`` protocol).

    The HTTP side builds the generator from the same model flags as ``hfspec generate`` and hands it over::

        gen = SpeculativeGenerator.from_pretrained(target, draft)  # or hfspec.api's loading of a --config
        engine = BatchEngine.from_generator(gen, model_name="smollm2", max_batch=8, max_queue=64)
        engine.start()  # the thread that owns the models from now on
        handle = engine.submit(Request(...), asyncio.get_running_loop())  # QueueFull: answer 503
        async for event in handle.events():  # Delta ... then Done
            ...
        handle.cancel()  # a client gone: its row leaves at the next step boundary
        engine.stop()  # rows in flight end with Done("cancelled")

    ``submit`` validates the request's settings once (``SamplingParams``; ``HfspecError`` names the problem: a 400).
    Up to ``max_batch`` rows run at once and ``max_queue`` more wait; past that, ``QueueFull``. ``seeded_gamma``:
    the γ of seeded sampled rows under ``"auto"`` (module ``hfspec.serve.batch`` says why it is fixed).
    The engine owns the generator once started: do not call its ``generate`` meanwhile.
    """

    run_here = False  # the caller runs the loop (:meth:`run`); ``start`` then starts nothing

    def __init__(
        self,
        generator: SpeculativeGenerator,
        *,
        model_name: str,
        max_batch: int = 8,
        max_queue: int = 64,
        seeded_gamma: int = SEEDED_GAMMA,
    ):
        if generator.tokenizer is None:
            raise HfspecError("the server needs the target's tokenizer: build the SpeculativeGenerator with one")
        if KVState.is_recurrent(generator.target) or generator.drafter.recurrent or window_in_columns(generator.target):
            raise HfspecError(
                "this pair cannot hold rows of different lengths in one batch (a recurrent state, or a sliding "
                "window counted in cache columns); serve another pair, or use hfspec generate"
            )
        if not merges_rows(generator.drafter):
            raise HfspecError(
                f"the {generator.drafter.kind} drafter cannot take rows into a running batch yet; serve with a "
                "draft model, an EAGLE-3 head or n-gram lookup"
            )
        if max_batch < 1 or max_queue < 0 or seeded_gamma < 0:
            raise HfspecError(f"need max_batch >= 1, max_queue >= 0, seeded_gamma >= 0; got {max_batch}, {max_queue}")
        self.gen, self.model_name = generator, model_name
        self.max_batch, self.max_queue, self.seeded_gamma = max_batch, max_queue, seeded_gamma
        window = generator._context_window()
        self.window = window
        self.context_length = window if window is not None else 1 << 30
        self.vocab_rows = generator.target.get_input_embeddings().num_embeddings
        self.eos = cfg.eos_ids(generator.target.generation_config)  # as hfspec generate ends a completion
        self._lock = threading.Condition()
        self._queue: deque[tuple[Handle, asyncio.AbstractEventLoop, SamplingParams]] = deque()
        self._live: dict[int, _Live] = {}
        self._slots = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ended = threading.Event()  # set when the loop has ended every request it held
        self._ready = threading.Event()  # set when the loop has measured its costs and takes requests

    @classmethod
    def from_generator(cls, generator: SpeculativeGenerator, *, model_name: str, **kwargs: int) -> BatchEngine:
        """An engine over ``generator`` (loaded with ``hfspec generate``'s model flags); see the class docstring."""
        return cls(generator, model_name=model_name, **kwargs)

    @property
    def ready(self) -> bool:
        """Whether the loop runs with its costs measured: timings taken before, while this machine may still be busy
        loading (another server, say), would misprice drafting for the engine's life."""
        return self._ready.is_set()

    @property
    def running(self) -> int:
        return len(self._live)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Handle:
        params = self.settings(request)
        handle = Handle(request)
        with self._lock:
            room = self.max_queue + max(0, self.max_batch - len(self._live))
            if self._stopping or len(self._queue) >= room:
                raise QueueFull(f"{len(self._live)} requests running and {len(self._queue)} waiting")
            self._queue.append((handle, loop, params))
            self._lock.notify()
        return handle

    def settings(self, request: Request) -> SamplingParams:
        """The request's validated settings; ``HfspecError`` for a prompt or γ the engine cannot take."""
        prompt = request.prompt_ids
        if not prompt or len(prompt) >= self.context_length:
            raise HfspecError(f"the prompt has {len(prompt)} tokens; it needs 1 to {self.context_length - 1}")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_rows for t in prompt):
            raise HfspecError(f"prompt token ids must be integers in [0, {self.vocab_rows})")
        gamma = request.gamma
        if not (gamma == "auto" or (isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= 0)):
            raise HfspecError(f"gamma must be 'auto' or a number of drafts >= 0, got {gamma!r}")
        return request_params(request)

    def start(self) -> None:
        """Run the engine's loop on a thread of its own (nothing to do where the caller runs it: :meth:`run`)."""
        if self._thread is None and not self.run_here:
            self._thread = threading.Thread(target=self._serve, name="hfspec-engine", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Run the engine's loop in the calling thread until :meth:`stop`. ``hfspec serve`` runs it on the main
        thread and the HTTP server beside it: OpenMP's parallel regions (torch's and the kernels') start cheaply only
        from the main thread, and a forward of the offline target took 2.2x as long from another one."""
        with self._lock:
            self._thread = threading.current_thread()
        self._serve()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop taking requests; the loop ends those in flight and waiting with ``Done("cancelled")`` at its next step
        boundary. Waits up to ``timeout`` seconds for that, from any thread but the loop's own."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
            started = self._thread is not None
        if not started:  # no loop to end them: the queued requests end here
            self._end_all("cancelled")
        elif self._thread is not threading.current_thread():  # only the loop's thread touches the batch
            self._ended.wait(timeout)

    # The engine's thread from here on.

    def _serve(self) -> None:
        try:
            with cpu_threads.using(self.gen.threads):  # the generator's CPU threads (--threads), on this thread
                self._loop()
        except Exception as error:  # the engine cannot go on (its models failed to start): nothing may hang
            log.exception("engine stopped")
            with self._lock:
                self._stopping = True
            self._end_all("error", f"{type(error).__name__}: {error}")
        finally:
            self._ended.set()

    def _loop(self) -> None:
        with torch.inference_mode():
            batch = self._batch()
            self._ready.set()
            while True:
                with self._lock:
                    while not self._stopping and not self._queue and not self._live:
                        self._lock.wait(0.5)
                    if self._stopping:
                        break
                    # Cancelled requests leave the queue now (_join ends them); as many as there is room for join.
                    gone = [entry for entry in self._queue if entry[0].cancelled]
                    for entry in gone:
                        self._queue.remove(entry)
                    room = min(len(self._queue), self.max_batch - batch.active)
                    joining = gone + [self._queue.popleft() for _ in range(room)]
                try:
                    self._join(batch, joining)
                    self._cancel(batch)
                    if batch.active:
                        self._commit(batch, batch.step())
                except Exception as error:  # the rows in flight fail; the engine keeps serving the queue
                    log.exception("engine step failed")
                    self._end_all("error", f"{type(error).__name__}: {error}", queued=False)
                    batch = self._batch()
            self._end_all("cancelled")

    def _batch(self) -> Batch:
        """A fresh batch, with ``gamma="auto"``'s costs measured on this machine (once per generator), and the
        target's forward over as many token rows as a full batch verifies (``batch_rows``)."""
        tuning = self.gen.tuning
        tuning.trees = ()  # the batch drafts chains
        tuning.setting = "serve"
        costs = self.gen.measure_costs()
        room = self.window if self.window is not None else 1 << 30  # context and rows within the positions
        sizes = [k for k in batch_rows(self.max_batch, costs.max_gamma) if 2 * k < room]
        if sizes:
            device = self.gen.target.get_output_embeddings().weight.device
            costs.measure_more(self.gen.target, [0] * min(64, room - max(sizes) - 1), sizes, device)
        return Batch(self.gen, AutoGamma(tuning), self.window)

    def _join(self, batch: Batch, joining: list[tuple[Handle, asyncio.AbstractEventLoop, SamplingParams]]) -> None:
        for handle, loop, params in joining:
            live = _Live(handle, loop, params, TextStream(self.gen.tokenizer, params.stop))
            if handle.cancelled:
                self._send(live, Done("cancelled", live.usage()))
                continue
            slot, self._slots = self._slots, self._slots + 1
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            gamma = handle.request.gamma
            if gamma == "auto":
                gamma = self.seeded_gamma if (params.seed is not None and not params.greedy) else None
            state = RowState(slot, Scoring(params), torch.Generator(batch.device).manual_seed(seed), gamma)
            try:
                part = batch.prefill_alone(state, list(handle.request.prompt_ids), params, self.eos)
            except Exception as error:  # this request fails; the batch, untouched, runs on
                log.exception("prefill failed")
                self._send(live, Done("error", live.usage(), f"{type(error).__name__}: {error}"))
                continue
            self._live[slot] = live
            batch.merge(part)

    def _cancel(self, batch: Batch) -> None:
        gone = torch.tensor([self._live[s.slot].handle.cancelled for s in batch.states], dtype=torch.bool)
        for s in [s for s, g in zip(batch.states, gone.tolist()) if g]:
            live = self._live.pop(s.slot)
            self._send(live, Done("cancelled", live.usage()))
        batch.leave(gone.to(batch.device))

    def _commit(self, batch: Batch, committed: list[Committed]) -> None:
        """Each row's tokens and text to its client; finished rows leave the batch."""
        finished = []
        for c in committed:
            live = self._live[c.slot]
            keep, text, stopped = live.text.add(c.tokens)
            origins = c.origins[:keep]
            live.passes += 1
            live.drafted += c.drafted
            live.accepted += origins.count("accepted")
            live.completion += keep
            done = stopped or c.eos or c.exhausted
            if done and not stopped:
                text += live.text.flush()
            if keep or text:
                self._send(live, Delta(c.tokens[:keep], origins, text))
            if done:
                reason: FinishReason = "stop" if stopped or c.eos else "length"
                self._send(live, Done(reason, live.usage()))
                del self._live[c.slot]
            finished.append(done)
        batch.leave(torch.tensor(finished, dtype=torch.bool, device=batch.device))

    def _end_all(self, reason: FinishReason, error: str | None = None, queued: bool = True) -> None:
        """End every request in the batch, and in the queue unless ``queued`` is False."""
        waiting = []
        if queued:
            with self._lock:
                waiting = [_Live(h, loop, p, TextStream(self.gen.tokenizer)) for h, loop, p in self._queue]
                self._queue.clear()
        for live in [*self._live.values(), *waiting]:
            self._send(live, Done(reason, live.usage(), error))
        self._live.clear()

    @staticmethod
    def _send(live: _Live, event: Event) -> None:
        try:
            live.loop.call_soon_threadsafe(live.handle.queue.put_nowait, event)
        except RuntimeError:  # the client's loop is closed: nobody is listening
            pass
