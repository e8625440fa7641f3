"""AsyncEngine: one thread owns the Engine; asyncio handlers submit requests and await their outputs.

The Engine is not thread-safe, so only the loop thread touches it. Handlers put commands (add,
abort, stop) on a thread-safe queue; the loop drains it before every step, steps while any request
is unfinished, and hands each RequestOutput to its request's RequestStream on the handler's event
loop. The engine makes DELTA outputs (what is new since the last), which the stream adds to the
one cumulative output it keeps: a slow client costs one output of memory, not one per step, and
no step copies a request's whole output (a cumulative output from the engine copied its tokens
and logprobs every step: O(output) a request a step, on the engine's thread). Admission is
bounded: a request that would leave more than max_queued_requests sequences waiting for a batch
slot is refused with ServerOverloaded.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.engine.engine import Engine
from tandem.errors import ConfigError, RequestError, StepError
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams
from tandem.server.metrics import ServerMetrics
from tandem.text_buffer import TextBuffer

logger = logging.getLogger("tandem.server")


class ServerOverloaded(Exception):
    """Too many requests are already waiting; the client should retry later."""


class EngineStopped(Exception):
    """The engine loop is shutting down (or died) and takes no more work."""


class EngineStepError(Exception):
    """An engine step failed; the requests it ran (every request in flight, when the engine
    cannot say which) are ended with this error."""


_ACCEPTED = object()


class GrowingCompletion(CompletionOutput):
    """One sequence's cumulative output, grown by the engine's deltas. Its text is a TextBuffer
    (`+=` on a str copies the whole text every step: O(length) a request a step, on the event loop,
    under the GIL the engine thread needs too). Reading `text` joins it (a copy); a streaming
    reader takes `buffer.length` and `buffer.between` instead, which cost only what they return.
    (CompletionOutput's __init__ sets `text` through the setter: dataclasses.replace works.)"""

    @property
    def text(self) -> str:
        return self.buffer.text

    @text.setter
    def text(self, value: str) -> None:
        self.buffer = TextBuffer(value)


def put_all(pairs: list[tuple[RequestStream, object]]) -> list[tuple[RequestStream, object]]:
    """Hand each (stream, item) to its stream's event loop, in order, with one wake-up a loop rather
    than one an item: call_soon_threadsafe writes to the loop's self-pipe every time, ~3-8 us of the
    engine thread's step per call (dev CPU), 256 calls a step at 256 streams. -> the pairs whose
    loop is gone."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
    for pair in pairs:
        by_loop.setdefault(pair[0].loop, []).append(pair)
    gone = []
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_all, batch)
        except RuntimeError:  # the event loop is closed
            gone += batch
    return gone


def _deliver_all(batch: list[tuple[RequestStream, object]]) -> None:
    for stream, item in batch:
        stream._deliver(item)


class RequestStream:
    """The event-loop side of one request: its acceptance, its output so far, or the error that ended it.

    The output is one cumulative RequestOutput that each delivered delta grows in place (on the
    event loop, between a reader's awaits): next_output hands out that same object whenever it
    changed, so what a reader sees is consistent until it awaits, and newer after."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, n: int = 1, logprobs: bool = False):
        """n: the request's sequences; logprobs: whether it asked for sample logprobs."""
        self.request_id = request_id
        self.arrival_time = time.monotonic()
        self.finished = False
        self.released = False
        self.loop = loop
        self._event = asyncio.Event()
        self._accepted = False
        self._n, self._logprobs = n, logprobs
        self._output: RequestOutput | None = None
        self._fresh = False  # the output changed since next_output last returned it
        self._error: BaseException | None = None

    # ---------------------------------------------------------------- loop-thread side
    def put(self, item: object) -> bool:
        """Hand an item to the event loop; False when that loop is gone."""
        return not put_all([(self, item)])

    def _deliver(self, item: object) -> None:
        try:
            self._take(item)
        except Exception as e:  # (an output this stream cannot add up): its reader gets the error, not a hang
            logger.exception("request %s: its output could not be delivered", self.request_id)
            self._error = e
        self._event.set()

    def _take(self, item: object) -> None:
        if item is _ACCEPTED:
            self._accepted = True
        elif isinstance(item, BaseException):
            self._error = item
        else:
            self._add(item)
            self._fresh = True

    def _add(self, delta: RequestOutput) -> None:
        """Grow the cumulative output by an engine DELTA output."""
        out = self._output
        if out is None:
            lps = self._logprobs
            seqs = [GrowingCompletion(i, "", [], 0.0 if lps else None, [] if lps else None) for i in range(self._n)]
            out = self._output = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, seqs, False)
        for part in delta.outputs:
            seq = out.outputs[part.index]
            seq.buffer.append(part.text)
            seq.token_ids += part.token_ids
            if part.logprobs is not None:
                seq.logprobs += part.logprobs
            seq.cumulative_logprob = part.cumulative_logprob
            seq.finish_reason, seq.stop_reason = part.finish_reason, part.stop_reason
        if delta.prompt_logprobs is not None:  # on the first output alone
            out.prompt_logprobs = delta.prompt_logprobs
        out.finished, out.metrics = delta.finished, delta.metrics

    # ---------------------------------------------------------------- event-loop side
    async def accepted(self) -> None:
        """Return once the engine took the request; raise the error if it refused it."""
        while not self._accepted:
            if self._error is not None:
                raise self._error
            self._event.clear()
            await self._event.wait()

    async def next_output(self) -> RequestOutput:
        """The output so far, once it changed since the last call (waiting for that); raises the
        request's error. The same object every time: read it before awaiting, or see it grown."""
        while not self._fresh:
            if self._error is not None:
                self.finished = True
                raise self._error
            self._event.clear()
            await self._event.wait()
        self._fresh = False
        self.finished = self._output.finished
        return self._output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next_output()

    async def final(self) -> RequestOutput:
        out = None
        async for out in self:
            pass
        assert out is not None
        return out


@dataclass
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int = 0
    cache_salt: str | None = None
    internal: bool = False  # a piece of a request (a beam search's step): no server metrics, never shed
    admitted: bool = False  # continues work already let in: past the queue limit, and through a drain
    num_seqs: int | None = None  # the sequences the queue limit counts it as (None: params.n)
    matcher: object = None  # params' structured output compiled for this prompt (None: the engine compiles it)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Tracked:
    """Loop-thread bookkeeping of one live request."""

    stream: RequestStream
    num_tokens: list[int]  # tokens seen so far, per sequence
    last_time: list[float] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)  # per sequence, once it finished
    internal: bool = False  # _Add.internal


