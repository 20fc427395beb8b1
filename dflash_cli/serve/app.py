"""The ASGI app: OpenAI-compatible completions and chat (streamed or not), models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash_cli.serve.intake import Intake, default_limit
from dflash_cli.serve.metrics import ServerMetrics
from dflash_cli.serve.protocol import ApiError, chunk, full_response, tool_calls_chunk, usage, usage_chunk
from dflash_cli.serve.scheduler import Job, Outcome, QueueFull, Scheduler

RETRY_AFTER_S = 1  # what a 503 tells the client to wait; one verify step is far shorter
log = logging.getLogger("dflash.serve")


def create_app(
    engine: Any,
    *,
    model_name: str,
    queue_size: int = 8,
    mode: str = "dflash",
    max_request_bytes: int | None = None,
    max_batch: int = 1,
) -> FastAPI:
    """An app serving `engine` (an opened `Engine`) as `model_name`; up to `max_batch` generations at a time."""
    metrics = ServerMetrics(model_name, engine.block_size if mode != "plain" else 1)
    scheduler = Scheduler(engine, queue_size, metrics, mode, max_batch)
    metrics.batch_stats = scheduler.batcher.stats if scheduler.batcher is not None else None
    intake = Intake(engine, model_name, max_request_bytes or default_limit(engine.ctx_len, engine.images is not None))
    created = int(time.time())
    app = FastAPI(title="dflash serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine
    app.state.intake = intake

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # Our own bug: still an OpenAI-style body (the traceback goes to the log).
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        err = ApiError(f"internal server error: {type(exc).__name__}", status=500, code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(ApiError(f"invalid request: {exc.errors()}").body(), status_code=400)

    @app.get("/health")
    async def health() -> dict:
        running, waiting = scheduler.counts()
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "dflash"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.ctx_len}]}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        running, waiting = scheduler.counts()
        return PlainTextResponse(metrics.render(running, waiting), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, "chat")

    async def _serve(request: Request, kind: str) -> Response:
        if scheduler.closing:
            raise _shutting_down()
        req, prompt_ids = await intake.read(request, kind)
        job = Job(req, prompt_ids, asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFull:
            metrics.count_rejected()
            raise ApiError(
                f"the server is busy: {scheduler.slots} request(s) running and {queue_size} waiting",
                status=503,
                code="server_busy",
                hint=f"retry after {RETRY_AFTER_S} s, or start the server with a larger --queue-size",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        if req.stream:
            return StreamingResponse(_events(job, scheduler), media_type="text/event-stream")
        return await _whole(job, request, scheduler)

    return app


def _shutting_down() -> ApiError:
    return ApiError(
        "the server is shutting down",
        status=503,
        code="server_shutting_down",
        hint="retry once it is back (or on another replica)",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _extension(outcome: Outcome) -> dict[str, Any]:
    r = outcome.result
    return {"acceptance_lengths": r.accept_lengths, "tau": r.tau, "mode": r.mode}


async def _whole(job: Job, request: Request, scheduler: Scheduler) -> Response:
    """Wait for the whole completion; a client that goes away cancels it at the next step."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        while True:
            kind, payload = await job.events.get()
            if kind == "gone" or (kind == "done" and payload is None):
                return Response(status_code=499)  # nobody reads it; nginx's code for a closed client
            if kind == "cut":
                raise _shutting_down()
            if kind == "error":
                raise payload
            if kind == "done":
                use = usage(len(job.prompt_ids), payload.result.new_tokens)
                ext = _extension(payload)
                tokens = payload.result.tokens
                body = full_response(
                    job.req, payload.text, payload.finish_reason, use, ext, tokens, payload.logprobs, payload.tool_calls
                )
                return JSONResponse(body)
    finally:
        watcher.cancel()
        scheduler.release(job)  # also stops the worker if this handler was cancelled


async def _watch_disconnect(request: Request, job: Job) -> None:
    # The body is read, so the next ASGI message is the client's disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()
    job.events.put_nowait(("gone", None))


async def _events(job: Job, scheduler: Scheduler) -> AsyncIterator[str]:
    """Server-sent events: text as it is committed, a closing chunk, usage if asked, then [DONE]."""
    req = job.req
    try:
        if req.kind == "chat":
            yield _sse(chunk(req, None, first=True))
        while True:
            kind, payload = await job.events.get()
            if kind == "text":
                text, logprobs = payload
                yield _sse(chunk(req, text, logprobs=logprobs))
            elif kind == "error":
                yield _sse(payload.body())
                break
            elif kind == "cut":  # shutdown's deadline: close the stream properly rather than drop it
                yield _sse(chunk(req, None, "abort"))
                break
            elif kind == "done":
                if payload is not None:
                    if payload.tool_calls:
                        yield _sse(tool_calls_chunk(req, payload.tool_calls))
                    yield _sse({**chunk(req, None, payload.finish_reason), **_extension(payload)})
                    if req.include_usage:
                        yield _sse(usage_chunk(req, usage(len(job.prompt_ids), payload.result.new_tokens)))
                break
        yield "data: [DONE]\n\n"
    finally:
        scheduler.release(job)  # a client that disconnected mid-stream frees the engine at the next step


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"
