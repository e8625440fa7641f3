"""Size the paged KV pool: from an explicit byte budget, or on GPU from a memory fraction."""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from tandem.config import EngineConfig
from tandem.errors import ConfigError
from tandem.models.decoder import KVCache
from tandem.oom import OutOfMemoryGuard, check_host_fits, host_available_bytes
from tandem.parallel.shard import shard_arch

logger = logging.getLogger("tandem")

CPU_DEFAULT_KV_BYTES = 4 << 30


def check_gpu_share(cfg: EngineConfig) -> None:
    """On a GPU sized from gpu_memory_utilization, before the weights load: vLLM's start-up check, that the
    free memory covers the share asked for, so that memory other processes hold is named at once rather
    than found as a pool too small. (The share bounds everything this process holds, its CUDA context and
    engines still alive in it too, so a second engine on a GPU asks for the whole of what the GPU may use.)"""
    cache = cfg.cache
    if cfg.device.type != "cuda" or cache.num_blocks is not None or cache.kv_cache_memory_bytes is not None:
        return
    torch.cuda.synchronize(cfg.device)
    gc.collect()
    torch.cuda.empty_cache()  # blocks an earlier engine cached are nobody's
    free, total = torch.cuda.mem_get_info(cfg.device)
    share = int(total * cache.gpu_memory_utilization)
    if free < share:
        raise ConfigError(
            f"gpu_memory_utilization={cache.gpu_memory_utilization} asks for {share / 2**30:.1f} GiB of the GPU's "
            f"{total / 2**30:.1f} GiB, but only {free / 2**30:.1f} GiB is free at start-up (other processes, or "
            f"engines still alive in this one, hold {(total - free) / 2**30:.1f} GiB); lower gpu_memory_utilization "
            "or free that memory"
        )


def num_kv_blocks(cfg: EngineConfig, model, draft_bytes_per_block: int = 0, draft_model=None,
                  after_pool: Callable[[], int] | None = None) -> tuple[int, int]:
    """Blocks that fit the budget, counting target and draft KV bytes per block together. On a
    GPU sized from gpu_memory_utilization, the largest step of both models is profiled (the draft
    runs the same prefill chunks), then after_pool() measures what the engine allocates after the
    pool (the runner's and speculator's buffers, the CUDA graphs, the sampler's temporaries;
    `after_pool_bytes`) and the pool takes what is left. -> (blocks, the bytes set aside for after the pool).

    Raises ConfigError when the pool cannot hold even one request of max_model_len tokens.
    """
    cache, sched = cfg.cache, cfg.sched
    later = 0  # bytes set aside for what the engine allocates after the pool
    per_block = bytes_per_block(cfg, draft_bytes_per_block)
    tokens_per_req = sched.max_model_len  # draft lookahead slots stop at max_model_len too
    blocks_per_req = -(-tokens_per_req // cache.block_size)
    if cache.num_blocks is not None:
        budget = cache.num_blocks * per_block
        source = f"num_gpu_blocks_override={cache.num_blocks}"
    elif cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
        source = f"kv_cache_memory_bytes={budget}"
    elif cfg.device.type == "cuda":
        with OutOfMemoryGuard(cfg.device, f"profiling the largest step (max_num_batched_tokens={sched.max_num_batched_tokens})",
                              "lower max_num_batched_tokens"):
            torch.cuda.empty_cache()  # blocks an earlier engine cached are not this one's
            torch.cuda.reset_peak_memory_stats(cfg.device)  # the peak from here on: not an earlier engine's
            _profile_forward(cfg, model)
            if draft_model is not None:
                _profile_forward(cfg, draft_model)
        budget = _gpu_budget(cfg)  # before after_pool(): the kernels it loads stay, as its other memory
        source = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
        if after_pool is not None:
            later = after_pool()
            budget -= later
            source += f" (less {later / 2**30:.2f} GiB for buffers, CUDA graphs and sampling)"
            if budget <= 0:  # no request length or cache dtype can help: the share itself is too small
                raise ConfigError(
                    f"{source} leaves no room for the KV cache; raise gpu_memory_utilization, or take less for "
                    "the buffers and graphs: lower max_num_seqs or max_cudagraph_tokens, or pass enforce_eager=True"
                )
    else:
        budget = min(CPU_DEFAULT_KV_BYTES, blocks_per_req * sched.max_num_seqs * per_block)
        source = "the CPU default (min of 4 GiB and max_num_seqs full-length requests)"
        available = host_available_bytes()  # (the weights loaded already count)
        if available is not None and budget > available // 2:
            budget = available // 2
            source = "the CPU default (half the memory this machine has available, less than 4 GiB)"
    if cfg.device.type == "cpu":
        check_host_fits(budget, f"the KV cache ({source})", f"lower {budget_setting(cfg)}")
    num_blocks = budget // per_block
    if num_blocks < blocks_per_req:
        need = blocks_per_req * per_block
        what, fix = f"max_model_len={sched.max_model_len}", "lower max_model_len"
        if cache.cache_dtype == "auto" and budget_setting(cfg) != "num_gpu_blocks_override":
            fix += " (or set kv_cache_dtype='fp8': a byte a cached value)"
        raise ConfigError(
            f"KV cache budget from {source} holds {num_blocks} blocks of {cache.block_size} tokens "
            f"({per_block} bytes each), but one request of {what} needs {blocks_per_req} blocks ({need} bytes); "
            f"raise {budget_setting(cfg)} or {fix}"
        )
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)", num_blocks, cache.block_size,
                num_blocks * per_block / 2**20, "float8 e4m3" if cache.cache_dtype != "auto" else "the model's dtype")
    return num_blocks, later


