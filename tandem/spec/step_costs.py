"""Measure what a decode step costs at each batch size and number of drafts (adaptive speculation).

Runs at start-up on the engine's runner, before any request: one dummy request prefills a short
context; for each batch size n, n dummy requests over its block table fill slots 0.., then steps
of n requests each verifying K drafts and proposing K more (K = 0: a plain decode step, the
draft skipped) are timed end to end through `ModelRunner.execute` (the CUDA graphs where they
apply, the sampler, the draft round and the result's copy to the host), warm-up first, median
of the rest. The requests share one block
table, so the profile needs no more KV blocks than one request does; what it writes there is
overwritten by the first requests that get those blocks.
"""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time

from tandem.config import EngineConfig
from tandem.engine.build import dummy_step
from tandem.runner.graphs import CAPTURE_SIZES
from tandem.runner.model_runner import ModelRunner
from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import StepCosts

logger = logging.getLogger("tandem")

MAX_CONTEXT = 256  # tokens of context the profiled steps attend to (fewer when max_model_len is small)
EAGER_CONTEXT = 64  # ... on the eager path, whose prefill of it is slow and whose steps it hardly changes
EAGER_MAX_SIZE = 8  # the largest batch timed on the eager path (CPU): larger ones extrapolate the costs
EAGER_MAX_STEP_MS = 500.0  # ... or the last size whose steps all took less (a real model on a CPU)


def profile_sizes(cfg: EngineConfig) -> list[int]:
    """The batch sizes to time: the CUDA graphs' sizes up to max_num_seqs (a batch pads to one), or
    on the eager path powers of two up to EAGER_MAX_SIZE (a CPU step of a real model at hundreds
    of requests takes seconds; past the last size timed, StepCosts.at extrapolates)."""
    top = cfg.sched.max_num_seqs
    if cfg.use_cuda_graphs:
        return [s for s in CAPTURE_SIZES if s < top] + [top]
    top = min(top, EAGER_MAX_SIZE)
    return [2**i for i in range(top.bit_length()) if 2**i < top] + [top]


def profile_step_costs(runner: ModelRunner, cfg: EngineConfig) -> StepCosts:
    """-> the median ms of a step at every size of profile_sizes(cfg) and every K in 0..k (on the
    graphs 2 warm-up steps then 5 timed; eagerly 1 then 3, and no larger size once a step took
    EAGER_MAX_STEP_MS: the 1.5B / 0.5B Qwen pair on 2 CPU cores, k = 3, times batch 1 only)."""
    sched, k = cfg.sched, cfg.spec.num_speculative_tokens
    graphs = cfg.use_cuda_graphs
    warmups, reps = (2, 5) if graphs else (1, 3)
    sizes = [n for n in profile_sizes(cfg) if n <= sched.max_num_batched_tokens]
    n_max = sizes[-1]
    context = max(1, min(MAX_CONTEXT if graphs else EAGER_CONTEXT, sched.max_model_len - 2 * k - 3))
    # the context, k drafts verified, one emitted token and k more drafts; as a real request's, never past
    # max_model_len (a block table holds no more)
    span = min(context + 2 * k + 2, sched.max_model_len)
    blocks = list(range(min(-(-span // cfg.cache.block_size), cfg.cache.num_blocks)))
    params = SamplingParams()
    t0 = time.monotonic()
    # The costs of rounds that draft all their K: the confidence stop would cut the dummy rounds
    # anywhere; AdaptiveDrafts prices its cuts from how long real chains run.
    with _whole_rounds(runner.speculator):
        # One request prefills the context, in chunks of the token budget; every request shares its
        # block table, so each attends to that context (of both models).
        for start in range(0, context, sched.max_num_batched_tokens):
            chunk = min(sched.max_num_batched_tokens, context - start)
            dummy_step(runner, [1] * chunk, [0], k, blocks, params, start_pos=start)
        rows = []
        for n in sizes:
            dummy_step(runner, [1], [0] * n, k, blocks, params, start_pos=context)  # slots 0..n - 1, drafts pending
            row = []
            for K in range(k + 1):
                if n * (1 + K) > sched.max_num_batched_tokens:
                    row.append(math.inf)  # the scheduler cannot give every request K drafts
                    continue
                times = []
                for _ in range(warmups + reps):
                    t = time.perf_counter()
                    dummy_step(runner, [1], [K] * n, K, blocks, params, start_pos=context, admit=False)
                    times.append((time.perf_counter() - t) * 1e3)
                row.append(statistics.median(times[warmups:]))
            rows.append(row)
            if not graphs and max((t for t in row if not math.isinf(t)), default=0.0) > EAGER_MAX_STEP_MS:
                break
    for slot in range(n_max):
        runner.state.remove(slot)
    costs = StepCosts.from_measured(sizes[: len(rows)], rows, padded=graphs)
    logger.info("adaptive speculation: step ms by batch size (K = 0..%d drafts), measured in %.1f s: %s",
                k, time.monotonic() - t0, costs.table())
    return costs


@contextlib.contextmanager
def _whole_rounds(speculator):
    """The speculator's rounds draft their plan's number, the confidence stop off for the while."""
    threshold, speculator.confidence_threshold = speculator.confidence_threshold, None
    try:
        yield
    finally:
        speculator.confidence_threshold = threshold
