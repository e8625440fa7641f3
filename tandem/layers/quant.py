"""Weight-only fp8 (e4m3) quantization: the target's `LLM(quantization="fp8")` and the draft's
`speculative_config` `quantization="fp8"`.

Each weight row n (an output channel) is stored as q[n, :] in float8_e4m3fn times a power of
two s[n], the least one with max |w[n, :]| / s[n] <= 448 (e4m3's largest value): round to
nearest, one scale a row. Activations stay in the model dtype (W8A16).

`fake_quantize_fp8_` replaces a weight by q * s in its own dtype. That is exact in bf16 / fp16
(a 4-bit significand times a power of two) barring fp16 range limits, so the quantized model is
one function on every path: fp32 models and the torch / FBGEMM CPU paths multiply those
model-dtype weights, while our CPU kernel (tandem/layers/cpu_linear.W8Linear) and the GPU's Triton
GEMV and GEMMs stream the fp8 bytes (half the traffic) and multiply each output by s[n] after the
sum: the same exact products (scaling by a power of two
commutes with every fp32 rounding), summed in the order of the fp8 tile's layout, so within an
ulp of the model-dtype weights' result rather than equal to it.

What is rounded: the target's decoder-layer linears (q | k | v, o, gate | up, down), its LM head
kept in the model dtype as vLLM keeps it; on a GPU in bf16 / fp16 those layers then hold only the
fp8 weights and their scales (tandem/layers/gpu_linear.py). The draft's every linear, its LM head
too (the draft only proposes: its precision moves the acceptance rate, never the output
distribution, which the target's verification keeps exact), keeping its model-dtype weights on a
GPU for the shapes cuBLAS runs faster (ModelConfig.fp8_draft_layout).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from tandem.parallel.shard import COLUMN_SPLIT

if TYPE_CHECKING:
    from tandem.parallel.group import TPGroup

FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZATIONS = ("fp8",)
ROWS_A_CHUNK = 4096  # rows rounded at a time: bounded temporaries (the 0.5B's head is 151936 rows)


def _exact_dtype(w: Tensor) -> torch.dtype:
    """The dtype w's rows are scaled in: bf16 weights in bf16 (fp32's exponent range, so times a
    power of two is exact wherever the result is normal, and below that e4m3 rounds it to zero
    anyway: the same bytes as fp32, in 0.3-0.6x the time on the CPU), others in fp32 (fp16's
    range cannot hold every scale)."""
    return torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32


def row_amax(w: Tensor) -> Tensor:
    """w [N, K] -> max |w[n, :]| [N] fp32 (max and -min rather than abs: no [N, K] temporary, a
    quarter of the time on the CPU)."""
    w = w.detach()
    return torch.maximum(w.amax(dim=1), w.amin(dim=1).neg()).float()


def quantize_fp8(w: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (q [N, K] float8_e4m3fn, s [N] fp32 powers of two) with w ~ q * s[:, None].
    amax [N]: each row's scale sized for this magnitude instead of row_amax(w) (>= it: a
    tensor-parallel rank's part of a row, scaled as the whole row is)."""
    w = w.detach()
    amax = row_amax(w) if amax is None else amax.float()
    # s >= the least normal fp32, so 1 / s is finite (an all-zero row gets q = 0)
    amax = amax.clamp(min=FP8_MAX * torch.finfo(torch.float32).tiny)
    s = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    dtype = _exact_dtype(w)
    inv = s.reciprocal().to(dtype)  # exact for a power of two, and cheaper than a division
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    for i in range(0, w.shape[0], ROWS_A_CHUNK):
        rows = slice(i, i + ROWS_A_CHUNK)
        q[rows] = (w[rows].to(dtype) * inv[rows, None]).clamp_(-FP8_MAX, FP8_MAX)  # (a new tensor: w may be fp32)
    return q, s


def fake_quantize_fp8_(w: Tensor, amax: Tensor | None = None) -> None:
    """w [N, K] <- q * s (quantize_fp8(w, amax)), in place, in w's dtype."""
    q, s = quantize_fp8(w, amax)
    dtype = _exact_dtype(w)
    s = s.to(dtype)
    for i in range(0, w.shape[0], ROWS_A_CHUNK):
        rows = slice(i, i + ROWS_A_CHUNK)
        w[rows] = q[rows].to(dtype).mul_(s[rows, None])


def quantize_linears_(model: nn.Module, method: str, lm_head: bool = True, in_place: bool = True,
                      tp: TPGroup | None = None) -> None:
    """Fake-quantize every nn.Linear weight of model in place (lm_head=False: all but the LM head;
    a weight tied to the input embedding is quantized once, so the embedding sees the same values),
    marking each rounded module `fp8_weights = True` (layers/gpu_linear.py and cpu_linear.py read it).
    in_place=False: the modules are marked only (their weights rounded in place only where another
    module shares them, as a tied embedding): each is about to become a W8Linear, which rounds its
    weight to the fp8 bytes itself (both roundings, and widening the bytes back, took ~2/3 of the
    real 1.5B's CPU load).
    tp: model is a tensor-parallel rank's shard. The row-parallel layers (o_proj, down_proj) hold part
    of each row, so their rows are scaled by the whole row's max |w| (one all-reduce of every such
    row's max over the ranks) and rounded here, whatever in_place says: the ranks then hold the
    one-rank model's fp8 values, and rounding them again later (W8Linear, the GPU's fp8 bytes) is
    exact (a rank's own smaller scale still fits each value)."""
    assert method in QUANTIZATIONS
    seen = set()
    head = getattr(model, "lm_head", None)
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    whole_rows = _whole_row_amax(model, tp) if tp is not None and tp.size > 1 else {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and (lm_head or module is not head):
            module.fp8_weights = True
            amax = whole_rows.get(id(module))
            if id(module.weight) not in seen and (in_place or id(module.weight) in shared or amax is not None):
                seen.add(id(module.weight))
                with torch.no_grad():
                    fake_quantize_fp8_(module.weight.data, amax)


def _whole_row_amax(model: nn.Module, tp: TPGroup) -> dict[int, Tensor]:
    """{id(module): [N] fp32 max |w| of each whole row} for the row-parallel linears of a rank's
    shard (tandem/parallel/shard.py COLUMN_SPLIT), reduced over the ranks in one all-reduce (every
    rank holds the same modules in the same order)."""
    split = [m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rpartition(".")[2] in COLUMN_SPLIT]
    if not split:
        return {}
    amax = torch.cat([row_amax(m.weight) for m in split])
    tp.all_reduce_max_(amax)
    return {id(m): part for m, part in zip(split, amax.split([m.out_features for m in split]))}
