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
from tandem.plan import NewReq, ScheduledReq, StepPlan
from tandem.runner.model_runner import ModelRunner
from tandem.sampling_params import SamplingParams


def worst_case_params() -> SamplingParams:
    """Every processor and the widest logprobs: the sampler's largest temporaries."""
    return SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                          frequency_penalty=0.1, presence_penalty=0.1, logit_bias={0: 0.5}, min_tokens=2,
                          logprobs=20, seed=0)


def build_runner(cfg: EngineConfig, cache: CacheConfig, model, speculator_factory) -> ModelRunner:
    """The runner over a KV pool of cache.num_blocks, with the speculator when there is a draft."""
    vocab = speculator_factory.vocab_size if speculator_factory is not None else None
    runner = ModelRunner(cfg.model, cache, cfg.sched, cfg.device, model, vocab_size=vocab)
    if speculator_factory is not None:
        runner.speculator = speculator_factory.build(cache, cfg.sched, runner)
    return runner


def capture_graphs(runner: ModelRunner, cfg: EngineConfig) -> None:
    """Capture the target's uniform decode and verification steps and the draft's graphs, all in
    one memory pool: they replay one after another on one stream and keep nothing in it between
    replays (logits and drafts live in static buffers), so their temporaries can share memory
    (H200, 8B + 1B shapes, k = 4, 256 sequences, probabilistic drafts: graphs 1.39 -> 1.05 GiB; at
    64 sequences 1.21 -> 1.31, within the measure's spread)."""
    k = cfg.spec.num_speculative_tokens if cfg.spec is not None else 0
    max_blocks = -(-(cfg.sched.max_model_len + k) // cfg.cache.block_size)
    pool = torch.cuda.graph_pool_handle()
    tokens_per_req = [1] + ([1 + k] if k else [])  # decode, and verification of k drafts
    runner.capture_graphs(tokens_per_req, cfg.sched.max_num_seqs, max_blocks, pool)
    if runner.speculator is not None:
        runner.speculator.capture_graphs(cfg.sched.max_num_seqs, max_blocks, pool)
    torch.cuda.empty_cache()  # the warm-up runs' temporaries, cached on the capture streams


def scratch_cache(cfg: EngineConfig) -> CacheConfig:
    """The rehearsal's KV pool: room for 2k + 3 tokens (a request at position 0 verifying k
    drafts, then drafting k more), shared by every request."""
    k = cfg.spec.num_speculative_tokens if cfg.spec is not None else 0
    return dataclasses.replace(cfg.cache, num_blocks=-(-(2 * k + 3) // cfg.cache.block_size))


def rehearse(cfg: EngineConfig, model, speculator_factory, use_graphs: bool) -> ModelRunner:
    """Build the runner over `scratch_cache(cfg)`, capture its graphs, and run one worst-case
    step, whose temporaries stay in the allocator's cache; -> the runner (the caller measures,
    then drops it)."""
    scratch = scratch_cache(cfg)
    runner = build_runner(cfg, scratch, model, speculator_factory)
    if use_graphs:
        capture_graphs(runner, cfg)
    k = cfg.spec.num_speculative_tokens if cfg.spec is not None else 0
    # Positions 0 .. d verified, d + 1 emitted; a tiny max_model_len gets fewer drafts, as the
    # scheduler would give it (the draft's later steps clamp their positions).
    d = min(k, cfg.sched.max_model_len - 2)
    blocks = list(range(scratch.num_blocks))  # every request on the same blocks: the values do not matter
    n, params = cfg.sched.max_num_seqs, worst_case_params()
    new = [NewReq(i, i, [1], 1, params, seed=i) for i in range(n)]
    reqs = [ScheduledReq(i, i, 0, [1], d, blocks, True, 0, num_next_drafts=d) for i in range(n)]
    runner.execute(StepPlan(new, reqs))
    return runner
