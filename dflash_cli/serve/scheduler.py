"""One engine, up to `max_batch` requests at a time: a worker thread per slot runs generations in arrival order.

With one slot, requests are decoded one after another. With more (and a build that can batch:
decoding/batched_engine.py), each worker decodes on its own engine view and their model calls run
together (continuous batching, decoding/batching.py); a finished request frees its slot at once.
Requests wait in a bounded queue; a full queue is refused at once (the caller answers 503). Each
job carries a cancel flag: the decoding loop checks it after every verify step, so a client that
disconnects frees the engine at the next step, and a job cancelled while waiting never starts.
Results travel back to the event loop of the request that asked for them. At shutdown, `cut_all`
tells every live request's handler to answer now (the worker stops its job at the next step).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from dflash_cli.decoding.result import GenerationResult
from dflash_cli.decoding.text_stream import TextStream
from dflash_cli.errors import DFlashError
from dflash_cli.serve import tools
from dflash_cli.serve.logprobs_body import chat_logprobs, completion_logprobs
from dflash_cli.serve.protocol import ApiError, GenRequest, finish_reason

log = logging.getLogger("dflash.serve")


class QueueFull(Exception):
    pass


@dataclass
class Outcome:
    result: GenerationResult
    text: str  # an echoed prompt's text first
    finish_reason: str
    logprobs: dict | None = None  # in the response's shape (serve/logprobs_body.py), where asked
    tool_calls: list[dict] | None = None  # the calls parsed out of the text (serve/tools.py), where tools were given


class Job:
    """A request handed to the worker; events arrive on `events` as (kind, payload):
    ("text", (str, the logprobs of the tokens since the last one or None)), then ("done", Outcome | None when
    cancelled before it started) or ("error", ApiError);
    the handler side may add ("gone", None) when its client disconnects, or ("cut", None) at shutdown."""

    def __init__(self, req: GenRequest, prompt_ids: list[int], loop: asyncio.AbstractEventLoop) -> None:
        self.req, self.prompt_ids, self.loop = req, prompt_ids, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancel.set()


class Scheduler:
    def __init__(self, engine: Any, queue_size: int, metrics: Any, mode: str = "dflash", max_batch: int = 1) -> None:
        self.engine, self.queue_size, self.metrics, self.mode = engine, queue_size, metrics, mode
        self.views, self.batcher, self.batch_refusal = [engine], None, None
        self.batch_check: dict | None = None  # batch invariance, where serving had to check it (the build could not)
        if max_batch > 1:
            self._open_batch(engine, max_batch)
        self.slots = len(self.views)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self._live: set[Job] = set()  # submitted and not yet answered by their handler
        self.closing = False  # set when shutdown begins: new requests get 503
        self._threads = [
            threading.Thread(target=self._work, args=(slot,), name=f"dflash-engine-{slot}", daemon=True)
            for slot in range(self.slots)
        ]
        for t in self._threads:
            t.start()

    def _open_batch(self, engine: Any, max_batch: int) -> None:
        from dflash_cli.decoding import batched_engine as be

        self.batch_refusal = be.batching_refusal(engine)
        fits = be.affordable_slots(engine, max_batch) if self.batch_refusal is None else 1
        if self.batch_refusal is None and fits < max_batch:
            self.batch_refusal = f"{max_batch} at once do not fit in memory ({fits} do)"
        if fits <= 1:
            return
        self.views, self.batcher = be.batched_views(engine, fits)
        if be.unchecked(engine) is None:
            return
        # The build could not afford the check; serving holds these sessions anyway, so it checks them now.
        self.batch_check = be.check_at_start(self.batcher, engine)
        if not self.batch_check["equal"]:
            self.batcher.close()
            self.views, self.batcher = [engine], None
            self.batch_refusal = "checked at start: a sequence's outputs changed with the others in its call"

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.running + self.waiting >= self.slots + self.queue_size:
                raise QueueFull
            self.waiting += 1
            self._live.add(job)
        self._jobs.put(job)

    def release(self, job: Job) -> None:
        """The handler has answered: the job no longer needs a word at shutdown (and is cancelled)."""
        job.cancel.set()
        with self._lock:
            self._live.discard(job)

    def cut_all(self) -> int:
        """Shutdown's deadline: every live handler answers at once; returns how many were cut."""
        with self._lock:
            live = list(self._live)
        for job in live:
            job.cancel.set()
            job.emit("cut", None)
        return len(live)

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.running, self.waiting

    def close(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout)
        if self.batcher is not None:
            self.batcher.close()

    def _work(self, slot: int) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.running += 1
            try:
                if job.cancel.is_set():
                    self.metrics.count_finished("abort")
                    job.emit("done", None)
                    continue
                outcome = self._generate(job, slot)
                self.metrics.record(outcome.result, outcome.finish_reason)
                job.emit("done", outcome)
            except DFlashError as exc:
                self.metrics.count_error()
                job.emit("error", ApiError.from_dflash(exc))
            except Exception as exc:  # a bug must not kill the worker: report it and serve the next request
                log.exception("generation failed")
                self.metrics.count_error()
                job.emit("error", ApiError(f"generation failed: {type(exc).__name__}: {exc}", status=500))
            finally:
                with self._lock:
                    self.running -= 1

    def _generate(self, job: Job, slot: int) -> Outcome:
        req, engine = job.req, self.views[slot]
        # Only this thread uses this view's tokenizer. With tools, text from a call's opening marker on is held
        # back (the calls are parsed once the answer is whole), without ending generation there.
        stream = TextStream(engine.decode, req.stop + ([tools.OPEN] if req.tools else []))
        entries = [] if req.logprobs is not None else None  # the loop appends as it commits
        streamed = _StreamedLogprobs(engine, req, entries) if req.stream and entries is not None else None

        at_call: list[bool] = []  # once the stream stops: whether at a call's marker (decided once)

        def on_commit(new: list[int]) -> str | None:
            delta = stream.push(new)
            fresh = streamed.take() if streamed is not None else None
            if delta or fresh:
                job.emit("text", (delta, fresh))
            if stream.stopped and not at_call:
                at_call.append(bool(req.tools) and tools.held_at_call(engine.decode, stream))
            if stream.stopped and not at_call[0]:
                return "stop_string"
            return "cancelled" if job.cancel.is_set() else None

        echoed = _echoed(engine, req, job.prompt_ids)
        if echoed:
            job.emit("text", (echoed, None))  # a stream shows it first
        if self.batcher is not None:
            self.batcher.enter(slot)
        try:
            result = engine.generate(
                job.prompt_ids,
                mode=self.mode,
                max_new_tokens=req.max_tokens,
                temperature=req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                seed=req.seed,
                repetition_penalty=req.repetition_penalty,
                on_commit=on_commit,
                images=req.images,
                ignore_eos=req.ignore_eos,
                logprobs=req.logprobs,
                prompt_logprobs=req.echo and req.logprobs is not None,
                constraint=req.constraint,
                logprobs_out=entries,
            )
        finally:
            if self.batcher is not None:
                self.batcher.leave(slot)
        tail = stream.finish()
        fresh = streamed.take() if streamed is not None else None
        if tail or fresh:
            job.emit("text", (tail, fresh))
        lp = _logprobs(engine, req, job, result)
        if req.tools is None:
            return Outcome(result, echoed + stream.text, finish_reason(result.stopped), lp)
        text = tools.cut(engine.decode(result.tokens), req.stop)
        parsed = tools.parse_calls(text, req.tools.fmt, req.tools.tools)
        if not parsed.calls and len(parsed.content) > len(stream.text):  # a marker but no call: text after all
            job.emit("text", (parsed.content[len(stream.text) :], None))
        reason = "tool_calls" if parsed.calls else finish_reason(result.stopped)
        return Outcome(result, parsed.content, reason, lp, parsed.calls or None)


