"""Beam search on the server (vLLM's use_beam_search on /v1/completions and /v1/chat/completions).

One prompt's search runs as a task over the async engine: each step submits every live beam as a
one-token request (tandem/beam_search.py's BeamSearch says which and takes their logprobs), so the
beams share the batch, and the prefix cache, with every other request. A BeamSearchStream stands
where a RequestStream does in the handlers: its one output is the search's final result, the
request's n best sequences as its n choices.
"""
from __future__ import annotations

import asyncio
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
        self._task = asyncio.ensure_future(self._search(prompt_token_ids, prompt, decode, logprobs))
        # a search cancelled or failed before anyone awaits it: retrieve its error, so it is not logged
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _search(self, prompt_token_ids: list[int], prompt: str | None, decode, logprobs: bool) -> RequestOutput:
        client = self._client
        search = BeamSearch([prompt_token_ids], self._params, client.engine.eos_token_ids,
                            client.engine.cfg.sched.max_model_len)
        while live := search.live():
            streams = []
            try:
                for j, (_, beam) in enumerate(live):
                    streams.append(await client.add_request(f"{self.request_id}-{search.num_steps}-{j}", beam.tokens,
                                                            self._step, None, self._priority, self._cache_salt))
                finals = await asyncio.gather(*(s.final() for s in streams))
            finally:
                for s in streams:
                    client.release(s)
            # each one's logprobs entry: its beam's likeliest next tokens, and the one drawn
            search.advance(live, [f.outputs[0].logprobs[-1] for f in finals])
        (result,) = search.results(decode)
        num = len(prompt_token_ids)
        choices = [CompletionOutput(i, seq.text, seq.tokens[num:], seq.cum_logprob, seq.logprobs if logprobs else None,
                                    seq.finish_reason, seq.stop_reason)
                   for i, seq in enumerate(result.sequences)]
        return RequestOutput(self.request_id, prompt, prompt_token_ids, choices, True)

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
