"""CPU bf16/fp16 linears: our kernel (tandem/kernels/cpu_gemm.c, its AVX-512 and AVX2 builds) and FBGEMM's fp16 GEMM."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.kernels import cpu_build, cpu_gemm
from tandem.layers.cpu_linear import FbgemmLinear, W16Linear, cpu_linear_kind, fbgemm_available, pack_linears
from tests.helpers import assert_greedy_equal_up_to_near_tie, make_hf_model

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="this PyTorch build has no FBGEMM")
needs_avx2 = pytest.mark.skipif(cpu_build.load_error("avx2") is not None,
                                reason=f"cpu_gemm: {cpu_build.load_error('avx2')}")
# Every build this CPU runs (an AVX-512 CPU runs both), each a parameter of the kernel tests.
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(cpu_build.load_error(isa) is not None,
                                                   reason=f"cpu_gemm: {cpu_build.load_error(isa)}"))
        for isa in cpu_build.ISAS]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _weights(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 6, 7, 13, 50, 100])
@pytest.mark.parametrize("n,k", [(200, 96), (7, 90), (33, 16), (5, 3), (9, 70)])
def test_gemm_w16_matches_reference(wdtype, out_dtype, rows, n, k, isa):
    """Tile tails in N (odd N), in rows (6-row tiles, 48-row panels) and in K (16- / 32-column
    chunks of the AVX2 / AVX-512 build)."""
    w = _weights(n, k, wdtype, seed=rows * 1000 + n + k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        out = cpu_gemm.gemm_w16(x, w, b, out_dtype, isa)
        ref = cpu_gemm.gemm_w16_ref(x, w, b, torch.float64)
        assert out.shape == (rows, n) and out.dtype == out_dtype
        if out_dtype == torch.float32:  # only the summation order differs from float64
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        else:  # one rounding of the fp32 result: half an ulp of the output dtype
            torch.testing.assert_close(out, ref.to(out_dtype), rtol=torch.finfo(out_dtype).eps, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [2, 5, 6, 7, 12, 13, 49])
def test_each_row_is_bit_identical_to_computing_it_alone(rows, isa):
    """A verified token's row equals the decode step's row exactly, whatever the batch."""
    w = _weights(70, 1000, torch.bfloat16, seed=rows)
    x = torch.randn(rows, 1000, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(70)
    batched = cpu_gemm.gemm_w16(x, w, bias, torch.bfloat16, isa)
    alone = torch.cat([cpu_gemm.gemm_w16(x[i:i + 1], w, bias, torch.bfloat16, isa) for i in range(rows)])
    assert torch.equal(batched, alone)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 50])
@pytest.mark.parametrize("n,k", [(200, 96), (7, 90), (33, 16), (5, 3), (9, 70)])
def test_gemm_w8_matches_reference(out_dtype, rows, n, k, isa):
    """fp8 weights (the fp8 target's and draft's on a CPU): the exact product of x and the rounded
    weights (e4m3 times the row scale, subnormals and zero rows included), summed in fp32; each row
    bit-identical to computing it alone; the tails in N, rows and K as the 16-bit tests."""
    from tandem.layers.quant import quantize_fp8

    w = _weights(n, k, torch.float32, seed=rows * 1000 + n + k) * torch.logspace(-9, 1, n)[:, None]
    w[n // 2] = 0
    q, s = quantize_fp8(w)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        out = cpu_gemm.gemm_w8(x, q, s, b, out_dtype, isa)
        ref = x.double() @ (q.double() * s.double()[:, None]).T + (b.double() if b is not None else 0)
        if out_dtype == torch.float32:
            scale = x.double().abs() @ (q.double().abs() * s.double()[:, None]).T + 1e-30
            assert ((out.double() - ref).abs() <= 1e-6 * scale + 1e-6 * (b.abs().double() if b is not None else 0)).all()
        else:
            torch.testing.assert_close(out, ref.to(out_dtype), rtol=torch.finfo(out_dtype).eps, atol=1e-5)
        alone = torch.cat([cpu_gemm.gemm_w8(x[i:i + 1], q, s, b, out_dtype, isa) for i in range(rows)])
        assert torch.equal(out, alone)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("col", [0, 13, 31, 45, 66])
def test_every_e4m3_byte_enters_as_its_value(isa, x_dtype, col):
    """Each finite e4m3 byte (zero, subnormals, both signs) multiplies x as its exact value, whether
    the build widens it to fp32 or (avx512bf16, bf16 rows) converts it to bf16 for VDPBF16PS; in a
    full 32-column chunk and in the tail (K = 70)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7f / 0xff: NaN
    w = torch.zeros(codes.numel(), 70, dtype=torch.uint8)
    w[:, col] = codes
    w8 = w.view(torch.float8_e4m3fn)
    x = torch.zeros(1, 70, dtype=x_dtype)
    x[0, col] = 1.0
    y = cpu_gemm.gemm_w8(x, w8, torch.ones(codes.numel()), None, torch.float32, isa)
    assert torch.equal(y[0], w8[:, col].float())


