"""Beam search on the server (vLLM's use_beam_search on /v1/completions and /v1/chat/completions).

One prompt's search runs as a task over the async engine: each step submits every live beam as a
one-token request (tandem/beam_search.py's BeamSearch says which and takes their logprobs), so the
beams share the batch, and the prefix cache, with every other request. A BeamSearchStream stands
where a RequestStream does in the handlers: its one output is the search's final result, the
request's n best sequences as its n choices.

The search is let in once: its first step is held to max_queued_requests and refused while the
server drains, the later ones are not (a search is not cut off half-way by other requests, or by a
graceful shutdown, which waits for it as for any request in flight). Its steps' requests are left
out of the server's metrics (and never shed for higher priorities); the search is counted as one
request of n sequences, its choices' tokens as its output.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable

from tandem.beam_search import BeamSearch
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from tandem.server.async_engine import AsyncEngine


class BeamSearchStream:
    """One prompt's beam search, started at once; iterating it yields its final RequestOutput.
    release() (the handler is done, or the client left) cancels the search and aborts its steps."""

    def __init__(self, client: AsyncEngine, request_id: str, prompt_token_ids: list[int], prompt: str | None,
                 params: BeamSearchParams, step: SamplingParams, decode: Callable[[list[int]], str],
                 logprobs: bool, priority: int = 0, cache_salt: str | None = None):
        """step: the one-token request that extends a beam (beam_search.step_params); decode: a
        sequence's text from its tokens; logprobs: whether the choices carry their tokens' logprobs."""
        self.request_id = request_id
        self.finished = False
        self.released = False
        self._client, self._params, self._step = client, params, step
        self._priority, self._cache_salt = priority, cache_salt
        self._accepted_at: float | None = None  # once its first step was let in (and counted in the metrics)
        client.num_in_flight += 1  # (a drain waits for the search, not only for its step's requests)
        self._task = asyncio.ensure_future(self._search(prompt_token_ids, prompt, decode, logprobs))
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        client = self._client
        client.num_in_flight -= 1
        failed = task.cancelled() or task.exception() is not None  # (retrieved: not logged as never awaited)
        if failed and self._accepted_at is not None and client.metrics is not None:  # counted as a request is
            reason = "abort" if task.cancelled() else "error"
            client.metrics.on_finished([reason] * self._params.beam_width, time.monotonic() - self._accepted_at)

    async def _search(self, prompt_token_ids: list[int], prompt: str | None, decode, logprobs: bool) -> RequestOutput:
        client = self._client
        start = time.monotonic()
        search = BeamSearch([prompt_token_ids], self._params, client.engine.eos_token_ids,
                            client.engine.cfg.sched.max_model_len)
        while live := search.live():
            finals = await self._step_all([beam.tokens for _, beam in live], search.num_steps)
            if search.num_steps == 0:
                self._accepted_at = start
                if client.metrics is not None:
                    client.metrics.on_accepted(len(prompt_token_ids))
            # each one's logprobs entry: its beam's likeliest next tokens, and the one drawn
            search.advance(live, [f.outputs[0].logprobs[-1] for f in finals])
        (result,) = search.results(decode)
        if client.metrics is not None:
            client.metrics.on_tokens(sum(len(seq.tokens) - len(prompt_token_ids) for seq in result.sequences), None)
            client.metrics.on_finished([seq.finish_reason for seq in result.sequences], time.monotonic() - start)
        num = len(prompt_token_ids)
        choices = [CompletionOutput(i, seq.text, seq.tokens[num:], seq.cum_logprob, seq.logprobs if logprobs else None,
                                    seq.finish_reason, seq.stop_reason)
                   for i, seq in enumerate(result.sequences)]
        return RequestOutput(self.request_id, prompt, prompt_token_ids, choices, True)

    async def _step_all(self, beams: list[list[int]], step: int) -> list[RequestOutput]:
        """Run one step: every beam's one-token request, submitted together (so the engine takes
        them in one step), then their final outputs. Those submitted are released however it ends."""
        client = self._client
        # the first step is let in for every beam the search will hold; the later ones are past the limit
        adds = [asyncio.ensure_future(client.add_request(
            f"{self.request_id}-{step}-{j}", tokens, self._step, None, self._priority, self._cache_salt,
            internal=True, admitted=step > 0, num_seqs=self._params.beam_width if step == 0 else None))
            for j, tokens in enumerate(beams)]
        finals: list[asyncio.Future] = []
        try:
            streams = await asyncio.gather(*adds)
            finals = [asyncio.ensure_future(s.final()) for s in streams]
            return await asyncio.gather(*finals)
        finally:
            for task in adds + finals:
                if not task.done():
                    task.cancel()  # (an add's request is aborted by add_request itself)
            for add in adds:
                if add.done() and not add.cancelled() and add.exception() is None:
                    client.release(add.result())

    async def final(self) -> RequestOutput:
        try:
            return await self._task
        finally:
            self.finished = True

    async def __aiter__(self):
        yield await self.final()

    def release(self) -> None:
        """Idempotent: cancel the search if it is still running (its steps' requests are aborted)."""
        self.released = self.finished = True
        self._task.cancel()
