"""tandem/kernels/cpu_attention.c (KV store + paged attention of every query row) against the
PyTorch reference of tandem/layers/attention.py, on the metadata the engine builds."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kernels import cpu_attention, cpu_build
from tandem.layers.attention import build_attn_metadata, build_decode_metadata
from tests.helpers import assert_greedy_equal_up_to_near_tie, make_hf_model

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(cpu_build.load_error(isa) is not None,
                                                   reason=f"CPU kernels: {cpu_build.load_error(isa)}"))
        for isa in cpu_build.ISAS]
BLOCK = 4


def _step(dtype, heads, kv_heads, head_dim, num_tokens, num_blocks=64, seed=0):
    """A qkv buffer with q / k / v views (as the model's split gives them) and two caches holding
    random earlier keys."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, heads, head_dim)
    k, v = k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim)
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    return q, k, v, k_cache, v_cache


def _both(meta, q, k, v, k_cache, v_cache, isa, scale=0.125):
    """(reference output, caches after it), (C output, caches after it) on copies of the caches."""
    ref_caches = (k_cache.clone(), v_cache.clone())
    c_caches = (k_cache.clone(), v_cache.clone())
    ref = meta.attend(q, k, v, *ref_caches, scale)
    assert cpu_attention.fits(q, k, v, *c_caches)
    out = meta.attend(q, k, v, *c_caches, scale, cpu_isa=isa)
    return (ref, ref_caches), (out, c_caches)


def _tables(counts, offset=1):
    """Disjoint block tables (block 0 stays the zeroed padding block)."""
    tables, nxt = [], offset
    for c in counts:
        tables.append(list(range(nxt, nxt + c)))
        nxt += c
    return tables


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (14, 2, 64), (4, 4, 32), (8, 1, 24)])
@pytest.mark.parametrize("rowwise", [True, False])
def test_mixed_step_matches_reference(isa, dtype, heads, kv_heads, head_dim, rowwise):
    """A prompt with no prefix, a chunk against a prefix, a decode and a 1 + k verification in one
    step (row groups when rowwise, masked batches when not): the caches equal, every output within
    bf16 / fp16 noise of SDPA's."""
    start_pos, q_lens = [0, 9, 30, 17], [7, 20, 1, 5]
    tables = _tables([(s + n + BLOCK - 1) // BLOCK for s, n in zip(start_pos, q_lens)])
    meta = build_attn_metadata(start_pos, q_lens, tables, BLOCK, torch.device("cpu"), rowwise=rowwise)
    q, k, v, k_cache, v_cache = _step(dtype, heads, kv_heads, head_dim, sum(q_lens))
    (ref, ref_caches), (out, c_caches) = _both(meta, q, k, v, k_cache, v_cache, isa)
    assert torch.equal(c_caches[0], ref_caches[0]) and torch.equal(c_caches[1], ref_caches[1])
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # Against the same inputs in float64 the kernel (fp32 throughout, one rounding) is at least as
    # close as SDPA in the 16-bit dtype: within one rounding of the exact result.
    exact = meta.attend(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), 0.125)
    err_c, err_ref = (out.double() - exact).abs(), (ref.double() - exact).abs()
    assert float(err_c.max()) <= float(err_ref.max()) + 1e-6
    eps = torch.finfo(dtype).eps
    assert bool((err_c <= exact.abs() * eps + 1e-6).all())


@pytest.mark.parametrize("isa", ISAS)
def test_decode_metadata_matches_reference(isa):
    """The draft's decode steps: one query per row at device-side positions, masked keys past them."""
    n, max_kv = 3, 40
    positions = torch.tensor([5, 39, 17])
    table = torch.tensor([_tables([10] * n)[i] for i in range(n)])
    meta = build_decode_metadata(positions, table, BLOCK, max_kv)
    q, k, v, k_cache, v_cache = _step(torch.bfloat16, 14, 2, 64, n, seed=3)
    (ref, ref_caches), (out, c_caches) = _both(meta, q, k, v, k_cache, v_cache, isa)
    assert torch.equal(c_caches[0], ref_caches[0])
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("isa", ISAS)
def test_a_token_verified_equals_it_decoded(isa):
    """A request's 1 + k verification tokens beside another request give, bit for bit, what each
    token gives decoded alone with the same keys in the cache (the exactness speculation needs)."""
    q, k, v, k_cache, v_cache = _step(torch.bfloat16, 12, 2, 128, 7, seed=5)
    tables = _tables([8, 8])
    k_cache0, v_cache0 = k_cache.clone(), v_cache.clone()
    meta = build_attn_metadata([20, 11], [5, 2], tables, BLOCK, torch.device("cpu"))
    together = meta.attend(q, k, v, k_cache, v_cache, 0.1, cpu_isa=isa)
    for t in range(5):  # request 0's tokens one at a time, in order
        one = build_attn_metadata([20 + t], [1], [tables[0]], BLOCK, torch.device("cpu"))
        alone = one.attend(q[t:t + 1], k[t:t + 1], v[t:t + 1], k_cache0, v_cache0, 0.1, cpu_isa=isa)
        assert torch.equal(alone[0], together[t])


@pytest.mark.parametrize("isa", ISAS)
def test_fits_refuses_what_the_kernel_does_not_take(isa):
    q, k, v, k_cache, v_cache = _step(torch.bfloat16, 4, 2, 32, 3)
    assert cpu_attention.fits(q, k, v, k_cache, v_cache)
    assert not cpu_attention.fits(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float())
    fp8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    assert cpu_attention.fits(q, k, v, *fp8) and not cpu_attention.fits(q, k, v, fp8[0], v_cache)
    assert not cpu_attention.fits(q, k, v, k_cache.transpose(1, 2), v_cache)
    assert not cpu_attention.fits(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, k_cache, v_cache)
    # caches of other heads than k's: the store would write rows of k's size past them
    assert not cpu_attention.fits(q, k, v, k_cache[:, :, :1].contiguous(), v_cache[:, :, :1].contiguous())
    assert not cpu_attention.fits(q, k, v, k_cache.flatten(2), v_cache.flatten(2))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (8, 1, 24), (6, 3, 40)])
