"""The batch-invariant GEMM: out = x @ w^T for any number of rows, each row's bits independent of the rest.

`LLM(batch_invariant=True)` sends every linear of the target through `gemm_invariant`, so a token's
logits do not depend on the step that computes them (decoded alone, verified among 1 + k drafts,
prefilled in a chunk of thousands). What fixes a row's bits is the tensor-core dot that sums it: x's
rows in 16-row tiles, each dotted with a weight tile, K walked in one order and never split. A dot of
more rows is not the same arithmetic (32- or 64-row dots gave other bits for 6 of 14 weight shapes on
an H100, docs/benchmarks.md, session 66), so every dot here is 16 rows wide whatever the step.

Around that dot the tile is free. A program owns BLOCK_N weight rows and TILES row tiles (16 x TILES
consecutive rows): at each K step it loads its weight tile once and runs one 16-row dot per row tile
into that tile's own accumulator; the weight tile is the dot's first operand (W_FIRST) or its second.
On an H100 every choice gave the same bits, for the 8B's and 1B's ten layer shapes: 16-256 weight rows
a program, 64-512 columns a K step, 4 or 8 warps, 1-8 row tiles, either operand order; fp8 weights, x
first at INVARIANT_W8's tile, at 1-8 row tiles (`bench/gpu_kernels.py --invariant 1,5,40,1536
--bits-only`). The GPU tests check it on fresh inputs (tests/kernels/test_chunked_attention.py); on
another architecture than Hopper, where Triton picks other tensor-core instructions, they are the
check to run first. So `invariant_plan` picks the fastest by row count:
gemm_rows' weight-first tile at one row tile up to 16 rows (a decode step streams the weights as the
default engine's few-row GEMM does), x first at 128 weight rows and 4 row tiles a program for many
(each weight tile read a quarter as often: the 8B's 1536-token prefill 77 ms against 177 at gemm_rows'
tile for every row count, and 40 in the default engine; H100, bench/gpu_bench.py --sections invariance).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.fused import _numerics
from tandem.kernels.gemm_rows import W8Tile, _dot, _launch_flags, _rows_out, _rows_store, _widen, _x_tile, rows_config
from tandem.kernels.pdl import release_next, wait_only

# Rows a dot: one tile for every step (see above); fp8 weights: gemm_w8's few-row tile, K unsplit.
INVARIANT_BLOCK_M = 16
INVARIANT_W8 = W8Tile(INVARIANT_BLOCK_M, 64, 128, 4, 4, True, 1)


@triton.jit
def _tile_dot(acc, w, x_ptr, offs_m, M, k0, K, stride_xm, W_FIRST: tl.constexpr, BLOCK_K: tl.constexpr,
              SOFT_BF16: tl.constexpr):
    """acc + one 16-row tile's product at columns k0 .. k0 + BLOCK_K: W_FIRST, w [BLOCK_N, BLOCK_K] and acc
    [BLOCK_N, BLOCK_M]; else w [BLOCK_K, BLOCK_N] in x's dtype and acc [BLOCK_M, BLOCK_N] (x first, as gemm_rows'
    fp8 form)."""
    x = _x_tile(x_ptr, offs_m, offs_m < M, k0, K, stride_xm, BLOCK_K)
    if W_FIRST:
        return _dot(w.to(x.dtype), tl.trans(x), acc, SOFT_BF16)
    else:
        return _dot(x, w, acc, SOFT_BF16)


@triton.jit
def _tile_store(acc, out_ptr, b_ptr, ws_ptr, offs_m, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS: tl.constexpr,
                W8: tl.constexpr, W_FIRST: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CUDA_LIBM: tl.constexpr, SOFT_BF16: tl.constexpr):
    if not W_FIRST:
        acc = tl.trans(acc)
    _rows_store(acc, out_ptr, b_ptr, ws_ptr, offs_m, offs_m < M, offs_n, n_ok, pid, N, stride_om, HAS_BIAS, W8,
                SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)


@triton.jit
def _invariant_kernel(
    x_ptr,  # [M, K] rows at stride_xm
    w_ptr,  # [N, K], rows contiguous (SILU_MUL: [gate (N / 2) | up (N / 2)])
    b_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N] rows at stride_om (SILU_MUL: [M, N / 2])
    ws_ptr,  # [N] fp32 row scales (W8 only: w is fp8 e4m3)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    W8: tl.constexpr,
    W_FIRST: tl.constexpr,  # the weight tile the dot's first operand (else x's tile: always with W8)
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    TILES: tl.constexpr,  # row tiles a program: 1, 2, 4 or 8, each its own dots and accumulator
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    ASM_WIDEN: tl.constexpr,
    PDL: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    """Grid (row tile groups, weight tiles); the row groups are the first axis, so the programs launched
    together share a weight tile (read from memory once, then from L2)."""
    pid = tl.program_id(1)
    offs_m = tl.program_id(0).to(tl.int64) * (TILES * BLOCK_M) + tl.arange(0, BLOCK_M)  # M * K may pass 2^31
    wait_only(PDL_WAIT)
    if SILU_MUL:  # a tile's gate rows, then the same output columns' up rows (gemm_rows' pairing)
        P: tl.constexpr = BLOCK_N // 2
        offs_r = tl.arange(0, BLOCK_N)
        cols = pid * P + offs_r % P
        offs_n = cols + (offs_r // P) * (N // 2)
        n_ok = cols < N // 2
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if W_FIRST:
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        acc0 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:  # K-major [BLOCK_K, BLOCK_N] (fp8: widened to x's dtype in registers)
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
        acc0 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    acc4 = tl.zeros_like(acc0)
    acc5 = tl.zeros_like(acc0)
    acc6 = tl.zeros_like(acc0)
    acc7 = tl.zeros_like(acc0)
    for k0 in range(0, K, BLOCK_K):
        if W_FIRST:
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        else:
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_ok[None, :] & (k0 + offs_k < K)[:, None], other=0.0)
            if W8:
                w = _widen(w, x_ptr.dtype.element_ty, ASM_WIDEN)
        acc0 = _tile_dot(acc0, w, x_ptr, offs_m, M, k0, K, stride_xm, W_FIRST, BLOCK_K, SOFT_BF16)
        if TILES > 1:
            acc1 = _tile_dot(acc1, w, x_ptr, offs_m + BLOCK_M, M, k0, K, stride_xm, W_FIRST, BLOCK_K, SOFT_BF16)
        if TILES > 2:
            acc2 = _tile_dot(acc2, w, x_ptr, offs_m + 2 * BLOCK_M, M, k0, K, stride_xm, W_FIRST, BLOCK_K, SOFT_BF16)
            acc3 = _tile_dot(acc3, w, x_ptr, offs_m + 3 * BLOCK_M, M, k0, K, stride_xm, W_FIRST, BLOCK_K, SOFT_BF16)
        if TILES > 4:
            acc4 = _tile_dot(acc4, w, x_ptr, offs_m + 4 * BLOCK_M, M, k0, K, stride_xm, W_FIRST, BLOCK_K, SOFT_BF16)
            acc5 = _tile_dot(acc5, w, x_ptr, offs_m + 5 * BLOCK_M, M, k0, K, stride_xm, W_FIRST, BLOCK_K, SOFT_BF16)
            acc6 = _tile_dot(acc6, w, x_ptr, offs_m + 6 * BLOCK_M, M, k0, K, stride_xm, W_FIRST, BLOCK_K, SOFT_BF16)
            acc7 = _tile_dot(acc7, w, x_ptr, offs_m + 7 * BLOCK_M, M, k0, K, stride_xm, W_FIRST, BLOCK_K, SOFT_BF16)
        w_ptrs += BLOCK_K
    release_next(PDL)
    _tile_store(acc0, out_ptr, b_ptr, ws_ptr, offs_m, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS, W8, W_FIRST,
                SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)
    if TILES > 1:
        _tile_store(acc1, out_ptr, b_ptr, ws_ptr, offs_m + BLOCK_M, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS, W8,
                    W_FIRST, SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)
    if TILES > 2:
        _tile_store(acc2, out_ptr, b_ptr, ws_ptr, offs_m + 2 * BLOCK_M, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS,
                    W8, W_FIRST, SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)
        _tile_store(acc3, out_ptr, b_ptr, ws_ptr, offs_m + 3 * BLOCK_M, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS,
                    W8, W_FIRST, SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)
    if TILES > 4:
        _tile_store(acc4, out_ptr, b_ptr, ws_ptr, offs_m + 4 * BLOCK_M, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS,
                    W8, W_FIRST, SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)
        _tile_store(acc5, out_ptr, b_ptr, ws_ptr, offs_m + 5 * BLOCK_M, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS,
                    W8, W_FIRST, SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)
        _tile_store(acc6, out_ptr, b_ptr, ws_ptr, offs_m + 6 * BLOCK_M, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS,
                    W8, W_FIRST, SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)
        _tile_store(acc7, out_ptr, b_ptr, ws_ptr, offs_m + 7 * BLOCK_M, offs_n, n_ok, pid, M, N, stride_om, HAS_BIAS,
                    W8, W_FIRST, SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)


# The tile for many rows, x's 16-row tiles the dot's first operand: 128 weight rows, 64 columns a K step, 4 row tiles
# a program (H100, bench/gpu_kernels.py --invariant, 1536 rows of the 8B's qkv / o / gate_up / down: 219 / 153 / 969 /
# 511 us against 708 / 481 / 2486 / 1633 at gemm_rows' weight-first tile, one row tile, and 98 / 68 / 472 / 229 for
# cuBLAS; the best of six tiles at 1, 4 and 8 row tiles but for the 1B's gate | up and the heads, within 15%).
MANY_ROWS = (128, 64, 4, 3, False)


def invariant_plan(m: int, n: int, k: int, fp8: bool) -> tuple[tuple[int, int, int, int, bool], int]:
    """-> ((BLOCK_N, BLOCK_K, num_warps, num_stages, weight first), row tiles a program) for m rows of an [n, k]
    weight. Any of them gives the same bits: they pick the speed. Up to 16 rows (decode steps, batch-1
    verifications) gemm_rows' tile for the weight (weight first, rows_config) at one row tile, as the one-row
    GEMV streams the weights; up to 64 rows the same but for the wide weights (gate | up, the head) and past 64
    rows MANY_ROWS. fp8 weights: INVARIANT_W8's tile (x first), 1 row tile up to 64 rows, else 4.
    TANDEM_INVARIANT_PLAN=rows: rows_config's tile (INVARIANT_W8's) at 1 row tile for every m (an A/B switch)."""
    plan = os.environ.get("TANDEM_INVARIANT_PLAN", "")
    if plan not in ("", "rows"):
        raise ValueError(f"TANDEM_INVARIANT_PLAN={plan!r}: expected rows (one tile a weight) or unset")
    if fp8:
        _, block_n, block_k, num_warps, num_stages, _, _ = INVARIANT_W8
        return (block_n, block_k, num_warps, num_stages, False), 1 if m <= 64 or plan else 4
    if m <= 16 or plan or (m <= 64 and n < 8192):
        return (*rows_config(n, k), True), 1
    return MANY_ROWS, 4


def gemm_invariant(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
                   act: str | None = None, w_scale: Tensor | None = None, tiles: int | None = None,
                   config: tuple[int, int, int, int, bool] | None = None) -> Tensor:
    """x [M, K] (M >= 0) bf16 / fp16, rows contiguous; weight [N, K] x's dtype, or fp8 e4m3 with w_scale [N]
    fp32; bias [N] or None; act="silu_mul": weight a packed [gate | up] and out [M, N / 2] (as gemm_rows).
    -> out [M, N], fp32 sums rounded once, each row's bits the same whatever M and the other rows.
    tiles, config: row tiles a program and (BLOCK_N, BLOCK_K, num_warps, num_stages, weight first) in place of
    invariant_plan's, for tests and sweeps; they never change the bits."""
    out = _rows_out(x, weight, bias, out, act, w_scale)
    n, k = weight.shape
    m = x.shape[0]
    if m == 0:
        return out
    w8 = w_scale is not None
    plan, plan_tiles = invariant_plan(m, n, k, w8)
    block_n, block_k, num_warps, num_stages, w_first = config or plan
    tiles = tiles or plan_tiles
    assert tiles in (1, 2, 4, 8) and not (w8 and w_first)
    silu_mul = act == "silu_mul"
    rows = tiles * INVARIANT_BLOCK_M
    while num_stages > 2 and num_stages * (block_n + rows) * block_k * x.element_size() > 200 << 10:
        num_stages -= 1  # (the pipeline's depth: not the arithmetic)
    assert not silu_mul or (n % 2 == 0 and block_n % 2 == 0)
    grid = (triton.cdiv(m, rows), triton.cdiv(out.shape[1], block_n // 2) if silu_mul else triton.cdiv(n, block_n))
    _invariant_kernel[grid](
        x, weight, bias if bias is not None else weight, out, w_scale if w8 else out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, W8=w8, W_FIRST=w_first, SILU_MUL=silu_mul, EVEN_K=k % block_k == 0, TILES=tiles,
        BLOCK_M=INVARIANT_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **_numerics(x), **_launch_flags(x),
    )
    return out
