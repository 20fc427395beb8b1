"""A request's way in: the body read within a size limit, then parsed, validated and tokenised on a
thread of its own, so a huge or hostile request never holds up the event loop (other clients,
/health) or the engine's thread (which decodes with its own tokenizer)."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.requests import ClientDisconnect

from dflash_cli.errors import DFlashError
from dflash_cli.serve.protocol import ApiError, GenRequest, parse_request

MIN_LIMIT = 1 << 20
BYTES_PER_POSITION = 32  # a full context of escaped non-ASCII text is ~9 bytes a token: 32 is generous
DRAIN_BYTES = 64 << 20  # an over-limit body up to this size is read and dropped, so the client gets
# to read the 413 rather than a connection reset in the middle of its upload


IMAGE_LIMIT = 32 << 20  # a vision-language model's default: a few inline (base64) photos


def default_limit(ctx_len: int, images: bool = False) -> int:
    """Request bytes a server accepts by default: far more than a prompt filling the context needs."""
    return max(IMAGE_LIMIT if images else MIN_LIMIT, BYTES_PER_POSITION * ctx_len)


class Intake:
    def __init__(self, engine: Any, model_name: str, limit: int) -> None:
        self.engine = engine.with_own_tokenizer()
        self.model_name, self.limit = model_name, limit
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-intake")

    async def read(self, request: Any, kind: str) -> tuple[GenRequest, list[int]]:
        raw = await self._body(request)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, raw, kind)

    async def _body(self, request: Any) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await self._drain(request, int(declared))
            raise self._too_large(int(declared))
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > self.limit:
                    await self._drain(request, size)
                    raise self._too_large(None)
                parts.append(part)
        except ClientDisconnect:
            # The client left mid-upload: nobody reads the answer, and it is no bug of ours to log.
            raise ApiError(
                "the client closed the connection before sending the whole body", status=499, code="client_closed"
            ) from None
        return b"".join(parts)

    async def _drain(self, request: Any, size: int) -> None:
        if size > DRAIN_BYTES:
            return  # not worth reading: the connection closes after the answer
        try:
            async for part in request.stream():
                size += len(part)
                if size > DRAIN_BYTES:
                    return
        except Exception:  # the client gave up first; the answer goes nowhere either way
            return

    def _too_large(self, size: int | None) -> ApiError:
        said = f" ({size} bytes)" if size is not None else ""
        return ApiError(
            f"the request body{said} is over this server's limit of {self.limit} bytes",
            status=413,
            code="request_too_large",
            hint="a prompt cannot be longer than the context anyway; raise the limit with "
            "--set serve.max_request_bytes=N if a valid request needs it",
        )

    def _prepare(self, raw: bytes, kind: str) -> tuple[GenRequest, list[int]]:
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError("the request body nests too deeply to be a request", code="invalid_json") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        engine = self.engine
        req = parse_request(body, kind, self.model_name, engine.settings.request_defaults)
        prompt_ids = _encode(engine, req)
        if not req.max_tokens_given:  # like vLLM: an unspecified length never overflows the context
            room = engine.positions_for_generation - len(prompt_ids)
            req.max_tokens = max(1, min(req.max_tokens, room))
        try:
            engine.check_request(prompt_ids, req.max_tokens, req.temperature, req.top_k, req.top_p)
            engine.check_logprobs(req.logprobs)
            if req.constraint is not None:
                engine.compile_constraint(req.constraint)  # a grammar that does not compile is this request's 400
        except DFlashError as exc:
            raise ApiError.from_dflash(exc) from None
        return req, prompt_ids


def _encode(engine: Any, req: GenRequest) -> list[int]:
    try:
        if req.kind == "chat" and any(isinstance(m["content"], list) for m in req.prompt):
            if req.tools is not None:  # the image path renders no tools: refused, not dropped
                raise ApiError("tools with images in one request are not supported yet", param="tools")
            ids, req.images = _encode_images(engine, req.prompt)
            return ids
        if req.kind == "chat":
            return engine.encode_chat(req.prompt, req.enable_thinking, _tools_for(engine, req))
        if isinstance(req.prompt, list):  # token ids
            vocab = len(engine.tokenizer)
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ApiError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(req.prompt)
        return engine.encode_prompt(req.prompt)
    except DFlashError as exc:
        raise ApiError.from_dflash(exc) from None


def _encode_images(engine: Any, messages: list[dict]):
    """A chat with image parts: each image read (serve/media.py), then the target's own processing."""
    from pathlib import Path

    from dflash_cli.serve.media import MAX_IMAGES, read_image

    if engine.images is None:
        raise ApiError(f"this model ({engine.settings.family}) takes no images", param="messages")
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    if len(parts) > MAX_IMAGES:
        raise ApiError(f"{len(parts)} images in one request: at most {MAX_IMAGES}", param="messages")
    allowed = engine.settings.allowed_local_media_path
    pictures = [read_image(p["url"], Path(allowed) if allowed else None, p["where"]) for p in parts]
    for picture, part in zip(pictures, parts):
        engine.images.check_shape(picture, part["where"])  # named by its part, not its place in the list
    plain = [
        {
            "role": m["role"],
            "content": [
                {"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})} for p in m["content"]
            ]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in messages
    ]
    return engine.encode_with_images(plain, pictures)


def _tools_for(engine: Any, req: GenRequest) -> list[dict] | None:
    """The request's tools for the chat template, where this family's calls can be read back (serve/tools.py)."""
    if req.tools is None:
        return None
    from dataclasses import replace

    from dflash_cli.families import family_named

    fmt = family_named(engine.settings.family).tool_call_format
    if fmt is None:
        raise ApiError(
            f"tool calling is not supported for {engine.settings.family} targets yet",
            param="tools",
            hint="Qwen3, Qwen3-MoE, Qwen3-VL, Qwen3.5 / 3.6 and Qwen3-Next targets take tools",
        )
    req.tools = replace(req.tools, fmt=fmt)
    if req.constraint is None:  # tool_choice required or named: calls in this family's format
        req.constraint = req.tools.constraint()
    return req.tools.tools
