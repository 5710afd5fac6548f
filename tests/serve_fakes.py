"""For the server's tests: an engine that plays a script without a model, and a server on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from hfspec.serve.events import Delta, Done, Handle, QueueFull, Request, Usage

ORIGINS = ("accepted", "accepted", "bonus", "resampled")


class FakeEngine:
    """Answers each request with tokens 10, 11, 12, ... (text ``w10 w11 ...``), two per step: the first an accepted
    draft, the second the bonus. ``mode``: "normal", "endless" (until cancelled), "error" (the engine reports a
    failure after one step), "raise" (submit itself fails); ``full`` makes submit raise QueueFull."""

    model_name = "fake-model"
    context_length = 64
    max_batch = 4

    def __init__(self, step_seconds: float = 0.0):
        self.step_seconds = step_seconds
        self.mode = "normal"
        self.full = False
        self.requests: list[Request] = []
        self.active: set[str] = set()
        self.stopped = False
        self.started = False
        self.tasks: set[asyncio.Task] = set()

    ready = True

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def waiting(self) -> int:
        return 0

    def start(self) -> None:
        self.started = True

    def stop(self, timeout: float = 5.0) -> None:
        self.stopped = True

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Handle:
        if self.mode == "raise":
            raise RuntimeError("scripted failure")
        if self.full or self.stopped:
            raise QueueFull
        self.requests.append(request)
        handle = Handle(request)
        self.active.add(request.request_id)
        task = loop.create_task(self._play(handle))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return handle

    async def _play(self, handle: Handle) -> None:
        r = handle.request
        n = 0
        reason = "length"
        try:
            while n < r.max_new_tokens or self.mode == "endless":
                await asyncio.sleep(self.step_seconds)
                if handle.cancelled or self.stopped:
                    reason = "cancelled"
                    break
                ids = tuple(10 + (n + k) % 50 for k in range(2) if self.mode == "endless" or n + k < r.max_new_tokens)
                text = "".join((" " if n + k else "") + f"w{i}" for k, i in enumerate(ids))
                handle.queue.put_nowait(Delta(ids, ("accepted", "bonus")[: len(ids)], text))
                n += len(ids)
                if self.mode == "error":
                    reason = "error"
                    break
        finally:
            self.active.discard(r.request_id)
            usage = Usage(len(r.prompt_ids), n, n, n // 2, (n + 1) // 2)
            error = "scripted engine failure" if reason == "error" else None
            handle.queue.put_nowait(Done(reason, usage, error))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app, engine) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread; yields its base URL."""
    from hfspec.serve.server import Server

    port = free_port()
    server = Server(app, engine, host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
