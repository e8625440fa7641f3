"""GEMM for a few rows (2-32): out[m, n] = sum_k x[m, k] * w[n, k], on tensor cores.

A verification step at batch 1 (1 + k tokens) and the draft's catch-up (k + 2 tokens) multiply a
handful of rows by every weight matrix: still weight streaming, like a one-row decode step. The
weights are the wide operand: one program owns BLOCK_N weight rows and walks K in BLOCK_K steps,
`tl.dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, BLOCK_M])` into an fp32 [BLOCK_N, BLOCK_M]
accumulator (the rows of x padded to BLOCK_M = 16, or 32 above 16 rows; padding rows are never
loaded). No split-K (cuBLAS splits K and launches a reduction for the 8B's o and down projections
at these sizes): each output element is summed in one order, the same for every row count.

17-32 rows are a decode step of 17-32 requests (the target's, and each of the draft's loop
steps) or a small batch's verification. There the products alone run about as fast as cuBLAS
(H200, `bench/gpu_kernels.py --rows 32`, cold weights, us, gemm_rows / cuBLAS: 8B o 12.8 / 13.5,
gate_up 57.9 / 57.6, LM head 244.5 / 270.4; 1B gate_up 18.1 / 18.6, head 127.1 / 131.1), and the
epilogues save the launches after them (the qkv projection with the rotary and KV store inside:
8B 18.8 against 19.5 us for cuBLAS and the rotary kernel, 1B 7.8 against 9.3); long-K layers
lose (the 8B's down, K = 14336: 35.6 against 33.1 with cuBLAS's split-K) and stay on cuBLAS
(tandem/layers/gpu_linear.py), at 2-16 rows too since the forty-ninth run (docs/benchmarks.md).
A plain qkv projection (a model with q / k norms rotates after them, outside the GEMM) loses at
the tile rows_config picks: 8B 18.1 against 15.7, 1B 7.5 against 6.6; 64 x 128 with 4 stages
matched cuBLAS there (15.7 / 7.2) but is not taken above 16 rows until the bit-equality tests have
run on a GPU at that tile. At 64 rows (a probe with the cap raised) every layer lost (8B down
44.5 / 36.1, gate_up 67.4 / 61.0), hence MAX_ROWS. In the
engine at 32 requests (bench/gpu_bench.py --batches 32 --env-ab TANDEM_GEMM_ROWS=16, the old
cap, in the same run): the 8B's decode step 5.13 -> 4.95 ms, a k = 4 round with the 1B draft
11.76 -> 11.53 ms (the draft's loop step 1.37 -> 1.28 ms).

gemm_rows_qkv_rope is the packed q | k | v projection with the rotary embedding and the paged KV
store in its epilogue (a program owns 16 rotary pairs (d, d + D/2) of one head: a 32-row tile),
replacing the rotary kernel's launch, with the rotary kernel's bits. Its programs are few (the
8B's 192 on 132 SMs), so with fp8 weights K is split too (qkv_split_k): each split stores its fp32
partial sums and raises its program's count (an atomic, after a barrier); the last to arrive adds
every split's sums in split order (the same bits whichever is last), runs the epilogue and zeroes
the count (_split_total; H200, 5 rows: the 8B 16.4 -> 14.3 us). gemm_w8 keeps a second kernel for
its splits: the last split adding them was no faster there (within 0.7 us either way across two runs,
and 1.7-5.8 us slower on the 8B's down).

fp8 e4m3 weights (w_scale, the fp8 draft): the product is computed the other way round,
x @ w^T with the weight tile as the dot's second operand, loaded K-major and widened to the
input's dtype in registers (_fp8_acc), and each row's sums are multiplied by its scale in the
epilogue. At 6 rows on the H200 that streams the 1B's gate_up in 15.8 us and its head in 89
against 17.8 / 122 for bf16 weights; the wgmma form (weights first) had taken 8-byte copies and
a register shuffle a step and no time off the catch-up. The engine still sends the fp8 draft's
few-row qkv projection to the bf16 copy (tandem/layers/gpu_linear.py).

Widening e4m3 to bf16 (_widen): Triton's cast goes e4m3x2 -> f16x2, then one f16 -> bf16 conversion
(F2F) a weight, instructions the SM issues at a fraction of the integer and half2 ops' rate, and that
bounded the fp8 tiles (H200, Nsight Compute: warps hardly waited on memory, 23-60% of the DRAM
bandwidth); the inline PTX of _E4M3_TO_BF16 builds the bf16 bits with byte permutes, shifts, masks and
one bf16x2 fma a pair (as many instructions, none a conversion), exactly (every byte tested). H200,
cold weights, us, the asm against the cast (TANDEM_W8_WIDEN=cvt): the 8B's gate_up at 5 rows 38.9 / 43.8, down
20.5 / 25.9, head 144 / 182; at 40 rows gate_up 54.9 / 65.0; the fp8 target's batch-8 decode step 3.83
-> 3.39 ms, its k = 4 round at batch 1 7.38 -> 6.95 ms.

gemm_w8 is the same kernel over a grid of row tiles, for the fp8 target's steps of 2 rows and more
(it keeps no bf16 weight for cuBLAS): weight-only like the rest, so a row's value does not depend on
the step it shares. Up to 32 rows its tile is gemm_rows' fp8 form with K split in up to eight (the 8B's
down at 5 rows 26.1 against 41.2 us unsplit at gemm_rows' tile, H200). Its tile (W8Tile) also says
where the e4m3 tile sits in the dot (second, as above, or first: past ~160 rows the wgmma form won,
H200 sweep in docs/benchmarks.md) and how many ways K is split (each split's fp32 sums stored, then
added in order and finished by _split_sum_kernel: deterministic, the same bits for every row count
at one tile). With _widen it beats cuBLAS on bf16 weights up to 8 rows (the 8B's layers 0.6-0.8x its
time, H200) and at 40 rows matches it on the 8B's o, down and gate_up (14.3 / 32.2 / 54.9 against 14.2
/ 34.4 / 62.2 us) but not its qkv (20.6 against 16.7); from 256 rows on it trails (2048 rows of the
gate_up 900 against 661). W8A8 (torch._scaled_mm, the
rows rounded to e4m3 too) was faster past ~500 rows, but a function that changes with the step's row
count parts greedy speculation from target-only (a decode step of 8 rows weight-only, its 40-row
verification W8A8), so it is not used.

Programmatic dependent launch (tandem/kernels/pdl.py): these kernels launch with PDL (programs
placed while the kernel before still runs; each waits for it before its first load) and release the
kernel after them once their main loop is done, so the small kernel that follows (a norm, the
attention) is launched and waiting when they finish. H200, k = 4 rounds at 0.8 (bench/gpu_bench.py
--env-ab TANDEM_ROWS_PDL=0, three runs): bf16 draft 8.22-8.23 -> 8.19-8.20 ms, fp8 draft 7.51-7.54
-> 7.48-7.51. When a separate silu_and_mul kernel still preceded the down projection, a PDL launch
had doubled the 8B down's time at 5 rows (60 against 32 us); enough pipeline stages to keep a second
program off each SM (> 114 KB of shared memory) made the rounds slower with or without PDL (8.23 ->
8.51 / 8.69 ms). TANDEM_ROWS_PDL=0 launches them plainly (A/B).

gemm_rows(act="silu_mul") is the packed gate | up projection with SiLU-and-mul in its epilogue:
a program's weight tile holds the gate rows and the up rows of the same output columns, so it
can multiply them itself. At batch 1, k = 4 (H200, bench/gpu_bench.py --sections synthetic): the
verification graph 4.55 -> 4.49 ms, the draft's catch-up 1.08 -> 1.05, the round 8.25 -> 8.17.

Tried and not kept (H200, bench/gpu_kernels.py --rows 5): the one-row GEMV's prologue fusions. An
RMSNorm of the input inside (8B qkv 21.9 us against 16.8 for rms_norm then the GEMM) and
SiLU-and-mul of the input inside the down projection (113 us against 16.5) cost more than the
launch they save: every program redoes them on a 16-row tile, and with arithmetic between the
input's load and the dot Triton no longer pipelines that load.

The wrappers take sizes from tensor shapes only (no device-to-host reads): graph-capturable.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.fused import _numerics, _round
from tandem.kernels.gemv import _check_weight, _mul_rn, _silu_mul
from tandem.kernels.kv_store import to_cache
from tandem.kernels.pdl import pdl_enabled, release_next, wait_only

MAX_ROWS = 32


def row_tile(m: int) -> int:
    """BLOCK_M for m rows: the 16 a tensor-core tile needs, or 32 above 16 rows."""
    return max(16, triton.next_power_of_2(m))


@triton.jit
def _x_tile(x_ptr, offs_m, m_ok, k0, K, stride_xm, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K]: columns k0 .. k0 + BLOCK_K of every row of x (zeros past M and K)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :],
                   other=0.0)


@triton.jit
def _dot(w, x_t, acc, SOFT_BF16: tl.constexpr):
    """acc + w @ x_t on tensor cores; in fp32 under the interpreter, whose bf16 dot is wrong."""
    if SOFT_BF16:
        return tl.dot(w.to(tl.float32), x_t.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w, x_t, acc)


# Four e4m3 bytes (one 32-bit register) -> four bf16 (two registers), exactly: prmt puts each byte in the
# low byte of a 16-bit half and copies its sign bit through the high byte; shifted left by 4 and masked
# to 0x87F0, a half holds the sign at bit 15 and the byte's exponent | mantissa bits where bf16 keeps
# them, which read as bf16 is the e4m3 value times 2^-120 (bias 127 against 7; an e4m3 subnormal lands
# on the bf16 subnormal of the same significand); the fma multiplies by 2^120 (0x7B80) and adds -0,
# exact and sign-keeping. No conversion instruction (the cast: e4m3x2 -> f16x2, then f16 -> bf16 one value
# at a time).
_E4M3_TO_BF16 = tl.constexpr("""
{
.reg .b32 lo, hi, scale, minus0;
mov.b32 scale, 0x7B807B80;
mov.b32 minus0, 0x80008000;
prmt.b32 lo, $2, 0, 0x9180;
prmt.b32 hi, $2, 0, 0xB3A2;
shl.b32 lo, lo, 4;
shl.b32 hi, hi, 4;
and.b32 lo, lo, 0x87F087F0;
and.b32 hi, hi, 0x87F087F0;
fma.rn.bf16x2 $0, lo, scale, minus0;
fma.rn.bf16x2 $1, hi, scale, minus0;
}
""")


@triton.jit
def _widen(w, dtype: tl.constexpr, ASM_WIDEN: tl.constexpr):
    """An e4m3 tile -> dtype (exact either way); ASM_WIDEN (bf16 on a compiled GPU): _E4M3_TO_BF16.
    Used where the widened tile is the mma.sync operand (the weights-second tiles: every fp8 step of up
    to 64 rows, some up to 256): Triton's cast spends conversion instructions there (e4m3x2 -> f16x2,
    then f16 -> bf16 one value at a time), which bounded those kernels. The weights-first (wgmma)
    tiles of large steps keep the cast: with the asm they ran slower (H200, 2048 rows: the 8B's
    gate_up 1147 against 970 us, down 507 against 466)."""
    if ASM_WIDEN:
        return tl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                         is_pure=True, pack=4)
    else:
        return w.to(dtype)


@triton.jit
def _fp8_acc(x_ptr, w_ptr, offs_m, m_ok, rows, rows_ok, K, stride_xm, stride_wn, EVEN_K: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_BF16: tl.constexpr,
             ASM_WIDEN: tl.constexpr, k_lo=0, k_hi=None):
    """fp32 [BLOCK_N, BLOCK_M]: (x @ w[rows]^T)^T for fp8 e4m3 weights, unscaled. The weight is the
    dot's second operand here, its tile loaded K-major and widened to x's dtype in registers (16-byte
    copies, mma.sync); as the first operand of the wgmma, as the model-dtype path has it, the e4m3 tile
    took 8-byte copies and a register shuffle a step (the 1B at 6 rows, H200: gate_up 16.4 -> 15.8 us,
    head 96 -> 89). k_lo .. k_hi: the columns summed (a split-K program's; k_lo a multiple of BLOCK_K)."""
    if k_hi is None:
        k_hi = K
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[None, :] * stride_wn + k_lo + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x = _x_tile(x_ptr, offs_m, m_ok, k0, K, stride_xm, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_ptrs, mask=rows_ok[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=rows_ok[None, :] & (k0 + offs_k < K)[:, None], other=0.0)
        acc = _dot(x, _widen(w, x.dtype, ASM_WIDEN), acc, SOFT_BF16)
        w_ptrs += BLOCK_K
    return tl.trans(acc)


@triton.jit
def _split_total(acc, p_ptrs, p_ok, count_ptr, tile, split, split_stride, SPLIT_K: tl.constexpr):
    """Split-K: store this split's fp32 partial sums acc at p_ptrs and count it done for its output
    tile. -> (whether this program is the tile's last split to arrive, and then the sum of every
    split's partials, added in split order: the same bits whichever arrives last). count_ptr + tile
    is back to zero after the last."""
    tl.store(p_ptrs, acc, mask=p_ok)
    tl.debug_barrier()  # (every thread's partial stored before the count is raised)
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    if last:
        acc = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(p_ptrs + (s - split) * split_stride, mask=p_ok, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)
    return last, acc


@triton.jit
def _rows_kernel(
    x_ptr,  # [M, K] rows at stride_xm
    w_ptr,  # [N, K], rows contiguous (SILU_MUL: [gate (N / 2) | up (N / 2)])
    b_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N] rows at stride_om (SILU_MUL: [M, N / 2])
    ws_ptr,  # [N] fp32 per-row weight scales (W_SCALE only: w is fp8)
    part_ptr,  # [SPLIT_K, M, N] fp32 unscaled partial sums (SPLIT_K > 1 only: the epilogue is _split_sum_kernel's)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # columns of K a split owns (a multiple of BLOCK_K)
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,  # w is fp8: widened to x's dtype for the dot, each row's sum times its scale
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    MULTI_M: tl.constexpr,  # grid (row tiles, column tiles): gemm_w8's any number of rows
    W8_SECOND: tl.constexpr,  # W_SCALE: the e4m3 tile the dot's second operand (else its first, as a model-dtype weight)
    SPLIT_K: tl.constexpr,  # MULTI_M: programs along K (grid axis 2), each storing its partial sums
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    ASM_WIDEN: tl.constexpr,  # W_SCALE with bf16 rows, compiled: e4m3 widened by _E4M3_TO_BF16
    PDL: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    """SILU_MUL: a packed gate | up projection whose output is silu(gate) * up: a program owns
    BLOCK_N / 2 output columns, its weight tile their gate rows then their up rows (one dot, as the
    qkv kernel's rotary pairs), and its epilogue multiplies them with the silu_and_mul kernel's
    rounding; the separate activation kernel and the [M, N] intermediate disappear.
    MULTI_M: the row tiles are the grid's first axis, so the programs launched together share a
    weight tile (read from memory once; the rows' tiles stay in L2)."""
    if MULTI_M:
        pid = tl.program_id(1)
        offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # M * K may pass 2^31
    else:
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_lo = tl.program_id(2) * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
    wait_only(PDL_WAIT)
    m_ok = offs_m < M
    if SPLIT_K > 1:  # the tile's own columns (the silu_mul pairing happens in _split_sum_kernel)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    elif SILU_MUL:
        P: tl.constexpr = BLOCK_N // 2
        half = N // 2
        offs_r = tl.arange(0, BLOCK_N)
        cols = pid * P + offs_r % P  # the output column of each tile row
        offs_n = cols + (offs_r // P) * half  # its gate row, then its up row
        n_ok = cols < half
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    if W_SCALE and W8_SECOND:
        acc = _fp8_acc(x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, K, stride_xm, stride_wn, EVEN_K, BLOCK_M, BLOCK_N,
                       BLOCK_K, SOFT_BF16, ASM_WIDEN, k_lo, k_hi)  # out^T
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + k_lo + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # out^T
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = _x_tile(x_ptr, offs_m, m_ok, k0, K, stride_xm, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
            acc = _dot(w.to(x.dtype), tl.trans(x), acc, SOFT_BF16)  # (fp8: widened by Triton's cast: see _widen)
            w_ptrs += BLOCK_K
    release_next(PDL)
    if SPLIT_K > 1:
        p_ptrs = part_ptr + (tl.program_id(2).to(tl.int64) * M + offs_m[None, :]) * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        _rows_store(acc, out_ptr, b_ptr, ws_ptr, offs_m, m_ok, offs_n, n_ok, pid, N, stride_om, HAS_BIAS, W_SCALE,
                    SILU_MUL, BLOCK_M, BLOCK_N, CUDA_LIBM, SOFT_BF16)


@triton.jit
def _rows_store(acc, out_ptr, b_ptr, ws_ptr, offs_m, m_ok, offs_n, n_ok, pid, N, stride_om, HAS_BIAS: tl.constexpr,
                W_SCALE: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CUDA_LIBM: tl.constexpr, SOFT_BF16: tl.constexpr):
    """_rows_kernel's epilogue: acc fp32 [BLOCK_N, BLOCK_M] (out^T, weight rows offs_n, input rows offs_m)
    times the row scales (W_SCALE), plus the bias, rounded once (SILU_MUL: the gate | up pairs of output
    columns pid * BLOCK_N / 2 .. multiplied first) and stored."""
    dtype = out_ptr.dtype.element_ty
    if W_SCALE:
        acc = acc * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if SILU_MUL:
        P: tl.constexpr = BLOCK_N // 2
        half = N // 2
        gate, up = tl.split(tl.permute(tl.reshape(acc, [2, P, BLOCK_M]), [1, 2, 0]))  # [P, BLOCK_M] each
        act = _silu_mul(gate.to(dtype), up.to(dtype), dtype, CUDA_LIBM, SOFT_BF16)  # as stored, then activated
        offs_c = pid * P + tl.arange(0, P)
        o_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_c[:, None]
        tl.store(o_ptrs, act.to(dtype), mask=(offs_c < half)[:, None] & m_ok[None, :])
    else:
        o_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(o_ptrs, acc.to(dtype), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, ws_ptr, b_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                      SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, CUDA_LIBM: tl.constexpr,
                      SOFT_BF16: tl.constexpr):
    """gemm_w8's split-K epilogue: out [M, N] (SILU_MUL: [M, N / 2]) from part [SPLIT_K, M, N], the
    splits summed in order, then _rows_kernel's epilogue (scale, bias, rounding, SiLU-and-mul)."""
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_out = N // 2 if SILU_MUL else N
    c_ok = offs_c < n_out
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], tl.float32)
    acc2 = tl.zeros([BLOCK], tl.float32)  # SILU_MUL: the up half's sums
    for s in tl.static_range(SPLIT_K):
        p_ptrs = part_ptr + (s * M + row) * N + offs_c
        acc += tl.load(p_ptrs, mask=c_ok, other=0.0)
        if SILU_MUL:
            acc2 += tl.load(p_ptrs + n_out, mask=c_ok, other=0.0)
    acc = acc * tl.load(ws_ptr + offs_c, mask=c_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    if SILU_MUL:
        acc2 = acc2 * tl.load(ws_ptr + n_out + offs_c, mask=c_ok, other=0.0)
        if HAS_BIAS:
            acc2 += tl.load(b_ptr + n_out + offs_c, mask=c_ok, other=0.0).to(tl.float32)
        acc = _silu_mul(acc.to(dtype), acc2.to(dtype), dtype, CUDA_LIBM, SOFT_BF16)
    tl.store(out_ptr + row * stride_om + offs_c, acc.to(dtype), mask=c_ok)


@triton.jit
def _rows_qkv_rope_kernel(
    x_ptr,  # [M, K] rows at stride_xm
    w_ptr,  # [(NUM_Q + 2 NUM_KV) * HEAD_DIM, K], rows contiguous: q | k | v
    b_ptr,  # [(NUM_Q + 2 NUM_KV) * HEAD_DIM] (HAS_BIAS only)
    out_ptr,  # [M, (NUM_Q + 2 NUM_KV) * HEAD_DIM] contiguous: q and k rotated, v
    cos_ptr,  # [max_pos, HEAD_DIM] fp32
    sin_ptr,
    pos_ptr,  # [M] int32 / int64
    slot_ptr,  # [M] int32 / int64, -1 = padding (nothing written to the cache)
    k_cache_ptr,  # [num_slots, NUM_KV, HEAD_DIM] contiguous
    v_cache_ptr,
    ws_ptr,  # [(NUM_Q + 2 NUM_KV) * HEAD_DIM] fp32 per-row weight scales (W_SCALE only: w is fp8)
    part_ptr,  # [SPLIT_K, M, (NUM_Q + 2 NUM_KV) * HEAD_DIM] fp32 partial sums (SPLIT_K > 1 only)
    count_ptr,  # [programs] int32, zero between calls (SPLIT_K > 1 only)
    M,
    K,
    k_per_split,  # columns of K a split owns (a multiple of BLOCK_K)
    stride_xm,
    stride_wn,
    stride_cos,
    stride_sin,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs along K (grid axis 1); the last of a tile's to finish runs the epilogue
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    ASM_WIDEN: tl.constexpr,
    PDL: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    """A q or k program owns 16 rotary pairs of one head: weight rows d .. d + 15 (x1) and
    d + D/2 .. d + D/2 + 15 (x2); a v program owns 32 rows of v (rows1, then rows2)."""
    pid = tl.program_id(0)
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_lo = tl.program_id(1) * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
    wait_only(PDL_WAIT)
    dtype = out_ptr.dtype.element_ty
    PAIRS: tl.constexpr = 16
    HALF: tl.constexpr = HEAD_DIM // 2
    CHUNKS: tl.constexpr = HALF // PAIRS
    ROPE_PROGRAMS: tl.constexpr = (NUM_Q + NUM_KV) * CHUNKS
    V0: tl.constexpr = (NUM_Q + NUM_KV) * HEAD_DIM
    rope = pid < ROPE_PROGRAMS
    head = pid // CHUNKS
    offs_p = tl.arange(0, PAIRS)
    dim = (pid % CHUNKS) * PAIRS + offs_p  # x1's dims within the head
    rows1 = tl.where(rope, head * HEAD_DIM + dim, V0 + (pid - ROPE_PROGRAMS) * (2 * PAIRS) + offs_p)
    rows2 = tl.where(rope, rows1 + HALF, rows1 + PAIRS)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    # One [2 * PAIRS, BLOCK_K] weight tile a step: rows1 then rows2 (one dot, as a 32-row tile of
    # _rows_kernel; two 16-row dots ran at 1.5x its time).
    offs_r = tl.arange(0, 2 * PAIRS)
    rows = tl.where(rope, head * HEAD_DIM + (pid % CHUNKS) * PAIRS + offs_r % PAIRS + (offs_r // PAIRS) * HALF,
                    V0 + (pid - ROPE_PROGRAMS) * (2 * PAIRS) + offs_r)
    if W_SCALE:
        acc = _fp8_acc(x_ptr, w_ptr, offs_m, m_ok, rows, rows >= 0, K, stride_xm, stride_wn, EVEN_K, BLOCK_M,
                       2 * PAIRS, BLOCK_K, SOFT_BF16, ASM_WIDEN, k_lo, k_hi)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + k_lo + offs_k[None, :]
        acc = tl.zeros([2 * PAIRS, BLOCK_M], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = tl.trans(_x_tile(x_ptr, offs_m, m_ok, k0, K, stride_xm, BLOCK_K))
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=(k0 + offs_k < K)[None, :], other=0.0)
            acc = _dot(w, x, acc, SOFT_BF16)
            w_ptrs += BLOCK_K
    release_next(PDL)
    if SPLIT_K > 1:
        n = (NUM_Q + 2 * NUM_KV) * HEAD_DIM
        p_ptrs = part_ptr + (tl.program_id(1).to(tl.int64) * M + offs_m[None, :]) * n + rows[:, None]
        last, acc = _split_total(acc, p_ptrs, m_ok[None, :], count_ptr, pid, tl.program_id(1), M * n, SPLIT_K)
        m_ok = m_ok & last  # (the other splits store nothing more)
    if W_SCALE:
        acc = acc * tl.load(ws_ptr + rows)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    acc1, acc2 = tl.split(tl.permute(tl.reshape(acc, [2, PAIRS, BLOCK_M]), [1, 2, 0]))  # rows1, rows2
    x1 = acc1.to(dtype)  # the projection's output, as the plain GEMM stores it
    x2 = acc2.to(dtype)
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)  # [BLOCK_M]
    row_base = offs_m[None, :] * (V0 + NUM_KV * HEAD_DIM)
    if rope:  # the rotary kernel's arithmetic: x1 c1 - x2 s1, x2 c2 + x1 s2 in fp32, rounded once
        pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        c_ptrs = cos_ptr + pos[None, :] * stride_cos + dim[:, None]
        s_ptrs = sin_ptr + pos[None, :] * stride_sin + dim[:, None]
        c1, c2 = tl.load(c_ptrs), tl.load(c_ptrs + HALF)
        s1, s2 = tl.load(s_ptrs), tl.load(s_ptrs + HALF)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = _round(_mul_rn(a1, c1, CUDA_LIBM) - _mul_rn(a2, s1, CUDA_LIBM), dtype, SOFT_BF16).to(dtype)
        o2 = _round(_mul_rn(a2, c2, CUDA_LIBM) + _mul_rn(a1, s2, CUDA_LIBM), dtype, SOFT_BF16).to(dtype)
        tl.store(out_ptr + row_base + rows1[:, None], o1, mask=m_ok[None, :])
        tl.store(out_ptr + row_base + rows2[:, None], o2, mask=m_ok[None, :])
        if head >= NUM_Q:
            kv = slot[None, :] * (NUM_KV * HEAD_DIM) + (head - NUM_Q) * HEAD_DIM + dim[:, None]
            ok = (slot >= 0)[None, :] & m_ok[None, :]
            tl.store(k_cache_ptr + kv, to_cache(o1, k_cache_ptr), mask=ok)
            tl.store(k_cache_ptr + kv + HALF, to_cache(o2, k_cache_ptr), mask=ok)
    else:
        tl.store(out_ptr + row_base + rows1[:, None], x1, mask=m_ok[None, :])
        tl.store(out_ptr + row_base + rows2[:, None], x2, mask=m_ok[None, :])
        kv = slot[None, :] * (NUM_KV * HEAD_DIM) - V0
        ok = (slot >= 0)[None, :] & m_ok[None, :]
        tl.store(v_cache_ptr + kv + rows1[:, None], to_cache(x1, v_cache_ptr), mask=ok)
        tl.store(v_cache_ptr + kv + rows2[:, None], to_cache(x2, v_cache_ptr), mask=ok)


def _launch_flags(x: Tensor) -> dict:
    """A PDL launch (programs placed while the kernel before runs, waiting for it before their first
    load) that releases the next kernel after its main loop; TANDEM_ROWS_PDL=0: a plain launch. ASM_WIDEN:
    e4m3 weights widened for bf16 rows by _E4M3_TO_BF16 (compiled CUDA; TANDEM_W8_WIDEN=cvt: Triton's
    cast, an A/B switch)."""
    on = pdl_enabled(x)
    wait = on and os.environ.get("TANDEM_ROWS_PDL", "1") == "1"
    widen = os.environ.get("TANDEM_W8_WIDEN", "")
    if widen not in ("", "cvt"):
        raise ValueError(f"TANDEM_W8_WIDEN={widen!r}: expected cvt (Triton's cast) or unset")
    asm = x.is_cuda and x.dtype == torch.bfloat16 and not _numerics(x)["SOFT_BF16"] and widen == ""
    return dict(PDL=on, PDL_WAIT=wait, launch_pdl=wait, ASM_WIDEN=asm)


def rows_config(n: int, k: int) -> tuple[int, int, int, int]:
    """-> (BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight, from the H200 sweep
    (bench/gpu_kernels.py --rows 5,2, cold weights, us per call against cuBLAS in docs/benchmarks.md):
    64 x 128 with 4 stages for wide weights (gate_up, LM heads); 16 x 512 with 3 stages for <= 2048
    rows (the 1B's o and down, which the engine leaves to cuBLAS: still 5-20% slower); 32 x 128
    with 6 stages between (qkv, the 8B's o and down)."""
    if n >= 8192:
        return 64, 128, 4, 4
    if n <= 2048:
        return 16, min(512, triton.next_power_of_2(k)), 4, 3
    return 32, 128, 4, 6


def _check_x(x: Tensor, k: int, weight: Tensor, w_scale: Tensor | None) -> None:
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == k and x.stride(1) == 1
    assert x.dtype in (torch.bfloat16, torch.float16)
    _check_weight(x, weight, w_scale)


def gemm_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
              config: tuple[int, int, int, int] | None = None, act: str | None = None,
              w_scale: Tensor | None = None) -> Tensor:
    """x [M, K] with 1 <= M <= MAX_ROWS, bf16 / fp16, rows contiguous; weight [N, K] same dtype, rows
    contiguous; bias [N] or None. -> out [M, N] (rows contiguous), fp32 accumulation, rounded once.
    w_scale [N] fp32: weight is fp8 e4m3 (widened to x's dtype in registers) and row n's sums are
    multiplied by w_scale[n] before the bias (power-of-two scales: the products of gemm_rows on
    weight * w_scale in x's dtype; tested within an ulp of it).
    act="silu_mul": weight is a packed [gate | up] (N even) and out [M, N / 2] is
    silu_and_mul(gemm_rows(x, weight, bias)), in one launch (same bits at the same tile).
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages) in place of rows_config, for tuning sweeps."""
    n, k = weight.shape
    m = x.shape[0]
    assert act in (None, "silu_mul")
    silu_mul = act == "silu_mul"
    n_out = n // 2 if silu_mul else n
    _check_x(x, k, weight, w_scale)
    if out is None:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n_out) and out.stride(1) == 1 and out.dtype == x.dtype
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    block_n, block_k, num_warps, num_stages = config or rows_config(n, k)
    assert not silu_mul or (n % 2 == 0 and block_n % 2 == 0)
    grid = (triton.cdiv(n_out, block_n // 2) if silu_mul else triton.cdiv(n, block_n),)
    _rows_kernel[grid](
        x, weight, bias if bias is not None else weight, out, w_scale if w_scale is not None else out, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k,
        HAS_BIAS=bias is not None, W_SCALE=w_scale is not None, SILU_MUL=silu_mul, EVEN_K=k % block_k == 0,
        MULTI_M=False, W8_SECOND=True, SPLIT_K=1, BLOCK_M=row_tile(m), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages, **_numerics(x), **_launch_flags(x),
    )
    return out


class W8Tile(NamedTuple):
    """gemm_w8's launch: row and column tiles, K step, warps, pipeline stages; w8_second: the e4m3
    tile the dot's second operand (gemm_rows' layout, mma.sync), else its first (a wgmma's register
    operand); split_k: programs along K, their fp32 partial sums added in order by a second kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    w8_second: bool = True
    split_k: int = 1


def w8_config(m: int, n: int, k: int) -> W8Tile:
    """gemm_w8's tile for m rows of an fp8 [n, k] weight, from the H200 sweeps (bench/gpu_kernels.py
    --w8, 8B and Qwen 1.5B shapes, docs/benchmarks.md).
    Up to MAX_ROWS: a 64 x 128 tile of the weight (the dot's second operand, rows padded to
    row_tile(m)), K split in pieces of at least 384 columns, at most 4 up to 4096 columns and 8 past
    them, and not at all for 16384 rows and more (the gate | up projections, whose 224-280 column
    tiles fill the chip). Swept with _widen's asm (--w8 5,16, 24 tiles x splits; cuBLAS on bf16
    weights in brackets): the 8B's qkv 11.5 (15.4), o 9.9 (13.6), gate_up 33.1 (63.1), down 20.4 (32.3)
    us and Qwen2.5 1.5B's gate_up 11.4 (17.5), down 10.1 (12.0) at 5 rows, each within 0.3 us of the
    best tile at 5 and 16 rows but the 8B's o at 16 rows (9.7 against 9.0 unsplit on 32 x 256). The
    splits swept under Triton's cast were 8, 8, 4, 8 (TANDEM_W8_SPLIT=cast); with the asm, 4 splits
    cost the 8B's gate_up 39.8 us against 33.1 unsplit, 8 its qkv 12.5 against 11.5 (the fp8 8B's k = 4
    round at batch 1 6.84 -> 6.70 ms, its batch-8 decode step 3.34 -> 3.28, `bench/gpu_bench.py --env-ab
    TANDEM_W8_SPLIT=cast`). On Qwen2.5 1.5B's K = 1536 the 384-column pieces give 4 splits (qkv 6.8 ->
    6.6, o 6.7 -> 6.4 us against 512-column pieces, under the cast). The tile does not depend on m
    (BLOCK_M aside), so a row's bits do not either, from 1 to MAX_ROWS rows.
    More rows (--w8 40,64,160,512,2048): each pick within 1.3x of the best unsplit tile there, and
    most within 1.1x; up to 256 rows K is split until about two programs an SM are launched (at
    most 4 splits of at least 1024 columns each), but 33-64 rows of fewer than 16384 weight rows (a
    batch-8 verification's qkv, o and down) take 64 x 64 weight tiles split 8 ways (pieces of at
    least 128 columns; --w8 40 sweep of 9 splits x 4 tiles): the 8B's qkv / o / down 21.1 / 14.9 /
    34.6 us and Qwen2.5 1.5B's 7.9 / 7.7 / 16.9 against 24.0 / 15.5 / 37.5 and 13.6 / 13.7 / 20.4 at the
    earlier rule (cuBLAS on bf16 weights 16.7 / 14.2 / 34.3 and 5.8 / 5.5 / 12.6), all swept with Triton's
    cast before _widen; re-swept with it at 40 rows, each default is the best of 30 tiles or within 0.4 us
    (the 8B's qkv / o / down 20.2 / 14.2 / 32.0 us, Qwen2.5 1.5B's down 15.0)."""
    if m <= MAX_ROWS:
        rule = _split_rule()
        if rule == "old":
            return W8Tile(row_tile(m), 64, 128, 4, 4, True, max(1, min(4, k // 1024)))
        if rule == "cast":
            return W8Tile(row_tile(m), 64, 128, 4, 4, True, max(1, min(4 if n >= 16384 else 8, k // 384)))
        split = 1 if n >= 16384 else max(1, min(4 if k <= 4096 else 8, k // 384))
        return W8Tile(row_tile(m), 64, 128, 4, 4, True, split)
    if m <= 64:
        if n >= 16384 or _split_rule() == "old":
            tile = W8Tile(64, 128, 64, 4, 4) if n >= 16384 else W8Tile(64, 64, 128, 4, 4)
        else:
            return W8Tile(64, 64, 64, 4, 4, True, max(1, min(8, k // 128)))
    elif m <= 256:
        tile = W8Tile(128, 64, 128, 8, 3) if n <= 4096 else W8Tile(128, 128, 64, 8, 3, False)
    elif m <= 1024 and n <= 2048:
        return W8Tile(128, 64, 128, 8, 3)
    else:
        return W8Tile(256, 128, 64, 8, 3, False)
    programs = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
    return tile._replace(split_k=max(1, min(4, 2 * _SMS // programs, k // 1024)))


_SMS = 132  # the H200's streaming multiprocessors (a constant: the tile must not vary with the device it runs on)


def _rows_out(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None, act: str | None,
              w_scale: Tensor | None) -> Tensor:
    """gemm_w8's and gemm_invariant's inputs checked (x [M, K] bf16 / fp16 rows contiguous, any M) -> out
    [M, N] or, for act="silu_mul", [M, N / 2] (allocated when None)."""
    n, k = weight.shape
    assert act in (None, "silu_mul")
    n_out = n // 2 if act == "silu_mul" else n
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
    _check_weight(x, weight, w_scale)
    if out is None:
        out = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    assert out.shape == (x.shape[0], n_out) and out.stride(1) == 1 and out.dtype == x.dtype
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    return out


def gemm_w8(x: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
            act: str | None = None, config: tuple | None = None) -> Tensor:
    """gemm_rows for any number of rows of fp8 e4m3 weights (W8A16: the weight widened to x's dtype
    in registers, exact products, fp32 sums, each output row's sum times w_scale[n]): x [M, K]
    bf16 / fp16, rows contiguous; weight [N, K] e4m3, w_scale [N] fp32; act="silu_mul" as gemm_rows.
    -> out [M, N] (or [M, N / 2]). config: a W8Tile (or its fields as a tuple) in place of w8_config."""
    assert w_scale is not None
    out = _rows_out(x, weight, bias, out, act, w_scale)
    n, k = weight.shape
    m = x.shape[0]
    silu_mul = act == "silu_mul"
    n_out = out.shape[1]
    tile = W8Tile(*(config or w8_config(m, n, k)))
    assert not silu_mul or (n % 2 == 0 and tile.block_n % 2 == 0)
    if m == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, tile.split_k), tile.block_k) * tile.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    pairs = silu_mul and splits == 1  # (split: the reduction pairs gate and up columns)
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n_out, tile.block_n // 2) if pairs else triton.cdiv(n, tile.block_n),
            splits)
    _rows_kernel[grid](
        x, weight, bias if bias is not None else weight, out, w_scale, part,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        HAS_BIAS=bias is not None, W_SCALE=True, SILU_MUL=silu_mul, EVEN_K=k % tile.block_k == 0,
        MULTI_M=True, W8_SECOND=tile.w8_second, SPLIT_K=splits, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages, **_numerics(x),
        **_launch_flags(x),
    )
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n_out))
        _split_sum_kernel[(m, triton.cdiv(n_out, block))](
            part, out, w_scale, bias if bias is not None else w_scale, m, n, out.stride(0),
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=splits, BLOCK=block, num_warps=4, **_numerics(x))
    return out


def rope_fusable(head_dim: int) -> bool:
    """Whether gemm_rows_qkv_rope takes this head size (16 rotary pairs per program)."""
    return head_dim % 32 == 0


def _split_rule() -> str:
    """TANDEM_W8_SPLIT, an A/B switch for the fp8 splits: "old", those of before 2026-12-03 (gemm_w8's K
    split at most 4 ways up to 32 rows and its 33-64-row tile of before, the qkv-with-rotary unsplit);
    "cast", the up-to-32-row splits swept under Triton's e4m3 cast (before _widen); unset: the current ones."""
    raw = os.environ.get("TANDEM_W8_SPLIT", "")
    if raw not in ("", "old", "cast"):
        raise ValueError(f"TANDEM_W8_SPLIT={raw!r}: expected old or cast (earlier few-row splits) or unset")
    return raw or "new"


def qkv_split_k(k: int, fp8: bool) -> int:
    """gemm_rows_qkv_rope's split of K: fp8 weights 8192 / K ways (at most 4): its (H + 2 Hkv) D / 32
    programs of 32 weight rows are too few for the chip (the 8B's 192 on 132 SMs; H200, 5 rows,
    bench/gpu_kernels.py --w8 5: 8B 16.4 -> 14.3 us at 2 splits, 1B 8.4 -> 6.8 at 4); model-dtype weights
    1 (the 8B's 15.9 us unsplit, 16.3 at 2)."""
    return max(1, min(4, 8192 // k)) if fp8 and _split_rule() != "old" else 1


def gemm_rows_qkv_rope(x: Tensor, weight: Tensor, bias: Tensor | None, num_heads: int, num_kv_heads: int,
                       positions: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slot_mapping: Tensor, config: tuple[int, int, int] | None = None,
                       w_scale: Tensor | None = None, split_k: int | None = None,
                       counts: Tensor | None = None) -> Tensor:
    """A few rows' packed q | k | v projection (gemm_rows(x, weight, bias)) with q and k
    rotated as kernels.fused.rotary_embedding rotates them and each row's k and v written into
    the paged cache at slot_mapping[m] (-1: not written). -> [M, (H + 2 Hkv) D] contiguous.

    positions, slot_mapping [M] int32 / int64; cos, sin [max_pos, D] fp32; k_cache, v_cache
    [num_blocks, block_size, Hkv, D] contiguous, x's dtype or float8 e4m3 (saturated); D % 32 == 0.
    config: (BLOCK_K, num_warps, num_stages). split_k: programs along K (default qkv_split_k), the
    last of a program's splits to arrive running the epilogue; counts: int32 zeros, N / 32 of them
    or more (left zero; allocated here when None)."""
    n, k = weight.shape
    m = x.shape[0]
    head_dim = k_cache.shape[-1]
    assert n == (num_heads + 2 * num_kv_heads) * head_dim and rope_fusable(head_dim)
    _check_x(x, k, weight, w_scale)
    assert k_cache.shape == v_cache.shape and k_cache.shape[-2] == num_kv_heads
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (x.dtype, torch.float8_e4m3fn)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert positions.shape == (m,) and slot_mapping.shape == (m,)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[1] == head_dim and cos.stride(1) == 1 and sin.stride(1) == 1
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    block_k, num_warps, num_stages = config or rows_config(n, k)[1:]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    programs = (num_heads + num_kv_heads) * (head_dim // 32) + num_kv_heads * head_dim // 32
    k_per_split = triton.cdiv(triton.cdiv(k, split_k or qkv_split_k(k, w_scale is not None)), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    part = out
    if splits > 1:
        part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        if counts is None:
            counts = torch.zeros(programs, dtype=torch.int32, device=x.device)
        assert counts.dtype == torch.int32 and counts.numel() >= programs
    _rows_qkv_rope_kernel[(programs, splits)](
        x, weight, bias if bias is not None else weight, out, cos, sin, positions, slot_mapping,
        k_cache, v_cache, w_scale if w_scale is not None else out, part, counts if splits > 1 else part,
        m, k, k_per_split, x.stride(0), weight.stride(0), cos.stride(0),
        sin.stride(0), NUM_Q=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, HAS_BIAS=bias is not None,
        W_SCALE=w_scale is not None,
        EVEN_K=k % block_k == 0, SPLIT_K=splits, BLOCK_M=row_tile(m), BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages,
        **_numerics(x),
        **_launch_flags(x),
    )
    return out
