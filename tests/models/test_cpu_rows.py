"""tandem/kernels/cpu_rows.c (RMSNorm, rotary, SiLU-and-mul rows) against the PyTorch paths it replaces."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kernels import cpu_build, cpu_rows
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.decoder import MLP
from tests.helpers import assert_greedy_equal_up_to_near_tie, make_hf_model

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(cpu_build.load_error(isa) is not None,
                                                   reason=f"CPU kernels: {cpu_build.load_error(isa)}"))
        for isa in cpu_build.ISAS]
DTYPES = [torch.bfloat16, torch.float16]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of a 16-bit dtype, elementwise (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _norm(dim: int, dtype: torch.dtype, isa: str | None, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(dim, generator=torch.Generator().manual_seed(seed))).to(dtype)
    norm.cpu_isa = isa
    return norm


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 896), (5, 1536), (3, 100), (7, 15), (64, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(isa, dtype, rows, dim, with_residual):
    """Almost always equal, else within two units in the last place (the sum of squares is ordered
    differently: one unit in the normalized value, which the weight's product can round to two);
    the residual stream bit-identical. x is a strided view, as after a split."""
    g = torch.Generator().manual_seed(rows * 7 + dim)
    wide = (torch.randn(rows, dim + 8, generator=g) * 3).to(dtype)
    x = wide[:, 4:4 + dim]  # [rows, dim], row stride dim + 8
    res = (torch.randn(rows, dim, generator=g) * 3).to(dtype) if with_residual else None
    res_c = res.clone() if with_residual else None
    ref = _norm(dim, dtype, None, dim)(x, res)
    out = _norm(dim, dtype, isa, dim)(x, res_c)
    assert out.dtype == dtype and out.shape == (rows, dim) and out.is_contiguous()
    assert int(ulps(out, ref).max()) <= 2
    assert float((out == ref).float().mean()) > 0.98
    if with_residual:
        assert torch.equal(res_c, res)


@pytest.mark.parametrize("isa", ISAS)
def test_rms_norm_rows_independent_and_parallel(isa):
    """A row's bits do not depend on its neighbours, whether the rows run on one thread or
    (prefill-sized) across the OpenMP team."""
    dim = 1536
    norm = _norm(dim, torch.bfloat16, isa, 1)
    x = torch.randn(300, dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    batched = norm(x)
    alone = torch.cat([norm(x[i:i + 1]) for i in range(0, 300, 37)])
    assert torch.equal(batched[::37], alone)


@pytest.mark.parametrize("isa", ISAS)
def test_rms_norm_of_qkv_views_keeps_a_rows_bits(isa):
    """A [n, H, D] view of a qkv buffer (Qwen3's q/k norm) is rows at two strides, one row's view is
    contiguous: both run the C kernel (the view gathered first), so a row's bits do not depend on
    how many rows its step has (they did: the torch path ran for n > 1, 1 ulp apart now and then,
    and greedy outputs changed with batching, preemption and speculation)."""
    n, heads, d = 256, 8, 64  # (seeds 1 and 3 had rows 1 ulp apart on the AVX512_BF16 build before)
    norm = _norm(d, torch.bfloat16, isa, 2)
    for seed in (1, 3):
        qkv = (torch.randn(n, heads * d + 32, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)
        q = qkv[:, : heads * d].view(n, heads, d)
        assert cpu_rows.rows_of(q) is None and cpu_rows.rows_of(q[:1]) is not None
        out = norm(q)
        assert torch.equal(out, torch.cat([norm(q[i:i + 1]) for i in range(n)]))
        assert int(ulps(out, _norm(d, torch.bfloat16, None, 2)(q)).max()) <= 2


@pytest.mark.parametrize("isa", ISAS)
def test_row_ops_leave_mismatched_shapes_to_torch(isa):
    """Shapes that do not fit together go to the torch path, which refuses them, instead of the C
    kernels, which would read or write past the tensors: a residual of another shape or of
    overlapping (expanded) rows; a k or a table of another head size than q's."""
    g = torch.Generator().manual_seed(5)
    norm = _norm(64, torch.bfloat16, isa, 3)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    for residual in (torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 64, dtype=torch.bfloat16).expand(8, 64)):
        before = residual.clone()
        with pytest.raises(RuntimeError):
            norm(x, residual)
        assert torch.equal(residual, before)
    # a residual of another dtype (the kernel read its bytes as x's): the torch path's result
    residual, ref_residual = torch.ones(8, 64, dtype=torch.float16), torch.ones(8, 64, dtype=torch.float16)
    assert torch.equal(norm(x, residual), _norm(64, torch.bfloat16, None, 3)(x, ref_residual))
    assert torch.equal(residual, ref_residual)
    with pytest.raises(RuntimeError):  # x wider than the weight (the kernel read past the weight)
        norm(torch.randn(8, 96).to(torch.bfloat16))
    rope = RotaryEmbedding(64, 16, 1e4, None)
    rope.cpu_isa = isa
    positions = torch.arange(3)
    q = torch.randn(3, 2, 64, generator=g).to(torch.bfloat16)
    assert not cpu_rows.rotary_fits(positions, q, torch.randn(3, 1, 128).to(torch.bfloat16), rope.cos)
    assert not cpu_rows.rotary_fits(positions, q, q[:, :1], rope.cos[:, :32].contiguous())
    assert not cpu_rows.rotary_fits(positions[:2], q, q[:, :1], rope.cos)  # fewer positions than rows
    with pytest.raises(RuntimeError):
        rope(positions, q, torch.randn(3, 1, 128).to(torch.bfloat16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (14, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rotary_matches_torch_bit_for_bit(isa, dtype, heads, kv_heads, head_dim, rows):
    """q and k rotated in place inside their qkv buffer give the torch path's bits; v is untouched."""
    rope = RotaryEmbedding(head_dim, 4096, 1e6, None)
    g = torch.Generator().manual_seed(rows + heads)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    v_before = v.clone()
    ref_q, ref_k = rope(positions, q, k)  # torch path: new tensors
    rope.cpu_isa = isa
    assert cpu_rows.rotary_fits(positions, q, k, rope.cos)
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 4864), (5, 8960), (3, 17), (40, 2048)])
def test_silu_mul_matches_torch(isa, dtype, rows, inter):
    """fp32 silu with libm's expf against PyTorch's vectorized one: the rounded results agree
    but for rare one-unit differences."""
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = cpu_rows.silu_mul(gate_up, isa)
    assert out.shape == (rows, inter) and out.dtype == dtype
    same_sign = torch.sign(out.float()) == torch.sign(ref.float())
    assert bool(same_sign[out.float() != 0].all())
    assert int(ulps(out, ref)[ref != 0].max()) <= 1
    assert float((out == ref).float().mean()) > 0.999


@pytest.mark.parametrize("isa", ISAS)
def test_model_logits_with_row_ops_match_torch_ops(tmp_path, isa):
    """The same bf16 model with and without the row ops (norms, rotary, SiLU-and-mul; attention
    stays on the C kernel in both): logprobs within bf16 noise, greedy text equal up to a near tie."""
    make_hf_model(tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = {}
    for use_rows in (False, True):
        llm = LLM(str(tmp_path / "m"), dtype="bfloat16", cpu_matmul=isa, max_model_len=128)
        model = llm.engine.runner.model
        modules = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, MLP))]
        assert modules and {m.cpu_isa for m in modules} == {isa}
        if not use_rows:
            for m in modules:
                m.cpu_isa = None
        outs[use_rows] = [o.outputs[0] for o in llm.generate(["The quick brown fox", "def fib(n):"], params,
                                                             use_tqdm=False)]
    for with_rows, without in zip(outs[True], outs[False]):
        assert_greedy_equal_up_to_near_tie(with_rows, without, logprob_tol=0.05)
