"""An engine that serves one request at a time through ``SpeculativeGenerator.generate``.

The fallback for pairs the batching engine cannot take: a worker thread owns the generator and runs each request
alone, with a streamer that turns every step's committed tokens into a ``Delta``. A step commits its accepted
drafts and then one token of the target's; the streamer sees no more than that, so the last token of a step is
reported as "bonus" whether it was drawn at a rejection or after every draft was accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from typing import Any

import torch

from hfspec.decoding import config as cfg
from hfspec.generator import SpeculativeGenerator
from hfspec.policy import FixedGamma
from hfspec.serve.engine import request_params
from hfspec.serve.events import Delta, Done, Event, Handle, Origin, QueueFull, Request, Usage
from hfspec.serve.text import TextStream

log = logging.getLogger(__name__)

UNLIMITED_CONTEXT = 1 << 20  # a model that names no context window


class _Ended(Exception):
    """Raised from the streamer to end a generate call early: a stop string, a cancel, or the engine stopping."""


class _Streamer:
    """Receives each step's committed tokens from ``generate`` (on the worker thread) and sends them as Deltas."""

    def __init__(self, engine: SequentialEngine, handle: Handle, loop: asyncio.AbstractEventLoop, tokenizer: Any):
        self.engine, self.handle, self.loop = engine, handle, loop
        self.text = TextStream(tokenizer, handle.request.stop)
        self.prompt_seen = False
        self.stopped = False
        self.committed = self.accepted = self.passes = 0

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands the prompt over first
            self.prompt_seen = True
            return
        if self.handle.cancelled or self.engine.stopping:
            raise _Ended
        ids = tuple(int(i) for i in value.reshape(-1).tolist())
        origins: tuple[Origin, ...] = ("accepted",) * (len(ids) - 1) + ("bonus",)
        keep, text, self.stopped = self.text.add(ids)  # a stop string: the tokens up to it
        self.committed += keep
        self.accepted += min(keep, len(ids) - 1)
        self.passes += 1
        self.engine.send(self.loop, self.handle, Delta(ids[:keep], origins[:keep], text))
        if self.stopped:
            raise _Ended

    def end(self) -> None:
        pass


class SequentialEngine:
    """The ``Engine`` protocol over one ``SpeculativeGenerator``, one request at a time (``max_batch`` is 1)."""

    def __init__(self, gen: SpeculativeGenerator, *, model_name: str, max_queue: int = 64):
        if gen.tokenizer is None:
            raise ValueError("the generator needs a tokenizer to serve text")
        self.gen = gen
        self.model_name = model_name
        self.max_batch = 1
        self.max_queue = max_queue
        window = gen._context_window()
        self.context_length = window if window is not None else UNLIMITED_CONTEXT
        self.eos = tuple(cfg.eos_ids(gen.target.generation_config))
        self.stopping = False
        self._queue: queue.Queue[tuple[Handle, asyncio.AbstractEventLoop] | None] = queue.Queue()
        self._waiting = 0
        self._running = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    ready = True  # each request runs generate(), which measures what it needs on its first call

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._waiting

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="hfspec-engine", daemon=True)
            self._thread.start()

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Handle:
        with self._lock:
            if self.stopping or self._waiting >= self.max_queue:
                raise QueueFull(f"{self._waiting} requests are waiting")
            self._waiting += 1
        handle = Handle(request)
        self._queue.put((handle, loop))
        return handle

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def send(self, loop: asyncio.AbstractEventLoop, handle: Handle, event: Event) -> None:
        try:
            loop.call_soon_threadsafe(handle.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            handle, loop = item
            with self._lock:
                self._waiting -= 1
            if handle.cancelled or self.stopping:
                self.send(loop, handle, Done("cancelled", Usage(len(handle.request.prompt_ids), 0, 0, 0, 0)))
                continue
            self._running = 1
            try:
                self.send(loop, handle, self._serve(handle, loop))
            finally:
                self._running = 0
        while not self._queue.empty():  # stopped: what still waits ends cancelled
            item = self._queue.get_nowait()
            if item is not None:
                handle, loop = item
                self.send(loop, handle, Done("cancelled", Usage(len(handle.request.prompt_ids), 0, 0, 0, 0)))

    def _serve(self, handle: Handle, loop: asyncio.AbstractEventLoop) -> Done:
        """Run one request to its end; the final event."""
        r = handle.request
        streamer = _Streamer(self, handle, loop, self.gen.tokenizer)
        try:
            params = request_params(r)
            out = self.gen.generate(
                torch.tensor([r.prompt_ids]),
                sampling_params=dataclasses.replace(params, stop_token_ids=self.eos + params.stop_token_ids),
                gamma=FixedGamma(0) if r.gamma == 0 else r.gamma,
                seed=r.seed,
                streamer=streamer,
            )
        except _Ended:
            reason = "stop" if streamer.stopped else "cancelled"
            # Ended early, the generator's statistics are lost: count what the streamer saw (drafts counted as
            # proposed only where they were accepted).
            n = streamer.committed
            usage = Usage(len(r.prompt_ids), n, streamer.accepted, streamer.accepted, streamer.passes)
            return Done(reason, usage)
        except Exception as exc:  # one bad request must not take the engine down
            log.error("request %s failed: %s: %s", r.request_id, type(exc).__name__, exc)
            usage = Usage(len(r.prompt_ids), streamer.committed, streamer.accepted, streamer.accepted, streamer.passes)
            return Done("error", usage, f"{type(exc).__name__}: {exc}")
        row = out.stats.rows[0]
        tail = streamer.text.flush()
        if tail:
            self.send(loop, handle, Delta((), (), tail))
        reason = "stop" if row.stop_reason == "eos" else "length"
        return Done(reason, Usage(len(r.prompt_ids), row.committed, row.drafted, row.accepted, row.target_passes))
