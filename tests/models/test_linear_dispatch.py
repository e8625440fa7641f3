"""Which kernel a CUDA linear (tandem/layers/gpu_linear.GemvLinear) picks for a row count: pure
shape rules, checked on CPU tensors (no kernel runs)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.layers.gpu_linear import GemvLinear


def layer(out_features: int, in_features: int) -> GemvLinear:
    return GemvLinear(nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows,few", [(1, False), (2, True), (16, True), (17, True), (32, True), (33, False)])
def test_wide_layers_take_the_few_row_gemm_up_to_32_rows(rows, few):
    lin = layer(6144, 4096)  # the 8B's qkv projection
    x = torch.zeros(rows, 4096, dtype=torch.bfloat16)
    assert lin.few_rows(x) is few
    assert lin.one_row(x) is (rows == 1)


def test_long_k_and_narrow_layers_keep_cublas(monkeypatch):
    down = layer(4096, 14336)  # the 8B's down projection: cuBLAS's split-K wins
    assert not down.few_rows(torch.zeros(2, 14336, dtype=torch.bfloat16))
    assert not down.few_rows(torch.zeros(17, 14336, dtype=torch.bfloat16))
    monkeypatch.setenv("TANDEM_ROWS_LONG_K", "16")  # the earlier rule (an A/B switch): gemm_rows up to 16 rows
    assert down.few_rows(torch.zeros(16, 14336, dtype=torch.bfloat16))
    assert not down.few_rows(torch.zeros(17, 14336, dtype=torch.bfloat16))
    monkeypatch.setenv("TANDEM_ROWS_LONG_K", "many")
    with pytest.raises(ValueError, match="TANDEM_ROWS_LONG_K"):
        down.few_rows(torch.zeros(2, 14336, dtype=torch.bfloat16))
    monkeypatch.delenv("TANDEM_ROWS_LONG_K")
    assert layer(4096, 4096).few_rows(torch.zeros(5, 4096, dtype=torch.bfloat16))  # K = 4096 is not long
    fp8 = GemvLinear(nn.Linear(14336, 4096, bias=False, dtype=torch.bfloat16), fp8=True)  # streams e4m3 bytes
    assert fp8.few_rows(torch.zeros(16, 14336, dtype=torch.bfloat16))
    assert not fp8.few_rows(torch.zeros(17, 14336, dtype=torch.bfloat16))
    narrow = layer(2048, 2048)  # the 1B's o projection
    assert not narrow.few_rows(torch.zeros(5, 2048, dtype=torch.bfloat16))
    assert not layer(6144, 4096).few_rows(torch.zeros(5, 4096, dtype=torch.float32))  # fp32: cuBLAS


def test_the_row_cap_is_an_environment_switch(monkeypatch):
    lin = layer(6144, 4096)
    x = torch.zeros(24, 4096, dtype=torch.bfloat16)
    monkeypatch.setenv("TANDEM_GEMM_ROWS", "16")
    assert not lin.few_rows(x) and lin.few_rows(x[:16])
    monkeypatch.setenv("TANDEM_GEMM_ROWS", "0")
    assert not lin.few_rows(x[:2])


def test_the_row_switch_keeps_its_old_values_and_names_itself(monkeypatch):
    lin = layer(6144, 4096)
    x = torch.zeros(32, 4096, dtype=torch.bfloat16)
    monkeypatch.setenv("TANDEM_GEMM_ROWS", "1")  # "on", as it meant before it became a cap
    assert lin.few_rows(x)
    monkeypatch.setenv("TANDEM_GEMM_ROWS", "yes")
    with pytest.raises(ValueError, match="TANDEM_GEMM_ROWS"):
        lin.few_rows(x)


def test_fp8_only_layers_send_few_rows_to_gemm_w8(monkeypatch):
    """The fp8 target's layers (no model-dtype weight) run 2-32 rows on gemm_w8's split tile;
    TANDEM_FP8_ROWS=rows (an A/B switch) sends them back to gemm_rows; a typo names the switch."""
    from tandem.layers import gpu_linear

    lin = GemvLinear(nn.Linear(4096, 6144, bias=False, dtype=torch.bfloat16), fp8=True, keep_weight=False)
    assert lin.fp8_only and lin.few_rows(torch.zeros(5, 4096, dtype=torch.bfloat16))
    calls = []
    monkeypatch.setattr(GemvLinear, "_many_rows", lambda self, x, out=None, act=None: calls.append((x.shape[0], act)))
    lin(torch.zeros(5, 4096, dtype=torch.bfloat16))
    lin.forward_then_silu_mul(torch.zeros(8, 4096, dtype=torch.bfloat16))
    assert calls == [(5, None), (8, "silu_mul")]
    assert gpu_linear._fp8_rows_w8()
    monkeypatch.setenv("TANDEM_FP8_ROWS", "rows")
    assert not gpu_linear._fp8_rows_w8()
    monkeypatch.setenv("TANDEM_FP8_ROWS", "gemm_w8")
    with pytest.raises(ValueError, match="TANDEM_FP8_ROWS"):
        lin(torch.zeros(5, 4096, dtype=torch.bfloat16))


def test_one_row_gemvs_preload_their_first_weight_tile(monkeypatch):
    """Every one-row GEMV loads one weight tile before its PDL wait unless TANDEM_GEMV_PRELOAD (an A/B
    switch) names other linears, "none", or TANDEM_GEMV_PRELOAD_TILES another count."""
    from tandem.layers.gpu_linear import prepare_gpu_linears

    o, down = layer(2048, 2048), layer(2048, 8192)
    o.site, down.site = "o_proj", "down_proj"
    assert (o.preload, down.preload) == (1, 1)
    monkeypatch.setenv("TANDEM_GEMV_PRELOAD", "o_proj:gate_up_proj")
    assert (o.preload, down.preload) == (1, 0)
    monkeypatch.setenv("TANDEM_GEMV_PRELOAD_TILES", "2")
    assert (o.preload, down.preload) == (2, 0)
    monkeypatch.setenv("TANDEM_GEMV_PRELOAD", "none")
    assert (o.preload, down.preload) == (0, 0)
    monkeypatch.setenv("TANDEM_GEMV_PRELOAD_TILES", "3")
    with pytest.raises(ValueError, match="TANDEM_GEMV_PRELOAD_TILES"):
        o.preload
    model = nn.Sequential()
    model.o_proj = nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)
    monkeypatch.setattr("tandem.layers.gpu_linear.fused_kernels_available", lambda: True)
    prepare_gpu_linears(model, torch.bfloat16)
    assert isinstance(model.o_proj, GemvLinear) and model.o_proj.site == "o_proj"