@pytest.mark.parametrize("isa", ISAS)
def test_thread_count_does_not_change_results(isa):
    w = _weights(301, 640, torch.bfloat16, seed=3)
    x = torch.randn(5, 640).to(torch.bfloat16)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.gemm_w16(x, w, None, torch.float32, isa)
        torch.set_num_threads(2)
        two = cpu_gemm.gemm_w16(x, w, None, torch.float32, isa)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


@pytest.mark.parametrize("isa", ISAS)
def test_special_values_and_empty_input(isa):
    w = _weights(4, 32, torch.bfloat16, seed=0)
    x = torch.zeros(3, 32)
    x[1, 5] = float("nan")
    x[2, 0] = 1e38
    w[:, 0] = 1e4
    out = cpu_gemm.gemm_w16(x, w, None, torch.bfloat16, isa)
    assert torch.equal(out[0], torch.zeros(4, dtype=torch.bfloat16))
    assert out[1].isnan().all()
    assert out[2].isinf().all()
    assert cpu_gemm.gemm_w16(x[:0], w, None, torch.bfloat16, isa).shape == (0, 4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [1, 5, 60])
def test_x_of_any_dtype_and_row_stride_is_widened_first(isa, wdtype, x_dtype, rows):
    """16-bit and strided x go in as they are (no torch conversion op) and give the bits of the
    same values passed as contiguous fp32; in the avx512bf16 build, bf16 rows against bf16
    weights (VDPBF16PS) give the bits of the same rows contiguous."""
    w = _weights(40, 100, wdtype, seed=5)
    wide = torch.randn(rows, 131, generator=torch.Generator().manual_seed(rows)).to(x_dtype)
    x = wide[:, 10:110]  # [rows, 100], row stride 131
    dp = isa == "avx512bf16" and wdtype == x_dtype == torch.bfloat16
    ref = cpu_gemm.gemm_w16(x.contiguous() if dp else x.float().contiguous(), w, None, torch.float32, isa)
    assert torch.equal(cpu_gemm.gemm_w16(x, w, None, torch.float32, isa), ref)


@needs_avx2
def test_bad_operands_are_refused():
    isa = "avx2"
    w = _weights(4, 32, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="weight must be a contiguous bf16/fp16"):
        cpu_gemm.gemm_w16(torch.zeros(2, 32), w.t(), None, torch.float32, isa)
    with pytest.raises(ValueError, match="weight must be"):
        cpu_gemm.gemm_w16(torch.zeros(2, 32), w.float(), None, torch.float32, isa)
    with pytest.raises(ValueError, match="bias must be a contiguous fp32"):
        cpu_gemm.gemm_w16(torch.zeros(2, 32), w, torch.zeros(4, dtype=torch.bfloat16), torch.float32, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bias", [False, True])
def test_w16_linear_matches_nn_linear(bias, isa):
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(2, 5, 96).to(torch.bfloat16)
    ref = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0)
    fast = W16Linear(lin, isa)
    assert fast.weight is lin.weight  # no copy: a tied embedding keeps sharing it
    out = fast(x)
    assert out.shape == (2, 5, 200) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= rel_err(lin(x), ref) * 1.5 + 1e-6


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
    # where "auto" fell back to FBGEMM (no build of ours), the linears stay PyTorch's instead
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), lin)
    pack_linears(model, chosen=False)
    assert all(type(m) is nn.Linear for m in model)


