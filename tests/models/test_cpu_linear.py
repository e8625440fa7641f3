"""CPU bf16/fp16 linears through FBGEMM's fp16-weight GEMM (tandem.layers.cpu_linear)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.layers.cpu_linear import FbgemmLinear, fbgemm_available, pack_linears, use_fbgemm
from tests.helpers import make_hf_model

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="this PyTorch build has no FBGEMM")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_fbgemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 7, 33])
def test_fbgemm_linear_matches_float64(bias, rows):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g) * 0.05)
        lin.weight[0, :4] = torch.tensor([1e-7, -3e-5, 60000.0, 2.0**-14])  # fp16 subnormal, max, min normal
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(2, rows, 96, generator=g).to(torch.bfloat16)
    ref = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0)
    native = lin(x).detach()
    holder = nn.Sequential(lin)
    pack_linears(holder)
    packed = holder[0]
    assert isinstance(packed, FbgemmLinear)
    out = packed(x)
    assert out.shape == native.shape == (2, rows, 200) and out.dtype == torch.bfloat16
    # Both round the fp32 result to bf16 once: the same error budget as torch's bf16 matmul.
    assert rel_err(out, ref) < 4e-3
    assert rel_err(out, ref) <= rel_err(native, ref) * 1.5 + 1e-6


@needs_fbgemm
def test_weight_beyond_fp16_range_is_refused():
    lin = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(0.1)
        lin.weight[3, 3] = 1e6
    with pytest.raises(ConfigError, match="fp16 range.*cpu_matmul='torch'"):
        pack_linears(nn.Sequential(lin))


def test_selection():
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert not use_fbgemm("auto", cpu, torch.float32)  # fp32 keeps torch's exact path
    assert not use_fbgemm("torch", cpu, bf16)
    assert not use_fbgemm("auto", torch.device("cuda"), bf16)
    assert use_fbgemm("auto", cpu, bf16) == fbgemm_available()


def test_bad_cpu_matmul_is_a_config_error(tmp_path):
    make_hf_model(tmp_path / "m")
    with pytest.raises(ConfigError, match="cpu_matmul='fast' is not supported"):
        LLM(str(tmp_path / "m"), cpu_matmul="fast")


@needs_fbgemm
def test_engine_greedy_matches_torch_matmul(tmp_path):
    """The same bf16 model through both CPU matmuls gives the same greedy text, and the
    packed engine really runs FBGEMM linears (draft included)."""
    make_hf_model(tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The quick brown fox", "def fib(n):"]
    outs = {}
    for mode in ("torch", "auto"):
        llm = LLM(str(tmp_path / "m"), dtype="bfloat16", cpu_matmul=mode, max_model_len=256,
                  speculative_config={"model": str(tmp_path / "m"), "num_speculative_tokens": 3})
        kinds = {type(m) for m in llm.engine.runner.model.modules()}
        draft_kinds = {type(m) for m in llm.engine.runner.speculator.model.modules()}
        assert (FbgemmLinear in kinds) == (FbgemmLinear in draft_kinds) == (mode == "auto")
        assert (nn.Linear in kinds) == (mode == "torch")
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["auto"] == outs["torch"]
