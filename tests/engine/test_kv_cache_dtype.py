"""kv_cache_dtype="fp8": keys and values kept in float8 e4m3 (saturated at +-448, no scale), read
widened to the model's dtype. The torch paths against the same values kept in the model's dtype;
the engine: twice the blocks for the memory, speculative greedy output equal to target-only, and
cached attention (a chunked prompt's later chunks) near the full-precision cache's."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.layers.attention import FP8_MAX, build_attn_metadata, paged_attention, store_kv, to_cache
from tandem.layers.table_attention import dense_paged_attention, store_kv_masked
from tests.helpers import make_hf_model

FP8 = torch.float8_e4m3fn


def test_to_cache_saturates_instead_of_making_nan():
    x = torch.tensor([1.0, -3.3, 447.0, 500.0, -1e4, float("inf"), 2e-3], dtype=torch.bfloat16)
    got = to_cache(x, FP8).float()
    assert got[3] == FP8_MAX and got[4] == -FP8_MAX and got[5] == FP8_MAX and not got.isnan().any()
    assert torch.equal(got[:3], x[:3].float().to(FP8).float())
    assert to_cache(x, torch.bfloat16) is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_an_fp8_cache_as_its_values_widened(dtype):
    """Both torch paths (the grouped reference and the block-table fallback) store into an fp8
    cache what to_cache makes of k and v, and attend exactly as over a cache of q's dtype that
    holds those values (a prompt's own keys too)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 4, 12
    start_pos, q_lens = [0, 5, 9], [6, 1, 4]  # a prompt, a decode, a chunk against a cached prefix
    tables = [[3, 1], [7, 2], [4, 9, 10, 0]]
    n = sum(q_lens)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    k = (torch.randn(n, kv_heads, head_dim, generator=g) * 300).to(dtype)  # some past 448
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    base_k = (torch.randn(shape, generator=g) * 3).to(FP8)  # the cached prefixes
    base_v = torch.randn(shape, generator=g).to(FP8)
    meta = build_attn_metadata(start_pos, q_lens, tables, block_size, torch.device("cpu"))
    fp8_k, fp8_v = base_k.clone(), base_v.clone()
    wide_k, wide_v = base_k.to(dtype), base_v.to(dtype)
    store_kv(k, v, fp8_k, fp8_v, meta.slot_mapping)
    store_kv(to_cache(k, FP8).to(dtype), to_cache(v, FP8).to(dtype), wide_k, wide_v, meta.slot_mapping)
    assert fp8_k.dtype == FP8 and torch.equal(fp8_k.to(dtype), wide_k) and torch.equal(fp8_v.to(dtype), wide_v)
    assert fp8_k.float().abs().max() == FP8_MAX
    kq, vq = to_cache(k, FP8).to(dtype), to_cache(v, FP8).to(dtype)  # a prompt's own k, v, as the cache keeps them
    want = paged_attention(q, kq, vq, wide_k, wide_v, meta, 0.25)
    assert torch.equal(paged_attention(q, k, v, fp8_k, fp8_v, meta, 0.25), want)

    table = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    seq_lens = torch.tensor([s + m for s, m in zip(start_pos, q_lens)])
    cu = torch.tensor([0, 6, 7, 11])
    masked_k, masked_v = base_k.clone(), base_v.clone()
    slots = meta.slot_mapping.clone()
    slots[0] = -1  # a padding row: nothing written
    store_kv_masked(k, v, masked_k, masked_v, slots)
    flat = masked_k.view(-1, kv_heads, head_dim)
    assert torch.equal(flat[slots[1:]].float(), to_cache(k[1:], FP8).float())
    assert torch.equal(flat[meta.slot_mapping[0]].float(), base_k.view(-1, kv_heads, head_dim)[meta.slot_mapping[0]].float())
    assert torch.equal(dense_paged_attention(q, fp8_k, fp8_v, table, seq_lens, cu, 6, 0.25),
                       dense_paged_attention(q, wide_k, wide_v, table, seq_lens, cu, 6, 0.25))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_a_padding_row_beside_a_token_at_slot_zero_keeps_that_token(dtype, device):
    """Block 0 is handed to requests like any other: a padding row (slot -1, CUDA-graph padding)
    beside a real token stored at slot 0 must not leave slot 0's old value (it did, the later of the
    two duplicate writes winning); padding alone leaves slot 0 as it was."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 8, generator=g).to(device), torch.randn(3, 2, 8, generator=g).to(device)
    for slots in ([0, -1, 5], [-1, 0, -1], [-1, 7, -1]):
        k_cache = torch.randn(4, 4, 2, 8, generator=g).to(device, dtype)
        v_cache = torch.randn(4, 4, 2, 8, generator=g).to(device, dtype)
        before_k, before_v = k_cache.clone(), v_cache.clone()
        store_kv_masked(k, v, k_cache, v_cache, torch.tensor(slots, device=device))
        for cache, before, new in ((k_cache, before_k, k), (v_cache, before_v, v)):
            flat, old = cache.view(-1, 2, 8).float(), before.view(-1, 2, 8).float()
            for row, slot in enumerate(slots):
                if slot >= 0:
                    assert torch.equal(flat[slot], to_cache(new[row], dtype).float()), slots
            if 0 not in slots:
                assert torch.equal(flat[0], old[0]), slots
            untouched = [s for s in range(16) if s not in slots]
            assert torch.equal(flat[untouched], old[untouched]), slots


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8kv")
    target = make_hf_model(root / "t", "qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           init_std=0.3, seed=2)
    draft = make_hf_model(root / "d", "qwen2", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, seed=3)
    return target, draft


def _llm(path, dtype, **kw) -> LLM:
    return LLM(str(path), dtype=dtype, max_model_len=256, block_size=8, max_num_seqs=8,
               kv_cache_memory_bytes=4 << 20, seed=0, **kw)


PROMPTS = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_greedy_equals_target_only_with_an_fp8_cache(pair, dtype):
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _llm(target, dtype)
    llm = _llm(target, dtype, kv_cache_dtype="fp8")
    assert llm.engine.runner.kv.k[0].dtype == FP8
    widen = 4 if dtype == "float32" else 2
    assert llm.config.cache.num_blocks == pytest.approx(widen * plain.config.cache.num_blocks, rel=0.01)
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for spec_model, k in ((draft, 3), (target, 4)):
        spec = _llm(target, dtype, kv_cache_dtype="fp8",
                    speculative_config=dict(model=str(spec_model), num_speculative_tokens=k))
        assert spec.engine.runner.speculator.kv.k[0].dtype == FP8
        assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)] == base
        if spec_model == target:
            assert spec.engine.spec_metrics.acceptance_rate > 0.9


def test_a_prefix_cache_hit_changes_nothing(pair):
    """A prompt attends its own keys as the fp8 cache keeps them, so a request reads the same
    values whether its prefix was computed now or found cached."""
    _, model = pair
    llm = _llm(model, "float32", kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    cold, hit = (llm.generate(PROMPTS[:1], params, use_tqdm=False)[0] for _ in range(2))
    assert hit.num_cached_tokens > 0 and cold.outputs[0].token_ids == hit.outputs[0].token_ids
    lp = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in (cold, hit)]
    assert lp[0] == pytest.approx(lp[1], abs=1e-5)


def test_cached_attention_stays_near_the_full_precision_caches(pair):
    """A prompt prefilled in 8-token chunks attends its earlier chunks through the cache: its
    prompt logprobs with an fp8 cache are near those with an fp32 one (and not the same bits)."""
    _, model = pair  # the draft: a model of ordinary weights (the target's are sharpened)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = [{"prompt_token_ids": list(range(5, 85))}]

    def logprobs(**kw) -> torch.Tensor:
        out = _llm(model, "float32", max_num_batched_tokens=8, **kw).generate(prompt, params, use_tqdm=False)[0]
        return torch.tensor([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])

    full, fp8 = logprobs(), logprobs(kv_cache_dtype="fp8")
    assert not torch.equal(full, fp8)
    diff = (full - fp8).abs()
    assert diff.mean() < 0.1 and diff.max() < 0.5, diff  # measured: 0.03 and 0.18 nats, logprobs near -6.4