def test_selection():
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert cpu_linear_kind("auto", cpu, torch.float32) == "torch"  # fp32 keeps torch's exact path
    assert cpu_linear_kind("torch", cpu, bf16) == "torch"
    assert cpu_linear_kind("auto", torch.device("cuda"), bf16) == "torch"
    fallback = "fbgemm" if fbgemm_available() else "torch"
    assert cpu_linear_kind("auto", cpu, bf16) == (cpu_build.best_isa() or fallback)
    if cpu_build.load_error("avx512bf16") is None:  # the best build runs by default
        assert cpu_build.best_isa() == "avx512bf16"
    elif cpu_build.load_error("avx512") is None:
        assert cpu_build.best_isa() == "avx512"
    for isa in cpu_build.ISAS:
        if cpu_build.load_error(isa) is None:
            assert cpu_linear_kind(isa, cpu, bf16) == isa
        else:
            with pytest.raises(ConfigError, match=f"cpu_matmul='{isa}' cannot run here"):
                cpu_linear_kind(isa, cpu, bf16)


def test_unbuildable_kernel_falls_back_or_says_why(monkeypatch, caplog):
    """No compiler: "auto" falls back with a warning saying why, an explicit "avx2" names the reason
    and the fix."""
    cpu_build._load.cache_clear()
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    try:
        assert "no C compiler" in cpu_build.load_error("avx2")
        assert cpu_build.best_isa() is None
        with caplog.at_level("WARNING", logger="tandem"):
            assert cpu_linear_kind("auto", torch.device("cpu"), torch.bfloat16) in ("fbgemm", "torch")
        assert any("cannot run here (no C compiler" in r.getMessage() for r in caplog.records), caplog.records
        with pytest.raises(ConfigError, match="cpu_matmul='avx2' cannot run here: .*no C compiler.*cpu_matmul='auto'"):
            cpu_linear_kind("avx2", torch.device("cpu"), torch.bfloat16)
    finally:
        monkeypatch.undo()
        cpu_build._load.cache_clear()


def test_bad_cpu_matmul_is_a_config_error(tmp_path):
    make_hf_model(tmp_path / "m")
    with pytest.raises(ConfigError, match="cpu_matmul='fast' is not supported"):
        LLM(str(tmp_path / "m"), cpu_matmul="fast")


def test_engine_greedy_matches_torch_matmul(tmp_path):
    """The same bf16 model through every CPU matmul gives the same greedy text (up to a near tie:
    our C builds also run our attention, which rounds differently from SDPA), and each engine
    really runs the kernel it was asked for (draft included), with our C row ops beside our GEMM."""
    make_hf_model(tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = ["The quick brown fox", "def fib(n):"]
    modes = {"torch": nn.Linear}
    for isa in cpu_build.ISAS:
        if cpu_build.load_error(isa) is None:
            modes[isa] = W16Linear
    if fbgemm_available():
        modes["fbgemm"] = FbgemmLinear
    outs = {}
    for mode, kind in modes.items():
        llm = LLM(str(tmp_path / "m"), dtype="bfloat16", cpu_matmul=mode, max_model_len=256,
                  speculative_config={"model": str(tmp_path / "m"), "num_speculative_tokens": 3})
        for model in (llm.engine.runner.model, llm.engine.runner.speculator.model):
            kinds = {type(m) for m in model.modules()} & {nn.Linear, W16Linear, FbgemmLinear}
            assert kinds == {kind}, mode
            assert {m.isa for m in model.modules() if isinstance(m, W16Linear)} <= {mode}
            row_isas = {m.cpu_isa for m in model.modules() if hasattr(type(m), "cpu_isa")}
            assert row_isas == {mode if mode in cpu_build.ISAS else None}, mode  # the row ops come with our GEMM
        outs[mode] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for mode, out in outs.items():
        for a, b in zip(out, outs["torch"]):
            assert_greedy_equal_up_to_near_tie(a, b)