def test_an_fp8_cache_matches_reference(isa, dtype, heads, kv_heads, head_dim):
    """kv_cache_dtype "fp8": the step's keys and values stored saturated and rounded (as the
    reference stores them), every row read through the 256 e4m3 values: within one rounding of
    the exact attention over the cache's values, and a verified token what it gives decoded alone
    (the reference attended a whole prompt at once and a chunk after a cached prefix row by row,
    so a prefix-cache hit or a preemption could turn a bf16 near tie)."""
    from tandem.layers.attention import to_cache

    start_pos, q_lens = [0, 9, 30, 17], [7, 20, 1, 5]
    tables = _tables([(s + n + BLOCK - 1) // BLOCK for s, n in zip(start_pos, q_lens)])
    meta = build_attn_metadata(start_pos, q_lens, tables, BLOCK, torch.device("cpu"))
    q, k, v, k_cache, v_cache = _step(dtype, heads, kv_heads, head_dim, sum(q_lens), seed=7)
    k[0, 0, 0] = 1000.0  # past e4m3's 448: saturated, as the reference stores it
    k_cache, v_cache = to_cache(k_cache * 4, torch.float8_e4m3fn), to_cache(v_cache, torch.float8_e4m3fn)
    (ref, ref_caches), (out, c_caches) = _both(meta, q, k, v, k_cache, v_cache, isa)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(c_caches, ref_caches))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # the exact attention over the values the cache holds (the step's own keys and values as stored)
    keys, values = (c.double() for c in c_caches)
    stored_k, stored_v = (c.view(-1, kv_heads, head_dim)[meta.slot_mapping] for c in (keys, values))
    exact = meta.attend(q.double(), stored_k, stored_v, keys, values, 0.125)
    err = (out.double() - exact).abs()
    assert bool((err <= exact.abs() * torch.finfo(dtype).eps + 1e-6).all()), float(err.max())
    one = build_attn_metadata([30], [1], [tables[2]], BLOCK, torch.device("cpu"))
    alone = one.attend(q[27:28], k[27:28], v[27:28], *c_caches, 0.125, cpu_isa=isa)
    assert torch.equal(alone[0], out[27])


@pytest.mark.parametrize("isa", ISAS)
def test_engine_with_cpu_attention_matches_reference_attention(tmp_path, isa):
    """A bf16 model (and its own copy as the draft) with the C attention and with the reference:
    speculative == target-only with the C attention; against the reference, greedy text equal
    up to a near tie and logprobs within bf16 noise (the two round differently: SDPA rounds its
    softmax weights to bf16, the kernel keeps them in fp32; the kernel tests bound the
    attention outputs themselves)."""
    make_hf_model(tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    prompts = ["The quick brown fox", "def fib(n):", "1, 2, 3,"]
    outs = {}
    for mode, spec in (("reference", None), ("C", None), ("C+draft", 3)):
        cfg = {"model": str(tmp_path / "m"), "num_speculative_tokens": spec} if spec else None
        llm = LLM(str(tmp_path / "m"), dtype="bfloat16", cpu_matmul=isa, max_model_len=128, speculative_config=cfg)
        runner = llm.engine.runner
        models = [runner.model] + ([runner.speculator.model] if spec else [])
        attns = [m for model in models for m in model.modules() if type(m).__name__ == "Attention"]
        assert attns and {a.cpu_isa for a in attns} == {isa}
        if mode == "reference":
            for a in attns:
                a.cpu_isa = None
        outs[mode] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in outs["C+draft"]] == [o.token_ids for o in outs["C"]]
    for c, ref in zip(outs["C"], outs["reference"]):
        assert_greedy_equal_up_to_near_tie(c, ref, logprob_tol=0.1)


@pytest.mark.parametrize("isa", ISAS)
def test_a_prefix_hit_over_an_fp8_cache_changes_nothing(tmp_path, isa):
    """kv_cache_dtype "fp8" in bf16 on the CPU: a request whose prefix the cache holds gives the
    tokens and logprobs it gives computed whole (the C kernel reads an fp8 cache too; through the
    reference, 5 of 6 such requests moved a logprob and 2 a token)."""
    make_hf_model(tmp_path / "m", init_std=0.3)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 300, (30,), generator=g).tolist()
    prompts = [{"prompt_token_ids": prefix + torch.randint(3, 300, (n,), generator=g).tolist()} for n in (3, 9, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(caching: bool):
        llm = LLM(str(tmp_path / "m"), dtype="bfloat16", kv_cache_dtype="fp8", cpu_matmul=isa, max_model_len=128,
                  block_size=8, enable_prefix_caching=caching)
        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]  # one at a time: later ones hit
        return outs, [o.num_cached_tokens for o in outs]

    (hit, cached), (whole, _) = run(True), run(False)
    assert cached[1:] == [24, 24]
    for a, b in zip(hit, whole):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == \
            [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