class AsyncEngine:
    """Runs an Engine on a background thread and serves many asyncio requests concurrently."""

    def __init__(self, engine: Engine, *, max_queued_requests: int = 256, metrics: ServerMetrics | None = None):
        if not isinstance(max_queued_requests, int) or isinstance(max_queued_requests, bool) or max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests={max_queued_requests!r} must be an integer >= 0")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[str, _Tracked] = {}  # loop thread only
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stopped = False  # the loop thread has ended (set under _stop_lock)
        self._stop_lock = threading.Lock()
        self._needs_step = False
        self.num_in_flight = 0  # event-loop side count of accepted, unfinished requests

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tandem-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new requests, wait up to drain_timeout_s for those in flight, abort the rest, stop.
        A second call (the app's lifespan after the server's own shutdown) finds nothing to do."""
        if not self.is_running:
            self._accepting = False
            return
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._commands.put(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    # ---------------------------------------------------------------- event-loop API
    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
        priority: int = 0, cache_salt: str | None = None, internal: bool = False, admitted: bool = False,
        num_seqs: int | None = None, matcher=None,
    ) -> RequestStream:
        """Submit a request; returns its stream once the engine accepted it. internal: a piece of a
        request the server reports itself (a beam search's step): left out of the server's metrics
        and never shed for a request of a higher priority; admitted: it continues work already let
        in (a beam search's later steps): not held to max_queued_requests, and taken while the
        server drains; num_seqs: the sequences max_queued_requests counts it as (None: params.n; a
        beam search's first step, one request, counts the beams it lets in); matcher: params'
        structured output compiled for this prompt (Engine.compile_structured), off the engine
        loop's thread (None: the engine compiles it there, while every request waits).

        Raises RequestError (invalid request), ServerOverloaded or EngineStopped.
        """
        self.check_accepting(admitted)
        self.engine.validate_priority(priority)  # before the queue's counts compare it
        if params.output_kind != RequestOutputKind.CUMULATIVE:  # a stream keeps the output so far
            raise RequestError(f"SamplingParams.output_kind={params.output_kind.name} is not served here: a request "
                               "stream holds each request's output so far, which is cumulative; leave "
                               "output_kind as CUMULATIVE (the default)")
        stream = RequestStream(request_id, asyncio.get_running_loop(), params.n, params.logprobs is not None)
        with self._stop_lock:  # (the loop thread's last drain answers every command put before it stopped)
            if self._stopped:
                raise EngineStopped("the engine stopped and takes no new requests")
            self._commands.put(_Add(stream, prompt_token_ids, params, prompt, priority, cache_salt, internal,
                                    admitted, num_seqs, matcher))
        try:
            await stream.accepted()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        self.num_in_flight += 1
        return stream

    def check_accepting(self, admitted: bool = False) -> None:
        """EngineStopped unless a new request (admitted: one continuing work let in) would be taken."""
        if not (self._accepting or admitted) or not self.is_running or self._stopped:
            raise EngineStopped("the server is shutting down and takes no new requests")

    def release(self, stream: RequestStream) -> None:
        """The handler is done with stream: abort it in the engine unless it finished. Idempotent."""
        if stream.released:
            return
        stream.released = True
        self.num_in_flight -= 1
        if not stream.finished:
            stream.finished = True
            self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---------------------------------------------------------------- the loop thread
    def _run(self) -> None:
        logger.info("engine loop started")
        while True:
            try:
                if not self._handle_commands():
                    break
                if self.engine.has_unfinished_requests() or self._needs_step:
                    self._step()
                if self.metrics is not None:
                    self.metrics.observe_engine(self.engine)
            except Exception:  # never let one bad request or step end the loop for everyone
                logger.exception("engine loop iteration failed; continuing")
        self._abort_all(EngineStopped("the server shut down before this request finished"))
        with self._stop_lock:  # no command is put after this: add_request refuses
            self._stopped = True
        while True:  # requests queued behind the stop (a fatal step's, which the loop did not await) are refused
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.stream.put(EngineStopped("the engine stopped and takes no new requests"))
        logger.info("engine loop stopped")

    def _handle_commands(self) -> bool:
        """Run queued commands (waiting for one when idle); False once told to stop."""
        idle = not self.engine.has_unfinished_requests() and not self._needs_step
        try:
            cmd = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            try:
                self._handle(cmd)
            except Exception:
                logger.exception("engine loop command %s failed", type(cmd).__name__)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            self._abort(cmd.request_id, None)
            return
        stream = cmd.stream
        if not (self._accepting or cmd.admitted):
            stream.put(EngineStopped("the server is shutting down and takes no new requests"))
            return
        num_seqs = cmd.params.n if cmd.num_seqs is None else cmd.num_seqs
        if not cmd.admitted and self._queued_after(num_seqs, cmd.priority) > self.max_queued_requests:
            stream.put(ServerOverloaded(
                f"the server is overloaded: more than max_queued_requests={self.max_queued_requests} sequences "
                "would be waiting for a batch slot; retry later"
            ))
            return
        params = cmd.params  # the engine sends only what is new; the stream adds it up
        if params.output_kind != RequestOutputKind.DELTA:
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        try:
            self.engine.add_request(stream.request_id, cmd.prompt_token_ids, params, prompt_text=cmd.prompt,
                                    priority=cmd.priority, cache_salt=cmd.cache_salt, matcher=cmd.matcher)
        except Exception as e:  # RequestError for bad input; anything else fails this request only
            stream.put(e)
            return
        n = cmd.params.n
        self._live[stream.request_id] = _Tracked(stream, [0] * n, [0.0] * n, [None] * n, cmd.internal)
        if self.metrics is not None and not cmd.internal:
            self.metrics.on_accepted(len(cmd.prompt_token_ids))
        stream.put(_ACCEPTED)
        if self.engine.scheduler.by_priority:
            self._shed(cmd.priority)

    def _queued_after(self, n: int, priority: int | None = None) -> int:
        """Sequences that would wait for a batch slot if n more were added now. Given a priority
        (under the priority policy), only those that would wait ahead of them: the waiting ones of
        that priority or better, for the slots not held by running ones as good (the rest it
        would preempt)."""
        sched = self.engine.scheduler
        running, waiting = sched.running, sched.waiting
        if priority is not None and sched.by_priority:
            running = [r for r in running if r.priority <= priority]
            waiting = [r for r in waiting if r.priority <= priority]
        free_slots = max(0, self.engine.cfg.sched.max_num_seqs - len(running))
        return max(0, len(waiting) + n - free_slots)

    def _shed(self, priority: int) -> None:
        """Bring the whole queue back within max_queued_requests once a request of `priority` was
        let in ahead of others: refuse the requests of a lower priority that have not started yet,
        the lowest and latest first (a 503, or the error event of a stream already answered).
        Started ones that were preempted stay: the queue can exceed the limit by those."""
        over = self._queued_after(0) - self.max_queued_requests
        if over <= 0:
            return
        for rank, _, request_id, num_seqs in sorted(self.engine.unstarted_requests(), reverse=True):
            if over <= 0 or rank <= priority:
                return
            if request_id not in self._live or self._live[request_id].internal:  # not this server's to refuse, or
                continue  # a piece of a request already let in (a beam search's step)
            self._abort(request_id, ServerOverloaded(
                f"the server is overloaded: requests of a higher priority took this one's place among the "
                f"max_queued_requests={self.max_queued_requests} sequences waiting for a batch slot; retry later"))
            over -= num_seqs

    def _abort(self, request_id: str, error: BaseException | None) -> None:
        tracked = self._live.pop(request_id, None)
        if tracked is None:
            return
        try:
            self.engine.abort_request(request_id)
        finally:
            self._needs_step = True  # the next step() reports (and forgets) the aborted request
            if error is not None:
                tracked.stream.put(error)
            if self.metrics is not None and not tracked.internal:  # a sibling (n > 1) finished before keeps its reason
                cut = "abort" if error is None else "error"
                self.metrics.on_finished([reason or cut for reason in tracked.finish_reasons],
                                         time.monotonic() - tracked.stream.arrival_time)

    def _abort_all(self, error: BaseException) -> None:
        for request_id in list(self._live):
            try:
                self._abort(request_id, error)
            except Exception:
                logger.exception("aborting request %s failed", request_id)

    def _step(self) -> None:
        self._needs_step = False
        try:
            outputs = self.engine.step()
        except StepError as e:  # the engine ended the requests of the failed step; the others go on
            logger.error("engine step failed: %s", e, exc_info=e.__cause__ is not None)
            error = EngineStepError(f"the engine failed while running this request: {e}")
            if e.fatal:  # the GPU cannot run anything more: end everything, stop (health turns 503)
                self._accepting = False
                self._commands.put(_Stop())
            if e.request_ids is None or e.fatal:  # failed while planning (nothing would end it), or dead
                self._abort_all(error)
            else:
                for request_id in e.request_ids:
                    self._abort(request_id, error)
            return
        except Exception as e:  # outside any step's requests: the engine's state is unknown
            logger.exception("engine step failed; ending the %d requests in flight", len(self._live))
            self._abort_all(EngineStepError(f"the engine failed while running this request: {e!r}"))
            return
        deliveries = []
        for out in outputs:
            tracked = self._live.get(out.request_id)
            if tracked is None:
                continue  # aborted
            try:
                self._record(tracked, out)
                deliveries.append((tracked.stream, out))
            except Exception as e:
                logger.exception("dispatching request %s failed", out.request_id)
                self._abort(out.request_id, e)
        for _, out in put_all(deliveries):  # (one wake-up of each handler loop a step)
            if not out.finished:
                self._abort(out.request_id, None)  # nobody is listening any more

    def _record(self, tracked: _Tracked, out: RequestOutput) -> None:
        """An output into its request's tracking: finish reasons, metrics, the live table."""
        now = time.monotonic()
        for seq in out.outputs:
            tracked.finish_reasons[seq.index] = seq.finish_reason
        if self.metrics is not None and not tracked.internal:
            self._observe(tracked, out, now)
        if out.finished:
            del self._live[out.request_id]

    def _observe(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        metrics = self.metrics
        for seq in out.outputs:  # a DELTA output: the tokens are new
            seen, new = tracked.num_tokens[seq.index], len(seq.token_ids)
            if new == 0:
                continue
            if seen == 0:
                metrics.on_first_token(now - tracked.stream.arrival_time)
                metrics.on_tokens(new, None)
            else:
                metrics.on_tokens(new, now - tracked.last_time[seq.index])
            tracked.num_tokens[seq.index] = seen + new
            tracked.last_time[seq.index] = now
        if out.finished:  # every sequence's reason: a DELTA output holds only those with something new
            metrics.on_finished([reason or "abort" for reason in tracked.finish_reasons],
                                now - tracked.stream.arrival_time)