def _echoed(engine: Any, req: GenRequest, prompt_ids: list[int]) -> str:
    """The prompt as an echoing completion shows it: its own text, or its token ids decoded."""
    if not req.echo:
        return ""
    return req.prompt if isinstance(req.prompt, str) else engine.decode(prompt_ids)


def _logprobs(engine: Any, req: GenRequest, job: Job, result: GenerationResult) -> dict | None:
    if result.logprobs is None:
        return None
    if req.kind == "chat":
        return chat_logprobs(engine.decode, result.logprobs)
    tokens, entries = list(result.tokens), list(result.logprobs)
    if req.echo:
        tokens, entries = job.prompt_ids + tokens, list(result.prompt_logprobs) + entries
    return completion_logprobs(engine.decode, tokens, entries)


class _StreamedLogprobs:
    """The entries the loop appended since the last chunk, in the response's shape (text offsets running on)."""

    def __init__(self, engine: Any, req: GenRequest, entries: list) -> None:
        self.engine, self.req, self.entries, self.sent, self.offset = engine, req, entries, 0, 0

    def take(self) -> dict | None:
        fresh, self.sent = self.entries[self.sent :], len(self.entries)
        if not fresh:
            return None
        if self.req.kind == "chat":
            return chat_logprobs(self.engine.decode, fresh)
        body = completion_logprobs(self.engine.decode, [e.token for e in fresh], fresh, start=self.offset)
        self.offset = body["text_offset"][-1] + len(body["tokens"][-1])
        return body
