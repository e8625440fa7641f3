"""GEMV for one-row steps: out[n] = sum_k x[k] * w[n, k] (+ bias[n]).

At batch 1 a linear layer is a matrix-vector product bound by reading the weight once. One
program owns BLOCK_N output rows and walks K in BLOCK_K steps, accumulating
elementwise products in fp32 registers (no reduction inside the loop), then reduces once and
rounds once to the output dtype. There is no split-K: the grid is N / BLOCK_N programs, enough
to fill the chip at every shape of the supported models, and each output element is summed in
one fixed order.

What neighbouring small kernels of a decoder layer did is folded in, each op rounded as the
separate kernel rounds it, to save their launches (a one-row step ran 9 kernels per layer, 7 now,
and each small launch costs ~2-3 us of a ~4.3 ms 8B step):
- act="silu_mul": the input is [gate | up] and the kernel multiplies silu(gate) * up, with the
  silu_and_mul kernel's bits;
- gemv_gate_up (the MLP's gate | up projection): a program owns gate rows and the up rows that pair
  with them, and its epilogue writes silu(gate) * up, the silu_and_mul kernel's bits, so the down
  projection reads the activation once instead of every program redoing SiLU over its input;
- gemv_add_ (down_proj): the product is added into the residual stream in place, and each
  program writes the sum of squares of its slice of the new stream;
- norm=RowNorm (the next layer's qkv_proj): the input is the residual stream and the RMSNorm is
  applied on the fly, its mean square taken from those partial sums (summed in one fixed order,
  so the only difference from the rms_norm kernel is the order of that fp32 sum);
- gemv_qkv_rope (the qkv projection): programs own rotary pairs (d, d + D/2) of one head, so
  the epilogue rotates q and k with the rotary kernel's bits and stores k and v in the paged
  cache, replacing the rotary launch.
Every program re-reads and re-normalizes the whole input row, so the norm pays only where
programs are few: H200, cold weights (bench/gpu_kernels.py --gemv-fused), 8B qkv 15.0 us against
16.8 for rms_norm + GEMV, 1B qkv 6.1 against 6.8; on gate_up (7168 programs of 4 rows) it lost
(62.6 against 57.9 us; 58.7 with 8 rows a program), so the post-attention norm stays a kernel
(written instead by the o projection's last program to finish, after an atomic count, it saved
nothing: docs/benchmarks.md, forty-eighth run).
With fp8 weights, act="silu_mul" costs more than its launch (a program of 4-16 one-byte rows
redoes SiLU over its whole input: the 8B's down 21.2-37.0 us fused against 17.6 apart, H200,
bench/gpu_kernels.py --gemv-fp8-fused), so GemvLinear runs the silu_and_mul kernel first there.

Weights may be fp8 e4m3 with one fp32 scale per row (w_scale; tandem/layers/quant.py, the fp8 draft
and the fp8 target): the tile is widened to fp32 in registers and each row's sum multiplied by its
scale after the reduction, half the bytes streamed for the same exact products. Each step first sums
every thread's 16 contiguous products in registers (SUB): an elementwise fp32 accumulator of an fp8
tile holds 4x the bytes it streams a step, and the 16x smaller one lets more programs share an SM
(H200, the 1B's head 95 -> 62 us, gate_up 12.9 -> 10.2; the fp8 draft's k = 4 round 7.85 -> 7.63
ms). So the sums run in another order than the bf16 weights' (within an ulp of their result,
tests/kernels/test_gemv.py).

Each program loads its first weight tile before its PDL wait (PRELOAD; tandem/kernels/pdl.py): the
weights are no earlier kernel's output, so the tile streams while the kernel before runs (the attention,
a norm, another GEMV's tail) and the products are the same, in the same order. Into registers, one tile
a resident program: H100, the 8B's decode step 5.45 -> 5.42 ms and a k = 4 round (1B draft) 10.56 ->
10.44 ms (fp8 draft 9.18 -> 9.10); two tiles gained nothing more (docs/benchmarks.md, session 63).
(Prefetching 4-16 KB a program into L2 instead, every program at once, had cost 10%: pdl.py.)

Rows 2-32 go to tandem/kernels/gemm_rows.py (a tensor-core tile); a CUDA-core tile reading each
weight tile once for 2-8 rows ran at 1.1-2.8x cuBLAS's time (bench/gpu_kernels.py at 2026-11-30) and
was not kept.

The wrapper takes its sizes from tensor shapes only (no device-to-host reads), so a launch can
be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from tandem.kernels.fused import _numerics, _round
from tandem.kernels.kv_store import to_cache
from tandem.kernels.pdl import pdl_flags, wait_for_inputs


class RowNorm(NamedTuple):
    """RMSNorm of a one-row GEMV input, applied inside the GEMV: the norm's weight [K] and eps,
    and sumsq [P] fp32, partial sums of squares of the row whose total is its sum of squares
    (as gemv_add_ returns them)."""

    weight: Tensor
    eps: float
    sumsq: Tensor


@triton.jit
def _silu_mul(gate, up, DTYPE: tl.constexpr, CUDA_LIBM: tl.constexpr, SOFT_BF16: tl.constexpr):
    """silu(gate) * up in fp32, rounded to DTYPE after each op as the silu_and_mul kernel rounds."""
    x = gate.to(tl.float32)
    if CUDA_LIBM:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    x = _round(tl.div_rn(x, 1.0 + e), DTYPE, SOFT_BF16).to(tl.float32)
    return _round(x * up.to(tl.float32), DTYPE, SOFT_BF16).to(tl.float32)


@triton.jit
def _halves(t, PAIRS: tl.constexpr):
    """[2 * PAIRS] -> its first and second PAIRS elements."""
    return tl.split(tl.trans(tl.reshape(t, [2, PAIRS])))


@triton.jit
def _inv_rms(sumsq_ptr, P, K, eps, inv_k, BLOCK_P: tl.constexpr, CUDA_LIBM: tl.constexpr):
    """1 / rms of a K-wide row from its P partial sums of squares, as the rms_norm kernel computes it."""
    offs_p = tl.arange(0, BLOCK_P)
    ss = tl.sum(tl.load(sumsq_ptr + offs_p, mask=offs_p < P, other=0.0), axis=0)
    if CUDA_LIBM:
        return libdevice.rsqrt(ss * inv_k + eps)
    else:
        return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, K.to(tl.float32)) + eps))


@triton.jit
def _w_tile(w_ptrs, rows_ok, k0, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at w_ptrs (columns k0 onwards), zero past N and K."""
    if EVEN_K:
        if EVEN_N:
            return tl.load(w_ptrs)
        return tl.load(w_ptrs, mask=rows_ok[:, None], other=0.0)
    k_ok = k0 + tl.arange(0, BLOCK_K) < K
    return tl.load(w_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _dot_rows(
    x_ptr, w_ptr, nw_ptr, inv, rows, rows_ok, K, stride_wn, w_first, w_second,
    DTYPE: tl.constexpr, SILU_MUL: tl.constexpr, NORM_IN: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    CUDA_LIBM: tl.constexpr, SOFT_BF16: tl.constexpr, PRELOAD: tl.constexpr,
):
    """fp32 [BLOCK_N]: the input row (SILU_MUL / NORM_IN applied to it) dotted with weight rows
    `rows`, accumulated elementwise over BLOCK_K tiles and reduced once. SUB > 1: every step sums
    each run of SUB contiguous products first (one thread's 16-byte load of fp8 weights, summed in
    its registers), so the accumulator is SUB times smaller. PRELOAD (0-2): w_first (and w_second)
    are the first tiles, loaded by the caller before its PDL wait; the same products in the same order."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // SUB], tl.float32)
    if PRELOAD >= 1:
        acc = _acc_tile(acc, w_first, x_ptr, nw_ptr, inv, 0, K, DTYPE, SILU_MUL, NORM_IN, EVEN_K, BLOCK_N, BLOCK_K,
                        SUB, CUDA_LIBM, SOFT_BF16)
        w_ptrs += BLOCK_K
    if PRELOAD >= 2:
        acc = _acc_tile(acc, w_second, x_ptr, nw_ptr, inv, BLOCK_K, K, DTYPE, SILU_MUL, NORM_IN, EVEN_K, BLOCK_N,
                        BLOCK_K, SUB, CUDA_LIBM, SOFT_BF16)
        w_ptrs += BLOCK_K
    for k0 in range(PRELOAD * BLOCK_K, K, BLOCK_K):
        w = _w_tile(w_ptrs, rows_ok, k0, K, EVEN_N, EVEN_K, BLOCK_K)
        acc = _acc_tile(acc, w, x_ptr, nw_ptr, inv, k0, K, DTYPE, SILU_MUL, NORM_IN, EVEN_K, BLOCK_N, BLOCK_K, SUB,
                        CUDA_LIBM, SOFT_BF16)
        w_ptrs += BLOCK_K
    return tl.sum(acc, axis=1)


@triton.jit
def _acc_tile(
    acc, w, x_ptr, nw_ptr, inv, k0, K, DTYPE: tl.constexpr, SILU_MUL: tl.constexpr, NORM_IN: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """acc + the products of weight tile w with the input's columns [k0, k0 + BLOCK_K)."""
    offs_k = tl.arange(0, BLOCK_K)
    if EVEN_K:
        x = tl.load(x_ptr + k0 + offs_k)
        if SILU_MUL:
            up = tl.load(x_ptr + K + k0 + offs_k)
        if NORM_IN:
            nw = tl.load(nw_ptr + k0 + offs_k)
    else:
        k_ok = k0 + offs_k < K
        x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        if SILU_MUL:
            up = tl.load(x_ptr + K + k0 + offs_k, mask=k_ok, other=0.0)
        if NORM_IN:
            nw = tl.load(nw_ptr + k0 + offs_k, mask=k_ok, other=0.0)
    if SILU_MUL:
        x = _silu_mul(x, up, DTYPE, CUDA_LIBM, SOFT_BF16)
    if NORM_IN:
        y = _round(x.to(tl.float32) * inv, DTYPE, SOFT_BF16).to(tl.float32)
        x = _round(nw.to(tl.float32) * y, DTYPE, SOFT_BF16)
    if SUB == 1:
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    else:
        prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc += tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // SUB, SUB]), axis=2)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] (NORM_IN: the residual stream, normalized on the fly)
    w_ptr,  # [N, K], rows contiguous
    b_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [N] (ADD_OUT: the residual stream, read and updated in place)
    nw_ptr,  # [K] the norm's weight (NORM_IN only)
    sumsq_in_ptr,  # [P_IN] fp32 partial sums of squares of x (NORM_IN only)
    sumsq_out_ptr,  # [num programs] fp32, each program's sum of squares of its new out (ADD_OUT only)
    ws_ptr,  # [N] fp32 per-row weight scales (W_SCALE only: w is fp8)
    N,
    K,
    stride_wn,
    P_IN,
    eps,
    inv_k,  # fp32(1 / K)
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,  # w is fp8: each row's sum is multiplied by its scale
    SILU_MUL: tl.constexpr,  # x is [gate (K) | up (K)]: multiply silu(gate) * up, rounded as silu_and_mul
    GATE_UP: tl.constexpr,  # w is [gate (N / 2) | up (N / 2)]: out [N / 2] = silu(gate) * up, as silu_and_mul
    NORM_IN: tl.constexpr,
    ADD_OUT: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SUB: tl.constexpr,  # see _dot_rows (fp8 weights: 16)
    CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PRELOAD: tl.constexpr,  # 0-2: weight tiles loaded before the PDL wait (they read no earlier kernel's output)
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    HALF_N: tl.constexpr = BLOCK_N // 2
    if GATE_UP:  # gate rows i and up rows N / 2 + i, i in [pid * HALF_N, (pid + 1) * HALF_N)
        offs = tl.arange(0, BLOCK_N)
        offs_i = pid * HALF_N + offs % HALF_N
        offs_n = (offs // HALF_N) * (N // 2) + offs_i
        n_ok = offs_i < N // 2
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    w_first, w_second = 0.0, 0.0
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    if PRELOAD >= 1:
        w_first = _w_tile(w_ptrs, n_ok, 0, K, EVEN_N, EVEN_K, BLOCK_K)
    if PRELOAD >= 2:
        w_second = _w_tile(w_ptrs + BLOCK_K, n_ok, BLOCK_K, K, EVEN_N, EVEN_K, BLOCK_K)
    wait_for_inputs(PDL)
    inv = 1.0
    if NORM_IN:
        inv = _inv_rms(sumsq_in_ptr, P_IN, K, eps, inv_k, BLOCK_P, CUDA_LIBM)
    out = _dot_rows(x_ptr, w_ptr, nw_ptr, inv, offs_n, n_ok, K, stride_wn, w_first, w_second, dtype, SILU_MUL, NORM_IN,
                    EVEN_N, EVEN_K, BLOCK_N, BLOCK_K, SUB, CUDA_LIBM, SOFT_BF16, PRELOAD)  # [BLOCK_N]
    if W_SCALE:
        out = out * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if GATE_UP:  # the GEMV's stored gate and up (rounded), then the silu_and_mul kernel's arithmetic
        gate, up = _halves(out, HALF_N)
        act = _silu_mul(_round(gate, dtype, SOFT_BF16), _round(up, dtype, SOFT_BF16), dtype, CUDA_LIBM, SOFT_BF16)
        offs_i = pid * HALF_N + tl.arange(0, HALF_N)
        tl.store(out_ptr + offs_i, act.to(dtype), mask=offs_i < N // 2)  # (act is exact in dtype)
    elif ADD_OUT:  # residual += round(out), rounded again (the rms_norm kernel's add)
        res = tl.load(out_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        r = _round(res + _round(out, dtype, SOFT_BF16).to(tl.float32), dtype, SOFT_BF16)
        tl.store(out_ptr + offs_n, r, mask=n_ok)
        r32 = tl.where(n_ok, r.to(tl.float32), 0.0)
        tl.store(sumsq_out_ptr + pid, tl.sum(r32 * r32, axis=0))
    else:
        tl.store(out_ptr + offs_n, out.to(dtype), mask=n_ok)


@triton.jit
def _mul_rn(a, b, CUDA_LIBM: tl.constexpr):
    """a * b rounded on its own (never contracted into an FMA), as in a kernel built without fp fusion."""
    if CUDA_LIBM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _gemv_qkv_rope_kernel(
    x_ptr,  # [K] (NORM_IN: the residual stream, normalized on the fly)
    w_ptr,  # [(NUM_Q + 2 NUM_KV) * HEAD_DIM, K], rows contiguous: q | k | v
    b_ptr,  # [(NUM_Q + 2 NUM_KV) * HEAD_DIM] (HAS_BIAS only)
    out_ptr,  # [(NUM_Q + 2 NUM_KV) * HEAD_DIM]: q and k rotated, v
    nw_ptr,  # [K] (NORM_IN only)
    sumsq_in_ptr,  # [P_IN] fp32 (NORM_IN only)
    cos_ptr,  # [max_pos, HEAD_DIM] fp32
    sin_ptr,
    pos_ptr,  # [1] int32 / int64
    slot_ptr,  # [1] int32 / int64, -1 = padding (nothing written to the cache)
    k_cache_ptr,  # [num_slots, NUM_KV, HEAD_DIM] contiguous
    v_cache_ptr,
    ws_ptr,  # [(NUM_Q + 2 NUM_KV) * HEAD_DIM] fp32 per-row weight scales (W_SCALE only: w is fp8)
    K,
    stride_wn,
    stride_cos,
    stride_sin,
    P_IN,
    eps,
    inv_k,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAIRS: tl.constexpr,  # rotary pairs (dims i, i + HEAD_DIM / 2) per program
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,
    NORM_IN: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SUB: tl.constexpr,
    CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PRELOAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """The qkv projection of one row with the rotary embedding and the paged KV store in its
    epilogue: a q or k program owns PAIRS rotary pairs of one head (weight rows d and
    d + HEAD_DIM / 2), so it can rotate what it computed; a v program owns 2 * PAIRS rows of v."""
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    CHUNKS: tl.constexpr = HALF // PAIRS
    ROPE_PROGRAMS: tl.constexpr = (NUM_Q + NUM_KV) * CHUNKS
    offs = tl.arange(0, 2 * PAIRS)
    head = pid // CHUNKS
    dim = (offs // PAIRS) * HALF + (pid % CHUNKS) * PAIRS + offs % PAIRS  # within the head
    rope = pid < ROPE_PROGRAMS
    rows = tl.where(rope, head * HEAD_DIM + dim, (NUM_Q + NUM_KV) * HEAD_DIM + (pid - ROPE_PROGRAMS) * (2 * PAIRS) + offs)
    w_first, w_second = 0.0, 0.0
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    if PRELOAD >= 1:
        w_first = _w_tile(w_ptrs, rows >= 0, 0, K, True, EVEN_K, BLOCK_K)
    if PRELOAD >= 2:
        w_second = _w_tile(w_ptrs + BLOCK_K, rows >= 0, BLOCK_K, K, True, EVEN_K, BLOCK_K)
    wait_for_inputs(PDL)
    inv = 1.0
    if NORM_IN:
        inv = _inv_rms(sumsq_in_ptr, P_IN, K, eps, inv_k, BLOCK_P, CUDA_LIBM)
    out = _dot_rows(x_ptr, w_ptr, nw_ptr, inv, rows, rows >= 0, K, stride_wn, w_first, w_second, dtype, False, NORM_IN,
                    True, EVEN_K, 2 * PAIRS, BLOCK_K, SUB, CUDA_LIBM, SOFT_BF16, PRELOAD)
    if W_SCALE:
        out = out * tl.load(ws_ptr + rows)
    if HAS_BIAS:
        out += tl.load(b_ptr + rows).to(tl.float32)
    x = out.to(dtype)  # the projection's output, as the plain GEMV stores it
    slot = tl.load(slot_ptr).to(tl.int64)
    if rope:  # the rotary kernel's arithmetic: x1 c1 - x2 s1, x2 c2 + x1 s2 in fp32, rounded once
        pos = tl.load(pos_ptr).to(tl.int64)
        c1, c2 = _halves(tl.load(cos_ptr + pos * stride_cos + dim), PAIRS)
        s1, s2 = _halves(tl.load(sin_ptr + pos * stride_sin + dim), PAIRS)
        x1, x2 = _halves(x.to(tl.float32), PAIRS)
        o1 = _round(_mul_rn(x1, c1, CUDA_LIBM) - _mul_rn(x2, s1, CUDA_LIBM), dtype, SOFT_BF16).to(dtype)
        o2 = _round(_mul_rn(x2, c2, CUDA_LIBM) + _mul_rn(x1, s2, CUDA_LIBM), dtype, SOFT_BF16).to(dtype)
        y = tl.reshape(tl.trans(tl.join(o1, o2)), [2 * PAIRS])
        tl.store(out_ptr + rows, y)
        if head >= NUM_Q and slot >= 0:
            tl.store(k_cache_ptr + slot * (NUM_KV * HEAD_DIM) + (head - NUM_Q) * HEAD_DIM + dim, to_cache(y, k_cache_ptr))
    else:
        tl.store(out_ptr + rows, x)
        if slot >= 0:
            tl.store(v_cache_ptr + slot * (NUM_KV * HEAD_DIM) + rows - (NUM_Q + NUM_KV) * HEAD_DIM,
                     to_cache(x, v_cache_ptr))


def gemv_config(n: int, k: int, fp8: bool = False) -> tuple[int, int, int]:
    """-> (BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight (fp8: e4m3 weights), from the H200 sweep
    (bench/gpu_kernels.py --gemv, cold weights, us against cuBLAS in docs/benchmarks.md): 8 x 512 for
    4096-8192 rows (Llama-3 8B's qkv / o / down); 4 x 1024 where K is a multiple of 1024 (every
    Llama-3.2 1B shape, the 8B's gate_up and head); 8 x 512 where K is a multiple of 512 only
    (Qwen2.5 1.5B, K = 1536: 4 x 1024 would waste half of every second step); else 4 x 2048 with
    8 warps and a masked last step (Qwen2.5 1.5B's down_proj, K = 8960). BLOCK_N stays <= 8 so
    a short N still gives hundreds of programs."""
    if fp8:  # e4m3 weights, summed 16 a thread a step (SUB; bench/gpu_kernels.py --gemv-fp8, H200)
        if n >= 16384:
            return 16, 512, 4  # the 1B's gate_up and head: 10.2 / 61.7 us against 12.9 / 95.2 unsummed at 8 x 1024
        if k >= 8192:  # the down projections: 8B 15.9 us against 18.0 at 4 x 4096, 1B 6.4 against 7.6
            return 8, 2048, 8
        return 4, min(4096, triton.next_power_of_2(k)), 4  # qkv, o (the 8B's within 0.4 us of the best of 12 tiles)
    if 4096 <= n <= 8192 or (k % 1024 and k % 512 == 0):
        return 8, 512, 4
    if k % 1024 == 0 or k < 1024:
        return 4, min(1024, triton.next_power_of_2(k)), 4
    return 4, 2048, 8


def _sub(w_scale: Tensor | None, block_k: int) -> int:
    """_dot_rows' SUB: fp8 weights sum each thread's 16 contiguous products a step (a 16x smaller
    accumulator, so more programs fit an SM: the 1B's head 95 -> 62 us on the H200); other weights
    accumulate elementwise (one order for every tile of the same BLOCK_K)."""
    return min(16, block_k) if w_scale is not None else 1


def _check_weight(x: Tensor, weight: Tensor, w_scale: Tensor | None) -> None:
    """weight [N, K] rows contiguous: x's dtype, or fp8 e4m3 with w_scale [N] fp32 (tandem/layers/quant.py)."""
    assert weight.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if w_scale is None:
        assert x.dtype == weight.dtype
    else:
        assert weight.dtype == torch.float8_e4m3fn and w_scale.shape == (weight.shape[0],)
        assert w_scale.dtype == torch.float32 and w_scale.is_contiguous()


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor, act: str | None,
            norm: RowNorm | None, sumsq_out: Tensor | None, block_n: int, block_k: int, num_warps: int,
            w_scale: Tensor | None = None, gate_up: bool = False, preload: int = 0) -> None:
    n, k = weight.shape
    silu_mul = act == "silu_mul"
    assert act in (None, "silu_mul")
    assert x.shape[-1] == (2 * k if silu_mul else k) and x.numel() == x.shape[-1] and x.is_contiguous()
    _check_weight(x, weight, w_scale)
    assert out.is_contiguous() and out.dtype == x.dtype
    if gate_up:  # programs of block_n // 2 gate rows and as many up rows, writing block_n // 2 outputs
        assert n % 2 == 0 and block_n % 2 == 0 and out.numel() == n // 2 and not silu_mul and sumsq_out is None
        programs, even_n = triton.cdiv(n // 2, block_n // 2), (n // 2) % (block_n // 2) == 0
    else:
        assert out.numel() == n
        programs, even_n = triton.cdiv(n, block_n), n % block_n == 0
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    if norm is not None:
        assert not silu_mul and norm.weight.shape == (k,) and norm.weight.dtype == x.dtype
        assert norm.sumsq.dim() == 1 and norm.sumsq.dtype == torch.float32 and norm.sumsq.is_contiguous()
    p_in = norm.sumsq.numel() if norm is not None else 1
    _gemv_kernel[(programs,)](
        x, weight, bias if bias is not None else weight, out,
        norm.weight if norm is not None else weight, norm.sumsq if norm is not None else out,
        sumsq_out if sumsq_out is not None else out, w_scale if w_scale is not None else out,
        n, k, weight.stride(0), p_in, float(norm.eps) if norm is not None else 0.0, 1.0 / k,
        HAS_BIAS=bias is not None, W_SCALE=w_scale is not None, SILU_MUL=silu_mul, GATE_UP=gate_up,
        NORM_IN=norm is not None, ADD_OUT=sumsq_out is not None,
        EVEN_N=even_n, EVEN_K=k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_P=triton.next_power_of_2(p_in), SUB=_sub(w_scale, block_k), num_warps=num_warps, **_numerics(x),
        PRELOAD=min(preload, triton.cdiv(k, block_k)), **pdl_flags(x),
    )


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
         config: tuple[int, int, int] | None = None, act: str | None = None, norm: RowNorm | None = None,
         w_scale: Tensor | None = None, preload: int = 0) -> Tensor:
    """x [1, K] (or [K]) bf16 / fp16 / fp32, contiguous; weight [N, K] same dtype, rows contiguous;
    bias [N] or None. -> out [1, N] (or [N]) in x's dtype, fp32 accumulation, rounded once.
    w_scale [N] fp32: weight is fp8 e4m3 and row n's sum is multiplied by w_scale[n] (before the
    bias): with power-of-two scales, the products of the same GEMV on weight * w_scale in x's
    dtype, summed in another order (within an ulp: the fp8 tile's register layout differs).
    act="silu_mul": x is [1, 2K] = [gate | up] and the product is of F.silu(gate) * up.
    norm: the product is of RMSNorm(x) (weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)).
    config: (BLOCK_N, BLOCK_K, num_warps) in place of gemv_config, for tuning sweeps."""
    n, k = weight.shape
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    tile = config or gemv_config(n, k, w_scale is not None)
    _launch(x, weight, bias, out, act, norm, None, *tile, w_scale=w_scale, preload=preload)
    return out


def gemv_gate_up(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
                 config: tuple[int, int, int] | None = None, norm: RowNorm | None = None,
                 w_scale: Tensor | None = None, preload: int = 0) -> Tensor:
    """F.silu(gate) * up of a packed [gate | up] projection of one row, the activation in the GEMV's
    epilogue: silu_and_mul(gemv(x, weight, bias, norm=norm, w_scale=w_scale)) bit for bit, in one
    launch and without the [1, N] intermediate. weight [N, K] = [gate (N / 2 rows) | up]; each
    program owns BLOCK_N / 2 gate rows and the up rows that pair with them (config as gemv's, its
    BLOCK_N even). -> out [1, N / 2] (or [N / 2])."""
    n, k = weight.shape
    if out is None:
        out = torch.empty(*x.shape[:-1], n // 2, dtype=x.dtype, device=x.device)
    tile = config or gemv_config(n, k, w_scale is not None)
    _launch(x, weight, bias, out, None, norm, None, *tile, w_scale=w_scale, gate_up=True, preload=preload)
    return out


def gemv_add_(x: Tensor, weight: Tensor, residual: Tensor, bias: Tensor | None = None,
              config: tuple[int, int, int] | None = None, act: str | None = None,
              w_scale: Tensor | None = None, preload: int = 0) -> Tensor:
    """residual += gemv(x, weight, bias, act=act), in place, with the product rounded
    to the dtype before the add and the sum rounded again (the rms_norm kernel's add).
    residual [1, N] (or [N]) contiguous, x's dtype, not x. -> sumsq [cdiv(N, BLOCK_N)] fp32: partial
    sums of squares of the new residual, for the next RowNorm."""
    n, k = weight.shape
    block_n, block_k, num_warps = config or gemv_config(n, k, w_scale is not None)
    assert residual.data_ptr() != x.data_ptr()
    sumsq = torch.empty(triton.cdiv(n, block_n), dtype=torch.float32, device=x.device)
    _launch(x, weight, bias, residual, act, None, sumsq, block_n, block_k, num_warps, w_scale=w_scale, preload=preload)
    return sumsq


def qkv_block_k(k: int, fp8: bool) -> int:
    """gemv_qkv_rope's BLOCK_K for K inputs: 1024 for fp8 weights (the 1B: 4.8 -> 4.1 us) and for
    K = 2048 (the bf16 1B draft's k = 4 round 8.22 -> 8.18 ms, H200), else 512 (at 1024 the 8B's
    step, K = 4096, went 4.09 -> 4.18 ms and Qwen2.5 1.5B's, K = 1536, 1.39 -> 1.45)."""
    return min(1024 if fp8 or k == 2048 else 512, triton.next_power_of_2(k))


def gemv_qkv_rope(x: Tensor, weight: Tensor, bias: Tensor | None, num_heads: int, num_kv_heads: int,
                  positions: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot_mapping: Tensor, norm: RowNorm | None = None, block_k: int | None = None,
                  w_scale: Tensor | None = None, preload: int = 0) -> Tensor:
    """One row's packed q | k | v projection (gemv(x, weight, bias, norm=norm)) with q and k
    rotated as kernels.fused.rotary_embedding rotates them (same bits) and this token's k and v
    written into the paged cache at slot_mapping[0] (-1: not written). -> [1, (H + 2 Hkv) D].

    positions, slot_mapping [1] int32 / int64; cos, sin [max_pos, D] fp32 (RotaryEmbedding's
    tables); k_cache, v_cache [num_blocks, block_size, Hkv, D] contiguous, x's dtype or float8 e4m3
    (saturated: kv_store.to_cache); D % 8 == 0."""
    n, k = weight.shape
    head_dim = k_cache.shape[-1]
    assert n == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 8 == 0
    assert x.shape[-1] == k and x.numel() == k and x.is_contiguous()
    _check_weight(x, weight, w_scale)
    assert k_cache.shape == v_cache.shape and k_cache.shape[-2] == num_kv_heads
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (x.dtype, torch.float8_e4m3fn)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert positions.shape == (1,) and slot_mapping.shape == (1,)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[1] == head_dim and cos.stride(1) == 1 and sin.stride(1) == 1
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    if norm is not None:
        assert norm.weight.shape == (k,) and norm.weight.dtype == x.dtype and norm.sumsq.dtype == torch.float32
    pairs = 4
    block_k = block_k or qkv_block_k(k, w_scale is not None)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    p_in = norm.sumsq.numel() if norm is not None else 1
    grid = ((num_heads + num_kv_heads) * (head_dim // 2 // pairs) + num_kv_heads * head_dim // (2 * pairs),)
    _gemv_qkv_rope_kernel[grid](
        x, weight, bias if bias is not None else weight, out,
        norm.weight if norm is not None else weight, norm.sumsq if norm is not None else out,
        cos, sin, positions, slot_mapping, k_cache, v_cache, w_scale if w_scale is not None else out,
        k, weight.stride(0), cos.stride(0), sin.stride(0), p_in, float(norm.eps) if norm is not None else 0.0,
        1.0 / k, NUM_Q=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, PAIRS=pairs, HAS_BIAS=bias is not None,
        W_SCALE=w_scale is not None,
        NORM_IN=norm is not None, EVEN_K=k % block_k == 0, BLOCK_K=block_k, BLOCK_P=triton.next_power_of_2(p_in),
        SUB=_sub(w_scale, block_k), num_warps=4, **_numerics(x), PRELOAD=min(preload, triton.cdiv(k, block_k)),
        **pdl_flags(x),
    )
    return out
