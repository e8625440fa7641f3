"""Build the runner (and speculator) over a KV pool, capture its CUDA graphs, and rehearse both.

The KV pool is sized before the runner exists, yet what the runner allocates after it (per-slot
buffers, the CUDA graphs' static outputs and memory pool, the kernels and driver memory they
load, the sampler's temporaries) comes out of the same gpu_memory_utilization. `rehearse` builds
all of it once against a scratch pool of a few blocks (`scratch_cache`), captures every graph
and runs one worst-case step (max_num_seqs requests, k drafts each, every sampling feature on),
so that `tandem.runner.memory.after_pool_bytes` can read what it takes before the real pool is
sized.
"""
from __future__ import annotations

import dataclasses

import torch

from tandem.config import CacheConfig, EngineConfig
from tandem.plan import NewReq, ScheduledReq, StepPlan, StepResult
from tandem.runner.model_runner import ModelRunner
from tandem.sampling_params import SamplingParams


def worst_case_params() -> SamplingParams:
    """Every processor and the widest logprobs: the sampler's largest temporaries."""
    return SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                          frequency_penalty=0.1, presence_penalty=0.1, logit_bias={0: 0.5}, min_tokens=2,
                          logprobs=20, seed=0)


def build_runner(cfg: EngineConfig, cache: CacheConfig, model, speculator_factory) -> ModelRunner:
    """The runner over a KV pool of cache.num_blocks, with the speculator when there is a draft."""
    runner = ModelRunner(cfg.model, cache, cfg.sched, cfg.device, model, cfg.watermark)
    if speculator_factory is not None:
        runner.speculator = speculator_factory.build(cache, cfg.sched, runner)
    return runner


def capture_graphs(runner: ModelRunner, cfg: EngineConfig, stream: torch.cuda.Stream) -> None:
    """Capture the target's uniform decode and verification steps and the draft's graphs on
    stream (the engine's one capture stream, so the rehearsal's cuBLAS workspace is the real
    capture's too), all in one memory pool: they replay one after another on one stream and
    keep nothing in it between replays (logits and drafts live in static buffers), so their
    temporaries can share memory (H200, 8B + 1B shapes, k = 4, 256 sequences, probabilistic
    drafts: graphs 1.39 -> 1.05 GiB; at 64 sequences 1.21 -> 1.31, within the measure's spread).
    The piecewise graphs of the other steps (runner/piecewise.py) join the pool; each token
    bucket keeps its output rows there, which every caller reads before another graph replays."""
    k = cfg.spec.num_speculative_tokens if cfg.spec is not None else 0
    max_blocks = -(-(cfg.sched.max_model_len + k) // cfg.cache.block_size)
    pool = torch.cuda.graph_pool_handle()
    counts = cfg.spec.verify_counts if cfg.spec is not None else ()
    tokens_per_req = [1] + [1 + d for d in counts]  # decode, and verification of each number of drafts
    max_pieces = cfg.max_cudagraph_tokens
    sched = cfg.sched
    runner.capture_graphs(tokens_per_req, sched.max_num_seqs, max_blocks, stream, pool,
                          piecewise_tokens=min(max_pieces, sched.max_num_batched_tokens))
    if runner.speculator is not None and not cfg.spec.enforce_eager:  # a catch-up adds a row per request
        draft_tokens = sched.max_num_batched_tokens + sched.max_num_seqs
        runner.speculator.capture_graphs(sched.max_num_seqs, max_blocks, stream, pool,
                                         piecewise_tokens=min(max_pieces, draft_tokens))
    torch.cuda.empty_cache()  # the warm-up runs' temporaries, cached on the capture stream


def scratch_cache(cfg: EngineConfig) -> CacheConfig:
    """The rehearsal's KV pool: room for 2k + 3 tokens (a request verifying k drafts, then
    drafting k more), shared by every request and position (block ids repeat in the tables)."""
    k = cfg.spec.num_speculative_tokens if cfg.spec is not None else 0
    return dataclasses.replace(cfg.cache, num_blocks=-(-(2 * k + 3) // cfg.cache.block_size))


def rehearse(cfg: EngineConfig, model, speculator_factory, capture_stream: torch.cuda.Stream | None) -> ModelRunner:
    """Build the runner over `scratch_cache(cfg)`, capture its graphs on capture_stream (None:
    eager), and run the steps whose temporaries the allocator keeps cached, in the order a
    generation meets them: max_num_seqs prompts prefilled at once, as many of them as the token
    budget allows verifying k drafts (the graphs), then unequal numbers of drafts (as beside a
    prefill or near max_model_len: logits for every row outside the graphs' buffers). The first
    and the last run as serving would run them: eagerly above max_cudagraph_tokens, on the
    piecewise graphs up to it. Every step samples with every feature on. One step alone is not enough: each kind
    leaves blocks in the cache that the next kind cannot reuse (H200, 2-layer 128k-vocabulary
    models, 256 sequences with every feature: the cache grew 1.27 GiB at the prefill, 1.26 at
    the first verification and 0.5 more by the end, 76 MiB over gpu_memory_utilization with only
    the graph step rehearsed, 876 MiB under with these three). -> the runner (the caller
    measures, then drops it)."""
    scratch = scratch_cache(cfg)
    runner = build_runner(cfg, scratch, model, speculator_factory)
    if capture_stream is not None:
        capture_graphs(runner, cfg, capture_stream)
    sched, bs = cfg.sched, cfg.cache.block_size
    k = cfg.spec.num_speculative_tokens if cfg.spec is not None else 0
    # Verification at position 0 (d drafts, then one emitted token and d new drafts); a tiny
    # max_model_len gets fewer drafts, as the scheduler would give it (the draft's later steps
    # clamp their positions).
    d = max(0, min(k, sched.max_model_len - 2))
    n = min(sched.max_num_seqs, sched.max_num_batched_tokens)
    prompt_len = max(1, min(sched.max_num_batched_tokens // n, sched.max_model_len - 1 - d))
    blocks = [b % scratch.num_blocks for b in range(-(-(prompt_len + d + 1) // bs))]  # the values do not matter
    params = worst_case_params()
    dummy_step(runner, [1] * prompt_len, [0] * n, d, blocks, params)  # prefill
    n_verify = min(n, max(1, sched.max_num_batched_tokens // (1 + d)))  # as many as the token budget lets verify
    dummy_step(runner, [1], [d] * n_verify, d, blocks, params)  # uniform verification: the graphs
    if d >= 1:
        dummy_step(runner, [1], [d] * (n_verify - 1) + [d - 1], d, blocks, params)  # ragged: the pieces, or eager
    return runner


def dummy_step(runner: ModelRunner, tokens: list[int], num_drafts: list[int], num_next: int, blocks: list[int],
               params: SamplingParams, start_pos: int = 0, admit: bool = True) -> StepResult:
    """Run one step of len(num_drafts) requests in slots 0.., each feeding `tokens` at start_pos plus
    num_drafts[i] of its pending drafts, and proposing num_next (0: the draft skips the step), over
    one shared block table. admit: (re)admit the requests first (their slots' sampling state)."""
    m = len(num_drafts)
    new = [NewReq(i, i, tokens, len(tokens), params, seed=i) for i in range(m)] if admit else []
    skip = runner.speculator is not None and not num_next and len(tokens) == 1
    reqs = [ScheduledReq(i, i, start_pos, tokens, num_drafts[i], blocks, True, 0, num_next_drafts=num_next,
                         draft_skip=skip) for i in range(m)]
    return runner.execute(StepPlan(new, reqs, freed_slots=list(range(m)) if admit else []))
