"""GPU, LLM(batch_invariant=True): a request's tokens and logprobs have the same bits whatever else runs and
however its tokens are computed: alone, batched, verified among a draft's tokens (another model's, its
own), eagerly, in small prefill chunks, from the prefix cache. The model is wide enough for every linear's
real kernel and its logits are close together (small weights: many near ties), where a sum taken in another
order would turn a greedy choice."""
import gc

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tests.helpers import make_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inv")
    target = make_hf_model(root / "t", "llama", vocab_size=2048, hidden_size=512, num_layers=4, num_heads=8,
                           num_kv_heads=2, intermediate_size=1536, init_std=0.02, max_position_embeddings=2048)
    draft = make_hf_model(root / "d", "llama", vocab_size=2048, hidden_size=256, num_layers=1, num_heads=4,
                          num_kv_heads=2, intermediate_size=512, seed=3, max_position_embeddings=2048)
    return target, draft


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(2, 2000, (n,), generator=g).tolist()} for n in (3, 700, 17, 64, 530, 9)]


def _run(target, params, batched=True, **kw):
    kw.setdefault("max_num_seqs", 8)
    llm = LLM(str(target), dtype="bfloat16", device="cuda", max_model_len=1024, block_size=16,
              kv_cache_memory_bytes=256 << 20, batch_invariant=True, **kw)
    prompts = _prompts()
    if batched:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    if kw.get("enable_prefix_caching", True) and not batched:  # the same prompts again: prefix-cache hits
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    result = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
              for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def test_batch_invariant_greedy_tokens_and_logprobs_on_gpu(models):
    target, draft = models
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    alone = _run(target, params, batched=False, max_num_seqs=1)
    runs = {
        "batched": _run(target, params),
        "eager": _run(target, params, enforce_eager=True),
        "chunked prefill": _run(target, params, max_num_batched_tokens=96, enable_prefix_caching=False),
        "draft k=3": _run(target, params, speculative_config=dict(model=str(draft), num_speculative_tokens=3)),
        "own draft k=4": _run(target, params, speculative_config=dict(model=str(target), num_speculative_tokens=4)),
    }
    for name, out in runs.items():
        for i, (got, want) in enumerate(zip(out, alone)):
            assert got[0] == want[0], (name, i)
            assert got[1] == want[1], (name, i)  # the logprobs' bits: the same logits


def test_batch_invariant_fp8_target_on_gpu(models):
    """quantization="fp8" (the target's e4m3 weights alone, gemm_w8 at one tile) and an fp8 KV cache: the same bits
    alone, batched and under speculation."""
    target, draft = models
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    kw = dict(quantization="fp8", kv_cache_dtype="fp8")
    alone = _run(target, params, batched=False, max_num_seqs=1, **kw)
    assert _run(target, params, **kw) == alone
    assert _run(target, params, speculative_config=dict(model=str(draft), num_speculative_tokens=3), **kw) == alone


def test_batch_invariant_qk_norm_model_on_gpu(tmp_path):
    """Qwen3's per-head q / k RMSNorm (torch's reduction over each head's row, applied after the qkv
    projection): the same bits alone, batched and under speculation with the model as its own draft."""
    target = make_hf_model(tmp_path / "q3", "qwen3", vocab_size=2048, hidden_size=512, num_layers=2, num_heads=8,
                           num_kv_heads=2, intermediate_size=1536, init_std=0.02, max_position_embeddings=2048)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    alone = _run(target, params, batched=False, max_num_seqs=1)
    assert _run(target, params) == alone
    assert _run(target, params, speculative_config=dict(model=str(target), num_speculative_tokens=4)) == alone


def test_batch_invariant_seeded_sampling_on_gpu(models):
    """Seeded sampling: batched and speculative (greedy drafts, verified by coupling) give the tokens of
    each request run alone."""
    target, draft = models
    params = [SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=10 + i, logprobs=1)
              for i in range(len(_prompts()))]
    llm = LLM(str(target), dtype="bfloat16", device="cuda", max_model_len=1024, block_size=16,
              kv_cache_memory_bytes=256 << 20, batch_invariant=True, max_num_seqs=8,
              speculative_config=dict(model=str(draft), num_speculative_tokens=3))
    spec = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    del llm
    gc.collect()
    llm = LLM(str(target), dtype="bfloat16", device="cuda", max_model_len=1024, block_size=16,
              kv_cache_memory_bytes=256 << 20, batch_invariant=True, max_num_seqs=1)
    alone = [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(_prompts(), params)]
    assert spec == alone


def test_batch_invariant_probabilistic_drafts_on_gpu(models):
    """Probabilistic drafts (their probabilities pick the seeded token the rejection sampler keeps, so the draft
    computes batch-invariantly too): each request's tokens batched are its tokens alone."""
    target, draft = models
    params = [SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=20 + i)
              for i in range(len(_prompts()))]
    llm = LLM(str(target), dtype="bfloat16", device="cuda", max_model_len=1024, block_size=16,
              kv_cache_memory_bytes=256 << 20, batch_invariant=True, max_num_seqs=8,
              speculative_config=dict(model=str(draft), num_speculative_tokens=3, draft_sample_method="probabilistic"))
    batched = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    alone = [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(_prompts(), params)]
    assert batched == alone


def test_batch_invariant_needs_half_precision_on_gpu(models):
    with pytest.raises(ConfigError, match="batch_invariant=True needs dtype bfloat16 or float16"):
        LLM(str(models[0]), dtype="float32", device="cuda", batch_invariant=True)
