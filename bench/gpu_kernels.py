"""Micro-benchmark of the Triton kernels (tandem/kernels/) against their torch counterparts.

    python bench/gpu_kernels.py                 # needs CUDA and Triton; prints one table
    python bench/gpu_kernels.py --json out.json

Main times are GPU times: 10 calls replayed in a CUDA graph (as the engine runs them), the L2
flushed by a 256 MB memset before every call and the memsets' own time (a graph of memsets
alone) subtracted; median of 7 replays. "eager us" is the wall time per call of the Triton
wrapper called in a plain loop (host launch overhead included). Each row gives the minimal
bytes the kernel must move (every input read once, every output written once) and the
bandwidth that implies, against the 4.3 TB/s device-to-device copy measured on the H200
(read + write). Attention prefill rows give TFLOP/s instead.
Shapes: Llama-3-8B attention (32 query heads, 8 KV heads, D 128, bf16, block size 16) and
its 128256-token vocabulary for the samplers.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import environment, print_table  # noqa: E402


@functools.cache
def copy_bw() -> float:
    """bytes/s of a device-to-device copy (read + write), measured once, as gpu_bench's roofline takes it."""
    from bench.gpu_bench import copy_bandwidth

    return copy_bandwidth()

H, HKV, D, BS = 32, 8, 128, 16
VOCAB = 128256
DEV = "cuda"


