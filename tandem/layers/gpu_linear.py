"""CUDA linears: one-row steps through our Triton GEMV, a few rows through a Triton tensor-core
GEMM, everything else through cuBLAS.

A batch-1 decode step (the target's, or each of the draft's k - 1 loop steps) multiplies one
row by every weight matrix: pure weight streaming. cuBLAS reaches 32-60% of the copy bandwidth
on the small matrices of a 1B model and 59-95% on an 8B model's; tandem/kernels/gemv.py reaches
48-104% on the same shapes (bench/gpu_kernels.py --gemv, H200). 2-16 rows (a batch-1 verification
of 1 + k tokens, the draft's catch-up) of layers wider than 2048 outputs (and of any qkv
projection that rotates in the epilogue) go to tandem/kernels/gemm_rows.py (tensor cores, no
split-K, the qkv projection rotating and storing K/V in its epilogue, the gate | up projection
applying SiLU-and-mul in its epilogue:
`forward_then_silu_mul`), and so do 17-32 rows (decode steps of 17-32 requests) of those layers
with at most 4096 inputs; more rows, the narrow layers and the long-K ones stay on cuBLAS.
A layer in fp8 alone (the target's `quantization="fp8"`, which keeps no model-dtype weight) sends
2 rows and more to gemm_w8 (gemm_rows' kernel over a grid of row tiles, K split in up to eight;
the few-row qkv projection with its rotary still to gemm_rows_qkv_rope): weight-only
everywhere, as one row, so a row's result does not hang on how many rows share its step. (At 2-32
rows gemm_w8's split tile took the 8B's batch-8 decode step from 5.32 to 4.10 ms and a batch-1
k = 4 round from 8.48 to 7.53 ms against gemm_rows' bf16-tuned tile, H200,
`bench/gpu_bench.py --env-ab TANDEM_FP8_ROWS=rows`.) (W8A8, the rows rounded to e4m3 for Hopper's
fp8 tensor cores as vLLM does, was faster past ~500 rows but made the function depend on the
batch: a decode step of 8 requests ran weight-only, their 40-row verification W8A8, and greedy
speculation parted from target-only.)

A one-row decoder layer runs its MLP's residual add and the next layer's input norm inside
these GEMVs (see tandem/models/decoder.py): the down projection adds into the residual stream
(`forward_add_`, which returns the stream's partial sums of squares as an `AddedRow`) and the
next qkv projection takes a `NormedRow` (the stream, its norm, those sums) and normalizes on the
fly, so one RMSNorm launch per layer disappears. The qkv projection of one row also rotates q
and k and stores k and v in the paged cache in its epilogue (`forward_qkv_rope`), replacing the
rotary kernel's launch. The MLP's gate | up GEMV applies SiLU-and-mul in its epilogue
(`forward_then_silu_mul`, as the few-row GEMM does; `activates_row`), and for fp8 weights it also
takes the post-attention RMSNorm, after the o projection added into the stream (`normalizes_row`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.layers.cpu_linear import linear_sites
from tandem.layers.norm import fused_kernels_available


FEW_ROWS = 32  # tandem.kernels.gemm_rows.MAX_ROWS (not imported here: Triton may be absent)
FEW_ROWS_MIN_OUT = 2049  # narrower layers keep cuBLAS for a few rows (see GemvLinear.few_rows)
# the qkv projection with its rotary and KV store in the epilogue takes any width: Qwen2.5 1.5B's (2048 x 1536)
# in gemm_rows_qkv_rope cut its k = 4 verification graph 1.74 -> 1.67 ms and a round at batch 1 4.79 -> 4.66 ms
# (H200, docs/benchmarks.md, 2026-12-05); every other shape measured is wider than FEW_ROWS_MIN_OUT already
FEW_ROWS_QKV_MIN_OUT = 1
FEW_ROWS_LONG_K = 4096  # model-dtype layers with more inputs keep cuBLAS (its split-K wins there)


def _gemm_rows_cap() -> int:
    """TANDEM_GEMM_ROWS: unset or 1 (on, its old meaning): FEW_ROWS; 0: off; N: at most N rows."""
    raw = os.environ.get("TANDEM_GEMM_ROWS", "1")
    try:
        cap = int(raw)
    except ValueError:
        raise ValueError(f"TANDEM_GEMM_ROWS={raw!r}: expected 0 (off), 1 (on) or a row cap such as 16") from None
    return FEW_ROWS if cap == 1 else cap


def _rows_min_out(qkv: bool = False) -> int:
    """TANDEM_ROWS_MIN_OUT: the fewest outputs of a model-dtype layer whose 2-32 rows go to gemm_rows
    (unset: FEW_ROWS_MIN_OUT); TANDEM_ROWS_QKV_MIN_OUT (qkv): the same for the qkv projection with its
    rotary in the epilogue (unset: FEW_ROWS_QKV_MIN_OUT). A/B switches."""
    if qkv:
        raw = os.environ.get("TANDEM_ROWS_QKV_MIN_OUT", str(FEW_ROWS_QKV_MIN_OUT))
    else:
        raw = os.environ.get("TANDEM_ROWS_MIN_OUT", str(FEW_ROWS_MIN_OUT))
    if not raw.isdigit():
        raise ValueError(f"TANDEM_ROWS_MIN_OUT / TANDEM_ROWS_QKV_MIN_OUT={raw!r}: expected an output count such as "
                         f"{FEW_ROWS_MIN_OUT} (the default)")
    return int(raw)


def _long_k_rows() -> int:
    """TANDEM_ROWS_LONG_K: the most rows a model-dtype layer of more than FEW_ROWS_LONG_K inputs
    sends to gemm_rows; unset: 1 (none: cuBLAS's split-K from 2 rows); 16: the earlier rule (an A/B switch)."""
    raw = os.environ.get("TANDEM_ROWS_LONG_K", "1")
    if not raw.isdigit():
        raise ValueError(f"TANDEM_ROWS_LONG_K={raw!r}: expected a row count such as 1 (the default) or 16")
    return int(raw)


def _fp8_rows_w8() -> bool:
    """TANDEM_FP8_ROWS: unset or "w8": an fp8-only layer's 2-32 rows run gemm_w8 (K split, its own
    tile); "rows": gemm_rows at the model-dtype tile (the earlier path; an A/B switch)."""
    raw = os.environ.get("TANDEM_FP8_ROWS", "w8")
    if raw not in ("w8", "rows"):
        raise ValueError(f"TANDEM_FP8_ROWS={raw!r}: expected w8 (gemm_w8, the default) or rows (gemm_rows)")
    return raw == "w8"


def _preload(site: str) -> int:
    """Weight tiles (0-2) the one-row GEMV of the linear named `site` loads before its PDL wait.
    TANDEM_GEMV_PRELOAD: the linears that do (attribute names joined by ":", e.g. "o_proj:gate_up_proj";
    unset: "all"; "none"); TANDEM_GEMV_PRELOAD_TILES: how many tiles (unset: 1). A/B switches."""
    sites = os.environ.get("TANDEM_GEMV_PRELOAD", "all").split(":")
    raw = os.environ.get("TANDEM_GEMV_PRELOAD_TILES", "1")
    if raw not in ("0", "1", "2"):
        raise ValueError(f"TANDEM_GEMV_PRELOAD_TILES={raw!r}: expected 0, 1 (the default) or 2")
    return int(raw) if site in sites or "all" in sites else 0


@dataclass(frozen=True)
class AddedRow:
    """A one-row layer output already added into the residual stream by its GEMV: sumsq [P] fp32,
    partial sums of squares of the new stream (what the next norm needs)."""

    sumsq: Tensor


@dataclass(frozen=True)
class NormedRow:
    """The input `norm(row)` of a one-row GEMV, computed inside it: row [1, H] (the residual
    stream), the RMSNorm module, and the row's partial sums of squares."""

    row: Tensor
    norm: nn.Module
    sumsq: Tensor

    def row_norm(self):
        """-> the kernels' RowNorm (the norm's weight and eps, the partial sums)."""
        from tandem.kernels.gemv import RowNorm

        return RowNorm(self.norm.weight, self.norm.eps, self.sumsq)


class GemvLinear(nn.Module):
    """nn.Linear's parameters (shared, not copied), with one-row inputs sent to the GEMV kernel.

    fp8: the weight holds fp8-representable values (tandem/layers/quant.py); the GEMV and the
    few-row GEMM then stream an fp8 copy with its per-row power-of-two scales (the same products,
    half the bytes). keep_weight: cuBLAS keeps the weight in the model dtype for the shapes it
    runs (the fp8 draft); False (the fp8 target): the model-dtype weight is dropped and every
    shape runs on the fp8 copy (`fp8_only`)."""

    def __init__(self, linear: nn.Linear, fp8: bool = False, keep_weight: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.use_gemv = True  # False: cuBLAS for every shape (A/B measurements)
        # LLM(batch_invariant=True): every input, one row or thousands, through gemm_invariant (one tile a
        # weight shape, no split of K), none of the one-row fusions: a row's bits do not depend on its step
        self.invariant = False
        self.site = ""  # the attribute name in its parent module (prepare_gpu_linears), for TANDEM_GEMV_PRELOAD
        self.w8 = self.w_scale = None  # fp8: the e4m3 copy [N, K] and its row scales [N] fp32
        if fp8:
            from tandem.layers.quant import quantize_fp8

            self.w8, self.w_scale = quantize_fp8(self.weight)
            # gemm_rows_qkv_rope's split counts, one a program (zero between calls)
            self.register_buffer("counts", torch.zeros(-(-self.out_features // 32), dtype=torch.int32,
                                                       device=self.w8.device), persistent=False)
            if not keep_weight:
                self.weight = None

    @property
    def preload(self) -> int:
        return _preload(self.site)

    @property
    def fp8_only(self) -> bool:
        """Whether the layer holds its fp8 weight alone (no model-dtype copy for cuBLAS)."""
        return self.weight is None

    @property
    def kernel_weight(self) -> Tensor:
        """The weight the Triton kernels stream: the fp8 copy (with w_scale) or the weight itself."""
        return self.weight if self.w8 is None else self.w8

    def one_row(self, x: Tensor) -> bool:
        """Whether x [n, in_features] takes the GEMV (and so the fused norm / add) path."""
        return self.use_gemv and not self.invariant and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()

    def few_rows(self, x: Tensor, qkv: bool = False) -> bool:
        """Whether x [n, in_features] takes the few-row tensor-core GEMM: bf16 / fp16, at least
        FEW_ROWS_MIN_OUT outputs, and 2 <= n <= 32 with model-dtype weights of at most FEW_ROWS_LONG_K
        inputs, or 2 <= n <= 16 with fp8 weights (any inputs).
        cuBLAS keeps the narrow layers: the 1B draft's o / down projections (2048 x 2048, 2048 x
        8192) ran 1.3 and 3.4 us slower a call in gemm_rows at 6 rows (H200, bench/gpu_profile.py
        --sections verify). It keeps the long-K ones too (the 8B's down, K = 14336: in the k = 4
        verification graph its split-K GEMM and reduction took 30.3 us a layer against gemm_rows'
        31.6; a k = 4 round with the 1B draft at batch 1 took 8.05-8.28 ms against 8.12-8.34 in four
        A/Bs with TANDEM_ROWS_LONG_K=16, which restores gemm_rows up to 16 rows, and the 8B's batch-8
        decode step 4.65-4.70 against 4.69-4.74: H200, docs/benchmarks.md, forty-ninth run).
        TANDEM_GEMM_ROWS=N caps the rows it takes (0: cuBLAS for every multi-row input, 1: on; an
        A/B switch); TANDEM_ROWS_MIN_OUT (and for the qkv projection, qkv, TANDEM_ROWS_QKV_MIN_OUT) moves
        the FEW_ROWS_MIN_OUT bound (A/B switches)."""
        n = x.shape[0] if x.dim() == 2 else 0
        if self.invariant:
            return False
        if self.fp8_only:  # no cuBLAS weight to fall back on: every width, up to 32 rows
            return 2 <= n <= min(FEW_ROWS, _gemm_rows_cap()) and x.stride(-1) == 1
        if not (self.use_gemv and self.out_features >= _rows_min_out(qkv) and 2 <= n <= FEW_ROWS and x.stride(-1) == 1
                and x.dtype in (torch.bfloat16, torch.float16)):
            return False
        if self.w8 is None and self.in_features > FEW_ROWS_LONG_K and n > _long_k_rows():
            return False  # (cuBLAS's split-K: see above)
        if n > 16 and self.w8 is not None:
            return False  # (fp8 weights at 17-32 rows: not measured; cuBLAS on the bf16 copy as before)
        return n <= _gemm_rows_cap()

    def forward(self, x: Tensor | NormedRow, out: Tensor | None = None) -> Tensor:
        """out [n, out_features] contiguous: the product is written there (the same bits)."""
        if isinstance(x, NormedRow):
            from tandem.kernels.gemv import gemv

            return gemv(x.row, self.kernel_weight, self.bias, out=out, norm=x.row_norm(), w_scale=self.w_scale,
                        preload=self.preload)
        if self.invariant:
            return self._invariant(x, out)
        if self.one_row(x):
            from tandem.kernels.gemv import gemv

            return gemv(x, self.kernel_weight, self.bias, out=out, w_scale=self.w_scale, preload=self.preload)
        if self.fp8_only and (not self.few_rows(x) or _fp8_rows_w8()):
            return self._many_rows(x, out)
        if self.few_rows(x):
            from tandem.kernels.gemm_rows import gemm_rows

            return gemm_rows(x, self.kernel_weight, self.bias, out=out, w_scale=self.w_scale)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:  # F.linear's kernels, into out
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def _invariant(self, x: Tensor, out: Tensor | None = None, act: str | None = None) -> Tensor:
        """The batch-invariant product of any rows x [..., in_features] (gemm_invariant)."""
        from tandem.kernels.gemm_invariant import gemm_invariant

        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = gemm_invariant(rows, self.kernel_weight, self.bias, out=out, act=act, w_scale=self.w_scale)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _many_rows(self, x: Tensor, out: Tensor | None = None, act: str | None = None) -> Tensor:
        """An fp8-only layer's product for any rows x [..., in_features]: gemm_w8 (weight-only)."""
        from tandem.kernels.gemm_rows import gemm_w8

        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = gemm_w8(rows, self.w8, self.w_scale, self.bias, out=out, act=act)
        return y.view(*x.shape[:-1], y.shape[-1])

    def forward_silu_mul(self, gate_up: Tensor) -> Tensor:
        """self(F.silu(gate) * up) for gate_up [n, 2 * in_features] = [gate | up], the activation
        fused into the GEMV for one row (same bits as the separate silu_and_mul kernel)."""
        if self.one_row(gate_up) and self.w8 is None:  # (fp8: apart, as forward_add_ says)
            from tandem.kernels.gemv import gemv

            return gemv(gate_up, self.kernel_weight, self.bias, act="silu_mul", w_scale=self.w_scale,
                        preload=self.preload)
        from tandem.kernels.fused import silu_and_mul

        return self(silu_and_mul(gate_up))

    def activates(self, x: Tensor | NormedRow) -> bool:
        """Whether forward_then_silu_mul takes x, this layer being a packed [gate | up] projection: a
        few rows (`few_rows`), or one row where `activates_row` says so; batch-invariant, any rows."""
        if self.invariant:
            return True
        if self.takes_row(x):
            return self.activates_row()
        return self.few_rows(x)

    def activates_row(self) -> bool:
        """Whether one row's SiLU-and-mul runs in this gate | up GEMV's epilogue (gemv_gate_up) rather
        than in the down projection's GEMV (model-dtype weights: each program redoes SiLU over its whole
        input) or the silu_and_mul kernel before it (fp8 weights): H200, `bench/gpu_bench.py --env-ab
        TANDEM_ROW_SILU=0`, the 8B's decode step 4.05 -> 4.01 ms (fp8 2.58 -> 2.54), a k = 4 round with the 1B
        draft 8.14 -> 8.09 (fp8 target 6.73 -> 6.70). TANDEM_ROW_SILU=0 turns it off (an A/B switch)."""
        mode = os.environ.get("TANDEM_ROW_SILU", "1")
        if mode not in ("1", "0"):
            raise ValueError(f"TANDEM_ROW_SILU={mode!r}: expected 1 (on, the default) or 0")
        return mode == "1"

    def forward_then_silu_mul(self, x: Tensor | NormedRow) -> Tensor:
        """F.silu(gate) * up of this packed [gate | up] projection of x (`activates(x)`), the
        activation in the epilogue of the one-row GEMV or the few-row GEMM: one launch instead of two,
        no [n, 2 I] intermediate (the silu_and_mul kernel's bits)."""
        if self.invariant:
            return self._invariant(x, act="silu_mul")
        if self.takes_row(x):
            from tandem.kernels.gemv import gemv_gate_up

            row, norm = (x.row, x.row_norm()) if isinstance(x, NormedRow) else (x, None)
            return gemv_gate_up(row, self.kernel_weight, self.bias, norm=norm, w_scale=self.w_scale,
                                preload=self.preload)
        if self.fp8_only and (not self.few_rows(x) or _fp8_rows_w8()):
            return self._many_rows(x, act="silu_mul")
        from tandem.kernels.gemm_rows import gemm_rows

        return gemm_rows(x, self.kernel_weight, self.bias, act="silu_mul", w_scale=self.w_scale)

    def normalizes_row(self) -> bool:
        """Whether a one-row input's RMSNorm runs inside this GEMV (a NormedRow) rather than as
        its own kernel after the previous projection's add (the MLP's gate | up projection). Every
        program re-normalizes the row for its tile: paid for by fp8 weights' 16-row tiles (H200, k = 4
        round with the fp8 1B draft 7.63 -> 7.60 ms), not by the model-dtype 4-row tiles (with
        TANDEM_ROW_NORM=all: 8B decode 4.09 -> 4.23 ms, bf16 draft round 8.21 -> 8.34). TANDEM_ROW_NORM=0
        turns it off (A/B)."""
        mode = os.environ.get("TANDEM_ROW_NORM", "fp8")
        return mode == "all" or (mode == "fp8" and self.w8 is not None)

    def takes_row(self, x: Tensor | NormedRow) -> bool:
        """Whether x (a NormedRow, or a Tensor) is one row for the GEMV path."""
        return isinstance(x, NormedRow) or self.one_row(x)

    def rotates(self, x: Tensor | NormedRow, head_dim: int) -> bool:
        """Whether forward_qkv_rope takes x: one row (head_dim % 8 == 0), or a few rows
        (head_dim % 32 == 0)."""
        if self.takes_row(x):
            return head_dim % 8 == 0
        return self.few_rows(x, qkv=True) and head_dim % 32 == 0  # gemm_rows.rope_fusable

    def forward_qkv_rope(self, x: Tensor | NormedRow, num_heads: int, num_kv_heads: int, positions: Tensor,
                         rotary: nn.Module, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> Tensor:
        """The packed q | k | v projection of x (`rotates(x, head_dim)`) with q and k rotated and
        each token's k and v stored in the paged cache, in one launch."""
        if not self.takes_row(x):
            from tandem.kernels.gemm_rows import gemm_rows_qkv_rope

            # The model-dtype weight where there is one, even for an fp8 layer: its 32-row fp8 tile was
            # no faster (1B, 6 rows, H200: 8.7 against 7.7 us; the catch-up round 7.51 against 7.50 ms).
            if self.fp8_only:
                return gemm_rows_qkv_rope(x, self.w8, self.bias, num_heads, num_kv_heads, positions, rotary.cos,
                                          rotary.sin, k_cache, v_cache, slot_mapping, w_scale=self.w_scale,
                                          counts=self.counts)
            return gemm_rows_qkv_rope(x, self.weight, self.bias, num_heads, num_kv_heads, positions,
                                      rotary.cos, rotary.sin, k_cache, v_cache, slot_mapping)
        from tandem.kernels.gemv import gemv_qkv_rope

        row, norm = (x.row, x.row_norm()) if isinstance(x, NormedRow) else (x, None)
        return gemv_qkv_rope(row, self.kernel_weight, self.bias, num_heads, num_kv_heads, positions, rotary.cos,
                             rotary.sin, k_cache, v_cache, slot_mapping, norm=norm, w_scale=self.w_scale,
                             preload=self.preload)

    def forward_add_(self, x: Tensor, residual: Tensor, act: str | None = None) -> AddedRow:
        """residual += self(x) (act="silu_mul": self(F.silu(gate) * up) for x = [gate | up]) in
        place, for a one-row x (`one_row(residual)`), in one GEMV launch; fp8 weights take the
        activation from the silu_and_mul kernel first (the same bits): with one byte a weight, the
        GEMV's programs redoing SiLU over their input cost more than the launch (H200,
        bench/gpu_kernels.py --gemv-fp8-fused: the 8B's down 17.6 us apart against 21.2-37.0 fused)."""
        from tandem.kernels.gemv import gemv_add_

        if act == "silu_mul" and self.w8 is not None:
            from tandem.kernels.fused import silu_and_mul

            x, act = silu_and_mul(x), None
        return AddedRow(gemv_add_(x, self.kernel_weight, residual, self.bias, act=act, w_scale=self.w_scale,
                                  preload=self.preload))


def prepare_gpu_linears(model: nn.Module, dtype: torch.dtype, keep_weights: bool = True,
                        invariant: bool = False) -> None:
    """Swap every nn.Linear of a CUDA model in bf16 / fp16 for a GemvLinear, in place. Linears
    marked `fp8_weights` (tandem/layers/quant.py: fp8-representable weights) get fp8 copies the
    kernels stream; keep_weights=False drops their model-dtype weights (the fp8 target); invariant:
    every product batch-invariant (GemvLinear.invariant)."""
    if dtype not in (torch.bfloat16, torch.float16) or not fused_kernels_available():  # CUDA + Triton
        return
    for module, name, child in linear_sites(model):
        if not child.weight.is_contiguous():
            child.weight = nn.Parameter(child.weight.detach().contiguous(), requires_grad=False)
        linear = GemvLinear(child, fp8=getattr(child, "fp8_weights", False), keep_weight=keep_weights)
        linear.site = name
        linear.invariant = invariant
        setattr(module, name, linear)
        if linear.fp8_only:
            child.weight = None  # freed now, not when the loop ends: the load's peak stays the model-dtype weights'