def after_pool_bytes(device: torch.device, build: Callable[[], object], scratch_bytes: int) -> int:
    """Device memory that build() takes and keeps (what it built, and blocks left in the
    allocator's cache), less scratch_bytes (its scratch KV pool); then what it built is freed.
    Read from the device's free memory, so memory outside PyTorch's allocator counts too.
    build() is `tandem.engine.build.rehearse`: every CUDA graph and a worst-case step. (The largest
    graph of each kind alone is not enough: H200, 8B + 1B shapes, k = 4, 64 sequences, 0.40 GiB
    measured that way, 0.95 taken by the whole ladder.)"""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    reserved_before = torch.cuda.memory_reserved(device)
    built = build()
    torch.cuda.synchronize(device)
    taken = free_before - torch.cuda.mem_get_info(device)[0]
    # At least what PyTorch's allocator grew by (free memory can also rise: another process).
    taken = max(taken, torch.cuda.memory_reserved(device) - reserved_before) - scratch_bytes
    del built
    gc.collect()
    torch.cuda.empty_cache()
    return max(taken, 0)


def bytes_per_block(cfg: EngineConfig, draft_bytes_per_block: int = 0) -> int:
    """KV bytes of one block id: the target's and the draft's together."""
    arch = shard_arch(cfg.model.arch, cfg.model.tp_size)  # this rank's key / value heads
    return KVCache.bytes_per_block(arch, cfg.cache.block_size, cfg.cache.kv_dtype(cfg.model.dtype)) \
        + draft_bytes_per_block


def budget_setting(cfg: EngineConfig) -> str:
    """The setting that decides the KV pool's size."""
    if cfg.cache.num_blocks is not None:
        return "num_gpu_blocks_override"
    if cfg.cache.kv_cache_memory_bytes is not None or cfg.device.type != "cuda":
        return "kv_cache_memory_bytes"
    return "gpu_memory_utilization"


@torch.inference_mode()
def _profile_forward(cfg: EngineConfig, model) -> None:
    """Run the largest step the scheduler can emit (max_num_batched_tokens tokens, logits for
    every sequence's verification rows) through model (the target, or the draft) against a
    scratch KV cache, so the allocator's peak includes activations before the KV pool takes what
    is left."""
    from tandem.layers.backend import AttnBackend

    n = min(cfg.sched.max_num_batched_tokens, cfg.sched.max_model_len)
    bs = cfg.cache.block_size
    num_blocks = -(-n // bs)
    kv = KVCache(model.arch, num_blocks, bs, cfg.cache.kv_dtype(model.model.embed_tokens.weight.dtype), cfg.device)
    meta = AttnBackend(bs, cfg.device, invariant=cfg.model.batch_invariant).prefill([0], [n], [list(range(num_blocks))])
    ids = torch.zeros(n, dtype=torch.int64, device=cfg.device)
    hidden = model(ids, torch.arange(n, device=cfg.device), meta, kv)
    rows = min(n, cfg.sched.max_num_seqs * (1 + cfg.sched.num_lookahead_tokens))
    model.compute_logits(hidden[:rows]).float()
    del kv, meta, hidden
    torch.cuda.synchronize(cfg.device)


def _gpu_budget(cfg: EngineConfig) -> int:
    """What is left of total * utilization after the weights and activations measured so far, and
    what is held outside this process's allocator (its CUDA context, other processes)."""
    device = cfg.device
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_reserved(device)  # what the allocator held at the peak, fragments too
    budget = int(total * cfg.cache.gpu_memory_utilization) - peak - outside
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization={cfg.cache.gpu_memory_utilization} leaves no room for the KV cache after "
            f"what this process already holds on the device ({peak / 2**30:.1f} GiB: the weights and the largest "
            f"step's activations, and any other engine still alive in it) and {outside / 2**30:.1f} GiB held outside "
            "its allocator (its CUDA context, other processes); raise gpu_memory_utilization, free the other "
            "engines, or use a smaller model"
        )
    return budget