def _replay_s(graph, reps: int = 7) -> float:
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def bench(fn, n: int = 10) -> float:
    """GPU seconds per call of fn: n calls in a CUDA graph, each after an L2 flush, minus the
    flushes alone. nan if fn cannot be captured."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    both, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(both):
            for _ in range(n):
                flush.zero_()
                fn()
    except Exception as e:  # noqa: BLE001
        print(f"capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return float("nan")
    with torch.cuda.graph(flush_only):
        for _ in range(n):
            flush.zero_()
    t = (_replay_s(both) - _replay_s(flush_only)) / n
    del both, flush_only, flush
    return max(t, 0.0)


def eager(fn, n: int = 50) -> float:
    """Wall seconds per call of fn in a plain loop (host overhead or GPU time, whichever is larger)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def paged_setup(q_lens: list[int], ctx_lens: list[int], dtype=torch.bfloat16, head_dim: int = D):
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [-(-s // BS) for s in seq_lens]
    perm = torch.randperm(sum(nblk)).tolist()
    tables, off = [], 0
    for n in nblk:
        tables.append(perm[off : off + n])
        off += n
    k_cache = torch.randn(sum(nblk), BS, HKV, head_dim, device=DEV, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(q_lens), H, head_dim, device=DEV, dtype=dtype)
    bt = torch.zeros(len(tables), max(nblk), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, bt.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV), cu, tables


def row_attention(name: str, q_lens: list[int], ctx_lens: list[int], flops_mode: bool = False) -> dict:
    from tandem.kernels.attention import paged_attention
    from tandem.layers.attention import build_attn_metadata
    from tandem.layers.attention import paged_attention as torch_attention

    q, kc, vc, bt, sl, cu, tables = paged_setup(q_lens, ctx_lens)
    out = torch.empty_like(q)
    scale = D**-0.5
    tri = lambda: paged_attention(q, kc, vc, bt, sl, cu, max(q_lens), scale, out)  # noqa: E731
    t_tri, t_eager = bench(tri), eager(tri)
    meta = build_attn_metadata(ctx_lens, q_lens, tables, BS, torch.device(DEV))
    k_new = torch.randn(q.shape[0], HKV, D, device=DEV, dtype=q.dtype)  # only read by no-prefix groups
    try:
        t_ref = bench(lambda: torch_attention(q, k_new, k_new, kc, vc, meta, scale))
    except torch.OutOfMemoryError:
        t_ref = float("nan")
    kv_bytes = sum(s for s in sl.tolist()) * HKV * D * 2 * q.element_size()
    nbytes = kv_bytes + 2 * q.numel() * q.element_size()
    pairs = sum(c * n + n * (n + 1) // 2 for c, n in zip(ctx_lens, q_lens))
    flops = 4 * H * D * pairs
    return dict(kernel="paged_attention", case=name, triton_us=t_tri * 1e6, torch_us=t_ref * 1e6, bytes=nbytes,
                flops=flops, compute_bound=flops_mode, eager_us=t_eager * 1e6)


def row_kv_store(num_tokens: int) -> dict:
    from tandem.kernels.kv_store import kv_store
    from tandem.layers.attention import store_kv

    num_blocks = 4096
    kc = torch.randn(num_blocks, BS, HKV, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    k = torch.randn(num_tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * BS, device=DEV)[:num_tokens]
    tri = lambda: kv_store(k, v, kc, vc, slots)  # noqa: E731
    t_tri, t_eager = bench(tri), eager(tri)
    t_ref = bench(lambda: store_kv(k, v, kc, vc, slots))
    nbytes = 2 * 2 * k.numel() * k.element_size()
    return dict(kernel="kv_store", case=f"{num_tokens} tokens", triton_us=t_tri * 1e6, torch_us=t_ref * 1e6,
                bytes=nbytes, eager_us=t_eager * 1e6)


def row_gumbel(n: int) -> dict:
    from tandem.kernels.gumbel import gumbel_sample
    from tandem.sampling.gumbel import TARGET_SALT, gumbel_argmax

    logits = torch.randn(n, VOCAB, device=DEV) * 3
    temp = torch.full((n,), 0.8, device=DEV)
    seeds = torch.randint(0, 2**62, (n,), device=DEV)
    pos = torch.randint(0, 4096, (n,), device=DEV)
    out = torch.empty(n, dtype=torch.int64, device=DEV)
    tri = lambda: gumbel_sample(logits, temp, seeds, pos, TARGET_SALT, out)  # noqa: E731
    t_tri, t_eager = bench(tri), eager(tri)
    t_ref = bench(lambda: gumbel_argmax(logits / temp[:, None], seeds, pos, TARGET_SALT))
    return dict(kernel="gumbel_sample", case=f"n={n} V={VOCAB}", triton_us=t_tri * 1e6, torch_us=t_ref * 1e6,
                bytes=logits.numel() * 4, eager_us=t_eager * 1e6)


def row_rejection(num_reqs: int, k: int, greedy_drafts: bool = False) -> dict:
    """greedy_drafts: the draft's argmax, verified with q one-hot (the coupled test)."""
    from tandem.kernels.rejection import rejection_sample
    from tandem.sampling.gumbel import DRAFT_SALT, gumbel_argmax
    from tandem.spec.rejection import rejection_sample as torch_rejection

    rows = num_reqs * (k + 1)
    p = torch.randn(rows, VOCAB, device=DEV) * 2
    q = p + torch.randn_like(p) * 0.5
    row_req = torch.arange(num_reqs, device=DEV).repeat_interleave(k + 1)
    row_index = torch.arange(k + 1, device=DEV).repeat(num_reqs)
    bonus = row_index == k
    seeds = torch.randint(0, 2**62, (num_reqs,), device=DEV)[row_req]
    pos = torch.randint(0, 4096, (num_reqs,), device=DEV)[row_req] + row_index
    drafts = torch.where(bonus, -1, q.argmax(-1) if greedy_drafts else gumbel_argmax(q, seeds, pos, DRAFT_SALT))
    greedy = torch.zeros(rows, dtype=torch.bool, device=DEV)
    sampled = torch.arange(rows, device=DEV)
    args = (p, drafts, bonus, greedy, sampled, None if greedy_drafts else q, seeds, pos, row_req, row_index, num_reqs)
    tri = lambda: rejection_sample(*args)  # noqa: E731
    t_tri, t_eager = bench(tri), eager(tri)
    t_ref = bench(lambda: torch_rejection(*args))
    _, emitted = rejection_sample(*args)
    # Rows a request reaches are read (p and q) once, and the stop row once more.
    reached = float(emitted.sum())
    nbytes = int((reached * (1 if greedy_drafts else 2) + num_reqs * 2) * VOCAB * 4)
    drafts_kind = "greedy" if greedy_drafts else "sampled"
    return dict(kernel="rejection_sample", case=f"reqs={num_reqs} k={k} V={VOCAB} {drafts_kind} drafts "
                                                 f"(acc {reached / num_reqs - 1:.1f})",
                triton_us=t_tri * 1e6, torch_us=t_ref * 1e6, bytes=nbytes, eager_us=t_eager * 1e6)


def sweep_decode() -> list[list]:
    """Decode-attention tile sweep (BLOCK_N, num_warps, num_stages) at B=1 / 8 / 32 / 64, ctx 4096."""
    from tandem.kernels.attention import paged_attention

    rows = []
    for b in (1, 8, 32, 64):
        q, kc, vc, bt, sl, cu, _ = paged_setup([1] * b, [4095] * b)
        out = torch.empty_like(q)
        nbytes = b * 4096 * HKV * D * 2 * 2
        for tile in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 4, 1), (128, 8, 3), (32, 4, 4), (64, 8, 4)):
            try:
                t = bench(lambda: paged_attention(q, kc, vc, bt, sl, cu, 1, D**-0.5, out, tile_override=tile))
            except Exception as e:  # noqa: BLE001  (a tile may not fit shared memory)
                print(f"tile {tile}: {type(e).__name__}", flush=True)
                continue
            rows.append([f"B={b}", str(tile), f"{t * 1e6:.1f}", f"{100 * nbytes / t / copy_bw():.0f}%"])
    return rows


# Linear layers at batch 1 (out rows, in features): Llama-3.1-8B, Llama-3.2-1B.
GEMV_SHAPES = [
    ("8b qkv", 6144, 4096), ("8b o", 4096, 4096), ("8b gate_up", 28672, 4096), ("8b down", 4096, 14336),
    ("8b lm_head", 128256, 4096),
    ("1b qkv", 3072, 2048), ("1b o", 2048, 2048), ("1b gate_up", 16384, 2048), ("1b down", 2048, 8192),
    ("1b lm_head", 128256, 2048),
    ("q1.5b qkv", 2048, 1536), ("q1.5b o", 1536, 1536), ("q1.5b gate_up", 17920, 1536), ("q1.5b down", 1536, 8960),
    ("q1.5b lm_head", 151936, 1536),
]
GEMV_CONFIGS = [(4, 1024, 4), (8, 512, 4), (2, 1024, 4), (4, 512, 4), (4, 2048, 8), (8, 1024, 8),
                (16, 512, 4), (16, 256, 4)]


def _rotating(fn_of_w, ws, reps: int = 5) -> float:
    """GPU seconds per call: one graph calls fn on each of `ws` in turn (their total >> L2, as
    the weights of a decode step), median of `reps` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in ws[:2]:
            fn_of_w(w)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            fn_of_w(w)
    t = _replay_s(g, reps) / len(ws)
    del g
    return t


def sweep_gemv() -> list[list]:
    """M = 1 linear layers: cuBLAS (F.linear) against the Triton GEMV at each tile config."""
    import torch.nn.functional as F

    from tandem.kernels.gemv import gemv, gemv_config

    rows = []
    for name, n, k in GEMV_SHAPES:
        nbytes = 2 * n * k
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(max(4, min(64, (3 << 30) // nbytes)))]
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        err = (gemv(x, ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
        cublas = _rotating(lambda w: F.linear(x, w), ws)
        times = {cfg: _rotating(lambda w, cfg=cfg: gemv(x, w, config=cfg), ws) for cfg in GEMV_CONFIGS}
        best = min(times, key=times.get)
        frac = lambda t: f"{100 * nbytes / t / copy_bw():.0f}%"  # noqa: E731  (the roofline's definition)
        rows.append([name, f"{cublas * 1e6:.1f}", frac(cublas), f"{times[gemv_config(n, k)] * 1e6:.1f}",
                     str(best), f"{times[best] * 1e6:.1f}", frac(times[best]), f"{err:.1e}"]
                    + [f"{times[c] * 1e6:.1f}" for c in GEMV_CONFIGS])
        del ws
        torch.cuda.empty_cache()
    return rows


FP8_CONFIGS = [(4, 1024, 4), (4, 2048, 4), (8, 1024, 4), (8, 2048, 8), (2, 2048, 4), (16, 1024, 8),
               (16, 512, 4), (8, 512, 4), (32, 512, 8), (4, 4096, 4), (4, 4096, 8), (16, 256, 4)]


def sweep_gemv_fp8() -> list[list]:
    """M = 1 GEMV with fp8 e4m3 weights (the fp8 target: the 8B's decoder shapes; the fp8 draft: the
    1B's) at each tile, against the bf16 GEMV at its default tile; "of copy bw" counts the fp8 bytes
    (cold weights, us per call)."""
    from tandem.kernels.gemv import gemv, gemv_config
    from tandem.layers.quant import quantize_fp8

    rows = []
    for name, n, k in GEMV_SHAPES[:4] + GEMV_SHAPES[5:10]:  # the 8B target's (its head stays bf16), the 1B draft's
        count = max(4, min(64, (3 << 30) // (2 * n * k)))
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        bf16 = _rotating(lambda w: gemv(x, w), ws)
        q8 = [quantize_fp8(w) for w in ws]
        del ws
        times = {cfg: _rotating(lambda qs, cfg=cfg: gemv(x, qs[0], config=cfg, w_scale=qs[1]), q8)
                 for cfg in dict.fromkeys(FP8_CONFIGS + [gemv_config(n, k, True)])}
        best = min(times, key=times.get)
        frac = lambda t: f"{100 * n * k / t / copy_bw():.0f}%"  # noqa: E731
        default = gemv_config(n, k, True)
        rows.append([name, f"{bf16 * 1e6:.1f}", str(default), f"{times[default] * 1e6:.1f}",
                     str(best), f"{times[best] * 1e6:.1f}", frac(times[best])]
                    + [f"{times[c] * 1e6:.1f}" for c in FP8_CONFIGS])
        del q8
        torch.cuda.empty_cache()
    return rows


def sweep_gemv_fused() -> list[list]:
    """The one-row GEMV plain, with the RMSNorm inside (norm=RowNorm) and adding into the residual
    (gemv_add_), against rms_norm + GEMV, at the 8B / 1B shapes (cold weights, us per call)."""
    from tandem.kernels.fused import rms_norm
    from tandem.kernels.gemv import RowNorm, gemv, gemv_add_

    rows = []
    for name, n, k in GEMV_SHAPES[:9]:
        if "lm_head" in name:
            continue
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(max(4, min(64, (3 << 30) // (2 * n * k))))]
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        res = torch.randn(1, n, device=DEV, dtype=torch.bfloat16)
        nw = torch.ones(k, device=DEV, dtype=torch.bfloat16)
        sumsq = torch.rand(512, device=DEV)
        plain = _rotating(lambda w: gemv(x, w), ws)
        normed = _rotating(lambda w: gemv(x, w, norm=RowNorm(nw, 1e-5, sumsq)), ws)
        pair = _rotating(lambda w: gemv(rms_norm(x, nw, 1e-5), w), ws)
        added = _rotating(lambda w: gemv_add_(x, w, res), ws)
        cfgs = {c: _rotating(lambda w, c=c: gemv(x, w, norm=RowNorm(nw, 1e-5, sumsq), config=c), ws)
                for c in ((8, 512, 4), (16, 512, 4), (8, 1024, 8))}
        rows.append([name, f"{plain * 1e6:.1f}", f"{normed * 1e6:.1f}", f"{pair * 1e6:.1f}", f"{added * 1e6:.1f}"]
                    + [f"{c}: {t * 1e6:.1f}" for c, t in cfgs.items()])
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_gemv_fp8_fused() -> list[list]:
    """The one-row fp8 GEMVs as a decoder layer runs them (the fp8 target's 8B shapes, the fp8
    draft's 1B): o adding into the residual, gate_up normalizing its input, down taking
    [gate | up] with SiLU-and-mul inside and adding; per tile, against the separate kernels
    (rms_norm / silu_and_mul, then the plain GEMV at its default tile; cold weights, us)."""
    from tandem.kernels.fused import rms_norm, silu_and_mul
    from tandem.kernels.gemv import RowNorm, gemv, gemv_add_, gemv_config
    from tandem.layers.quant import quantize_fp8

    rows = []
    for name, n, k in [s for s in GEMV_SHAPES[:10] if s[0].split()[1] in ("o", "gate_up", "down")]:
        count = max(4, min(64, (3 << 30) // (2 * n * k)))
        q8 = [quantize_fp8(torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02) for _ in range(count)]
        kind = name.split()[1]
        x = torch.randn(1, 2 * k if kind == "down" else k, device=DEV, dtype=torch.bfloat16)
        res = torch.randn(1, n, device=DEV, dtype=torch.bfloat16)
        nw = torch.ones(k, device=DEV, dtype=torch.bfloat16)
        sumsq = torch.rand(512, device=DEV)
        if kind == "o":
            fused = lambda qs, c: gemv_add_(x, qs[0], res, config=c, w_scale=qs[1])  # noqa: E731
            apart = lambda qs: gemv_add_(x, qs[0], res, w_scale=qs[1])  # noqa: E731
        elif kind == "gate_up":
            fused = lambda qs, c: gemv(x, qs[0], norm=RowNorm(nw, 1e-5, sumsq), config=c, w_scale=qs[1])  # noqa: E731
            apart = lambda qs: gemv(rms_norm(x, nw, 1e-5), qs[0], w_scale=qs[1])  # noqa: E731
        else:
            fused = lambda qs, c: gemv_add_(x, qs[0], res, act="silu_mul", config=c, w_scale=qs[1])  # noqa: E731
            apart = lambda qs: gemv_add_(silu_and_mul(x), qs[0], res, w_scale=qs[1])  # noqa: E731
        times = {c: _rotating(lambda qs, c=c: fused(qs, c), q8)
                 for c in dict.fromkeys(FP8_CONFIGS + [gemv_config(n, k, True)])}
        best = min(times, key=times.get)
        default = gemv_config(n, k, True)
        rows.append([name, f"{_rotating(apart, q8) * 1e6:.1f}", str(default), f"{times[default] * 1e6:.1f}", str(best),
                     f"{times[best] * 1e6:.1f}"] + [f"{times[c] * 1e6:.1f}" for c in FP8_CONFIGS])
        del q8
        torch.cuda.empty_cache()
    return rows


ROWS_CONFIGS = [(16, 256, 4, 4), (16, 128, 4, 6), (16, 512, 4, 3), (16, 256, 4, 6), (32, 256, 4, 4),
                (32, 128, 4, 6), (16, 256, 8, 4), (64, 128, 4, 4)]


def sweep_rows(m: int) -> list[list]:
    """M = 2..32 rows (a verification of 1 + k tokens, the draft's catch-up, decode steps of up
    to 32 requests): cuBLAS against
    gemm_rows at each tile, and the one-row GEMV's time for scale (cold weights, us per call)."""
    import torch.nn.functional as F

    from tandem.kernels.gemm_rows import gemm_rows, rows_config
    from tandem.kernels.gemv import gemv

    rows = []
    for name, n, k in GEMV_SHAPES[:10]:
        nbytes = 2 * n * k
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(max(4, min(64, (3 << 30) // nbytes)))]
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        err = (gemm_rows(x, ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
        cublas = _rotating(lambda w: F.linear(x, w), ws)
        one = _rotating(lambda w: gemv(x[:1], w), ws)
        times = {cfg: _rotating(lambda w, cfg=cfg: gemm_rows(x, w, config=cfg), ws) for cfg in ROWS_CONFIGS}
        best = min(times, key=times.get)
        frac = lambda t: f"{100 * nbytes / t / copy_bw():.0f}%"  # noqa: E731
        rows.append([name, f"{cublas * 1e6:.1f}", frac(cublas), f"{one * 1e6:.1f}",
                     f"{times[rows_config(n, k)] * 1e6:.1f}", str(best), f"{times[best] * 1e6:.1f}", frac(times[best]),
                     f"{err:.1e}"] + [f"{times[c] * 1e6:.1f}" for c in ROWS_CONFIGS])
        del ws
        torch.cuda.empty_cache()
    return rows


# gemm_invariant's tiles for model-dtype weights with x's 16-row tile the dot's first operand (mma.sync, whatever
# the tile around it): (BLOCK_N, BLOCK_K, num_warps, num_stages, weight first=False)
INVARIANT_X_FIRST = [(32, 128, 4, 4, False), (64, 128, 4, 4, False), (64, 64, 4, 4, False), (128, 64, 4, 3, False),
                     (128, 128, 8, 3, False), (256, 64, 8, 3, False)]


def sweep_invariant(ms: list[int], check_only: bool = False) -> list[list]:
    """gemm_invariant (LLM(batch_invariant=True)'s linears) at each row count (the first rows of one x): the default
    tile (the weight the dot's first operand, rows_config's tile; fp8: x first at INVARIANT_W8's; session 66's for
    every row count, invariant_plan's up to 16 rows) at 1 / 4 / 8 row tiles a program,
    and x first at each INVARIANT_X_FIRST tile and 1 / 4 / 8 row tiles, against cuBLAS (us, cold weights).
    "bits": one mark a variant, in the columns' order: "=" when its rows have the bits of x first at the first
    tile, 1 row tile, on the most rows; "d" when they have the default's at 1 row tile instead; "x" neither.
    check_only: the marks alone (no timing)."""
    import torch.nn.functional as F

    from tandem.kernels.gemm_invariant import INVARIANT_W8, gemm_invariant
    from tandem.kernels.gemm_rows import rows_config
    from tandem.layers.quant import quantize_fp8

    rows = []
    for name, n, k in GEMV_SHAPES[:10]:
        for fp8 in (False, True) if name.startswith("8b") and "head" not in name else (False,):
            nbytes = (1 if fp8 else 2) * n * k
            ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
                  for _ in range(1 if check_only else max(2, min(16, (3 << 30) // nbytes)))]
            x = torch.randn(max(ms), k, device=DEV, dtype=torch.bfloat16)
            cublas = {m: 0.0 if check_only else _rotating(lambda w, m=m: F.linear(x[:m], w), ws) for m in ms}
            if fp8:
                ws = [quantize_fp8(w) for w in ws]

            def call(w, m, tiles=None, config=None):
                if fp8:
                    return gemm_invariant(x[:m], w[0], w_scale=w[1], tiles=tiles, config=config)
                return gemm_invariant(x[:m], w, tiles=tiles, config=config)

            w8 = INVARIANT_W8
            default = (w8.block_n, w8.block_k, w8.num_warps, w8.num_stages, False) if fp8 else rows_config(n, k) + (True,)
            variants = [(default, t) for t in (1, 4, 8)] + ([] if fp8 else [(c, t) for c in INVARIANT_X_FIRST for t in (1, 4, 8)])
            ref_default = call(ws[0], max(ms), 1, default)
            ref_x = ref_default if fp8 else call(ws[0], max(ms), 1, INVARIANT_X_FIRST[0])
            for m in ms:
                row, marks = [name + (" fp8" if fp8 else ""), str(m), f"{cublas[m] * 1e6:.1f}"], ""
                for cfg, t in variants:
                    if t > 1 and m <= 16:
                        row.append("")
                        marks += "."
                        continue
                    try:
                        got = call(ws[0], m, t, cfg)
                        marks += "=" if torch.equal(got, ref_x[:m]) else "d" if torch.equal(got, ref_default[:m]) else "x"
                        row.append("" if check_only else f"{_rotating(lambda w: call(w, m, t, cfg), ws) * 1e6:.1f}")
                    except Exception as e:  # noqa: BLE001  (a tile may not fit shared memory)
                        row.append(type(e).__name__)
                        marks += "?"
                row += [""] * (3 + 3 + 3 * len(INVARIANT_X_FIRST) - len(row))  # (fp8: the default alone)
                rows.append(row + [marks])
            del ws
            torch.cuda.empty_cache()
    return rows


# gemm_w8's tiles (tandem.kernels.gemm_rows.W8Tile): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages,
# w8_second, split_k)
W8_CONFIGS = [(64, 64, 128, 4, 4, True, 1), (64, 64, 128, 4, 4, True, 2), (64, 64, 128, 4, 4, True, 4),
              (64, 32, 128, 4, 4, True, 1), (64, 32, 128, 4, 4, True, 2), (64, 128, 64, 4, 4, True, 1),
              (64, 128, 64, 4, 4, True, 2), (32, 64, 128, 4, 4, True, 1), (32, 64, 128, 4, 4, True, 4),
              (128, 64, 128, 8, 3, True, 1), (128, 64, 128, 8, 3, True, 2), (128, 128, 64, 8, 3, False, 1),
              (128, 128, 64, 8, 3, False, 2), (256, 128, 64, 8, 3, False, 1), (64, 128, 128, 4, 3, False, 1),
              (64, 64, 128, 8, 4, True, 2), (64, 64, 128, 8, 4, True, 4), (64, 128, 64, 8, 4, True, 1)]
# and at <= 32 rows (the fp8 target's decode steps and batch-1 verifications), BLOCK_M = row_tile(m):
# gemm_rows' fp8 tiles (BLOCK_N, BLOCK_K, warps, stages) with K split 1, 2, 4 or 8 ways
W8_FEW_TILES = [(32, 128, 4, 6), (64, 128, 4, 4), (32, 256, 4, 4), (16, 256, 4, 4), (128, 128, 4, 3), (64, 128, 4, 6)]


def w8a8(x, q, s):
    """The W8A8 alternative (vLLM's fp8 on Hopper): each row of x scaled into e4m3 by its max,
    then torch._scaled_mm with row-wise scales."""
    a = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
    xq = (x.float() / a).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, q.t(), scale_a=a, scale_b=s.view(1, -1), out_dtype=x.dtype)


def sweep_w8(m: int) -> tuple[list[list], list[dict]]:
    """m rows through fp8 e4m3 weights with per-row scales: gemm_w8 (W8A16) at every tile of
    W8_CONFIGS, and W8A8 (torch._scaled_mm after rounding the rows with torch operations), against
    cuBLAS on bf16 weights (8B and Qwen 1.5B shapes, cold weights, us per call; rel err against the
    fake-quantized weights' fp32 product). -> the table's rows, and every tile's time (JSON)."""
    import torch.nn.functional as F

    from tandem.kernels.gemm_rows import MAX_ROWS, W8Tile, gemm_rows, gemm_w8, row_tile, w8_config
    from tandem.layers.quant import fake_quantize_fp8_, quantize_fp8

    rows, raw = [], []
    for name, n, k in GEMV_SHAPES[:4] + GEMV_SHAPES[12:14]:
        count = max(4, min(32, (3 << 30) // (2 * n * k)))
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        fake_quantize_fp8_(ws[0])
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        cublas = _rotating(lambda w: F.linear(x, w), ws)
        q8 = [quantize_fp8(w) for w in ws]
        del ws
        torch.cuda.empty_cache()

        def err(out):
            return f"{(out.float() - ref).abs().max().item() / ref.abs().max().item():.1e}"

        if m <= MAX_ROWS:
            configs = [W8Tile(row_tile(m), *t, True, s) for t in W8_FEW_TILES for s in (1, 2, 4, 8)]
        else:  # (up to 128 rows, the few-row tiles over several row tiles too)
            configs = [W8Tile(*c) for c in W8_CONFIGS] + [W8Tile(bm, *t, True, s) for bm in (16, 32)
                                                          for t in W8_FEW_TILES[:3] for s in (2, 4) if m <= 128]
        times = {}
        for cfg in dict.fromkeys(configs + [w8_config(m, n, k)]):
            try:
                times[cfg] = _rotating(lambda qs, cfg=cfg: gemm_w8(x, qs[0], qs[1], config=cfg), q8)
            except Exception as e:  # noqa: BLE001  (a tile past the shared memory: skipped, shown)
                print(f"{name} m={m} {cfg}: {type(e).__name__}", file=sys.stderr)
                times[cfg] = float("nan")
        ok = [c for c in times if times[c] == times[c]]

        def best(cands):
            if not cands:
                return "-"
            c = min(cands, key=times.get)
            return f"{tuple(c[:5]) + tuple(c[6:])} {times[c] * 1e6:.1f}"

        few = f"{_rotating(lambda qs: gemm_rows(x, qs[0], w_scale=qs[1]), q8) * 1e6:.1f}" if m <= MAX_ROWS else "-"

        try:
            scaled = f"{_rotating(lambda qs: w8a8(x, *qs), q8) * 1e6:.1f}"
            scaled_err = err(w8a8(x, *q8[0]))
        except Exception as e:  # noqa: BLE001
            print(f"_scaled_mm: {type(e).__name__}: {e}", file=sys.stderr)
            scaled, scaled_err = "-", "-"
        top = min(ok, key=times.get)
        rows.append([name, m, f"{cublas * 1e6:.1f}", scaled, few, f"{times[w8_config(m, n, k)] * 1e6:.1f}",
                     best([c for c in ok if c[5]]), best([c for c in ok if not c[5]]),
                     f"{100 * n * k / times[top] / copy_bw():.0f}%", err(gemm_w8(x, *q8[0], config=top)), scaled_err])
        raw.append(dict(layer=name, m=m, cublas_us=cublas * 1e6, tiles={str(c): times[c] * 1e6 for c in times}))
        del q8
        torch.cuda.empty_cache()
    return rows, raw


W8_WIDEN_SHAPES = [GEMV_SHAPES[i] for i in (0, 1, 2, 3, 4, 7, 9, 10, 13)]


def sweep_w8_widen(ms: list[int]) -> list[list]:
    """The e4m3 -> bf16 widening A/B: gemm_w8 at its default tile (and, up to 32 rows, gemm_rows' fp8
    tile, the fp8 draft's) with _widen's inline PTX against Triton's cast (TANDEM_W8_WIDEN=cvt), cuBLAS on
    the bf16 weights alongside; cold weights, us per call. LM heads at <= 32 rows only."""
    import os

    import torch.nn.functional as F

    from tandem.kernels.gemm_rows import MAX_ROWS, gemm_rows, gemm_w8
    from tandem.layers.quant import quantize_fp8

    def both(fn, q8):
        times = []
        for widen in ("", "cvt"):
            os.environ["TANDEM_W8_WIDEN"] = widen
            times.append(_rotating(fn, q8) * 1e6)
        os.environ.pop("TANDEM_W8_WIDEN")
        return times

    rows = []
    for name, n, k in W8_WIDEN_SHAPES:
        count = max(3, min(32, (3 << 30) // (2 * n * k)))
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        q8 = [quantize_fp8(w) for w in ws]
        for m in ms:
            if "lm_head" in name and m > MAX_ROWS:
                continue
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            cublas = _rotating(lambda w: F.linear(x, w), ws) * 1e6
            asm, cast = both(lambda qs: gemm_w8(x, qs[0], qs[1]), q8)
            few = both(lambda qs: gemm_rows(x, qs[0], w_scale=qs[1]), q8) if m <= MAX_ROWS else None
            rows.append([name, m, f"{cublas:.1f}", f"{asm:.1f}", f"{cast:.1f}", f"{cast / asm:.2f}",
                         f"{few[0]:.1f} / {few[1]:.1f}" if few else "-"])
        del ws, q8
        torch.cuda.empty_cache()
    return rows


def _qkv_case(name: str, n: int, k: int, m: int):
    """A qkv projection's benchmark inputs (8B / 1B heads): rotating weights (~3 GB), m rows,
    (head_dim, heads, kv heads), the rotary tables, positions, slots, and the K / V caches."""
    from tandem.layers.rotary import RotaryEmbedding

    ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
          for _ in range(max(4, min(64, (3 << 30) // (2 * n * k))))]
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    hd, heads, kv = (128 if name.startswith("8b") else 64), 32, 8
    rot = RotaryEmbedding(hd, 4096, 500000.0, None, device=DEV)
    pos = torch.arange(m, device=DEV) + 300
    slots = torch.arange(m, device=DEV) + 300
    kc = torch.zeros(64, 16, kv, hd, device=DEV, dtype=torch.bfloat16)
    return ws, x, (hd, heads, kv), rot, pos, slots, kc, torch.zeros_like(kc)


def sweep_rows_rope(m: int) -> list[list]:
    """The qkv projection at M rows with the rotary embedding and KV store inside
    (gemm_rows_qkv_rope) against gemm_rows + rotary_embedding(store=...) and cuBLAS + the same
    (8B / 1B shapes, cold weights, us per call)."""
    import torch.nn.functional as F

    from tandem.kernels.fused import rotary_embedding
    from tandem.kernels.gemm_rows import gemm_rows, gemm_rows_qkv_rope

    rows = []
    for name, n, k in [s for s in GEMV_SHAPES if s[0] in ("8b qkv", "1b qkv")]:
        ws, x, (hd, heads, kv), rot, pos, slots, kc, vc = _qkv_case(name, n, k, m)

        def unfused(w, linear):
            q, kk, v = linear(x, w).split([heads * hd, kv * hd, kv * hd], dim=-1)
            rotary_embedding(pos, q.view(m, heads, hd), kk.view(m, kv, hd), rot.cos, rot.sin,
                             store=(v.view(m, kv, hd), kc, vc, slots))

        fused = _rotating(lambda w: gemm_rows_qkv_rope(x, w, None, heads, kv, pos, rot.cos, rot.sin, kc, vc, slots), ws)
        rows.append([name, f"{fused * 1e6:.1f}", f"{_rotating(lambda w: unfused(w, gemm_rows), ws) * 1e6:.1f}",
                     f"{_rotating(lambda w: unfused(w, F.linear), ws) * 1e6:.1f}"])
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_qkv_split(m: int) -> list[list]:
    """gemm_rows_qkv_rope at M rows with K split 1, 2, 4, 8 ways (the last split of a program runs
    the rotary epilogue), bf16 and fp8 weights (8B / 1B shapes, cold weights, us per call)."""
    from tandem.kernels.gemm_rows import gemm_rows_qkv_rope, qkv_split_k
    from tandem.layers.quant import quantize_fp8

    rows = []
    for name, n, k in [s for s in GEMV_SHAPES if s[0] in ("8b qkv", "1b qkv")]:
        ws, x, (hd, heads, kv), rot, pos, slots, kc, vc = _qkv_case(name, n, k, m)
        counts = torch.zeros(n // 32, dtype=torch.int32, device=DEV)
        for label, weights in (("bf16", [(w, None) for w in ws]), ("fp8", [quantize_fp8(w) for w in ws])):
            times = [_rotating(lambda ws_, sp=sp: gemm_rows_qkv_rope(x, ws_[0], None, heads, kv, pos, rot.cos, rot.sin,
                                                                      kc, vc, slots, w_scale=ws_[1], split_k=sp,
                                                                      counts=counts), weights)
                     for sp in (1, 2, 4, 8)]
            rows.append([name, label, qkv_split_k(k, label == "fp8")] + [f"{t * 1e6:.1f}" for t in times])
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_short_attention() -> list[list]:
    """Batch-1 decode / verification attention at short contexts (the benchmarks' regime): tile
    (BLOCK_N, warps, stages; None = the built-in choice) x split policy (num_splits,
    min_split_keys; None = built-in)."""
    from tandem.kernels.attention import paged_attention

    tiles = [None, (128, 4, 1), (128, 4, 2), (128, 4, 3), (64, 4, 1), (64, 4, 2), (64, 2, 1), (32, 2, 1)]
    splits = [(None, None), (None, 256), (1, None), (4, None)]
    rows = []
    for q_len, ctx in ((1, 150), (1, 400), (1, 1000), (5, 150)):
        q, kc, vc, bt, sl, cu, _ = paged_setup([q_len], [ctx])
        out = torch.empty_like(q)
        res = {}
        for tile in tiles:
            for ns, msk in splits:
                res[(tile, ns, msk)] = bench(lambda: paged_attention(
                    q, kc, vc, bt, sl, cu, q_len, D**-0.5, out, num_splits=ns, tile_override=tile,
                    min_split_keys=msk))
        best = sorted(res, key=res.get)[:3]
        rows.append([f"q={q_len} ctx={ctx}", f"{res[(None, None, None)] * 1e6:.1f}"]
                    + [f"{b}: {res[b] * 1e6:.1f}" for b in best])
    return rows


def sweep_fp8_attention() -> list[list]:
    """Decode attention over an fp8 KV cache (kv_cache_dtype='fp8') against the bf16 cache, D = 128,
    short and long contexts: the bf16 cache's built-in choice, then the fp8 cache's tiles (BLOCK_N, warps, stages;
    None = built-in) x num_splits (None = built-in); bandwidth counts the bytes each cache holds."""
    from tandem.kernels.attention import paged_attention
    from tandem.layers.attention import to_cache

    tiles = [None, (128, 4, 1), (128, 4, 3), (128, 4, 6), (128, 8, 4), (256, 4, 3), (256, 8, 3), (64, 4, 6)]
    splits = [None, 1, 2, 4, 8]
    rows = []
    for b, ctx in ((1, 500), (1, 4096), (8, 4096), (16, 4096), (64, 4096)):
        q, kc, vc, bt, sl, cu, _ = paged_setup([1] * b, [ctx - 1] * b)
        k8, v8 = to_cache(kc, torch.float8_e4m3fn), to_cache(vc, torch.float8_e4m3fn)
        out = torch.empty_like(q)
        nbytes = b * ctx * HKV * D * 2  # K and V, one byte a value
        t_bf16 = bench(lambda: paged_attention(q, kc, vc, bt, sl, cu, 1, D**-0.5, out))
        res = {}
        for tile in tiles:
            for ns in splits:
                try:
                    res[(tile, ns)] = bench(lambda: paged_attention(q, k8, v8, bt, sl, cu, 1, D**-0.5, out,
                                                                    num_splits=ns, tile_override=tile))
                except Exception as e:  # noqa: BLE001  (a tile may not fit shared memory)
                    print(f"tile {tile} splits {ns}: {type(e).__name__}", flush=True)
        res = {key: t for key, t in res.items() if t == t}
        best = sorted(res, key=res.get)[:3]
        rows.append([f"B={b} ctx={ctx}", f"{t_bf16 * 1e6:.1f} ({100 * 2 * nbytes / t_bf16 / copy_bw():.0f}%)",
                     f"{res[(None, None)] * 1e6:.1f} ({100 * nbytes / res[(None, None)] / copy_bw():.0f}%)"]
                    + [f"{t}, {ns}: {res[(t, ns)] * 1e6:.1f} ({100 * nbytes / res[(t, ns)] / copy_bw():.0f}%)"
                       for t, ns in best])
    return rows


def sweep_batch_attention() -> list[list]:
    """Decode / verification attention at serving batch sizes (8B: D = 128, 1B: D = 64; 32 query
    and 8 KV heads), short and longer contexts: tile (BLOCK_N, warps, stages; None = built-in)
    x num_splits (None = built-in)."""
    from tandem.kernels.attention import paged_attention

    tiles = [None, (128, 4, 1), (128, 4, 3), (64, 4, 1), (64, 4, 2), (64, 4, 3), (32, 4, 2), (64, 8, 2)]
    splits = [None, 1, 2, 4, 8]
    rows = []
    for d, b, q_len, ctx in ((128, 8, 5, 200), (128, 32, 1, 200), (128, 32, 5, 200), (128, 32, 5, 1000),
                             (64, 32, 1, 200), (64, 32, 6, 200)):
        q, kc, vc, bt, sl, cu, _ = paged_setup([q_len] * b, [ctx] * b, head_dim=d)
        out = torch.empty_like(q)
        res = {}
        for tile in tiles:
            for ns in splits:
                try:
                    res[(tile, ns)] = bench(lambda: paged_attention(q, kc, vc, bt, sl, cu, q_len, d**-0.5, out,
                                                                    num_splits=ns, tile_override=tile))
                except Exception as e:  # noqa: BLE001  (a tile may not fit shared memory)
                    print(f"tile {tile} splits {ns}: {type(e).__name__}", flush=True)
        nbytes = b * (ctx + q_len) * HKV * d * 2 * 2
        res = {key: t for key, t in res.items() if t == t}  # bench() gives nan where capture failed
        best = sorted(res, key=res.get)[:3]
        rows.append([f"D={d} B={b} q={q_len} ctx={ctx}", f"{nbytes / 1e6:.1f}",
                     f"{res.get((None, None), float('nan')) * 1e6:.1f}"]
                    + [f"{t}, {ns}: {res[(t, ns)] * 1e6:.1f}" for t, ns in best])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the rows and environment here")
    ap.add_argument("--sweep", action="store_true", help="also sweep decode-attention tiles")
    ap.add_argument("--gemv", action="store_true", help="only the batch-1 GEMV sweep against cuBLAS")
    ap.add_argument("--short-attn", action="store_true", help="only the short-context batch-1 attention sweep")
    ap.add_argument("--batch-attn", action="store_true", help="only the serving-batch attention sweep")
    ap.add_argument("--fp8-attn", action="store_true", help="only the decode attention over an fp8 KV cache, per tile")
    ap.add_argument("--gemv-fused", action="store_true", help="only the one-row GEMV with its norm / add fusions")
    ap.add_argument("--gemv-fp8", action="store_true", help="only the one-row GEMV with fp8 weights, per tile")
    ap.add_argument("--gemv-fp8-fused", action="store_true",
                    help="only the one-row fp8 GEMVs with their norm / SiLU-and-mul / residual fusions, per tile")
    ap.add_argument("--rows", default="", help="only the few-row GEMM (gemm_rows) sweeps at these row counts, e.g. 5,6")
    ap.add_argument("--w8", default="", help="only the fp8-weight GEMM (gemm_w8) sweeps at these row counts, e.g. 64,1024")
    ap.add_argument("--w8-widen", default="",
                    help="only the fp8 GEMMs with _widen's inline PTX against Triton's cast at these row counts, "
                         "e.g. 5,40")
    ap.add_argument("--invariant", default="",
                    help="only the batch-invariant GEMM (gemm_invariant) at these row counts, e.g. 1,40,1536")
    ap.add_argument("--bits-only", action="store_true", help="with --invariant: the bit checks alone, no timing")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    torch.manual_seed(0)
    if args.invariant:
        table = sweep_invariant([int(m) for m in args.invariant.split(",")], args.bits_only)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(env=environment(), rows=table), indent=2, default=str))
        heads = [f"default x{t}" for t in (1, 4, 8)] + [f"x first {c[:4]} x{t}" for c in INVARIANT_X_FIRST for t in (1, 4, 8)]
        print_table(["layer", "M", "cuBLAS us"] + heads + ["bits"], table,
                    title="gemm_invariant: tiles and row tiles a program, us, GPU time in CUDA graphs")
        return
    if args.w8_widen:
        table = sweep_w8_widen([int(v) for v in args.w8_widen.split(",")])
        print_table(["layer", "M", "cuBLAS bf16 us", "gemm_w8 asm us", "gemm_w8 cast us", "cast / asm",
                     "gemm_rows fp8 tile: asm / cast us"], table,
                    title="e4m3 widened by inline PTX (_widen) or Triton's cast, cold weights (rotating), CUDA graphs")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(env=environment(), rows=table), indent=2, default=str))
        return
    if args.w8:
        table, raw = [], []
        for m in args.w8.split(","):
            rows, tiles = sweep_w8(int(m))
            table += rows
            raw += tiles
        print_table(["layer", "M", "cuBLAS bf16 us", "W8A8 us", "gemm_rows fp8 us", "w8 default us",
                     "best w8 second (BM, BN, BK, warps, stages, split) us", "best w8 first us", "best: of copy bw (fp8)",
                     "w8 rel err", "W8A8 rel err"], table,
                    title="fp8 e4m3 weights, M rows, cold weights (rotating), GPU time in CUDA graphs")
        for m in [int(v) for v in args.w8.split(",") if int(v) <= 32]:
            print_table(["layer", "weights", "default split", "split 1 us", "2", "4", "8"], sweep_qkv_split(m),
                        title=f"qkv projection with the rotary (gemm_rows_qkv_rope) at M = {m}, K split")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(env=environment(), rows=table, tiles=raw), indent=2,
                                                  default=str))
        return
    if args.rows:
        for m in [int(v) for v in args.rows.split(",")]:
            print_table(["layer", "cuBLAS us", "of copy bw", "1-row GEMV us", "default us",
                         "best (BN, BK, warps, stages)", "best us", "of copy bw", "rel err"]
                        + [str(c) for c in ROWS_CONFIGS], sweep_rows(m),
                        title=f"M = {m} rows, bf16, cold weights (rotating), GPU time in CUDA graphs")
            print_table(["layer", "rotary + KV store inside", "gemm_rows + rotary", "cuBLAS + rotary"],
                        sweep_rows_rope(m), title=f"qkv projection with the rotary at M = {m}, us per call")
        return
    if args.gemv_fp8:
        print_table(["layer", "bf16 GEMV us", "default tile", "fp8 default us", "best fp8 tile", "best us",
                     "of copy bw"] + [str(c) for c in FP8_CONFIGS], sweep_gemv_fp8(),
                    title="M = 1 GEMV, fp8 e4m3 weights, cold weights (rotating), GPU time in CUDA graphs")
        return
    if args.gemv_fp8_fused:
        print_table(["layer", "separate kernels us", "default tile", "fused default us", "best fused tile", "best us"]
                    + [str(c) for c in FP8_CONFIGS], sweep_gemv_fp8_fused(),
                    title="M = 1 GEMV, fp8 e4m3 weights, as a decoder layer fuses them, cold weights (rotating), us")
        return
    if args.gemv_fused:
        print_table(["layer", "GEMV us", "norm inside us", "rms_norm + GEMV us", "add into residual us",
                     "norm inside, other tiles", "", ""],
                    sweep_gemv_fused(), title="one-row GEMV fusions, bf16, cold weights, CUDA graphs")
        return
    if args.fp8_attn:
        print_table(["case", "bf16 cache us", "fp8 built-in us", "best fp8 (tile, splits)", "2nd", "3rd"],
                    sweep_fp8_attention(), title="decode attention, fp8 KV cache, cold L2, CUDA graphs")
        return
    if args.batch_attn:
        print_table(["case", "KV MB", "built-in us", "best (tile, splits)", "2nd", "3rd"], sweep_batch_attention(),
                    title="serving-batch attention: (tile, num_splits), cold L2, CUDA graphs")
        return
    if args.short_attn:
        print_table(["case", "built-in us", "best", "2nd", "3rd"], sweep_short_attention(),
                    title="batch-1 attention: (tile, num_splits, min_split_keys), cold L2, CUDA graphs")
        return
    if args.gemv:
        print_table(["layer", "cuBLAS us", "of copy bw", "default us", "best (BN, BK, warps)", "best us", "of copy bw",
                     "rel err"] + [str(c) for c in GEMV_CONFIGS], sweep_gemv(),
                    title="M = 1 GEMV, bf16, cold weights (rotating), GPU time in CUDA graphs")
        return
    rows = []
    for b in (1, 8, 32, 64):
        rows.append(row_attention(f"decode B={b} ctx=4096", [1] * b, [4095] * b))
    rows.append(row_attention("verify B=32 q=5 ctx=4096", [5] * 32, [4091] * 32))
    rows.append(row_attention("mixed 8 dec + 8 verify + 2k chunk", [1] * 8 + [5] * 8 + [2048],
                              [4095] * 8 + [4091] * 8 + [2048]))
    rows.append(row_attention("prefill 1x4096 (no prefix)", [4096], [0], flops_mode=True))
    rows.append(row_attention("prefill 8x2048 chunk, 2k prefix", [2048] * 8, [2048] * 8, flops_mode=True))
    for n in (64, 4096):
        rows.append(row_kv_store(n))
    for n in (1, 64):
        rows.append(row_gumbel(n))
    for b in (1, 32):
        rows.append(row_rejection(b, 4))
        rows.append(row_rejection(b, 4, greedy_drafts=True))

    if args.sweep:
        print_table(["batch", "(BLOCK_N, warps, stages)", "us", "of 4.3 TB/s"], sweep_decode(),
                    title="decode attention tile sweep (ctx 4096, default splits)")
    table = []
    for r in rows:
        t = r["triton_us"] * 1e-6
        bw = r["bytes"] / t
        r["gb_per_s"] = bw / 1e9
        r["tflops"] = r.get("flops", 0) / t / 1e12
        achieved = f"{r['tflops']:.0f} TFLOP/s" if r.get("compute_bound") else f"{bw / 1e9:.0f} GB/s"
        table.append([r["kernel"], r["case"], f"{r['triton_us']:.1f}", f"{r['torch_us']:.1f}",
                      f"{r['torch_us'] / r['triton_us']:.1f}x", f"{r['eager_us']:.1f}", f"{r['bytes'] / 1e6:.1f}",
                      achieved, "-" if r.get("compute_bound") else f"{100 * bw / copy_bw():.0f}%"])
    if args.json:
        Path(args.json).write_text(json.dumps(dict(env=environment(), device=torch.cuda.get_device_name(),
                                                   rows=rows), indent=2, default=str))
    print_table(["kernel", "case", "triton us", "torch us", "speedup", "eager us", "MB moved", "achieved",
                 f"of {copy_bw() / 1e12:.2f} TB/s"], table,
                title=f"tandem kernels on {torch.cuda.get_device_name()} (GPU time in CUDA graphs, cold L2, median)")


if __name__ == "__main__":
    main()
