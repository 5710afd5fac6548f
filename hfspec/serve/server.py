"""uvicorn's server, stopping the engine at the first SIGINT or SIGTERM."""

from __future__ import annotations

import threading
from typing import Any

import uvicorn

from hfspec.serve.events import Engine

SHUTDOWN_SECONDS = 5  # after SIGINT/SIGTERM: how long the streams in flight get to send their last event


class Server(uvicorn.Server):
    """At the first signal uvicorn stops accepting; the engine's stop then ends the streams in flight with their
    last event at once, instead of holding the shutdown until they finish."""

    def __init__(self, app: Any, engine: Engine, **config: Any):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=SHUTDOWN_SECONDS, **config))
        self.engine = engine
        self.stopping = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            threading.Thread(target=self.engine.stop, name="hfspec-stop", daemon=True).start()
        super().handle_exit(sig, frame)
