"""Programmatic dependent launch (PDL, Hopper and newer) for the decode chain's kernels.

A one-row decode step is ~230 small kernels in a row (7 per 8B layer); between two of them the
GPU drains one grid, then launches and ramps up the next, so the bandwidth sits idle for a
microsecond or two at every boundary. Launched with `launch_pdl=True`, a kernel may start while
the kernel before it still runs, as soon as every program of that kernel has released it
(`griddepcontrol.launch_dependents`); it then waits (`griddepcontrol.wait`) until that kernel has
finished and its writes are visible. The launch and the programs' placement overlap the previous
kernel's tail instead of following it.

The rule every kernel here keeps: a kernel launched with PDL calls `wait_for_inputs` (or
`release_then_wait`, `wait_only`) first, in every program, before it reads or writes any memory.
Waiting is transitive (a kernel finishes only after its own wait returned), so a kernel may read
what any earlier kernel wrote. Kernels launched without PDL (torch's, cuBLAS's) wait for everything
before them as usual. The few-row GEMMs (gemm_rows.py) wait first (`wait_only`) and release the
kernel after them (`release_next`) only once their main loop is done.

One exception: the attention reads the step's metadata (cu_q_lens, seq_lens) before its wait.
That metadata is written before the forward's first kernel, the embedding lookup, a torch kernel
that launches plainly and never releases early: no later kernel starts before it has finished,
so the metadata is complete when the attention starts, and those loads overlap the qkv
projection's tail. This holds only while a plainly launched kernel separates the metadata's
writer (a host copy, or tandem/kernels/decode_inputs.py in the draft loop) from the attention:
an embedding lookup launched with PDL, or metadata computed inside the layers, would race.
Another: the one-row GEMVs (gemv.py) load their first weight tile before their wait. Weights are
written only by plainly launched kernels (loading, quantization) outside any forward, so they are
complete before a kernel that may start early is launched.

`release_then_wait` lets the next kernel start before this one's inputs are ready: used by the
small kernels that precede a GEMV (the attention's split merge, RMSNorm), so the GEMV's programs
are placed while the kernels before them run. At most three kernels are in flight: the one
running, a small one waiting for it, the next waiting for that one.

Measured (H200, bench/gpu_bench.py --env-ab TANDEM_PDL=0, engine steps at batch 1): 8B decode
4.26 -> 4.12 ms, Qwen2.5 1.5B 1.54 -> 1.41 ms, a k = 4 speculative round (8B + 1B draft) 8.99 ->
8.68 ms. Fetching the first 4 or 16 KB of each GEMV program's weight rows into L2 before the wait
(cp.async.bulk.prefetch) made the 8B step slower (4.51 / 4.94 ms against 4.11 in the same run):
the prefetches compete with the previous kernel's own weight reads, and most of the chain is
GEMVs. Not kept. Loading one tile into registers before the wait, only in the programs already
resident, does pay (~1%: tandem/kernels/gemv.py, PRELOAD).

TANDEM_PDL=0 launches every kernel plainly (an A/B switch for benchmarks). Off in Triton's
interpreter, on CPU tensors and before compute capability 9.0.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tandem.kernels.device import interpreting


@functools.lru_cache(maxsize=None)
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_enabled(t: Tensor) -> bool:
    """Whether kernels working on t launch with PDL."""
    if not t.is_cuda or interpreting() or os.environ.get("TANDEM_PDL", "1") == "0":
        return False
    return _has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_flags(t: Tensor) -> dict:
    """Launch keywords: the kernel's PDL constexpr and Triton's launch_pdl option."""
    on = pdl_enabled(t)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel has finished, then let the next kernel start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def wait_only(PDL: tl.constexpr):
    """Wait until the previous kernel has finished (the next kernel is released later, by release_next)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel start: called once a kernel's main loop is done, where its programs
    would otherwise share their SMs with the next kernel's early (tandem/kernels/gemm_rows.py)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def release_then_wait(PDL: tl.constexpr):
    """Let the next kernel start now, then wait until the previous kernel has finished."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
