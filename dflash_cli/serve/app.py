"""The ASGI app: OpenAI-compatible completions and chat (streamed or not), models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash_cli.errors import DFlashError
from dflash_cli.serve.metrics import ServerMetrics
from dflash_cli.serve.protocol import ApiError, GenRequest, chunk, full_response, parse_request, usage, usage_chunk
from dflash_cli.serve.scheduler import Job, Outcome, QueueFull, Scheduler

RETRY_AFTER_S = 1  # what a 503 tells the client to wait; one verify step is far shorter


def create_app(engine: Any, *, model_name: str, queue_size: int = 8, mode: str = "dflash") -> FastAPI:
    """An app serving `engine` (an opened `Engine`) as `model_name`; one generation at a time."""
    metrics = ServerMetrics(model_name, engine.block_size if mode != "plain" else 1)
    scheduler = Scheduler(engine, queue_size, metrics, mode)
    created = int(time.time())
    app = FastAPI(title="dflash serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

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
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        req = parse_request(body, kind, model_name, engine.recipe.run)
        with scheduler.tokenizer_lock:
            prompt_ids = _encode(engine, req)
        if not req.max_tokens_given:  # like vLLM: an unspecified length never overflows the context
            room = engine.positions_for_generation - len(prompt_ids)
            req.max_tokens = max(1, min(req.max_tokens, room))
        try:
            engine.check_request(prompt_ids, req.max_tokens, req.temperature, req.top_k, req.top_p)
        except DFlashError as exc:
            raise ApiError.from_dflash(exc) from None
        job = Job(req, prompt_ids, asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFull:
            metrics.count_rejected()
            raise ApiError(
                f"the server is busy: one request running and {queue_size} waiting",
                status=503,
                code="server_busy",
                hint=f"retry after {RETRY_AFTER_S} s, or start the server with a larger --queue-size",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        if req.stream:
            return StreamingResponse(_events(job), media_type="text/event-stream")
        return await _whole(job, request)

    return app


def _encode(engine: Any, req: GenRequest) -> list[int]:
    try:
        if req.kind == "chat":
            return engine.encode_chat(req.prompt, req.enable_thinking)
        if isinstance(req.prompt, list):  # token ids
            vocab = len(engine.tokenizer)
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ApiError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(req.prompt)
        return engine.encode_prompt(req.prompt)
    except DFlashError as exc:
        raise ApiError.from_dflash(exc) from None


def _extension(outcome: Outcome) -> dict[str, Any]:
    r = outcome.result
    return {"acceptance_lengths": r.accept_lengths, "tau": r.tau, "mode": r.mode}


async def _whole(job: Job, request: Request) -> Response:
    """Wait for the whole completion; a client that goes away cancels it (freeing the engine)."""
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    return Response(status_code=499)
                continue
            if kind == "error":
                raise payload
            if kind == "done":
                use = usage(len(job.prompt_ids), payload.result.new_tokens)
                ext = _extension(payload)
                body = full_response(job.req, payload.text, payload.finish_reason, use, ext, payload.result.tokens)
                return JSONResponse(body)
    finally:
        job.cancel.set()  # harmless once done; stops the worker if this handler was cancelled


async def _events(job: Job) -> AsyncIterator[str]:
    """Server-sent events: text as it is committed, a closing chunk, usage if asked, then [DONE]."""
    req = job.req
    try:
        if req.kind == "chat":
            yield _sse(chunk(req, None, first=True))
        while True:
            kind, payload = await job.events.get()
            if kind == "text":
                yield _sse(chunk(req, payload))
            elif kind == "error":
                yield _sse(payload.body())
                break
            elif kind == "done":
                if payload is not None:
                    yield _sse({**chunk(req, None, payload.finish_reason), **_extension(payload)})
                    if req.include_usage:
                        yield _sse(usage_chunk(req, usage(len(job.prompt_ids), payload.result.new_tokens)))
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # a client that disconnected mid-stream frees the engine at the next verify step


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"
