"""The HTTP layer: OpenAI's routes over an ``Engine``, which it only translates to and from.

``create_app(engine, tokenizer)`` gives a FastAPI app: POST /v1/chat/completions and /v1/completions (streamed as
server-sent events or not), GET /v1/models, /health, /metrics and the page at /. With ``api_key``, every /v1 route
wants ``Authorization: Bearer KEY``. A client that leaves cancels its requests; the engine frees their rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from hfspec.errors import HfspecError
from hfspec.serve import errors, prompts
from hfspec.serve.errors import ApiError
from hfspec.serve.events import Delta, Done, Engine, Handle, QueueFull, Usage
from hfspec.serve.events import Request as EngineRequest
from hfspec.serve.metrics import Metrics
from hfspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from hfspec.serve.responses import CHAT, TEXT, Choice, Envelope, sse, usage_dict

log = logging.getLogger(__name__)

PAGE = Path(__file__).parent / "static" / "index.html"
RETRY_AFTER_SECONDS = 1
SHUTTING_DOWN = "the server is shutting down; the completion was cut short"


def create_app(engine: Engine, tokenizer: Any, *, api_key: str | None = None, gamma: int | str = "auto") -> FastAPI:
    """The app over ``engine`` (started and stopped with the app's lifespan); ``gamma`` goes to every request."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="hfspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(engine)
    app.state.metrics = metrics
    errors.install(app, metrics.errors)
    if api_key:
        app.add_middleware(_BearerKey, key=api_key, counter=metrics.errors)
    serving = _Serving(engine, tokenizer, metrics, gamma)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> Response:
        """200 once the engine serves; 503 while it loads and takes its first measurements (as llama-server)."""
        if not engine.ready:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": engine.model_name,
            "object": "model",
            "created": serving.started,
            "owned_by": "hfspec",
            "max_model_len": engine.context_length,
        }
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        ids = [prompts.chat_ids(tokenizer, body)]
        budget = prompts.budget(ids, body.token_budget, engine.context_length, None)
        return await serving.run(request, body, ids, budget, Envelope(_id("chatcmpl"), _now(), engine.model_name, CHAT))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        ids = prompts.completion_ids(tokenizer, body)
        budget = prompts.budget(ids, body.token_budget, engine.context_length, prompts.DEFAULT_COMPLETION_TOKENS)
        return await serving.run(request, body, ids, budget, Envelope(_id("cmpl"), _now(), engine.model_name, TEXT))

    return app


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class _Serving:
    """Submits a request's prompts to the engine and turns their events into a response or a stream."""

    def __init__(self, engine: Engine, tokenizer: Any, metrics: Metrics, gamma: int | str):
        self.engine, self.tokenizer, self.metrics, self.gamma = engine, tokenizer, metrics, gamma
        self.started = _now()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.engine.model_name:
            raise ApiError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.engine.model_name}' (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def submit(self, body: Any, ids: list[list[int]], budget: int, envelope: Envelope) -> list[Handle]:
        loop = asyncio.get_running_loop()
        handles: list[Handle] = []
        for i, prompt in enumerate(ids):
            request = EngineRequest(
                request_id=f"{envelope.id}-{i}",
                prompt_ids=tuple(prompt),
                max_new_tokens=budget,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(0, body.top_k),
                min_p=body.min_p,
                seed=body.seed,
                stop=body.stops,
                gamma=self.gamma,
            )
            try:
                handles.append(self.engine.submit(request, loop))
            except HfspecError as exc:  # settings the engine cannot take, named by it
                for h in handles:
                    self.abandon(h)
                raise ApiError(400, str(exc)) from None
            except QueueFull:
                for h in handles:
                    self.abandon(h)
                raise ApiError(
                    503,
                    "the server is busy: its batch and its queue are full; retry shortly",
                    code="overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                ) from None
        return handles

    async def run(self, request: Request, body: Any, ids: list[list[int]], budget: int, envelope: Envelope) -> Response:
        handles = self.submit(body, ids, budget, envelope)
        if body.stream:
            return StreamingResponse(
                self.stream(handles, envelope, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collect = asyncio.ensure_future(self.collect(handles))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left first: its requests are cancelled as collect ends
                collect.cancel()
                await asyncio.wait({collect})
        if collect.cancelled():
            return Response(status_code=499)  # nobody reads it; nginx's code for a client that closed
        choices, usages = collect.result()
        for c in choices:
            if c.finish_reason == "error":
                raise ApiError(500, "the engine failed on this request; see the server's log")
            if c.finish_reason == "cancelled":
                raise ApiError(503, SHUTTING_DOWN, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return JSONResponse(envelope.response(choices, usages))

    async def collect(self, handles: list[Handle]) -> tuple[list[Choice], list[Usage]]:
        choices = [Choice(i) for i in range(len(handles))]
        usages: list[Usage] = []
        async for i, event in self.events(handles):
            if isinstance(event, Delta):
                choices[i].add(event)
            else:
                choices[i].finish_reason = event.finish_reason
                usages.append(event.usage)
        return choices, usages

    async def stream(self, handles: list[Handle], envelope: Envelope, include_usage: bool) -> AsyncIterator[str]:
        usages: list[Usage] = []
        try:
            for i in range(len(handles)):
                first = envelope.first(i)
                if first is not None:
                    yield sse(first)
            async for i, event in self.events(handles):
                if isinstance(event, Delta):
                    if event.text or event.token_ids:
                        yield sse(envelope.piece(i, event, self.pieces(event)))
                    continue
                usages.append(event.usage)
                if event.finish_reason in ("error", "cancelled"):
                    status = 500 if event.finish_reason == "error" else 503
                    message = "the engine failed on this request" if status == 500 else SHUTTING_DOWN
                    yield sse(errors.error_body(status, message))
                    yield sse("[DONE]")
                    return
                yield sse(envelope.last(i, event.finish_reason))
            if include_usage:
                yield sse(envelope.chunk([], usage_dict(usages)))
            yield sse("[DONE]")
        except Exception as exc:  # after the 200: the error goes out as an event
            log.error("stream %s failed: %s: %s", envelope.id, type(exc).__name__, exc)
            yield sse(errors.error_body(500, f"internal error: {type(exc).__name__}"))
            yield sse("[DONE]")

    def pieces(self, delta: Delta) -> list[str] | None:
        """Each token's own text, where they add up to the delta's text (not across a split character)."""
        parts = [self.tokenizer.decode([i], skip_special_tokens=True) for i in delta.token_ids]
        return parts if "".join(parts) == delta.text else None

    async def events(self, handles: list[Handle]) -> AsyncIterator[tuple[int, Delta | Done]]:
        """The events of ``handles``, tagged by index, as they come; metrics counted; and, if the reader stops
        early (a client gone), the requests still running cancelled."""
        start = time.perf_counter()
        first: dict[int, float] = {}
        merged: asyncio.Queue[tuple[int, Delta | Done]] = asyncio.Queue()

        async def pump(i: int, handle: Handle) -> None:
            async for event in handle.events():
                await merged.put((i, event))

        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        left = set(range(len(handles)))
        try:
            while left:
                i, event = await merged.get()
                if isinstance(event, Delta) and event.token_ids:
                    first.setdefault(i, time.perf_counter() - start)
                elif isinstance(event, Done):
                    left.discard(i)
                    self.metrics.finished(
                        event.finish_reason, event.usage, first.get(i), time.perf_counter() - start, False
                    )
                    if event.error:
                        log.error("request %s failed in the engine: %s", handles[i].request.request_id, event.error)
                yield i, event
        finally:
            for p in pumps:
                p.cancel()
            for i in left:
                self.abandon(handles[i])

    def abandon(self, handle: Handle) -> None:
        """Cancel ``handle`` (its client is gone) and count its end when the engine reports it."""
        if handle.cancelled:
            return
        handle.cancel()
        asyncio.ensure_future(self._count_abandoned(handle))

    async def _count_abandoned(self, handle: Handle) -> None:
        start = time.perf_counter()
        while True:
            event = await handle.queue.get()
            if isinstance(event, Done):
                self.metrics.finished("cancelled", event.usage, None, time.perf_counter() - start, True)
                return


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the request's body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _BearerKey:
    """Every /v1 route wants ``Authorization: Bearer KEY``; checked before the body is read."""

    def __init__(self, app: ASGIApp, key: str, counter: Any = None):
        self.app, self.key, self.counter = app, key.encode(), counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            headers = dict(scope.get("headers", ()))
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                message = "a valid API key is needed: send 'Authorization: Bearer KEY'"
                if given:
                    message = "the API key is wrong: send 'Authorization: Bearer KEY' with the server's key"
                if self.counter is not None:
                    self.counter.labels(status="401").inc()
                body = errors.error_body(401, message, code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
